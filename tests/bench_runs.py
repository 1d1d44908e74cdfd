"""Step benchmarks (``attnplug.bench.step_case``) as the tests run them: the smallest step shape
and timing settings that exercise every row kind in seconds, on the host or a device."""

from __future__ import annotations

import torch

from attnplug import ForwardMode
from attnplug.bench.step_case import StepShape, run_step_benchmark

#: 4 layers (3 SWA), 4 query / 2 KV heads of 16, float32, a 32-token context, window 8, 2 drafts
SMALL_STEP = dict(
    num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16, context=32, window=8, num_draft=2, dtype=torch.float32
)


def small_step_shape(**overrides) -> StepShape:
    """``SMALL_STEP`` with ``overrides``."""
    return StepShape(**{**SMALL_STEP, **overrides})


def quick_step_benchmark(ctx, **kwargs):
    """``run_step_benchmark(ctx, **kwargs)`` timing decode steps once each: one step a sample,
    one repeat, no warm-up, no minimum run time, a 64 KiB bandwidth copy, batch size 1 (``kwargs``
    give the rest and may override these)."""
    quick = dict(
        modes=(ForwardMode.DECODE,), sizes=(1,), steps=lambda bs: 1, repeats=1, warmup=0, need_s=0, copy_bytes=1 << 16
    )
    return run_step_benchmark(ctx, **{**quick, **kwargs})
