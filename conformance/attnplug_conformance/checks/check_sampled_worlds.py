"""check_sampled_worlds — attention matches float64 in worlds sampled from real models' shape space.

The other checks run hand-picked worlds; a kernel bug that lives in a corner none of them visits
(3 query heads per KV head, 9 drafts, a NaN in a freed slot, a float16 logit of 40, a fresh
prompt batched before a cached one, a sequence ending on a page edge) passes them all. This
check samples worlds instead (``attnplug_conformance.sampling``: hypothesis, derandomized, no
database), one case per dimension of the space, and runs each world through
``attnplug_conformance.worlds.run_world``: a mixed EXTEND batch, DECODE, a speculative step
with its rejected drafts rolled back, DECODE, every output compared with attention computed in
float64 from the tokens' history (relative error per token, layer and head within
``exact.LONG_TOL``), with every row no request owns poisoned before each step.

A failure quotes the smallest world that still fails (hypothesis shrinks it), e.g.
``contract (attention matches float64 in sampled worlds): DECODE step (2 of 4) of
SampledWorld(num_kv_heads=2, group=3, ...): relative error 1.4 ...``; running the same case again
reproduces it, and ``run_world(SampledWorld(...), make_world)`` replays that world alone.

The default run samples ``PROFILES["default"]`` worlds a dimension, ``--attnplug-thorough``
``PROFILES["thorough"]``. Skipped when hypothesis is not installed (``pip install
'attnplug[test]'``), saying so; the half-magnitude worlds use a declared half dtype (float32
where none is declared), soft-cap and sinks only where declared.

Every dimension is also sampled over each declared FP8 cache (``...-kv_fp8_e4m3``: the worlds'
``kv_cache_dtype``, a half-precision model dtype), judged against float64 attention over the
dequantised cache: FP8 bugs live where the dimensions meet the cache (a scale indexed by the
wrong head in an odd head group, a byte offset at a page edge, NaN / ±max / ±Inf bytes in
unowned rows, saturated keys under large logits), which one FP8 dimension of its own, mild in
everything else, would not reach.
"""

from __future__ import annotations

import pytest

from attnplug_conformance.rules import WORLDS
from attnplug_conformance.support import base_config, conformance_check, kv_axis
from attnplug_conformance.worlds import DIMENSIONS

__all__ = ["check_sampled_worlds"]


@conformance_check(rule=WORLDS)
@pytest.mark.parametrize(*kv_axis("dimension", DIMENSIONS, DIMENSIONS))
def check_sampled_worlds(dimension, kv_cache_dtype, attnplug_capabilities, attnplug_world, attnplug_thorough):
    """Every sampled world of ``dimension`` within ``LONG_TOL`` of float64 attention."""
    try:
        from attnplug_conformance.sampling import PROFILES, sample_worlds
    except ImportError as exc:  # hypothesis is a test dependency
        pytest.skip(f"sampled worlds need hypothesis ({exc}); pip install 'attnplug[test]'")
    caps = attnplug_capabilities
    examples = PROFILES["thorough" if attnplug_thorough else "default"]
    cfg = base_config(caps, kv_cache_dtype=kv_cache_dtype)
    sample_worlds(dimension, caps, cfg, attnplug_world, examples=examples)
