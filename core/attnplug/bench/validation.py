"""``batch_validation``: what ``ATTNPLUG_VALIDATE=1`` costs a step.

With validation on, every metadata call (and every graph replay's preparation) first runs
``AttentionBackend.check_batch(batch, read_device=True)``: the field checks of
``attnplug.batch_checks`` and the consistency rules of ``attnplug.batch_consistency`` (the
step against ``req_to_token`` and the pool's mapping), which read the step's rows and the
verdicts back to the host: one synchronisation a step on an accelerator. This benchmark
times that call per DECODE step of the hybrid world the step benchmarks use (the hybrid_step
context of 1,024 tokens, window 256), at the batch sizes of ``hybrid_step``, beside the eager
metadata call of the same step for scale. The time is wall clock with the device idle
before each call (what validation adds to a step, its sync included).

Run it with ``attnplug bench --backend NAME --only batch_validation``.
"""

from __future__ import annotations

from typing import List

import torch

from ..batch import ForwardMode
from .context import Ctx
from .rows import row
from .suite import Benchmark
from .world import build_world

__all__ = ["BENCHMARK", "run"]

NAME = "batch_validation"
#: the entry a suite lists (only run when named: ``attnplug bench --only batch_validation``)
BENCHMARK = Benchmark(
    NAME,
    f"{__name__}:run",
    "what ATTNPLUG_VALIDATE=1 costs a DECODE step (check_batch with device reads) vs the metadata call",
    reserve_s=60.0,
    default=False,
)

CONTEXT, WINDOW = 1024, 256


def run(ctx: Ctx) -> List[dict]:
    """The rows of the module docstring for ``ctx.backend_cls`` on ``ctx.device``."""
    if ctx.backend_cls is None:
        raise ValueError("batch_validation needs a backend (ctx.backend_cls is None)")
    on_host = ctx.device.type == "cpu"
    sizes = (1, 4) if ctx.quick else ((1, 8, 32) if on_host else (1, 8, 32, 64, 128))
    context, window = (64, 16) if ctx.quick else (CONTEXT, WINDOW)
    world = build_world(
        num_layers=4,
        max_bs=max(sizes),
        context=context,
        window=window,
        num_draft=1,
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        dtype=torch.float32 if on_host else torch.bfloat16,
        device=ctx.device,
        fill_random=False,
    )
    backend = ctx.backend_cls(world.pool, world.rows, num_heads=world.num_heads, sliding_window=window)
    with_cpu = bool(getattr(ctx.backend_cls, "needs_cpu_seq_lens", False))
    calls, repeats = (5, 3) if ctx.quick else (20, 7)
    rows: List[dict] = []
    for bs in sizes:
        if ctx.deadline.expired(ctx.reserve_after_s):
            rows.append(row(NAME, f"decode bs={bs}", "validation per step", None, "us", notes="skipped: budget"))
            continue
        batch = world.batch(ForwardMode.DECODE, bs, with_cpu=with_cpu)
        check_us = ctx.timer.wall_us(lambda b=batch: backend.check_batch(b, read_device=True), calls=1, repeats=calls)
        meta_us = ctx.timer.wall_us(lambda b=batch: backend.init_forward_metadata(b), calls=calls, repeats=repeats)
        detail = f"context {context}, window {window}; eager init_forward_metadata {meta_us:.1f} us"
        rows.append(row(NAME, f"decode bs={bs}", "validation per step", check_us, "us", bs=bs, detail=detail, key=True))
        rows.append(row(NAME, f"decode bs={bs}", "metadata per step", meta_us, "us", bs=bs))
        ctx.log(f"{NAME}: bs={bs}: validation {check_us:.1f} us, metadata {meta_us:.1f} us")
    return rows
