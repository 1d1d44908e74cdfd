"""check_matches_transformers — real models through the backend give transformers' logits.

Guards the contract at model level: tiny random models of every supported architecture
(Llama, Mistral, Qwen2, Qwen3, Gemma2, Gemma3 text, Cohere2, GPT-OSS) run step by step
through ``attnplug.integrations.transformers.ModelRunner`` on the backend under test —
chunked EXTEND of several requests of different lengths, DECODE, TARGET_VERIFY with the
rejected drafts rolled back, DRAFT_EXTEND, a request finishing and one joining, windows
smaller than the sequences with out-of-window SWA slots evicted and reused — and every new
token's logits are compared with transformers' eager attention over the full sequence (same
weights): float32 strictly, float16 / bfloat16 by cosine similarity and against
transformers' own error in that dtype (``attnplug_conformance.model_check``).

What the model brings that the other checks do not: the sliding-window layer pattern,
scaling and GQA layout of real configurations, positions and RoPE through the step, the
model's own soft-capping and sinks, and errors compounding over layers.

With an FP8 KV cache (the cases ``...-kv_fp8_e4m3`` and ``...-kv_fp8_e5m2``, where the
backend lists the dtype in ``capabilities().fp8_kv_dtypes``), in the backend's default dtype,
with per-layer, per-head scales that make the scenario's outliers saturate: every new token's
logits against the reference backend's over an FP8 cache of the same dtype and scales (the
same bytes for the same k/v: the backend's own error, the dtype's bound) and the KV bytes
themselves, then against transformers' float32 attention over the unquantised sequence by a
looser cosine-similarity bound (the quantisation's error); ``model_check`` gives the bounds
and what they were measured against.

Skipped when transformers is not installed, and per case only from the backend's declared
``capabilities()`` (dtype, head dim 64, page size, SWA, logit soft-capping, attention sinks,
FP8 KV cache dtypes). By default every architecture runs in the backend's first dtype
(float32 where declared, else bfloat16, else its first), and so do the FP8 cases; the other
dtypes run with ``--attnplug-thorough``.
"""

from __future__ import annotations

import pytest

from attnplug_conformance.model_check import MODEL_CASES, default_dtype, run_model_case, transformers_missing
from attnplug_conformance.rules import MODEL
from attnplug_conformance.support import conformance_check, require

__all__ = ["check_matches_transformers"]


@conformance_check(rule=MODEL)
@pytest.mark.parametrize("model_case", MODEL_CASES, ids=[c.id for c in MODEL_CASES])
def check_matches_transformers(
    model_case, attnplug_backend_cls, attnplug_device, attnplug_capabilities, attnplug_thorough
):
    """Every new token's logits within the dtype's bound of transformers eager (FP8 KV cache
    cases: of the reference backend over the same FP8 cache, and within a looser bound of
    transformers eager)."""
    why = transformers_missing()
    if why is not None:
        pytest.skip(why)
    if model_case.dtype in attnplug_capabilities.dtypes and model_case.dtype != default_dtype(attnplug_capabilities):
        require(
            attnplug_thorough, "another dtype of an architecture the default run covers: runs with --attnplug-thorough"
        )
    run_model_case(model_case, attnplug_backend_cls, attnplug_device, attnplug_capabilities)
