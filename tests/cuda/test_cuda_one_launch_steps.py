"""The cuda backend's one-launch small steps (``store_attend``) against its two-launch path
(KV store + attention), under TRITON_INTERPRET=1 on the CPU: which steps take one launch, and
that both paths store the same KV and give the same outputs (eager and replayed)."""

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("needs the Triton interpreter (set by conftest without a GPU)", allow_module_level=True)
pytest.importorskip("triton")

from attnplug import ForwardMode  # noqa: E402
from attnplug_conformance.harness import World, WorldSpec  # noqa: E402
from attnplug_cuda.backend import CudaBackend  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SPEC = WorldSpec(
    num_layers=2,
    swa_layer_ids=(0,),
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    dtype=torch.float16,
    sliding_window=6,
    size=512,
    size_swa=256,
    max_reqs=6,
    max_context_len=96,
    scramble_swa=True,
)


class TwoLaunch(CudaBackend):
    one_launch_small_steps = False


class SeparateStore(TwoLaunch):
    """The two-launch path as it was: a KV store launch, then the attention storing nothing."""

    paged_attention_stores = False


def _decode_twice(backend_cls, *, graphs: bool, mode=ForwardMode.DECODE, drafts=None):
    world = World(SPEC, backend_cls, DEVICE, seed=3)
    reqs = world.prefill([40, 9], backend=world.reference_backend)
    outs, fused, paged_store = [], [], []
    runner = world.graph_runner(max_bs=2, num_draft_tokens=drafts, bucket_sizes=[2]) if graphs else None
    for _ in range(2):
        step = world.plan(mode, reqs, num_draft_tokens=drafts)
        if runner is None:
            outs.append(world.run_eager(step).float().clone())
        else:
            outs.append(runner.run(step.batch, step.inputs).float().clone())
        fused.append(world.backend.forward_metadata.fused)
        paged_store.append(world.backend.forward_metadata.paged_store)
        world.advance(step)
    if backend_cls is SeparateStore or backend_cls is TwoLaunch:
        assert paged_store == [backend_cls.paged_attention_stores] * 2
    return outs, fused, world.snapshot_kv()


def _assert_same(one, two, kv_one, kv_two):
    for a, b in zip(one, two):
        assert torch.isfinite(a).all() and (a - b).abs().max().item() <= 2e-3
    for (k1, v1), (k2, v2) in zip(kv_one, kv_two):  # the one launch stored exactly what the store did
        assert torch.equal(k1.nan_to_num(), k2.nan_to_num()) and torch.equal(v1.nan_to_num(), v2.nan_to_num())


@pytest.mark.parametrize("graphs", [False, True])
def test_one_launch_steps_match_the_two_launch_path(graphs):
    one, fused_one, kv_one = _decode_twice(CudaBackend, graphs=graphs)
    two, fused_two, kv_two = _decode_twice(TwoLaunch, graphs=graphs)
    assert fused_one == [True, True] and fused_two == [False, False]
    _assert_same(one, two, kv_one, kv_two)


@pytest.mark.parametrize("graphs", [False, True])
def test_draft_steps_of_up_to_16_rows_take_one_launch(graphs):
    # 6 drafts x 2 q heads per kv head = 12 rows: one launch, as the two-launch path computes it
    one, fused, kv_one = _decode_twice(CudaBackend, graphs=graphs, mode=ForwardMode.TARGET_VERIFY, drafts=6)
    two, fused_two, kv_two = _decode_twice(TwoLaunch, graphs=graphs, mode=ForwardMode.TARGET_VERIFY, drafts=6)
    assert all(fused) and not any(fused_two)
    _assert_same(one, two, kv_one, kv_two)


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("mode,drafts", [(ForwardMode.DECODE, None), (ForwardMode.TARGET_VERIFY, 6)])
def test_paged_attention_storing_the_step_matches_a_separate_store(graphs, mode, drafts, monkeypatch):
    """Steps beyond the one-launch path store their K/V inside paged_attention's launch: the
    same cache and bit-identical outputs as a KV store launch first, and no store launch."""
    stores = []
    monkeypatch.setattr(TwoLaunch, "_store", lambda self, *args: stores.append(args))
    inside, _, kv_inside = _decode_twice(TwoLaunch, graphs=graphs, mode=mode, drafts=drafts)
    assert stores == []
    monkeypatch.undo()
    separate, _, kv_separate = _decode_twice(SeparateStore, graphs=graphs, mode=mode, drafts=drafts)
    for a, b in zip(inside, separate):
        assert torch.isfinite(a).all() and torch.equal(a, b)
    for (k1, v1), (k2, v2) in zip(kv_inside, kv_separate):
        assert torch.equal(k1.nan_to_num(), k2.nan_to_num()) and torch.equal(v1.nan_to_num(), v2.nan_to_num())


