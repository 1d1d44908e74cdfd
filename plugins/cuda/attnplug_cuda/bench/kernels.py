"""Benchmark ``kernels`` (only with ``--only kernels``): each kernel alone, on its own tensors.

Device work is timed as the median of CUDA-graph replays (``ctx.timer.graph_us``:
``triton.testing.do_bench_cudagraph``, no host launch gaps) and, separately, the host time
to enqueue one call (``ctx.timer.host_us``: what eager mode pays), with slots scattered at
random through a cache far larger than L2:

* SWA decode, the target case: bs=64, window 4096, 32 q / 8 KV heads, D=128, bf16 (about
  1.07 GB of K/V read per call), against the device's copy bandwidth; full-layer decode over
  ``req_to_token``, TARGET_VERIFY (q_len 4), a long prefill and an extend;
* a 32-layer decode step (store + attention per layer) in one graph, PDL off / on;
* ``kv_store`` (64 decode tokens, an 8192-token prefill) and ``step_metadata``.

Each attention case runs the plan the planner gives it (``planner.plan_paged``), as the
backend would.

Each checked attention case is compared with a float32 torch computation (relative error
``rel_err``, target <= 2e-2). Rows: ``time`` per case (us, with TB/s or TFLOP/s, the launch
plan, the host enqueue time in the JSON).
"""

from __future__ import annotations

import functools
import math
from typing import List, Optional

import torch

from attnplug.bench import Ctx, bandwidth_row, copy_bandwidth, error_row, free_memory, row
from attnplug.bench.floors import attention_flops

NAME = "kernels"
H, HKV, D = 32, 8, 128
REL_ERR_TARGET = 2e-2


def _case(bs, q_len, seq_len, window, H, Hkv, D, dtype, device, layer, seed=0):
    """Caches, tables and inputs of one uniform step (every request the same lengths)."""
    from ..kernels.common import KeyTable
    from ..kernels.step_metadata import step_metadata

    g = torch.Generator(device=device).manual_seed(seed)
    reach = seq_len if window is None else min(seq_len, q_len + window - 1)
    n_slots = bs * (seq_len if layer == "full" else reach) + 1
    k_cache = torch.randn(n_slots, Hkv, D, generator=g, device=device).to(dtype)
    v_cache = torch.randn(n_slots, Hkv, D, generator=g, device=device).to(dtype)
    perm = torch.randperm(n_slots - 1, generator=g, device=device).int() + 1
    max_ctx = seq_len + 8
    req_to_token = torch.zeros(bs + 1, max_ctx, dtype=torch.int32, device=device)
    mapping = torch.zeros(bs * seq_len + 2, dtype=torch.int32, device=device)
    full = torch.arange(1, bs * seq_len + 1, device=device).view(bs, seq_len).int()
    req_to_token[1:, :seq_len] = full
    if layer == "full":
        mapping[1 : bs * seq_len + 1] = perm[: bs * seq_len]  # unused by the full layer
        req_to_token[1:, :seq_len] = perm[: bs * seq_len].view(bs, seq_len)
    else:
        mapping[full[:, seq_len - reach :].reshape(-1).long()] = perm[: bs * reach]
    rpi = torch.arange(1, bs + 1, dtype=torch.int64, device=device)
    seq_lens = torch.full((bs,), seq_len, dtype=torch.int32, device=device)
    T = bs * q_len
    out_cache_loc = req_to_token[1:, seq_len - q_len : seq_len].reshape(-1).long()
    width = q_len + window - 1 if window is not None else max_ctx
    bufs = dict(
        cu_q_lens=torch.empty(bs + 1, dtype=torch.int32, device=device),
        window_start=torch.empty(bs, dtype=torch.int32, device=device),
        token_pos=torch.empty(T, dtype=torch.int32, device=device),
        swa_out_cache_loc=torch.empty(T, dtype=torch.int32, device=device),
        swa_window_table=torch.empty(bs, width, dtype=torch.int32, device=device) if window is not None else None,
    )
    meta = lambda: step_metadata(  # noqa: E731
        rpi,
        seq_lens,
        q_len,
        out_cache_loc,
        full_to_swa_index_mapping=mapping,
        req_to_token=req_to_token,
        window=window,
        **bufs,
    )
    meta()
    q = torch.randn(T, H, D, generator=g, device=device).to(dtype)
    if layer == "full":
        keys = KeyTable.of(req_to_token, rpi)
    else:
        keys = KeyTable.of(
            bufs["swa_window_table"], torch.arange(bs, dtype=torch.int32, device=device), bufs["window_start"]
        )
    return dict(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        cu=bufs["cu_q_lens"],
        seq_lens=seq_lens,
        keys=keys,
        max_kv_len=max_ctx,
        meta=meta,
        reach=reach,
        out_cache_loc=out_cache_loc,
    )


