"""The portable suite: benchmarks any backend runs, on any device (the host included).

``hybrid_step``: whole steps of a small hybrid model (SWA on ``layer % 4 != 3``) for DECODE
and DRAFT_EXTEND, with the backend under test through ``GraphRunner`` (variant ``graph``:
the backend's device graph, or the eager stand-in where the device has none) against the
same backend stepping eagerly (variant ``eager``, the baseline: metadata and every layer
each step). The two must produce the same outputs. Sizes are small so it runs in seconds on
the host; ``--quick`` shrinks them further.

``prefill`` (only with ``--only prefill``): paged causal prefill through the backend's
``forward`` over a pool, small cases (``attnplug.bench.prefill``).

Options: ``dtype`` (``--set dtype=float16``): the model's dtype (q, k, v; and the cache's
unless ``kv_cache_dtype`` says otherwise); ``auto``: float32 on the host, bfloat16 on an
accelerator. ``kv_cache_dtype`` (the engines' names: ``auto``, ``fp8``, ``fp8_e4m3``,
``fp8_e5m2``; ``attnplug.memory.fp8.KV_CACHE_DTYPE_NAMES``): with an FP8 dtype
``hybrid_step`` also runs variant ``graph-<name>`` (the backend through ``GraphRunner`` over
an FP8 cache holding the same keys, quantised with ``world.bench_kv_scales``), its speedup
``graph / graph-<name>`` and its DECODE attention against float32 attention over the
dequantised cache. ``model_decode_series``: the row series ``model_decode`` runs
(``prefill``, ``decode``; default both).
"""

from __future__ import annotations

from typing import List

import torch

from ..batch import ForwardMode
from ..memory.fp8 import is_fp8, resolve_kv_cache_dtype
from .context import Ctx
from .model_decode import BENCHMARK as MODEL_DECODE
from .model_decode import OPTIONS as MODEL_DECODE_OPTIONS
from .step_case import StepRatio, StepShape, StepVariant, run_step_benchmark
from .suite import Benchmark, Suite
from .validation import BENCHMARK as BATCH_VALIDATION

__all__ = ["SUITE", "run_hybrid_step", "suite_dtype", "QUICK_SHAPE", "FULL_SHAPE"]

QUICK_SHAPE = dict(num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16, context=32, window=8, num_draft=2)
FULL_SHAPE = dict(num_layers=8, num_heads=8, num_kv_heads=2, head_dim=64, context=256, window=64, num_draft=4)


def suite_dtype(ctx: Ctx) -> torch.dtype:
    """The model dtype of the run: option ``dtype`` (``auto``: float32 on the host, bfloat16
    on an accelerator)."""
    name = str(ctx.options.get("dtype", "auto"))
    if name == "auto":
        return torch.float32 if ctx.device.type == "cpu" else torch.bfloat16
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"option dtype={name!r} is not a torch dtype (e.g. float32, bfloat16, float16)")
    return dtype


def run_hybrid_step(ctx: Ctx) -> List[dict]:
    """The ``hybrid_step`` benchmark of the module docstring for ``ctx.backend_cls``."""
    if ctx.backend_cls is None:
        raise ValueError("the portable hybrid_step benchmark needs a backend (ctx.backend_cls is None)")
    shape = StepShape(dtype=suite_dtype(ctx), **(QUICK_SHAPE if ctx.quick else FULL_SHAPE))
    cls = ctx.backend_cls
    with_cpu = bool(getattr(cls, "needs_cpu_seq_lens", False))
    variants = {
        "graph": StepVariant(make=cls, graph=True, with_cpu=with_cpu),
        "eager": StepVariant(make=cls, graph=False, with_cpu=with_cpu),
    }
    ratios = []
    kv_name = str(ctx.options.get("kv_cache_dtype", "auto"))
    kv_cache_dtype = resolve_kv_cache_dtype(kv_name, shape.dtype)
    if is_fp8(kv_cache_dtype):
        quantised = f"graph-{kv_name}"
        variants[quantised] = StepVariant(
            make=cls, with_cpu=with_cpu, kv_cache_dtype=kv_cache_dtype, vs_baseline=False, check_attention=True
        )
        ratios.append(StepRatio(slow="graph", fast=quantised))
    tolerance = 1e-4 if shape.dtype == torch.float32 else 2e-2
    return run_step_benchmark(
        ctx,
        name="hybrid_step",
        shape=shape,
        variants=variants,
        baseline="eager",
        modes=(ForwardMode.DECODE, ForwardMode.DRAFT_EXTEND),
        sizes=(1, 4) if ctx.quick else (1, 4, 16),
        steps=lambda bs: 2 if ctx.quick else 20,
        repeats=2 if ctx.quick else 5,
        warmup=1 if ctx.quick else 3,
        tolerance=tolerance,
        need_s=5.0,
        ratios=ratios,
    )


SUITE = Suite(
    name="portable",
    module="attnplug.bench.portable",
    baseline="eager",
    benchmarks=[
        Benchmark(
            "hybrid_step",
            "attnplug.bench.portable:run_hybrid_step",
            "whole steps of a small hybrid model through GraphRunner vs eager steps",
            reserve_s=10.0,
        ),
        Benchmark(
            "prefill",
            "attnplug.bench.prefill:run_portable",
            "paged causal prefill through the backend's forward over a pool (small cases)",
            reserve_s=10.0,
            default=False,
        ),
        MODEL_DECODE,
        BATCH_VALIDATION,
    ],
    options={"dtype": "auto", "kv_cache_dtype": "auto", **MODEL_DECODE_OPTIONS},
    isolate=False,
)
