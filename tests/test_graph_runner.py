"""Graph runner over the reference backend with the eager stand-in graph (CPU)."""

import pytest
import torch

from attnplug import ForwardMode, GraphRunner
from attnplug.backends.reference import ReferenceBackend
from attnplug.graphs import default_bucket_sizes
from attnplug_conformance.harness import World, WorldSpec

from oracle import assert_close_rel, dense_attention

SPEC = WorldSpec(num_layers=4, num_heads=8, num_kv_heads=2, head_dim=32, sliding_window=6,
                 size=512, size_swa=256, max_reqs=12, max_context_len=64)


def _prefilled(n_reqs, seed=3):
    world = World(SPEC, ReferenceBackend, "cpu", seed=seed)
    reqs = [world.new_request() for _ in range(n_reqs)]
    step = world.plan(ForwardMode.EXTEND, reqs, [4 + 3 * i for i in range(n_reqs)])
    world.run_eager(step)
    world.commit(step)
    for r in reqs:
        world.evict(r)
    return world, reqs


def test_default_buckets():
    assert default_bucket_sizes(1) == (1,)
    assert default_bucket_sizes(5) == (1, 2, 4, 5)
    assert default_bucket_sizes(80) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80)


@pytest.mark.parametrize("mode,ndt", [(ForwardMode.DECODE, None), (ForwardMode.TARGET_VERIFY, 4),
                                      (ForwardMode.DRAFT_EXTEND, 3)])
@pytest.mark.parametrize("n_reqs", [3, 4, 6], ids=["padded", "exact", "eager-fallback"])
def test_replay_equals_eager_and_dense(mode, ndt, n_reqs):
    world, reqs = _prefilled(n_reqs)
    runner = world.graph_runner(max_bs=4, num_draft_tokens=ndt, bucket_sizes=[1, 2, 4])
    step = world.plan(mode, reqs, num_draft_tokens=ndt)
    replayed = runner.run(step.batch, step.inputs).clone()
    assert (runner.bucket_for(step.batch) is None) == (n_reqs > 4)
    eager = world.run_eager(step)  # rewrites the same k/v at the same slots
    assert_close_rel(replayed, eager.double().cpu(), 1e-6, "replay vs eager")
    world.commit(step)
    for layer in range(SPEC.num_layers):
        window = SPEC.sliding_window if world.pool.is_swa_layer(layer) else None
        assert_close_rel(replayed[:, layer], dense_attention(step, layer, num_heads=8, window=window), 2e-5)


def test_swa_buffer_translated_tail_zero_and_static():
    world, reqs = _prefilled(4)
    runner = world.graph_runner(max_bs=4, bucket_sizes=[2, 4])
    buf = world.backend.cuda_graph_swa_out_cache_loc
    assert buf.dtype == torch.int32 and buf.shape == (runner.max_num_tokens,)
    ptr = buf.data_ptr()
    step = world.plan(ForwardMode.DECODE, reqs)  # 4 tokens
    runner.run(step.batch, step.inputs)
    world.commit(step)
    expected = world.pool.translate_loc_from_full_to_swa(step.batch.out_cache_loc)
    assert torch.equal(buf[:4], expected) and (buf[:4] > 0).all()
    step = world.plan(ForwardMode.DECODE, reqs[:1])  # 1 token, bucket 2: tail must be zeroed
    runner.run(step.batch, step.inputs)
    assert torch.equal(buf[:1], world.pool.translate_loc_from_full_to_swa(step.batch.out_cache_loc))
    assert (buf[1:] == 0).all()
    assert world.backend.cuda_graph_swa_out_cache_loc.data_ptr() == ptr


def _count_translations(pool):
    calls = []
    original = pool.translate_loc_from_full_to_swa

    def counting(loc):
        calls.append(loc.shape[0])
        return original(loc)

    pool.translate_loc_from_full_to_swa = counting
    return calls


@pytest.mark.parametrize("path", ["eager", "replay", "fallback"])
def test_one_translation_per_step(path):
    world, reqs = _prefilled(3)
    runner = world.graph_runner(max_bs=2 if path == "fallback" else 4, bucket_sizes=None)
    calls = _count_translations(world.pool)
    for _ in range(3):
        step = world.plan(ForwardMode.DECODE, reqs)
        before = len(calls)
        if path == "eager":
            world.run_eager(step)
        else:
            runner.run(step.batch, step.inputs)
        assert len(calls) - before == 1, f"{SPEC.num_layers}-layer step translated {len(calls) - before} times"
        world.commit(step)


def test_runner_rejects_modes_the_backend_cannot_capture():
    world, _ = _prefilled(1)
    with pytest.raises(ValueError, match="cannot capture"):
        GraphRunner(world.backend, world.step_fn, max_bs=2, inputs=world.input_shapes(), modes=[ForwardMode.EXTEND])
