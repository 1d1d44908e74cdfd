"""Many requests over many steps: prefill, chunked extend, decode, verify (with rejected
drafts rolled back), draft-extend, eviction between steps, requests finishing. Every output
equals dense recomputation over the full token history; the allocator's invariants hold
after every step; nothing leaks at the end. Run eagerly and through the graph runner."""

import random

import pytest

from attnplug import ForwardMode
from attnplug.backends.reference import ReferenceBackend
from attnplug_conformance.harness import World
from oracle import assert_close_rel, dense_attention
from worlds import small_spec

NDT = 3


def _check(world, step, out):
    for layer in range(world.spec.num_layers):
        window = world.spec.sliding_window if world.pool.is_swa_layer(layer) else None
        expected = dense_attention(step, layer, window=window)
        assert_close_rel(out[:, layer], expected, 3e-5, f"{step.batch.forward_mode.name} layer {layer}")


@pytest.mark.parametrize("use_graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_multi_step_scenario(use_graphs, page_size):
    rng = random.Random(1234 + page_size)
    spec = small_spec(head_dim=16, sliding_window=7, page_size=page_size, size=1024, max_reqs=10, max_context_len=128)
    world = World(spec, ReferenceBackend, "cpu", seed=11)
    runner = world.graph_runner(max_bs=4, num_draft_tokens=NDT, bucket_sizes=[1, 2, 4]) if use_graphs else None
    full0, swa0 = world.alloc.full_available_size(), world.alloc.swa_available_size()
    steps_by_mode = {}
    for _ in range(40):
        live = [r for r in world.requests if r.seq_len]
        choice = rng.random()
        if not live or (choice < 0.2 and len(world.requests) < 6):
            reqs = [world.new_request() for _ in range(rng.randint(1, 2))]
            step = world.plan(ForwardMode.EXTEND, reqs, [rng.randint(1, 20) for _ in reqs])
        elif choice < 0.3:
            reqs = rng.sample(live, rng.randint(1, len(live)))
            step = world.plan(ForwardMode.EXTEND, reqs, [rng.randint(1, 9) for _ in reqs])
        elif choice < 0.6:
            step = world.plan(ForwardMode.DECODE, rng.sample(live, rng.randint(1, len(live))))
        elif choice < 0.75:
            step = world.plan(ForwardMode.TARGET_VERIFY, live, num_draft_tokens=NDT)
        elif choice < 0.9:
            step = world.plan(ForwardMode.DRAFT_EXTEND, live, num_draft_tokens=NDT)
        else:
            world.finish(rng.choice(live))
            world.alloc.check_invariants()
            continue
        out = runner.run(step.batch, step.inputs) if runner else world.run_eager(step)
        world.commit(step)
        _check(world, step, out)
        steps_by_mode[step.batch.forward_mode] = steps_by_mode.get(step.batch.forward_mode, 0) + 1
        if step.batch.forward_mode is ForwardMode.TARGET_VERIFY and page_size == 1:
            for r in step.requests:  # accept 1..NDT drafts, free the rejected ones
                world.rollback(r, r.seq_len - NDT + rng.randint(1, NDT))
        for r in world.requests:
            freed = world.evict(r)
            assert freed >= 0
            held = int(
                (world.pool.full_to_swa_index_mapping[world.rows.req_to_token[r.row, : r.seq_len].long()] != 0).sum()
            )
            assert held <= spec.sliding_window + page_size
        world.alloc.check_invariants()
    assert len(steps_by_mode) == 4, f"scenario did not reach every mode: {steps_by_mode}"
    for r in list(world.requests):
        world.finish(r)
    world.alloc.check_invariants()
    assert (world.alloc.full_available_size(), world.alloc.swa_available_size()) == (full0, swa0)