def test_larger_steps_take_the_two_launch_path():
    world = World(SPEC, CudaBackend, DEVICE, seed=1)
    world.backend._num_sms = 3  # as the interpreter's stand-in, whatever GPU runs the test
    reqs = world.prefill([12, 7, 20, 5], backend=world.reference_backend)
    step = world.plan(ForwardMode.DECODE, reqs)  # 4 requests x 2 kv heads on 3 SMs: > 2 groups an SM
    world.run_eager(step)
    assert world.backend.forward_metadata.fused is False
    assert world.backend.forward_metadata.paged_store is True  # paged_attention stores the step
    step = world.plan(ForwardMode.TARGET_VERIFY, reqs[:1], num_draft_tokens=9)  # 9 x 2 rows > MAX_ROWS
    world.run_eager(step)
    assert world.backend.forward_metadata.fused is False
    assert world.backend.forward_metadata.paged_store is False  # more rows than one tile: a store launch


@pytest.mark.parametrize("graphs", [False, True])
def test_layers_routed_to_the_staged_kernel_match_the_two_launch_path(graphs, monkeypatch):
    # the one-launch layers through the C++ kernels (asked for; FILL 0: any grid covers "the
    # GPU"), where the extension loads: the draft steps' layers fit the resident kernel, the
    # decode steps' stay with store_attend (takes_layer); 12-row draft steps, eager and replayed
    import attnplug_cuda.staged_attend as staged

    monkeypatch.setenv("ATTNPLUG_ONE_LAUNCH", "cpp")
    monkeypatch.setattr(staged, "FILL", 0.0)
    backend = World(SPEC, CudaBackend, DEVICE, seed=3).backend
    if backend._staged_attend is None:
        pytest.skip(backend.one_launch_reason)
    for mode, drafts in ((ForwardMode.DECODE, None), (ForwardMode.TARGET_VERIFY, 6)):
        one, fused, kv_one = _decode_twice(CudaBackend, graphs=graphs, mode=mode, drafts=drafts)
        two, _, kv_two = _decode_twice(TwoLaunch, graphs=graphs, mode=mode, drafts=drafts)
        assert all(fused)
        _assert_same(one, two, kv_one, kv_two)


def test_the_step_routes_each_layer_kind_once(monkeypatch):
    # the backend decides per step which layer kinds the staged kernel takes (_StepTables.staged)
    # and calls it for exactly those layers; here a stand-in that records the call and runs
    # store_attend, so any machine checks the routing
    import attnplug_cuda.staged_attend as staged

    world = World(SPEC, CudaBackend, DEVICE, seed=3)
    backend = world.backend
    calls = []

    def stand_in(*args, **kwargs):
        calls.append(kwargs.get("window"))
        return backend._store_attend(*args, **kwargs)

    backend._staged_attend = stand_in
    reqs = world.prefill([40, 9], backend=world.reference_backend)
    monkeypatch.setattr(staged, "FILL", 2.0)  # no grid covers twice the GPU: none routed
    world.run_eager(world.plan(ForwardMode.DECODE, reqs))
    assert backend.forward_metadata.staged == (False, False) and calls == []
    monkeypatch.setattr(staged, "FILL", 0.0)  # every grid covers "the GPU"
    # both layers' cached keys fit the resident kernel, which decode steps are not given
    world.run_eager(world.plan(ForwardMode.DECODE, reqs))
    assert backend.forward_metadata.staged == (False, False) and calls == []
    world.run_eager(world.plan(ForwardMode.TARGET_VERIFY, reqs, num_draft_tokens=6))
    assert backend.forward_metadata.fused and backend.forward_metadata.staged == (True, True)
    assert len(calls) == 2 and set(calls) == {None, SPEC.sliding_window}  # one full, one SWA layer
