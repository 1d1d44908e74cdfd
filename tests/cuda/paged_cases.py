"""``paged_attention`` against a float64 dense masked softmax: the cases' machinery.

``run_case`` builds per-request K/V histories, scatters them into a full cache (through
``req_to_token``) and into an SWA cache (through ``full_to_swa_index_mapping``; positions the
window can no longer reach hold NaN there, so reading one would show), builds the step's
tables with ``step_metadata`` and runs the kernel as a full layer (``req_to_token`` rows) or
as an SWA layer (the window table from each request's ``window_start``), through ``attend``:
the plan the planner gives the shape (``plan_paged``), with ``config`` fields replaced.
``kv_dtype`` (an FP8 dtype) makes both caches FP8 with per-head ``kv_scales``
(``one_launch_cases.Stored``): histories stored quantised, the oracle over what the cache holds.
"""

import math
from typing import List, Optional

import torch
from one_launch_cases import Stored, bits

from attnplug.memory.fp8 import is_fp8
from attnplug_cuda.kernels import pdl_supported
from attnplug_cuda.kernels.common import AttentionInputs, KeyTable, KVScales, NewRows, num_sms
from attnplug_cuda.kernels.paged_attention import paged_attention
from attnplug_cuda.kernels.pdl import Schedule
from attnplug_cuda.kernels.step_metadata import step_metadata
from attnplug_cuda.planner import LaunchShape, plan_paged
from attnplug_cuda.tuning import CudaTuning

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PDL = pdl_supported(DEVICE)[0]


def plan_for(q, k_cache, *, max_q_len, max_kv_len, window, num_reqs, config=None):
    """The planner's plan for this launch shape (the default tuning), ``config`` fields replaced."""
    T, H, D = q.shape
    hkv = k_cache.shape[1]
    shape = LaunchShape(
        num_reqs, T, hkv, H // hkv, D, max_q_len, max_kv_len, window, num_sms(q.device), is_fp8(k_cache.dtype)
    )
    return plan_paged(shape, CudaTuning())._replace(**(config or {}))


def attend(q, k_cache, v_cache, out, *, cu_q_lens, seq_lens, table, rows, start=None, max_q_len, max_kv_len,
           window=None, config=None, k=None, v=None, loc=None, sm_scale=None, softcap=None, sinks=None,
           pdl=None, kv_scales=None):  # fmt: skip
    """``paged_attention`` as the backend calls it: the planned plan, the key table; ``k``,
    ``v``, ``loc``: the step's rows to store; ``kv_scales``: an FP8 cache's ``KVScales``."""
    plan = plan_for(q, k_cache, max_q_len=max_q_len, max_kv_len=max_kv_len, window=window,
                    num_reqs=cu_q_lens.shape[0] - 1, config=config)  # fmt: skip
    if loc is None and (k is not None or v is not None):
        raise ValueError("k / v without loc")
    new = NewRows.of(k, v, loc) if loc is not None else None
    keys = KeyTable.of(table, rows, start)
    inputs = AttentionInputs(cu_q_lens, seq_lens, keys, max_q_len, sm_scale, window, softcap, sinks, kv_scales)
    return paged_attention(q, k_cache, v_cache, out, inputs, plan, new=new, pdl=pdl)


TOL = {torch.float16: 4e-3, torch.bfloat16: 2e-2, torch.float32: 1e-5}
PAD = -1  # a seq_len entry of PAD marks a padded request: seq_len 1, req row 0


