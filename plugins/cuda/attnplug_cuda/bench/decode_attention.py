"""Benchmark 3, ``decode_attention``: one SWA layer's decode attention at long context.

bs=64 requests of 32768 tokens (the new token at position 32767), window 4096, 32 q / 8 KV
heads, D=128, bf16. Pool: ONE SWA layer (``size = 64 * 32768`` full slots, ``size_swa`` =
``64 * 4096`` + 64); each request's full slots are contiguous (``1 + b * 32768 + p``) and the
window's positions ``32768 - 4096 .. 32767`` are mapped to contiguous SWA slots
(``1 + b * 4096 + j``), as an allocator that hands out pages in order would leave them
after evicting out-of-window slots. Metadata is built once (``init_forward_metadata``); only
the layer's attention is timed (``backend.forward(..., save_kv_cache=False)``: the paged
attention kernel over the step's ``swa_window_table`` and its split-KV combine).

Times are medians of ``triton.testing.do_bench`` (``ctx.timer.device_us``).
Bytes moved = the window's K and V once: 64 * 4096 * 8 * 128 * 2 B * 2. Reported as TB/s and
as % of the device-to-device copy bandwidth measured in the same run (bytes read+written).

Peers on the same data: PyTorch SDPA over the window laid out contiguously ([64,32,1,128] q,
[64,8,4096,128] k/v, ``enable_gqa=True``, no paging); gathering the paged window
(``k_cache[table]``) then SDPA; and ``flex_attention`` with a sliding-window block mask
(compiled in a child process with a time budget; the error is reported if it fails).

Target: >= 70% of the copy bandwidth.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from typing import List, Optional

import torch

from attnplug.bench import Ctx, Timer, bandwidth_row, copy_bandwidth, error_row, free_memory, row

NAME = "decode_attention"
BS, CONTEXT, WINDOW, H, HKV, D = 64, 32768, 4096, 32, 8, 128
BYTES = BS * WINDOW * HKV * D * 2 * 2
TARGET_FRACTION = 0.70


def _sdpa(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def _paged_and_peers(ctx: Ctx, rows: List[dict], copy_tb_s: float, rep_ms: float) -> float:
    """The cuda backend's SWA decode attention and the SDPA peers; returns its time (us)."""
    from attnplug import ForwardBatch, ForwardMode, ReqToTokenPool, SWAKVPool

    from ..backend import CudaBackend

    dev = torch.device("cuda", torch.cuda.current_device())

    size = BS * CONTEXT
    size_swa = BS * WINDOW + 64
    pool = SWAKVPool(size, size_swa, 1, [0], HKV, D, torch.bfloat16, dev)
    rows_pool = ReqToTokenPool(BS + 2, CONTEXT, dev)
    req = torch.arange(1, BS + 1, device=dev)  # request b lives in row b + 1
    pos = torch.arange(CONTEXT, device=dev)
    full = 1 + (req[:, None] - 1) * CONTEXT + pos[None, :]  # [BS, CONTEXT]
    rows_pool.req_to_token[1 : BS + 1] = full.to(torch.int32)
    for _ in range(BS):
        rows_pool.alloc()  # mark rows 1..BS used (bookkeeping only)
    win = torch.arange(WINDOW, device=dev)
    swa = 1 + (req[:, None] - 1) * WINDOW + win[None, :]  # [BS, WINDOW]
    pool.full_to_swa_index_mapping[full[:, CONTEXT - WINDOW :].reshape(-1)] = swa.reshape(-1).to(torch.int32)
    gen = torch.Generator(device=dev).manual_seed(0)
    k_cache, v_cache = pool.get_kv_buffer(0)
    k_cache.normal_(generator=gen)
    v_cache.normal_(generator=gen)

    backend = CudaBackend(pool, rows_pool, num_heads=H, sliding_window=WINDOW)
    batch = ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=BS,
        req_pool_indices=req.clone(),
        seq_lens=torch.full((BS,), CONTEXT, dtype=torch.int64, device=dev),
        out_cache_loc=(1 + (req - 1) * CONTEXT + CONTEXT - 1).contiguous(),
        positions=torch.full((BS,), CONTEXT - 1, dtype=torch.int64, device=dev),
    )
    backend.init_forward_metadata(batch)
    q = torch.randn(BS, H, D, device=dev, dtype=torch.bfloat16, generator=gen)
    kv_dummy = torch.zeros(BS, HKV, D, device=dev, dtype=torch.bfloat16)

    def ours():
        return backend.forward(q, kv_dummy, kv_dummy, 0, batch, save_kv_cache=False)

    out_ours = ours()
    us = ctx.timer.device_us(ours, rep_ms=rep_ms)
    tbs = BYTES / (us * 1e-6) / 1e12
    frac = tbs / copy_tb_s
    rows.append(
        row(
            NAME,
            "cuda backend (paged, swa_window_table)",
            "time",
            us,
            "us",
            achieved_tb_s=tbs,
            pct_of_copy=100 * frac,
            bytes=BYTES,
            pdl=backend.pdl,
        )
    )
    rows.append(
        row(
            NAME,
            "cuda backend (paged, swa_window_table)",
            "% of copy bandwidth",
            100 * frac,
            "%",
            target=f">= {100 * TARGET_FRACTION:g}%",
            met=frac >= TARGET_FRACTION,
            achieved_tb_s=tbs,
            detail=f"{us:.1f} us, {tbs:.2f} TB/s (copy {copy_tb_s:.2f} TB/s)",
        )
    )
    ctx.log(f"  cuda backend: {us:.1f} us, {tbs:.3f} TB/s = {100 * frac:.1f}% of copy")

    # The window laid out contiguously: position CONTEXT - WINDOW + j of request b is SWA slot 1 + b*WINDOW + j.
    kc = k_cache[1 : 1 + BS * WINDOW].view(BS, WINDOW, HKV, D).transpose(1, 2).contiguous()
    vc = v_cache[1 : 1 + BS * WINDOW].view(BS, WINDOW, HKV, D).transpose(1, 2).contiguous()
    q4 = q.view(BS, H, 1, D)
    try:
        out_sdpa = _sdpa(q4, kc, vc)
        diff = (out_sdpa.view(BS, H, D).float() - out_ours.float()).abs().max().item()
        rows.append(
            row(
                NAME,
                "cuda backend vs SDPA (same window)",
                "max |out diff|",
                diff,
                "",
                target="<= 2e-2",
                met=diff <= 2e-2,
            )
        )
        ctx.log(f"  max |diff| SDPA vs ours {diff:.2e}")
        _peer(ctx, rows, "peer: SDPA, contiguous window, enable_gqa", lambda: _sdpa(q4, kc, vc), us, rep_ms)
    except Exception as exc:
        rows.append(error_row(NAME, "peer: SDPA, contiguous window", "time", "us", exc))
        ctx.log(f"  SDPA contiguous: FAILED {type(exc).__name__}: {exc}")
    kc = vc = None  # free the contiguous copies before the gather peer
    free_memory(ctx.timer)

    table = backend.forward_metadata.swa_window_table  # [BS, WINDOW] int32

    def gather_sdpa():
        idx = table.long()
        kg = k_cache[idx].transpose(1, 2)  # [BS, HKV, WINDOW, D]
        vg = v_cache[idx].transpose(1, 2)
        return _sdpa(q4, kg, vg)

    try:
        _peer(ctx, rows, "peer: gather k_cache[table] + SDPA", gather_sdpa, us, rep_ms)
    except Exception as exc:
        rows.append(error_row(NAME, "peer: gather + SDPA", "time", "us", exc))
        ctx.log(f"  gather + SDPA: FAILED {type(exc).__name__}: {exc}")
    return us


