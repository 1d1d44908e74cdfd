"""One step through ``store_attend`` (the one-launch kernel) against float64.

``run_case`` builds per-request K/V histories in a paged cache (slots shuffled, every other
slot NaN so a stray read shows), writes the step's own K/V only through the kernel's store
(the cache holds NaN at those slots before the call), and returns the output with
``attnplug.oracle.exact_attention``'s; ``check`` compares them and the stored rows, and
checks that the launch left the tickets at zero (so graph replays can repeat it).
"""

from typing import List, Optional

import torch

from attnplug.oracle import exact_attention
from attnplug_cuda.kernels.common import AttentionInputs, KeyTable, num_sms
from attnplug_cuda.kernels.store_attend import store_attend
from attnplug_cuda.planner import LaunchShape, plan_one_launch
from attnplug_cuda.tuning import CudaTuning

TOL = {torch.float16: 4e-3, torch.bfloat16: 2e-2, torch.float32: 1e-5}


def run_case(
    seq_lens: List[int],
    q_len: int,
    *,
    H: int = 8,
    Hkv: int = 2,
    D: int = 64,
    dtype=torch.float32,
    window: Optional[int] = None,
    splits: Optional[int] = None,
    softcap: Optional[float] = None,
    with_sinks: bool = False,
    store: bool = True,
    padded: int = 0,
    bad_loc: bool = False,
    seed: int = 0,
    max_kv_len: Optional[int] = None,
    keep: Optional[dict] = None,
    config: Optional[dict] = None,
    device: torch.device,
    pdl=None,
):
    """Run one step through ``store_attend``; returns (out, expected, k_cache, v_cache, loc, k,
    v, tickets). ``max_kv_len``: the host bound (default: the table's width); ``keep``: gets
    the ``workspace`` and the ``plan`` used; ``config``: plan fields to override, ``splits``
    the plan's ``NUM_SPLITS``; ``pdl``: the launch's PDL schedule."""
    g = torch.Generator().manual_seed(seed)
    bs = len(seq_lens)
    S = 2 * sum(seq_lens) + 8
    k_cache = torch.full((S, Hkv, D), float("nan"), dtype=dtype)
    v_cache = torch.full((S, Hkv, D), float("nan"), dtype=dtype)
    k_cache[0] = v_cache[0] = 0  # the sink
    width = max(seq_lens) + 2
    table = torch.zeros(bs + padded + 1, width, dtype=torch.int32)
    free = (torch.randperm(S // 2 - 1, generator=g) * 2 + 2).tolist()  # even slots; odd ones stay NaN
    hist_k = torch.zeros(bs + padded, width, Hkv, D, dtype=torch.float64)
    hist_v = torch.zeros_like(hist_k)
    T = (bs + padded) * q_len
    loc = torch.zeros(T, dtype=torch.int64)
    k = torch.randn(T, Hkv, D, generator=g).to(dtype)
    v = torch.randn(T, Hkv, D, generator=g).to(dtype)
    for b, s in enumerate(seq_lens):
        slots = torch.tensor([free.pop() for _ in range(s)])
        table[b + 1, :s] = slots.int()
        old_k = torch.randn(s, Hkv, D, generator=g).to(dtype)
        old_v = torch.randn(s, Hkv, D, generator=g).to(dtype)
        new = slice(b * q_len, (b + 1) * q_len)
        old_k[s - q_len :], old_v[s - q_len :] = k[new], v[new]
        old = slots[: s - q_len]
        k_cache[old], v_cache[old] = old_k[: s - q_len], old_v[: s - q_len]
        if not store:  # the layer saved its KV earlier: the cache already holds the new rows
            k_cache[slots[s - q_len :]], v_cache[slots[s - q_len :]] = k[new], v[new]
        loc[new] = slots[s - q_len :]
        hist_k[b, :s], hist_v[b, :s] = old_k.double(), old_v.double()
    if bad_loc:  # garbage store slots are skipped; the table still names the real slots
        loc[0] = -1
        loc[-1 if not padded else 1] = S + 5
    rows = torch.arange(1, bs + 1).tolist() + [0] * padded  # padded requests read row 0
    seq_all = seq_lens + [1] * padded
    q = torch.randn(T, H, D, generator=g).to(dtype)
    sinks = (torch.randn(H, generator=g) * 2).float() if with_sinks else None
    window_start = None
    tab = table
    if window is not None:  # an SWA-style table: row b holds the window's slots only
        starts = [max(0, s - q_len - window + 1) for s in seq_all]
        wwidth = window + q_len - 1
        tab = torch.zeros(bs + padded, wwidth, dtype=torch.int32)
        for b, (r, s0) in enumerate(zip(rows, starts)):
            n = min(wwidth, width - s0)
            tab[b, :n] = table[r, s0 : s0 + n]
        window_start = torch.tensor(starts, dtype=torch.int32)
        rows = list(range(bs + padded))
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    kc, vc = to(k_cache), to(v_cache)
    tickets = torch.zeros(64, dtype=torch.int32, device=device)
    workspace = torch.empty(4 * 132 * 16 * (D + 2) * 4, dtype=torch.float32, device=device)
    bound = tab.shape[1] if max_kv_len is None else max_kv_len
    tuning = CudaTuning()
    shape = LaunchShape(bs + padded, T, Hkv, H // Hkv, D, q_len, bound, window, num_sms(torch.device(device)))
    plan = plan_one_launch(shape, tuning)
    if splits:
        chunk = max(1, min(splits, tuning.merge_rows // plan.ROWS))  # as the planner takes it
        plan = plan._replace(NUM_SPLITS=splits, MERGE_CHUNK=chunk)
    plan = plan._replace(**(config or {}))
    if keep is not None:
        keep["workspace"] = workspace
        keep["plan"] = plan
    cu = torch.arange(0, T + 1, q_len, dtype=torch.int32, device=device)
    keys = KeyTable.of(to(tab), torch.tensor(rows, dtype=torch.int64, device=device), to(window_start))
    seq_t = torch.tensor(seq_all, dtype=torch.int32, device=device)
    inputs = AttentionInputs(cu, seq_t, keys, q_len, 0.3, window, softcap, to(sinks))
    out = torch.empty(T, H, D, dtype=dtype, device=device)
    loc_arg = to(loc) if store else None
    out = store_attend(
        to(q), to(k), to(v), loc_arg, kc, vc, out, inputs, plan, workspace=workspace, tickets=tickets, pdl=pdl
    )
    real_T = bs * q_len
    expected = exact_attention(
        q[:real_T].double(),
        hist_k[:bs],
        hist_v[:bs],
        seq_lens,
        [q_len] * bs,
        window,
        0.3,
        logit_softcap=softcap,
        sinks=sinks,
    )
    return out.cpu(), expected, kc.cpu(), vc.cpu(), loc, k, v, tickets.cpu()


def check(res, dtype, *, bs, q_len, padded=0, store=True, bad_loc=False):
    out, expected, kc, vc, loc, k, v, tickets = res
    real = bs * q_len
    assert torch.isfinite(out).all()
    err = (out[:real].double() - expected).abs().max().item()
    assert err <= TOL[dtype] * max(1.0, expected.abs().max().item()), f"max error {err}"
    assert (out[real:] == 0).all(), "padded requests (no key) must output zeros"
    assert int(tickets.abs().sum()) == 0, "every launch must leave the tickets at zero"
    if store:
        for t in range(real):
            s = int(loc[t])
            if 1 <= s < kc.shape[0]:
                assert torch.equal(kc[s], k[t]) and torch.equal(vc[s], v[t]), f"token {t} not stored at slot {s}"
        if bad_loc:
            assert torch.isnan(kc[1]).all(), "a garbage slot must not be written"
