"""The cuda backend's paths (``planner.Path``) against each other, under TRITON_INTERPRET=1 on
the CPU: which steps take one launch (``store_attend``), which store inside
``paged_attention``, and that every path stores the same KV and gives the same outputs (eager
and replayed). The variants are tunings (``CudaTuning``), as a benchmark builds them."""

import dataclasses
import functools
import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("needs the Triton interpreter (set by conftest without a GPU)", allow_module_level=True)
pytest.importorskip("triton")

from attnplug import ForwardMode  # noqa: E402
from attnplug_conformance.harness import World  # noqa: E402
from attnplug_cuda.backend import CudaBackend  # noqa: E402
from attnplug_cuda.planner import Path  # noqa: E402
from attnplug_cuda.tuning import CudaTuning  # noqa: E402
from worlds import kernel_spec  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SPEC = kernel_spec(swa_layer_ids=(0,), max_context_len=96, scramble_swa=True)


def tuned(**changes):
    """The cuda backend with the default tuning changed by ``changes``."""
    return functools.partial(CudaBackend, tuning=dataclasses.replace(CudaTuning(), **changes))


#: the two-launch path: paged_attention storing the step (larger decode / draft steps)
TWO_LAUNCH = tuned(one_launch=False)
#: the two-launch path as it was: a KV store launch, then the attention storing nothing
SEPARATE_STORE = tuned(one_launch=False, paged_store=False)


def _decode_twice(backend_cls, *, graphs: bool, mode=ForwardMode.DECODE, drafts=None):
    """Two steps of ``mode``: their outputs, each step's path, the KV the world holds after."""
    world = World(SPEC, backend_cls, DEVICE, seed=3)
    reqs = world.prefill([40, 9], backend=world.reference_backend)
    outs, paths = [], []
    runner = world.graph_runner(max_bs=2, num_draft_tokens=drafts, bucket_sizes=[2]) if graphs else None
    for _ in range(2):
        step = world.plan(mode, reqs, num_draft_tokens=drafts)
        if runner is None:
            outs.append(world.run_eager(step).float().clone())
        else:
            outs.append(runner.run(step.batch, step.inputs).float().clone())
        paths.append(world.backend.forward_metadata.plan.path)
        world.advance(step)
    return outs, paths, world.snapshot_kv()


def _assert_same(one, two, kv_one, kv_two):
    for a, b in zip(one, two):
        assert torch.isfinite(a).all() and (a - b).abs().max().item() <= 2e-3
    for (k1, v1), (k2, v2) in zip(kv_one, kv_two):  # the one launch stored exactly what the store did
        assert torch.equal(k1.nan_to_num(), k2.nan_to_num()) and torch.equal(v1.nan_to_num(), v2.nan_to_num())


@pytest.mark.parametrize("graphs", [False, True])
def test_one_launch_steps_match_the_two_launch_path(graphs):
    one, paths_one, kv_one = _decode_twice(CudaBackend, graphs=graphs)
    two, paths_two, kv_two = _decode_twice(TWO_LAUNCH, graphs=graphs)
    assert paths_one == [Path.ONE_LAUNCH] * 2 and paths_two == [Path.PAGED_STORE] * 2
    _assert_same(one, two, kv_one, kv_two)


@pytest.mark.parametrize("graphs", [False, True])
def test_draft_steps_of_up_to_16_rows_take_one_launch(graphs):
    # 6 drafts x 2 q heads per kv head = 12 rows: one launch, as the two-launch path computes it
    one, paths, kv_one = _decode_twice(CudaBackend, graphs=graphs, mode=ForwardMode.TARGET_VERIFY, drafts=6)
    two, paths_two, kv_two = _decode_twice(TWO_LAUNCH, graphs=graphs, mode=ForwardMode.TARGET_VERIFY, drafts=6)
    assert paths == [Path.ONE_LAUNCH] * 2 and Path.ONE_LAUNCH not in paths_two
    _assert_same(one, two, kv_one, kv_two)


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("mode,drafts", [(ForwardMode.DECODE, None), (ForwardMode.TARGET_VERIFY, 6)])
def test_paged_attention_storing_the_step_matches_a_separate_store(graphs, mode, drafts, monkeypatch):
    """Steps beyond the one-launch path store their K/V inside paged_attention's launch: the
    same cache and bit-identical outputs as a KV store launch first, and no store launch."""
    stores = []
    monkeypatch.setattr(CudaBackend, "_store", lambda self, *args: stores.append(args))
    inside, paths, kv_inside = _decode_twice(TWO_LAUNCH, graphs=graphs, mode=mode, drafts=drafts)
    assert stores == [] and paths == [Path.PAGED_STORE] * 2
    monkeypatch.undo()
    separate, paths, kv_separate = _decode_twice(SEPARATE_STORE, graphs=graphs, mode=mode, drafts=drafts)
    assert paths == [Path.TWO_LAUNCH] * 2
    for a, b in zip(inside, separate):
        assert torch.isfinite(a).all() and torch.equal(a, b)
    for (k1, v1), (k2, v2) in zip(kv_inside, kv_separate):
        assert torch.equal(k1.nan_to_num(), k2.nan_to_num()) and torch.equal(v1.nan_to_num(), v2.nan_to_num())


def test_larger_steps_take_the_two_launch_path():
    world = World(SPEC, CudaBackend, DEVICE, seed=1)
    backend = world.backend
    backend.shape = dataclasses.replace(backend.shape, num_sms=3)  # a small GPU, whatever runs the test
    reqs = world.prefill([12, 7, 20, 5], backend=world.reference_backend)
    step = world.plan(ForwardMode.DECODE, reqs)  # 4 requests x 2 kv heads on 3 SMs: > 2 groups an SM
    world.run_eager(step)
    assert backend.forward_metadata.plan.path is Path.PAGED_STORE  # paged_attention stores the step
    step = world.plan(ForwardMode.TARGET_VERIFY, reqs[:1], num_draft_tokens=9)  # 9 x 2 rows > 16
    world.run_eager(step)
    assert backend.forward_metadata.plan.path is Path.TWO_LAUNCH  # more rows than one tile: a store launch