def _peer(ctx: Ctx, rows: List[dict], case: str, fn, us: float, rep_ms: float) -> None:
    """Time a peer's ``fn`` and append its row against the cuda backend's ``us``."""
    us_peer = ctx.timer.device_us(fn, rep_ms=rep_ms)
    tb_s = BYTES / (us_peer * 1e-6) / 1e12
    rows.append(
        row(
            NAME,
            case,
            "time",
            us_peer,
            "us",
            achieved_tb_s=tb_s,
            ours_speedup=us_peer / us,
            key=True,
            detail=f"{tb_s:.2f} TB/s; cuda backend {us_peer / us:.2f}x its speed",
        )  # fmt: skip
    )
    ctx.log(f"  {case}: {us_peer:.1f} us")


def run(ctx: Ctx) -> List[dict]:
    rows: List[dict] = ctx.rows
    rep_ms = 30.0 if ctx.quick else 100.0
    bw = copy_bandwidth(ctx.timer, 2 << 30, rep_ms=rep_ms)
    rows.append(bandwidth_row(NAME, "device-to-device copy (2 GiB, read+write)", bw, bytes=bw["bytes"]))
    ctx.log(f"  copy bandwidth: {bw['tb_s']:.3f} TB/s ({bw['us']:.1f} us for {bw['bytes'] / 1e9:.2f} GB)")
    us = None
    try:
        us = _paged_and_peers(ctx, rows, bw["tb_s"], rep_ms)
    except Exception as exc:
        rows.append(error_row(NAME, "cuda backend (paged, swa_window_table)", "time", "us", exc))
        ctx.log(f"  cuda backend: FAILED {type(exc).__name__}: {exc}")
    free_memory(ctx.timer)

    # flex_attention: compiled in a child process, so a slow or failing compile cannot hang the run.
    flex_budget = float(ctx.options.get("flex_budget_s", 150.0))
    budget = min(flex_budget, max(0.0, ctx.deadline.left() - ctx.reserve_after_s - 15))
    if ctx.quick or budget < 30:
        why = "skipped in --quick" if ctx.quick else f"skipped: time budget ({budget:.0f} s left for it)"
        rows.append(row(NAME, "peer: flex_attention, sliding-window mask", "time", None, "us", notes=why, key=True))
        ctx.log(f"  flex_attention: {why}")
    else:
        ctx.log(f"  flex_attention: compiling in a child process (budget {budget:.0f} s) ...")
        rows.append(_flex_row(budget, us, rep_ms))
        ctx.log(f"  flex_attention: {rows[-1]['value']} us {rows[-1].get('error') or ''}")
    return rows


