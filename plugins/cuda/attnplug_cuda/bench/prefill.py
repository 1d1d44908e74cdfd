"""Benchmark ``prefill`` (only with ``--only prefill``): paged causal prefill on the GPU, the
cuda backend's EXTEND path against FlashInfer's on the same cache.

Cases (``attnplug.bench.prefill``, which also holds how each is built, timed and checked):
bf16, 32 q / 8 KV heads, head dims 128 and 256; one prompt of 16,384, 8,192, 4,096, 2,048 or
1,024 tokens, and a batch of 8 prompts of 1,024; page sizes 1 and 16 (``--quick``: D=128, one
prompt of 4,096 and the batch, page size 16).

* **cuda**: ``CudaBackend.forward`` of the EXTEND step over a one-layer pool (the KV store and
  ``paged_attention``; metadata built once before), eagerly, ``triton.testing.do_bench``;
* **cuda, the other prefill tiles** (``tiles_peer``; on a compute capability 9.0 GPU whose
  Triton has Gluon): the same forward with ``CudaTuning.sm90_prefill`` the other way round
  (the Hopper tiles of ``paged_prefill_sm90`` against ``paged_attention``'s Triton tiles);
* **flashinfer** (``flashinfer_prefill``; where ``import flashinfer`` works):
  ``BatchPrefillWithPagedKVCacheWrapper`` on the same cache, planned and compiled in set-up,
  the faster of its ``fa3`` / ``fa2`` backends;
* TFLOP/s = ``2 * 2 * H * D * sum over prompts of T (T + 1) / 2`` / time; targets (issue 38,
  on an sm_90 GPU): ``flashinfer / cuda >= 1`` at every case, and ``>= 450 TFLOP/s`` at D=128,
  one prompt of 8k and 16k tokens;
* both checked against float32 attention on sampled queries (``<= 2e-2``).

The published anchors of the issue (``ANCHORS``) are printed at the start and the end of the
run for reference; they are not measured here.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple

import torch

from attnplug.bench import Ctx
from attnplug.bench.prefill import PrefillCase, PrefillPeer, run_prefill_benchmark
from attnplug.bench.step_spec import PeerUnavailable

NAME = "prefill"
NUM_HEADS, NUM_KV_HEADS = 32, 8
HEAD_DIMS = (128, 256)
#: prompts of a case: one request of each length, then a batch
PROMPTS = ((16384,), (8192,), (4096,), (2048,), (1024,), (1024,) * 8)
PAGE_SIZES = (1, 16)
#: issue 38's goals: cuda's TFLOP/s at D=128 for one prompt of these lengths, and FlashInfer /
#: cuda at every case
TFLOPS_TARGET, TFLOPS_TOKENS = 450.0, (8192, 16384)
FLASHINFER_TARGET = 1.0
#: the published figures the issue quotes, printed for reference (never measured rows)
ANCHORS = (
    "published anchors (H100, bf16, D=128, causal, 16k tokens; not measured here): FlashAttention-3 ~616 TFLOP/s, "
    "FlashAttention-2 ~370 TFLOP/s, Triton's fused-attention tutorial ~400-480 TFLOP/s"
)


def cases(quick: bool) -> List[PrefillCase]:
    """The cases of the module docstring, head dim 128 first (the published anchors' shape)."""
    if quick:
        return [PrefillCase(128, (4096,), 16), PrefillCase(128, (1024,) * 8, 16)]
    return [PrefillCase(d, prompts, page) for d in HEAD_DIMS for prompts in PROMPTS for page in PAGE_SIZES]


def tflops_target(case: PrefillCase) -> Optional[float]:
    """``TFLOPS_TARGET`` at D=128 for one prompt of ``TFLOPS_TOKENS``, else None."""
    held = case.head_dim == 128 and len(case.q_lens) == 1 and case.q_lens[0] in TFLOPS_TOKENS
    return TFLOPS_TARGET if held else None


def tiles_peer(rep_ms: float) -> PrefillPeer:
    """The cuda backend with the other prefill tiles (``CudaTuning.sm90_prefill`` flipped):
    what the default's choice is measured against, where the device has both."""
    from ..device import CudaDevice
    from ..tuning import CudaTuning

    other = not CudaTuning().sm90_prefill
    name = f"cuda sm90_prefill={'on' if other else 'off'}"

    def measure(ctx: Ctx, world) -> Tuple[float, torch.Tensor, str, dict]:
        from ..backend import CudaBackend

        ok, reason = CudaDevice().wgmma_support(world.pool.device)
        if not ok:
            raise PeerUnavailable(f"one tile family here: {reason}")
        tuning = dataclasses.replace(CudaDevice().default_tuning(), sm90_prefill=other)
        backend = CudaBackend(world.pool, world.rows, num_heads=world.num_heads, tuning=tuning)
        backend.init_forward_metadata(world.batch)

        def forward() -> torch.Tensor:
            return backend.forward(world.q, world.k, world.v, 0, world.batch)

        out = forward()
        us = ctx.timer.device_us(forward, rep_ms=rep_ms)
        return us, out, "KV store + paged attention, the other prefill tiles", {}

    return PrefillPeer(name, measure, what="the cuda forward with the other prefill tiles")


def run(ctx: Ctx) -> List[dict]:
    from ..backend import CudaBackend
    from . import flashinfer_prefill

    chosen = cases(ctx.quick)
    rep_ms = 30.0 if ctx.quick else 100.0
    ctx.log(f"  {ANCHORS}")
    rows = run_prefill_benchmark(
        ctx,
        name=NAME,
        make=CudaBackend,
        cases=chosen,
        num_heads=NUM_HEADS,
        num_kv_heads=NUM_KV_HEADS,
        dtype=torch.bfloat16,
        peers=[
            tiles_peer(rep_ms),
            flashinfer_prefill.peer(sorted({c.head_dim for c in chosen}), target=FLASHINFER_TARGET, rep_ms=rep_ms),
        ],
        tflops_target=tflops_target,
        rep_ms=rep_ms,
    )
    ctx.log(f"  {ANCHORS}")
    return rows
