"""Reference backend vs an independent float64 dense masked softmax, for every mode."""

import pytest
import torch

from attnplug import ForwardMode
from attnplug.backends.reference import ReferenceBackend
from attnplug_conformance.harness import World
from oracle import assert_close_rel, dense_attention
from worlds import small_spec

PREFILL = [5, 12, 16]


def _world(num_kv_heads, window, page_size=1, head_dim=32, dtype=torch.float32):
    spec = small_spec(
        num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, sliding_window=window, page_size=page_size
    )
    return World(spec, ReferenceBackend, "cpu", seed=7)


def _check(world, step, out, tol=2e-5):
    spec = world.spec
    assert out.shape == (step.batch.num_tokens, spec.num_layers, spec.num_heads, spec.head_dim)
    for layer in range(spec.num_layers):
        window = spec.sliding_window if world.pool.is_swa_layer(layer) else None
        expected = dense_attention(step, layer, window=window)
        assert_close_rel(out[:, layer], expected, tol, f"layer {layer} (window={window})")


def _run(world, step):
    out = world.run_eager(step)
    world.commit(step)
    return out


@pytest.mark.parametrize("num_kv_heads", [8, 2, 1], ids=["gqa1", "gqa4", "gqa8"])
@pytest.mark.parametrize("window", [4, 16, 64], ids=["W<seq", "W=seq", "W>seq"])
@pytest.mark.parametrize(
    "mode",
    [ForwardMode.EXTEND, "extend_prefix", ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND],
    ids=lambda m: m if isinstance(m, str) else m.name.lower(),
)
def test_reference_matches_dense(mode, window, num_kv_heads):
    world = _world(num_kv_heads, window)
    reqs = [world.new_request() for _ in PREFILL]
    prefill = world.plan(ForwardMode.EXTEND, reqs, PREFILL)
    out = _run(world, prefill)
    if mode is ForwardMode.EXTEND:
        return _check(world, prefill, out)
    for r in reqs:
        world.evict(r)
    if mode == "extend_prefix":
        step = world.plan(ForwardMode.EXTEND, reqs, [3, 1, 6])
    elif mode is ForwardMode.DECODE:
        step = world.plan(ForwardMode.DECODE, reqs)
    else:
        step = world.plan(mode, reqs, num_draft_tokens=4 if mode is ForwardMode.TARGET_VERIFY else 3)
    _check(world, step, _run(world, step))
    world.alloc.check_invariants()


def test_full_attention_only_pool():
    world = _world(2, None)
    reqs = [world.new_request() for _ in PREFILL]
    _check(world, prefill := world.plan(ForwardMode.EXTEND, reqs, PREFILL), _run(world, prefill))
    _check(world, step := world.plan(ForwardMode.DECODE, reqs), _run(world, step))


@pytest.mark.parametrize("page_size", [4])
def test_paged_pool_matches_dense(page_size):
    world = _world(2, 6, page_size=page_size)
    reqs = [world.new_request() for _ in PREFILL]
    _run(world, world.plan(ForwardMode.EXTEND, reqs, PREFILL))
    for _ in range(5):
        for r in reqs:
            world.evict(r)
        step = world.plan(ForwardMode.DECODE, reqs)
        _check(world, step, _run(world, step))
        world.alloc.check_invariants()


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 2e-3), (torch.bfloat16, 1.5e-2)])
def test_half_precision(dtype, tol):
    world = _world(2, 8, dtype=dtype)
    reqs = [world.new_request() for _ in PREFILL]
    _run(world, world.plan(ForwardMode.EXTEND, reqs, PREFILL))
    step = world.plan(ForwardMode.TARGET_VERIFY, reqs, num_draft_tokens=4)
    out = _run(world, step)
    assert out.dtype == dtype
    _check(world, step, out, tol)


def test_idle_step():
    world = _world(2, 8)
    step = world.plan(ForwardMode.IDLE, [])
    out = world.run_eager(step)
    assert out.shape[0] == 0


def test_sync_free_metadata_accepts_no_cpu_seq_lens():
    assert ReferenceBackend.needs_cpu_seq_lens is False
    world = _world(2, 8)
    reqs = [world.new_request() for _ in PREFILL]
    step = world.plan(ForwardMode.EXTEND, reqs, PREFILL)
    assert step.batch.seq_lens_cpu is None
    world.run_eager(step)