def _flex_row(budget: float, ours_us: Optional[float], rep_ms: float) -> dict:
    case = "peer: flex_attention, sliding-window mask"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    cmd = [sys.executable, "-m", "attnplug_cuda.bench.decode_attention", "--flex-child", str(rep_ms)]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=budget)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the child and its compile workers
        except OSError:
            proc.kill()
        proc.communicate()
        return row(NAME, case, "time", None, "us", error=f"did not compile and run within {budget:.0f} s", key=True)
    result = None
    for line in reversed(stdout.splitlines()):
        if line.startswith("FLEX_RESULT "):
            result = json.loads(line[len("FLEX_RESULT ") :])
            break
    if result is None or result.get("error"):
        err = (result or {}).get("error") or f"child exited {proc.returncode}: " + " | ".join(
            (stderr or stdout).strip().splitlines()[-6:]
        )
        return row(NAME, case, "time", None, "us", error=err, key=True)
    us = result["us"]
    ratio = us / ours_us if ours_us else None
    return row(
        NAME,
        case,
        "time",
        us,
        "us",
        achieved_tb_s=BYTES / (us * 1e-6) / 1e12,
        ours_speedup=ratio,
        compile_s=result.get("compile_s"),
        max_abs_diff_vs_sdpa=result.get("diff"),
        key=True,
        detail=(f"cuda backend {ratio:.2f}x its speed; " if ratio else "")
        + f"compiled in {result.get('compile_s', 0):.0f} s; {BYTES / (us * 1e-6) / 1e12:.2f} TB/s",
    )


def _flex_child(rep_ms: float) -> None:
    """Child process: compile flex_attention for the same problem (contiguous window, a
    sliding-window mask whose query sits at position CONTEXT - 1) and time it."""
    import time

    result = {}
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        dev = "cuda"
        gen = torch.Generator(device=dev).manual_seed(0)
        q = torch.randn(BS, H, 1, D, device=dev, dtype=torch.bfloat16, generator=gen)
        k = torch.randn(BS, HKV, WINDOW, D, device=dev, dtype=torch.bfloat16, generator=gen)
        v = torch.randn(BS, HKV, WINDOW, D, device=dev, dtype=torch.bfloat16, generator=gen)
        q_pos0, k_pos0 = CONTEXT - 1, CONTEXT - WINDOW  # absolute positions of index 0

        def sliding_window(b, h, q_idx, kv_idx):
            qp, kp = q_idx + q_pos0, kv_idx + k_pos0
            return (kp <= qp) & (qp - kp < WINDOW)

        t0 = time.time()
        mask = create_block_mask(sliding_window, B=None, H=None, Q_LEN=1, KV_LEN=WINDOW, device=dev)
        compiled = torch.compile(flex_attention, dynamic=False)
        out = compiled(q, k, v, block_mask=mask, enable_gqa=True)
        torch.cuda.synchronize()
        result["compile_s"] = time.time() - t0
        ref = _sdpa(q, k, v)
        result["diff"] = (out.float() - ref.float()).abs().max().item()
        result["us"] = Timer(dev).device_us(lambda: compiled(q, k, v, block_mask=mask, enable_gqa=True), rep_ms=rep_ms)
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:500]
    print("FLEX_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "--flex-child":
        _flex_child(float(sys.argv[2]))
