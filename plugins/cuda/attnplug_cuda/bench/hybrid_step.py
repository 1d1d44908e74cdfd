"""Benchmark 4, ``hybrid_step``: whole steps of a 48-layer hybrid model, new path vs before.

Model: 48 attention layers, SWA on ``layer % 4 != 3`` (36 SWA, 12 full), 32 q / 8 KV heads,
D=128, bf16; each layer's q/k/v are static random tensors (the "model" is just the attention
layers). Context: 1024 tokens per request, window 256 (chosen so the SWA layers read a
quarter of what the full layers read, as in production hybrid models, while a 128-request
world stays within ~12 GB). Requests are allocated through ``SWATokenAllocator`` with the
out-of-window SWA slots evicted (``attnplug.bench.world``).

Modes: DECODE and DRAFT_EXTEND (4 draft tokens); bs = 1, 8, 32, 64, 128 (``--quick``: 1 and
64). Both paths run as CUDA graphs through ``attnplug.GraphRunner`` (one bucket: the case's
bs): the new path with the cuda backend (``seq_lens_cpu=None``), the before path with
``BeforeBackend`` (host ``seq_lens_cpu``, per-layer translation, index_put stores, no PDL).

Time per full step = wall clock of N back-to-back ``runner.run`` calls (host preparation +
replay, the GPU kept busy) followed by one synchronize, divided by N; median of a few
repeats (``attnplug.bench.step_case``). Target: before / new >= 1.5x at every bs; the two
paths' outputs must agree.
"""

from __future__ import annotations

from typing import List

import torch

from attnplug import ForwardMode
from attnplug.bench import Ctx
from attnplug.bench.step_case import StepShape, StepVariant, run_step_benchmark

NAME = "hybrid_step"
NUM_LAYERS, CONTEXT, WINDOW, NUM_DRAFT = 48, 1024, 256, 4
TARGET_SPEEDUP = 1.5
SHAPE = StepShape(
    num_layers=NUM_LAYERS,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    context=CONTEXT,
    window=WINDOW,
    num_draft=NUM_DRAFT,
    dtype=torch.bfloat16,
)


def variants() -> dict:
    """``new``: the cuda backend (``seq_lens_cpu=None``); ``before``: ``BeforeBackend``."""
    from ..backend import CudaBackend
    from .before import BeforeBackend

    return {"new": StepVariant(make=CudaBackend), "before": StepVariant(make=BeforeBackend, with_cpu=True)}


def run(ctx: Ctx) -> List[dict]:
    sizes = (1, 64) if ctx.quick else (1, 8, 32, 64, 128)
    return run_step_benchmark(
        ctx,
        name=NAME,
        shape=SHAPE,
        variants=variants(),
        baseline="before",
        modes=(ForwardMode.DECODE, ForwardMode.DRAFT_EXTEND),
        sizes=sizes,
        steps=lambda bs: 30 if ctx.quick else (50 if bs >= 64 else 100),
        repeats=3 if ctx.quick else 5,
        target_speedup=TARGET_SPEEDUP,
        tolerance=1e-2,
    )
