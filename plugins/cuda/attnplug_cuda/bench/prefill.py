"""Benchmark ``prefill`` (only with ``--only prefill``): paged causal prefill on the GPU, the
cuda backend's EXTEND path against FlashInfer's on the same cache.

Cases (``attnplug.bench.prefill``, which also holds how each is built, timed and checked):
bf16, 32 q / 8 KV heads, head dims 128 and 256; one prompt of 16,384, 8,192, 4,096, 2,048 or
1,024 tokens, and a batch of 8 prompts of 1,024; page sizes 1 and 16 (``--quick``: D=128, one
prompt of 4,096 and the batch, page size 16).

* **cuda**: ``CudaBackend.forward`` of the EXTEND step over a one-layer pool (the KV store and
  ``paged_attention``; metadata built once before), eagerly, ``triton.testing.do_bench``;
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

from typing import List, Optional

import torch

from attnplug.bench import Ctx
from attnplug.bench.prefill import PrefillCase, run_prefill_benchmark

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
        peers=[flashinfer_prefill.peer(sorted({c.head_dim for c in chosen}), target=FLASHINFER_TARGET, rep_ms=rep_ms)],
        tflops_target=tflops_target,
        rep_ms=rep_ms,
    )
    ctx.log(f"  {ANCHORS}")
    return rows