def reference(q, hist_k, hist_v, q_lens, seq_lens, window, sm_scale, softcap=None, sinks=None):
    """float64 dense masked softmax; a query with no valid key gives zeros. ``softcap``:
    logits ``c * tanh(s / c)``; ``sinks`` ([H]): one more logit per head, in the denominator only."""
    T, H, D = q.shape
    out = torch.zeros(T, H, D, dtype=torch.float64)
    qd = q.cpu().double()
    t = 0
    for kh, vh, n, s in zip(hist_k, hist_v, q_lens, seq_lens):
        hkv = kh.shape[1]
        kk = kh.double().repeat_interleave(H // hkv, dim=1)
        vv = vh.double().repeat_interleave(H // hkv, dim=1)
        for i in range(n):
            p = s - n + i
            lo = 0 if window is None else max(0, p - window + 1)
            if p >= 0:
                logits = torch.einsum("hd,jhd->hj", qd[t], kk[lo : p + 1]) * sm_scale
                if softcap is not None:
                    logits = softcap * torch.tanh(logits / softcap)
                if sinks is not None:
                    probs = torch.softmax(torch.cat([logits, sinks.double()[:, None]], -1), -1)[:, :-1]
                else:
                    probs = torch.softmax(logits, -1)
                out[t] = torch.einsum("hj,jhd->hd", probs, vv[lo : p + 1])
            t += 1
    return out


def run_case(
    q_lens: List[int],
    seq_lens: List[int],
    *,
    H: int,
    Hkv: int,
    D: int,
    dtype=torch.float16,
    window: Optional[int] = None,
    layer: str = "full",
    config: Optional[dict] = None,
    pdl: Optional[Schedule] = None,
    seed: int = 0,
    check: bool = True,
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
    store: bool = False,
    bad_locs: Optional[List[int]] = None,
    kv_dtype=None,
    kv_scales=None,
    **kernel_kw,
):
    """One paged_attention call against float64. ``store``: the new tokens' cache rows hold
    NaN before the call and the kernel stores them itself (``NewRows``); the cache
    after the call must equal the cache with the rows written, nothing else changed.
    ``bad_locs``: slot values for the first ``len(bad_locs)`` new tokens of the last request
    (garbage the kernel must skip; their keys stay out of the reference too). ``kv_dtype``: the
    caches' dtype (default ``dtype``), with ``kv_scales`` = (k_scale, v_scale) float32 ``[Hkv]``
    for an FP8 one (default ones)."""
    g = torch.Generator().manual_seed(seed)
    cache_dtype = dtype if kv_dtype is None else kv_dtype
    if is_fp8(cache_dtype) and kv_scales is None:
        kv_scales = (torch.ones(Hkv), torch.ones(Hkv))
    kv = Stored(cache_dtype, *(kv_scales or (None, None)))
    bs = len(q_lens)
    padded = [s == PAD for s in seq_lens]
    seq = [1 if p else s for p, s in zip(padded, seq_lens)]
    size = sum(s for s, p in zip(seq, padded) if not p) + 8
    max_ctx = max(seq) + 3
    # full pool: slot 0 is the sink (zeros: padded tokens' junk is finite)
    k_full = torch.zeros(size, Hkv, D, dtype=cache_dtype)
    v_full = torch.zeros(size, Hkv, D, dtype=cache_dtype)
    k_swa = torch.full((size, Hkv, D), float("nan"), dtype=cache_dtype)
    v_swa = torch.full((size, Hkv, D), float("nan"), dtype=cache_dtype)
    bits(k_swa)[0] = bits(v_swa)[0] = 0
    mapping = torch.zeros(size + 2, dtype=torch.int32)
    mapping[1:size] = (torch.randperm(size - 1, generator=g) + 1).int()
    mapping[-1] = -1
    req_to_token = torch.zeros(bs + 2, max_ctx, dtype=torch.int32)
    rows = (torch.randperm(bs + 1, generator=g)[:bs] + 1).tolist()  # shuffled, never row 0
    free = (torch.randperm(size - 1, generator=g) + 1).tolist()
    hist_k, hist_v, locs = [], [], []
    for b in range(bs):
        s, n = seq[b], q_lens[b]
        if padded[b]:
            rows[b] = 0
            hist_k.append(torch.zeros(1, Hkv, D, dtype=dtype))
            hist_v.append(torch.zeros(1, Hkv, D, dtype=dtype))
            locs.append(torch.zeros(n, dtype=torch.int64))
            continue
        slots = torch.tensor([free.pop() for _ in range(s)])
        req_to_token[rows[b], :s] = slots.int()
        kh = torch.randn(s, Hkv, D, generator=g).to(dtype)
        vh = torch.randn(s, Hkv, D, generator=g).to(dtype)
        hist_k.append(kh)
        hist_v.append(vh)
        kv.put(k_full, slots, kh, "k")
        kv.put(v_full, slots, vh, "v")
        reach = 0 if window is None else max(0, s - n - window + 1)  # first position any query sees
        swa_slots = mapping[slots].long()
        kv.put(k_swa, swa_slots[reach:], kh[reach:], "k")
        kv.put(v_swa, swa_slots[reach:], vh[reach:], "v")
        locs.append(slots[s - n :])
    T = sum(q_lens)
    q = torch.randn(T, H, D, generator=g).to(dtype)
    cache_k, cache_v = (k_full, v_full) if layer == "full" else (k_swa, v_swa)
    store_args = {}
    if store:
        # the rows the step stores, and its slots in the layer's pool (SWA: translated)
        def step_rows(hist):  # the last n rows of each history (zeros for a padded request)
            return torch.cat(
                [h.new_zeros(n, Hkv, D) if p else h[h.shape[0] - n :] for h, n, p in zip(hist, q_lens, padded)]
            )

        k_new, v_new = step_rows(hist_k), step_rows(hist_v)
        loc = torch.cat(locs)
        if layer != "full":
            loc = torch.where(loc > 0, mapping[loc].long(), loc).int()
        want_k, want_v = cache_k.clone(), cache_v.clone()
        live = loc > 0
        cache_k[loc[live].long()] = float("nan")  # read back unstored, they would show
        cache_v[loc[live].long()] = float("nan")  # (an FP8 cache's NaN code)
        first = T - q_lens[-1]
        for i, bad in enumerate(bad_locs or []):
            slot = loc[first + i].long()
            want_k[slot] = want_v[slot] = float("nan")  # never stored: stays as set above
            loc[first + i] = bad
        store_args = dict(k=k_new.to(DEVICE), v=v_new.to(DEVICE), loc=loc.to(DEVICE))

    to = lambda t: t.to(DEVICE)  # noqa: E731
    rpi = torch.tensor(rows, dtype=torch.int64, device=DEVICE)
    seq_t = torch.tensor(seq, dtype=torch.int32, device=DEVICE)
    max_q = max(q_lens)
    width = max_q + (window - 1 if window is not None else max_ctx)
    cu = torch.empty(bs + 1, dtype=torch.int32, device=DEVICE)
    ws = torch.empty(bs, dtype=torch.int32, device=DEVICE)
    table = torch.empty(bs, width, dtype=torch.int32, device=DEVICE)
    step_metadata(
        rpi,
        seq_t,
        torch.tensor(q_lens, device=DEVICE),
        to(torch.cat(locs)),
        cu_q_lens=cu,
        window_start=ws,
        token_pos=torch.empty(T, dtype=torch.int32, device=DEVICE),
        full_to_swa_index_mapping=to(mapping),
        swa_out_cache_loc=torch.empty(T, dtype=torch.int32, device=DEVICE),
        req_to_token=to(req_to_token),
        swa_window_table=table if window is not None else None,
        window=window,
    )
    out = torch.full((T, H, D), float("nan"), dtype=dtype, device=DEVICE)
    common = dict(cu_q_lens=cu, seq_lens=seq_t, max_q_len=max_q, window=window, config=config, pdl=pdl)
    if softcap is not None:
        common["softcap"] = softcap
    if sinks is not None:
        common["sinks"] = sinks.to(DEVICE)
    common.update(store_args, **kernel_kw)
    dev_k, dev_v = to(cache_k), to(cache_v)
    if is_fp8(cache_dtype):
        common["kv_scales"] = KVScales.of(*(t.float().to(DEVICE) for t in kv_scales))
    if layer == "full":
        attend(to(q), dev_k, dev_v, out, table=to(req_to_token), rows=rpi, max_kv_len=max_ctx, **common)
    else:
        assert window is not None
        rows_swa = torch.arange(bs, dtype=torch.int32, device=DEVICE)
        attend(to(q), dev_k, dev_v, out, table=table, rows=rows_swa, start=ws, max_kv_len=max_ctx, **common)
    held_k, held_v = [kv.held(h, "k") for h in hist_k], [kv.held(h, "v") for h in hist_v]
    want = reference(q, held_k, held_v, q_lens, seq, window, 1.0 / math.sqrt(D), softcap, sinks)
    if store:  # bit for bit (NaN included)
        assert torch.equal(bits(dev_k.cpu()), bits(want_k)), "the K cache differs from the expected stores"
        assert torch.equal(bits(dev_v.cpu()), bits(want_v)), "the V cache differs from the expected stores"
    if check:
        got = out.cpu().double()
        assert torch.isfinite(got).all(), "non-finite output"
        err = (got - want).norm() / want.norm().clamp_min(1e-30)
        assert err <= TOL[dtype], f"relative error {err:.3e} > {TOL[dtype]:.0e}"
    return out, want
