"""Benchmark 4, ``hybrid_step``: whole steps of a 48-layer hybrid model, new path vs before.

Model: 48 attention layers, SWA on ``layer % 4 != 3`` (36 SWA, 12 full), 32 q / 8 KV heads,
D=128, bf16; each layer's q/k/v are static random tensors (the "model" is just the attention
layers). Context: 1024 tokens per request, window 256 (chosen so the SWA layers read a
quarter of what the full layers read, as in production hybrid models, while a 128-request
world stays within ~12 GB, and its FP8 twin within ~6 GB). Requests are allocated through
``SWATokenAllocator`` with the out-of-window SWA slots evicted (``attnplug.bench.world``).

Modes: DECODE and DRAFT_EXTEND (4 draft tokens; the suite option ``hybrid_modes`` names the
ones run); bs = 1, 8, 32, 64, 128 (the suite option ``hybrid_sizes`` names others; ``--quick``:
1 and 64). Both paths run as CUDA graphs
through ``attnplug.GraphRunner`` (one bucket: the case's bs): the new path with the cuda
backend (``seq_lens_cpu=None``), the before path with ``BeforeBackend`` (host
``seq_lens_cpu``, per-layer translation, index_put stores, no PDL).

Time per full step = wall clock of N back-to-back ``runner.run`` calls (host preparation +
replay, the GPU kept busy) followed by one synchronize, divided by N; median of a few
repeats (``attnplug.bench.step_case``). Target: before / new >= 1.5x at every bs; the two
paths' outputs must agree.

Around the new path's steps, in the same run:

* **floors**: each ``new`` row carries its floor and % of floor: the launch floor (a graph of
  as many empty Triton kernels as the step launches, counted with ``torch.profiler``, with
  PDL where the backend uses it: ``floor.EmptyKernelFloor``) and the bandwidth floor (the
  step's bytes, ``attnplug.bench.floors.step_bytes``, at the device-to-device copy bandwidth
  measured first); times held to ``TIME_TARGETS_US``;
* **one launch per layer**: at bs 1, 8 and 32 the same backend with its one-launch small steps
  and in-attention stores off (variant ``new-two-launch``, ``CudaTuning(one_launch=False,
  paged_store=False)``: KV store + attention launches): ``new-two-launch / new``; at bs 64
  and 128 (where ``paged_attention`` stores the step itself) the same backend with a KV store
  launch before each attention (``new-store-launch``, ``paged_store=False``), bit-identical
  to ``new``;
* **PDL**: at bs 1 the same backend without PDL (variant ``new-no-pdl``,
  ``CudaTuning(pdl=False)``): ``new-no-pdl / new`` held to ``>= 1.15x``, and every layer's
  output must be bit-identical (every PDL schedule the step's launches take gives the bits of
  PDL off);
* **an FP8 KV cache** (variant ``new-fp8``, every size and mode): the same backend over a
  ``float8_e4m3fn`` cache holding the same keys quantised with per-layer scales
  (``attnplug.bench.world.bench_kv_scales``), its new K/V quantised at store; its floor counts
  one byte a cached element; ``new / new-fp8`` held to ``FP8_TARGET`` at ``FP8_SIZES`` (the
  difference of the two outputs is the quantisation's, reported); at every DECODE size its
  first SWA and full layer checked against float32 attention over the dequantised cache.
  Where the cuda backend does not serve that cache, one error row says so;
* **FlashInfer** (``flashinfer_peer``; DECODE, when ``import flashinfer`` works): its
  attention-only time for all layers in one graph in the best of its configurations (page
  size, layout, tensor cores, graph mode; named in the row), ``flashinfer / new`` held to
  ``FLASHINFER_TARGETS``; and ``flashinfer-fp8`` on the FP8 cache with the same scales,
  ``flashinfer-fp8 / new-fp8`` held to ``FLASHINFER_FP8_TARGETS``;
* **replay preparation** at DECODE bs 128: host time of ``runner.run`` with the replay
  skipped (``attnplug.bench.step_case.replay_prep_us``), held to ``<= 30 us``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import List

import torch

from attnplug import ForwardMode
from attnplug.bench import Ctx
from attnplug.bench.step_case import PrepCheck, StepPeer, StepRatio, StepShape, StepVariant, run_step_benchmark

NAME = "hybrid_step"
NUM_LAYERS, CONTEXT, WINDOW, NUM_DRAFT = 48, 1024, 256, 4
TARGET_SPEEDUP = 1.5
#: (mode, bs) -> microseconds per whole step the new path is held to (an sm_90 GPU of 132 SMs)
TIME_TARGETS_US = {
    (ForwardMode.DECODE, 1): 150.0,
    (ForwardMode.DECODE, 8): 250.0,
    (ForwardMode.DECODE, 64): 1450.0,
    (ForwardMode.DECODE, 128): 2750.0,
    (ForwardMode.DRAFT_EXTEND, 1): 180.0,
    (ForwardMode.DRAFT_EXTEND, 8): 300.0,
}
#: whole-step speedup of PDL on over PDL off, at the batch sizes below
PDL_TARGET, PDL_SIZES = 1.15, (1,)
#: bs -> FlashInfer attention-only time / the new path's whole step, held at these sizes
FLASHINFER_TARGETS = {1: 3.0, 8: 3.0, 64: 1.4}
#: the FP8 KV cache: new (bf16 cache) / new-fp8 held at these batch sizes (issue 38)
FP8_TARGET, FP8_SIZES = 1.6, (64, 128)
FP8_CACHE = torch.float8_e4m3fn
#: bs -> FlashInfer's FP8 decode / new-fp8's whole step, held at these sizes
FLASHINFER_FP8_TARGETS = {64: 1.0, 128: 1.0}
PREP_BS, PREP_TARGET_US = 128, 30.0
#: batch sizes where the two-launch path is timed against the one-launch small steps
TWO_LAUNCH_SIZES = (1, 8, 32)
#: batch sizes where paged_attention storing the step is timed against a KV store launch first
STORE_LAUNCH_SIZES = (64, 128)
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


def cuda_backend(**changes):
    """A maker of the cuda backend with ``CudaTuning.from_env()`` changed by ``changes``
    (``dataclasses.replace``): the variants that switch one of its choices off."""

    def make(*args, **kwargs):
        from ..backend import CudaBackend
        from ..tuning import CudaTuning

        return CudaBackend(*args, tuning=dataclasses.replace(CudaTuning.from_env(), **changes), **kwargs)

    return make


def variants() -> dict:
    """``new``: the cuda backend (``seq_lens_cpu=None``; floors measured); ``before``:
    ``BeforeBackend``; ``new-no-pdl``: the cuda backend without PDL, at ``PDL_SIZES``;
    ``new-two-launch``: without its one-launch small steps and in-attention stores, at
    ``TWO_LAUNCH_SIZES``; ``new-store-launch``: a KV store launch before each
    ``paged_attention``, at ``STORE_LAUNCH_SIZES``; ``new-fp8``: the cuda backend over an
    ``FP8_CACHE`` cache (floors measured, its DECODE attention checked)."""
    from .before import BeforeBackend

    return {
        "new": StepVariant(make=cuda_backend(), floor=True),
        "before": StepVariant(make=BeforeBackend, with_cpu=True),
        "new-no-pdl": StepVariant(make=cuda_backend(pdl=False), sizes=PDL_SIZES, vs_baseline=False),
        "new-two-launch": StepVariant(
            make=cuda_backend(one_launch=False, paged_store=False), sizes=TWO_LAUNCH_SIZES, vs_baseline=False
        ),
        "new-store-launch": StepVariant(
            make=cuda_backend(paged_store=False), sizes=STORE_LAUNCH_SIZES, vs_baseline=False
        ),
        "new-fp8": StepVariant(
            make=cuda_backend(), floor=True, kv_cache_dtype=FP8_CACHE, vs_baseline=False, check_attention=True
        ),
    }


def flashinfer_peer() -> StepPeer:
    """FlashInfer's decode on the bf16 cache, against ``new``."""
    from . import flashinfer_peer as fi

    return StepPeer(
        name=fi.NAME,
        measure=functools.partial(fi.measure, kv_cache_dtypes=(SHAPE.dtype, FP8_CACHE)),
        against="new",
        modes=(ForwardMode.DECODE,),
        target=lambda mode, bs: FLASHINFER_TARGETS.get(bs),
        what="attention only, every layer in one graph, its best configuration",
    )


