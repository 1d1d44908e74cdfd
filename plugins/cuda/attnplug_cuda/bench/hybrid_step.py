"""Benchmark 4, ``hybrid_step``: whole steps of a 48-layer hybrid model, new path vs before.

Model: 48 attention layers, SWA on ``layer % 4 != 3`` (36 SWA, 12 full), 32 q / 8 KV heads,
D=128, bf16; each layer's q/k/v are static random tensors (the "model" is just the attention
layers). Context: 1024 tokens per request, window 256 (chosen so the SWA layers read a
quarter of what the full layers read, as in production hybrid models, while a 128-request
world stays within ~12 GB). Requests are allocated through ``SWATokenAllocator`` with the
out-of-window SWA slots evicted (``_world.py``).

Modes: DECODE and DRAFT_EXTEND (4 draft tokens); bs = 1, 8, 32, 64, 128 (``--quick``: 1 and
64). Both paths run as CUDA graphs through ``attnplug.GraphRunner`` (one bucket: the case's
bs): the new path with the cuda backend (``seq_lens_cpu=None``), the before path with
``BeforeBackend`` (host ``seq_lens_cpu``, per-layer translation, index_put stores, no PDL).

Time per full step = wall clock of N back-to-back ``runner.run`` calls (host preparation +
replay, the GPU kept busy) followed by one synchronize, divided by N; median of a few
repeats. Target: before / new >= 1.5x at every bs.
"""

from __future__ import annotations

import time
import traceback
from typing import Dict, List, Optional, Tuple

import torch

from .common import Ctx, row
from .timing import free_cuda, median, sync

NAME = "hybrid_step"
NUM_LAYERS, CONTEXT, WINDOW, NUM_DRAFT = 48, 1024, 256, 4
TARGET_SPEEDUP = 1.5


def _time_steps(runner, batch, inputs, steps: int, repeats: int, warmup: int = 5) -> float:
    """Median over ``repeats`` of (wall clock of ``steps`` back-to-back steps, then one
    synchronize) / ``steps``, in microseconds."""
    for _ in range(warmup):
        runner.run(batch, inputs)
    sync()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(steps):
            runner.run(batch, inputs)
        sync()
        samples.append((time.perf_counter() - t0) * 1e6 / steps)
    return median(samples)


def _run_path(world, backend, mode, bs: int, steps: int, repeats: int, with_cpu: bool,
              warmup: int = 5) -> Tuple[float, torch.Tensor]:
    from attnplug import ForwardMode, GraphRunner

    from ._world import INPUTS, make_step

    q = 1 if mode is ForwardMode.DECODE else NUM_DRAFT
    T = bs * q
    step = make_step(backend, world, T)
    runner = GraphRunner(backend, step, max_bs=bs, inputs=INPUTS, num_draft_tokens=NUM_DRAFT if q > 1 else None,
                         bucket_sizes=[bs], modes=[mode])
    runner.capture()
    batch = world.batch(mode, bs, with_cpu=with_cpu)
    inputs = {"x": torch.zeros(T, 1, dtype=INPUTS["x"][1], device=world.pool.device)}
    out = runner.run(batch, inputs).float().clone()
    us = _time_steps(runner, batch, inputs, steps, repeats, warmup)
    return us, out


def run(ctx: Ctx) -> List[dict]:
    from attnplug import ForwardMode

    from ..backend import CudaBackend
    from ._world import build_world
    from .before import BeforeBackend

    rows: List[dict] = ctx.rows
    sizes = (1, 64) if ctx.quick else (1, 8, 32, 64, 128)
    repeats = 3 if ctx.quick else 5
    world = build_world(num_layers=NUM_LAYERS, max_bs=max(sizes), context=CONTEXT, window=WINDOW, num_draft=NUM_DRAFT)
    ctx.log(f"  world: {NUM_LAYERS} layers (36 SWA), context {CONTEXT}, window {WINDOW}, max bs {max(sizes)}, "
            f"{torch.cuda.memory_allocated() / 2**30:.1f} GiB allocated")
    backends = {
        "new": CudaBackend(world.pool, world.rows, num_heads=world.num_heads, sliding_window=WINDOW),
        "before": BeforeBackend(world.pool, world.rows, num_heads=world.num_heads, sliding_window=WINDOW),
    }
    for mode in (ForwardMode.DECODE, ForwardMode.DRAFT_EXTEND):
        for bs in sizes:
            label = f"{mode.name.lower()} bs={bs}"
            if ctx.time_low(30):
                rows.append(row(NAME, label, "speedup (before / new)", None, "x", notes="skipped: time budget", key=True))
                ctx.log(f"  {label}: skipped (time budget)")
                continue
            steps = 30 if ctx.quick else 100
            if bs >= 64 and not ctx.quick:
                steps = 50
            times: Dict[str, float] = {}
            outs: Dict[str, torch.Tensor] = {}
            for path, backend in backends.items():
                try:
                    us, out = _run_path(world, backend, mode, bs, steps, repeats, with_cpu=(path == "before"))
                    times[path], outs[path] = us, out
                    rows.append(row(NAME, f"{label} {path}", "time per step", us, "us", steps=steps, repeats=repeats))
                    ctx.log(f"  {label} {path}: {us:.1f} us/step")
                except Exception as exc:
                    rows.append(row(NAME, f"{label} {path}", "time per step", None, "us",
                                    error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()))
                    ctx.log(f"  {label} {path}: FAILED {type(exc).__name__}: {exc}")
                finally:
                    free_cuda()
            diff: Optional[float] = None
            if len(outs) == 2:
                diff = (outs["new"] - outs["before"]).abs().max().item()
            if len(times) == 2:
                s = times["before"] / times["new"]
                differ = diff is not None and diff > 1e-2
                rows.append(row(NAME, label, "speedup (before / new)", s, "x", target=f">= {TARGET_SPEEDUP}x",
                                met=s >= TARGET_SPEEDUP, new_us=times["new"], before_us=times["before"],
                                max_abs_out_diff=diff,
                                detail=(f"OUTPUTS DIFFER (max {diff:.3g}); " if differ else "")
                                + f"step: new {times['new']:.1f} us, before {times['before']:.1f} us"))
                ctx.log(f"  {label:20s} new {times['new']:9.1f} us  before {times['before']:9.1f} us  "
                        f"speedup {s:5.2f}x  (max |out diff| {diff:.2e})")
            del outs
    del backends, world
    return rows
