"""check_replay_equals_eager — graph replay gives the eager results.

For every mode the declared ``GraphSupport`` covers, a step replayed through
``attnplug.GraphRunner`` (the backend's own graph via ``new_graph()``; the eager stand-in
where the device has none) gives the same outputs as the same step run eagerly, within
about one unit in the last place, and writes the same KV (slot 0, the padding sink,
excepted). Cases: a batch that fills a bucket exactly, one padded up to the bucket, and one
larger than the largest bucket (the runner's eager fallback, also compared with the
reference). Two consecutive steps each, so state left by one replay is exercised by the next.
EXTEND (a backend at ``ALWAYS``): chunks of uneven lengths on top of a cached prefix, in
token-count buckets of 8 and 14 tokens: 4 requests of 14 tokens fill one exactly, 3 requests
of 12 leave a request and 2 tokens of padding, 6 requests exceed the runner's ``max_bs``.
Also over each declared FP8 cache (``...-kv_fp8_e4m3``): the replayed store writes the same bytes.
"""

from __future__ import annotations

import pytest

from attnplug import ForwardMode
from attnplug.graphs import captures_extend
from attnplug_conformance.support import (
    PREFIX,
    REPLAY,
    REPLAY_TOL,
    Twins,
    assert_attention_close,
    assert_caches_equal,
    base_config,
    conformance_check,
    kv_axis,
    kv_bits,
    new_tokens_of,
    require,
    require_graph_mode,
)

__all__ = ["check_replay_equals_eager"]

_SIZES = {"exact": 4, "padded": 3, "eager_fallback": 6}
CASES = [(m, k) for m in (*ForwardMode.uniform(), ForwardMode.EXTEND) for k in _SIZES]
#: the token-count buckets of the EXTEND graphs
_EXTEND_TOKENS = [8, 14]


@conformance_check(rule=REPLAY)
@pytest.mark.parametrize(*kv_axis("mode,kind", CASES, [f"{m.name}-{k}" for m, k in CASES]))
def check_replay_equals_eager(
    mode, kind, kv_cache_dtype, attnplug_capabilities, attnplug_world, attnplug_reference_world
):
    """Replayed outputs and KV equal eager ones (tight tolerance)."""
    caps = attnplug_capabilities
    if mode is ForwardMode.EXTEND:
        graphs = caps.graphs.name
        require(captures_extend(caps.graphs), f"capabilities().graphs is {graphs}: EXTEND steps are not captured")
    else:
        require_graph_mode(caps, mode)
    cfg = base_config(caps, kv_cache_dtype=kv_cache_dtype)
    spec = cfg.spec()
    world, ref = attnplug_world(spec, 41), attnplug_reference_world(spec, 41)
    n = _SIZES[kind]
    twins = Twins(world, ref)
    twins.setup(PREFIX[:n])
    new, ndt = new_tokens_of(mode, n)
    extend_tokens = _EXTEND_TOKENS if mode is ForwardMode.EXTEND else None
    runner = world.graph_runner(
        max_bs=4, num_draft_tokens=ndt, bucket_sizes=[1, 2, 4], modes=[mode], extend_tokens=extend_tokens
    )
    tol = REPLAY_TOL[spec.dtype]
    for i in range(2):
        wreqs, _ = twins.requests(range(n))
        step = world.plan(mode, wreqs, new, num_draft_tokens=ndt)
        replays = runner.bucket_for(step.batch) is not None
        if replays != (kind != "eager_fallback"):
            pytest.fail(
                f"{REPLAY}: the graph runner {'replayed' if replays else 'did not replay'} a {kind} "
                f"{mode.name} batch of {n} requests (buckets {extend_tokens or runner.bucket_sizes})"
            )
        before = world.snapshot_kv()
        replayed = runner.run(step.batch, step.inputs).clone()
        world.backend.synchronize(world.device)
        after_replay = world.snapshot_kv()
        world.restore_kv(before)
        eager = world.run_eager(step)
        world.backend.synchronize(world.device)
        path = "replay" if replays else "runner fallback"
        what = f"{mode.name} step {i + 1}, {kind} batch of {n} requests: {path} vs eager"
        assert_attention_close(replayed, eager, world, what=what, rule=REPLAY, tol=tol)
        for layer, ((kr, vr), (ke, ve)) in enumerate(zip(after_replay, world.snapshot_kv())):
            for name, a, b in (("k", kr, ke), ("v", vr, ve)):
                diff = (kv_bits(a)[1:] != kv_bits(b)[1:]).flatten(1).any(1).nonzero().flatten() + 1
                if diff.numel():
                    pytest.fail(
                        f"{REPLAY}: {what}: layer {layer} {name} cache differs at slots {diff.tolist()[:8]} "
                        "(slot 0, the padding sink, excepted)"
                    )
        # Eager results (and, for the fallback, the runner's) against the reference twin.
        rreqs = twins.requests(range(n))[1]
        ref_step = ref.plan(mode, rreqs, new, num_draft_tokens=ndt)
        expected = ref.run_eager(ref_step)
        assert_attention_close(eager, expected, world, what=f"{mode.name} step {i + 1} ({kind}), eager vs reference")
        assert_caches_equal(world, ref, what=f"{mode.name} step {i + 1} ({kind}), eager vs reference")
        world.advance(step)
        ref.advance(ref_step)