def flashinfer_fp8_peer() -> StepPeer:
    """FlashInfer's decode on the FP8 cache (the same bytes and scales), against ``new-fp8``."""
    from . import flashinfer_peer as fi

    return StepPeer(
        name=fi.FP8_NAME,
        measure=functools.partial(fi.measure, kv_cache_dtypes=(SHAPE.dtype, FP8_CACHE)),
        against="new-fp8",
        modes=(ForwardMode.DECODE,),
        target=lambda mode, bs: FLASHINFER_FP8_TARGETS.get(bs),
        what="attention only over the FP8 cache, every layer in one graph, its best configuration",
        kv_cache_dtype=FP8_CACHE,
    )


def modes(option: str) -> tuple:
    """The step modes of the suite option ``hybrid_modes`` (``"decode,draft_extend"``), in
    that order; ``ValueError`` naming the choices for anything else."""
    choices = {"decode": ForwardMode.DECODE, "draft_extend": ForwardMode.DRAFT_EXTEND}
    names = [n.strip().lower() for n in str(option).split(",") if n.strip()]
    unknown = [n for n in names if n not in choices]
    if unknown or not names:
        raise ValueError(f"hybrid_modes={option!r}: name one or more of {sorted(choices)}, comma-separated")
    return tuple(choices[n] for n in choices if n in names)