def _reference(c, q_len, window):
    """float32 dense attention over the slots the table names (one request at a time)."""
    q, kc, vc = c["q"], c["k_cache"], c["v_cache"]
    T, H, D = q.shape
    Hkv = kc.shape[1]
    bs = c["seq_lens"].shape[0]
    seq_len = int(c["seq_lens"][0])
    out = torch.empty(T, H, D, dtype=torch.float32, device=q.device)
    keys = c["keys"]
    for b in range(bs):
        lo_col = 0 if keys.start is None else int(keys.start[b])
        row = int(keys.rows[b])
        pos_all = torch.arange(lo_col, seq_len, device=q.device)
        slots = keys.table[row, pos_all - lo_col].long()
        k = kc[slots].float().repeat_interleave(H // Hkv, 1)
        v = vc[slots].float().repeat_interleave(H // Hkv, 1)
        qb = q[b * q_len : (b + 1) * q_len].float()
        s = torch.einsum("thd,jhd->thj", qb, k) / math.sqrt(D)
        p = seq_len - q_len + torch.arange(q_len, device=q.device)
        keep = pos_all[None, :] <= p[:, None]
        if window is not None:
            keep &= pos_all[None, :] >= (p - window + 1)[:, None]
        s = s.masked_fill(~keep[:, None, :], float("-inf"))
        out[b * q_len : (b + 1) * q_len] = torch.einsum("thj,jhd->thd", torch.softmax(s, -1), v)
    return out


def _plan(c, q_len, window):
    """The plan the planner gives this case (``planner.plan_paged``), as the backend would."""
    from ..kernels.common import num_sms
    from ..planner import LaunchShape, plan_paged
    from ..tuning import CudaTuning

    q = c["q"]
    T, heads, head_dim = q.shape
    bs, group = c["seq_lens"].shape[0], heads // HKV
    shape = LaunchShape(bs, T, HKV, group, head_dim, q_len, c["max_kv_len"], window, num_sms(q.device))
    return plan_paged(shape, CudaTuning())


def _attention_fn(c, q_len, window, *, pdl=False):
    from ..kernels.common import AttentionInputs
    from ..kernels.paged_attention import paged_attention
    from ..kernels.pdl import PLAIN

    q = c["q"]
    out = torch.empty_like(q)
    plan = _plan(c, q_len, window)
    ws = torch.empty(q.shape[0] * q.shape[1] * plan.NUM_SPLITS * (q.shape[2] + 2), dtype=torch.float32, device=q.device)

    def fn():
        inputs = AttentionInputs(c["cu"], c["seq_lens"], c["keys"], q_len, window=window)
        paged_attention(q, c["k_cache"], c["v_cache"], out, inputs, plan, workspace=ws, pdl=PLAIN if pdl else None)
        return out

    return fn


def _attention_row(
    ctx: Ctx,
    name: str,
    bs: int,
    q_len: int,
    seq_len: int,
    window: Optional[int],
    layer: str,
    pdl: bool,
    copy_tb_s: float,
    *,
    check: bool = True,
) -> dict:
    dev = ctx.device
    c = _case(bs, q_len, seq_len, window, H, HKV, D, torch.bfloat16, dev, layer)
    keys = min(seq_len, q_len + window - 1) if window is not None else seq_len
    kv_bytes = bs * keys * HKV * D * 2 * 2
    plan = _plan(c, q_len, window)
    fn = _attention_fn(c, q_len, window, pdl=pdl)
    out = fn()
    err = None
    if check:
        ref = _reference(c, q_len, window)
        err = float((out.float() - ref).norm() / ref.norm())
    us = ctx.timer.graph_us(fn, rep_ms=20.0 if ctx.quick else 100.0)
    host = ctx.timer.host_us(fn, iters=50 if ctx.quick else 200, warmup=5)
    flops = attention_flops(H, D, [seq_len] * bs, [q_len] * bs, window)
    tb_s = kv_bytes / (us * 1e-6) / 1e12
    tflops = flops / (us * 1e-6) / 1e12
    del c
    free_memory(ctx.timer)
    return row(
        NAME,
        name,
        "time",
        us,
        "us",
        target=f"rel_err <= {REL_ERR_TARGET:g}" if check else None,
        met=(err <= REL_ERR_TARGET) if check else None,
        key=True,
        kv_gb=kv_bytes / 1e9,
        tb_s=tb_s,
        pct_of_copy=100 * tb_s / copy_tb_s,
        tflop_s=tflops,
        rel_err=err,
        plan=plan._asdict(),
        host_us=host,
        detail=f"{tb_s:.2f} TB/s ({100 * tb_s / copy_tb_s:.0f}% of copy), {tflops:.1f} TFLOP/s, "
        f"host {host:.0f} us" + (f", rel err {err:.1e}" if err is not None else ""),
    )


def _guarded(ctx: Ctx, case: str, fn) -> None:
    """Run ``fn() -> row`` and append its row, or an error row (the other cases still run)."""
    if ctx.time_low(20):
        ctx.rows.append(row(NAME, case, "time", None, "us", notes="skipped: time budget", key=True))
        return
    try:
        r = fn()
        ctx.rows.append(r)
        ctx.log(f"  {case}: {r['value']:.1f} us  {r.get('detail', '')}")
    except Exception as exc:
        ctx.rows.append(error_row(NAME, case, "time", "us", exc))
        ctx.log(f"  {case}: FAILED {type(exc).__name__}: {exc}")
        free_memory(ctx.timer)


def _step_row(ctx: Ctx, use_pdl: bool) -> dict:
    """A 32-layer decode step (store + SWA attention per layer) in one graph."""
    from ..kernels.kv_store import kv_store

    dev = ctx.device
    c = _case(8, 1, 2048, 1024, H, HKV, D, torch.bfloat16, dev, "swa")
    k_new = torch.randn(8, HKV, D, device=dev).to(torch.bfloat16)
    loc = torch.arange(1, 9, dtype=torch.int32, device=dev)
    attend = _attention_fn(c, 1, 1024, pdl=use_pdl)

    def step():
        for _ in range(32):
            kv_store(k_new, k_new, c["k_cache"], c["v_cache"], loc, pdl=use_pdl)
            attend()

    step()
    us = ctx.timer.graph_us(step, rep_ms=20.0 if ctx.quick else 100.0)
    return row(
        NAME,
        f"32-layer decode step bs8 W1024 pdl={use_pdl}",
        "time",
        us,
        "us",
        key=True,
        detail=f"{us / 32:.2f} us per layer (store + attention)",
    )


def _store_row(ctx: Ctx, T: int, pdl: bool) -> dict:
    from ..kernels.kv_store import kv_store

    dev, S = ctx.device, 1 << 20
    kc = torch.zeros(S, HKV, D, dtype=torch.bfloat16, device=dev)
    vc = torch.zeros_like(kc)
    k = torch.randn(T, HKV, D, device=dev).to(torch.bfloat16)
    v = torch.randn_like(k)
    loc = torch.randperm(S, device=dev)[:T]
    kv_store(k, v, kc, vc, loc, pdl=pdl)
    ok = bool(torch.equal(kc[loc], k) and torch.equal(vc[loc], v))
    fn = lambda: kv_store(k, v, kc, vc, loc, pdl=pdl)  # noqa: E731
    us = ctx.timer.graph_us(fn, rep_ms=20.0 if ctx.quick else 100.0)
    host = ctx.timer.host_us(fn, iters=50 if ctx.quick else 200, warmup=5)
    tb_s = 4 * k.numel() * 2 / (us * 1e-6) / 1e12
    return row(
        NAME,
        f"kv_store T={T}",
        "time",
        us,
        "us",
        target="stored values equal",
        met=ok,
        key=True,
        tb_s=tb_s,
        host_us=host,
        detail=f"{tb_s:.2f} TB/s, host {host:.0f} us",
    )


def _metadata_row(ctx: Ctx, bs: int) -> dict:
    c = _case(bs, 1, 4200, 4096, 8, 8, 64, torch.bfloat16, ctx.device, "swa")
    us = ctx.timer.graph_us(c["meta"], rep_ms=20.0 if ctx.quick else 100.0)
    host = ctx.timer.host_us(c["meta"], iters=50 if ctx.quick else 200, warmup=5)
    return row(
        NAME,
        f"step_metadata decode bs={bs} W4096",
        "time",
        us,
        "us",
        key=True,
        host_us=host,
        detail=f"host {host:.0f} us",
    )


def run(ctx: Ctx) -> List[dict]:
    from ..kernels.pdl import pdl_supported

    pdl, reason = pdl_supported(ctx.device)
    bw = copy_bandwidth(ctx.timer, 2 << 30, rep_ms=30.0 if ctx.quick else 100.0)
    ctx.rows.append(
        bandwidth_row(NAME, "device-to-device copy (2 GiB, read+write)", bw, detail=f"PDL {pdl} ({reason})")
    )
    ctx.log(f"  copy bandwidth {bw['tb_s']:.2f} TB/s; PDL {pdl} ({reason})")
    cases = [
        ("swa_decode bs64 W4096 seq8192", 64, 1, 8192, 4096, "swa", True),
        ("full_decode bs64 seq4096", 64, 1, 4096, None, "full", True),
        ("swa_decode bs8 W4096 seq8192", 8, 1, 8192, 4096, "swa", True),
        ("swa_decode bs256 W4096 seq4096", 256, 1, 4096, 4096, "swa", False),
        ("swa_verify bs64 q4 W4096", 64, 4, 8192, 4096, "swa", True),
        ("full_prefill bs1 q8192", 1, 8192, 8192, None, "full", False),
        ("full_extend bs4 q2048 prefix2048", 4, 2048, 4096, None, "full", False),
    ]
    if ctx.quick:
        cases = cases[:2]
    for name, bs, q_len, seq_len, window, layer, check in cases:
        _guarded(
            ctx,
            name,
            functools.partial(
                _attention_row, ctx, name, bs, q_len, seq_len, window, layer, pdl, bw["tb_s"], check=check
            ),
        )
    for use_pdl in [False, True] if pdl else [False]:
        _guarded(ctx, f"32-layer decode step bs8 W1024 pdl={use_pdl}", functools.partial(_step_row, ctx, use_pdl))
    for T in (64, 8192):
        _guarded(ctx, f"kv_store T={T}", functools.partial(_store_row, ctx, T, pdl))
    for bs in (64, 1024):
        _guarded(ctx, f"step_metadata decode bs={bs} W4096", functools.partial(_metadata_row, ctx, bs))
    return ctx.rows