def batch_sizes(option: str) -> tuple:
    """The batch sizes of the suite option ``hybrid_sizes`` (``"1,8,32,64,128"``), ascending;
    ``ValueError`` naming the rule for anything but positive integers."""
    try:
        sizes = sorted({int(n) for n in str(option).split(",") if n.strip()})
    except ValueError:
        sizes = []
    if not sizes or sizes[0] < 1:
        raise ValueError(f"hybrid_sizes={option!r}: name one or more batch sizes >= 1, comma-separated")
    return tuple(sizes)


def run(ctx: Ctx) -> List[dict]:
    from .floor import EmptyKernelFloor

    sizes = (1, 64) if ctx.quick else batch_sizes(ctx.options.get("hybrid_sizes", "1,8,32,64,128"))
    pdl_ratio = StepRatio(slow="new-no-pdl", fast="new", target=PDL_TARGET, identical=True)
    one_launch = StepRatio(slow="new-two-launch", fast="new")
    store_in_attention = StepRatio(slow="new-store-launch", fast="new", identical=True)
    fp8 = StepRatio(slow="new", fast="new-fp8", target=FP8_TARGET, held_at=FP8_SIZES)
    return run_step_benchmark(
        ctx,
        name=NAME,
        shape=SHAPE,
        variants=variants(),
        baseline="before",
        modes=modes(ctx.options.get("hybrid_modes", "decode,draft_extend")),
        sizes=sizes,
        steps=lambda bs: 30 if ctx.quick else (50 if bs >= 64 else 100),
        repeats=3 if ctx.quick else 5,
        target_speedup=TARGET_SPEEDUP,
        tolerance=1e-2,
        time_targets=TIME_TARGETS_US,
        launch_floor=EmptyKernelFloor(ctx.timer, repeats=3 if ctx.quick else 5),
        ratios=[pdl_ratio, one_launch, store_in_attention, fp8],
        peers=[flashinfer_peer(), flashinfer_fp8_peer()],
        prep=PrepCheck(variant="new", bs=PREP_BS, target_us=PREP_TARGET_US, iters=300 if ctx.quick else 2000),
    )
