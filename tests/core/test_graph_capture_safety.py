"""Graph capture cannot poison the process (CPU).

``StreamGraph`` runs over a fake device module (``fake_graph_device``) that fails the way a
real one does: an illegal call on a capturing stream invalidates the capture, ending it then
raises, and some PyTorch versions leave the allocator recording into the pool. The real
``torch.cuda`` path is exercised by ``benchmarks/graph_capture_soak.py`` on a GPU.
"""

import gc
import weakref

import pytest
import torch

from attnplug import ForwardMode, GraphRunner
from attnplug.backends.reference import ReferenceBackend
from attnplug.graphs import EagerGraph, StreamGraph, collector_paused, stream_graph
from attnplug.graphs.stream_graph import WARMUP_RUNS
from attnplug_conformance.harness import World
from fake_graph_device import FakeDevice
from worlds import tiny_spec

SPEC = tiny_spec()


@pytest.fixture
def gc_state():
    """Restore the collector's state and thresholds whatever a test does."""
    enabled, thresholds = gc.isenabled(), gc.get_threshold()
    yield
    gc.set_threshold(*thresholds)
    (gc.enable if enabled else gc.disable)()


def _out():
    return torch.zeros(3)


def _step(dev: FakeDevice, launches: int = 2):
    def fn():
        for _ in range(launches):
            dev.launch()
        return _out()

    return fn


def _graph(dev: FakeDevice) -> StreamGraph:
    return StreamGraph(dev, dev.FakeGraph, pool_ops=dev.pool_ops())


# ---------------------------------------------------------------- the collector
def test_collector_paused_collects_once_and_restores(gc_state, monkeypatch):
    calls = []
    real_collect = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append(a) or real_collect(*a))
    gc.enable()
    with collector_paused(collect=False):
        assert not gc.isenabled() and calls == []
        with collector_paused():
            assert not gc.isenabled() and len(calls) == 1
        with collector_paused():
            assert len(calls) == 1  # the enclosing pause has collected already
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(KeyError):
        with collector_paused():
            raise KeyError("boom")
    assert gc.isenabled() and len(calls) == 2
    gc.disable()
    with collector_paused():
        pass
    assert not gc.isenabled()  # the prior state, not "enabled"


# ---------------------------------------------------------------- StreamGraph
def test_stream_graph_warms_up_the_same_callable_then_captures_with_collector_off(gc_state):
    dev = FakeDevice()
    gc.enable()
    g = _graph(dev)
    out = g.capture(_step(dev, launches=3))
    assert dev.launches == [False] * (3 * WARMUP_RUNS) + [True] * 3
    assert g.graph.gc_enabled_at_begin is False and gc.isenabled()
    assert dev.allocator.recording == {} and dev.current is dev.default
    g.replay()
    assert g.graph.replays == 1 and out.shape == (3,)
    with pytest.raises(RuntimeError, match="captures once"):
        g.capture(_step(dev))


@pytest.mark.parametrize(
    "ends_pool_on_failure", [False, True], ids=["runtime-leaves-pool-recording", "runtime-ends-pool"]
)
@pytest.mark.parametrize("failure", ["step-raises", "capture-end-raises"])
def test_failed_capture_is_ended_and_later_captures_work(ends_pool_on_failure, failure, gc_state):
    dev = FakeDevice(ends_pool_on_failure=ends_pool_on_failure)
    before = _graph(dev)
    before.capture(_step(dev))
    old_pool = before.graph.pool

    failing = _graph(dev)
    weak_failed = weakref.ref(failing.graph)
    if failure == "step-raises":
        dev.fail_next_launch = True  # warm-up is outside capture: the captured launch fails
        cause = "not permitted when stream is capturing"
    else:
        original_end = dev.FakeGraph.capture_end

        def end_invalidated(self):
            dev.invalidated = True
            original_end(self)

        failing.graph.capture_end = end_invalidated.__get__(failing.graph)
        cause = None
    with pytest.raises(RuntimeError, match="capture invalidated") as raised:
        failing.capture(_step(dev))
    if cause is not None:  # ending the invalidated capture raised while the step's error propagated
        assert cause in str(raised.value.__context__)
    del raised
    assert dev.current is dev.default, "the caller's stream was not restored"
    assert dev.allocator.recording == {}, "a failed capture left the allocator recording into its pool"
    with pytest.raises(RuntimeError, match="not captured"):
        failing.replay()
    del failing
    gc.collect()
    stream_graph._kept_failed.clear()  # what the process keeps for the allocator's sake
    gc.collect()
    assert weak_failed() is None

    after = _graph(dev)
    after.capture(_step(dev))  # would raise "already recording to mempool_id" on a poisoned pool
    assert after.graph.pool != old_pool, "the pool of a failed capture must be retired"
    before.replay()
    after.replay()
    assert before.graph.replays == after.graph.replays == 1
    del before, after
    gc.collect()
    assert all(n == 0 for n in dev.allocator.refs.values()), f"pool references leaked: {dict(dev.allocator.refs)}"


def _captured_graph_in_a_cycle(dev):
    old = _graph(dev)
    old.capture(_step(dev))
    cycle = [old]
    cycle.append(cycle)
    return cycle, weakref.ref(old.graph)


def test_garbage_holding_a_graph_is_collected_before_capture(gc_state):
    dev = FakeDevice()
    gc.disable()  # the collector never runs by itself here: only the capture's collection frees it
    cycle, weak_old = _captured_graph_in_a_cycle(dev)
    del cycle
    g = _graph(dev)
    g.capture(_step(dev))
    assert weak_old() is None, "capture did not collect the unreachable graph first"
    assert dev.destroyed_during_capture == 0 and g.graph.ended


def test_garbage_made_during_capture_is_not_collected_inside_it(gc_state):
    dev = FakeDevice()
    gc.enable()
    gc.set_threshold(1, 1, 1)  # the collector would run on nearly every allocation

    def step():
        if dev.capturing is not None:
            cycle = [dev.FakeGraph()]  # a graph object that becomes cyclic garbage inside the captured region
            cycle.append(cycle)
            del cycle
            junk = [[i] for i in range(200)]  # allocations that would trigger the collector
            del junk
        dev.launch()
        return _out()

    g = _graph(dev)
    g.capture(step)
    assert dev.destroyed_during_capture == 0 and g.graph.ended
    gc.collect()  # collected after the capture, harmlessly
    assert dev.destroyed_during_capture == 0


# ---------------------------------------------------------------- GraphRunner over StreamGraph
def _world():
    world = World(SPEC, ReferenceBackend, "cpu", seed=5)
    world.prefill([3, 5, 2, 6], backend=world.reference_backend)
    return world


def _fake_runner(world, dev, *, fail_bucket=None, max_bs=4, buckets=(1, 2, 4), spy=None):
    world.backend.new_graph = lambda: _graph(dev)

    def step(batch, inputs):
        if spy is not None:
            spy.append(("step", id(batch), dev.capturing is not None))
        if batch.batch_size == fail_bucket and dev.capturing is not None:
            dev.fail_next_launch = True
        dev.launch()
        return world.step_fn(batch, inputs)

    runner = GraphRunner(
        world.backend,
        step,
        max_bs=max_bs,
        inputs=world.input_shapes(),
        bucket_sizes=buckets,
        num_draft_tokens=2,
        modes=[ForwardMode.DECODE, ForwardMode.TARGET_VERIFY],
    )
    runner.capture()
    return runner


@pytest.mark.parametrize(
    "ends_pool_on_failure", [False, True], ids=["runtime-leaves-pool-recording", "runtime-ends-pool"]
)
def test_runner_records_a_failed_bucket_and_captures_the_rest(ends_pool_on_failure, caplog):
    dev = FakeDevice(ends_pool_on_failure=ends_pool_on_failure)
    world = _world()
    with caplog.at_level("WARNING", logger="attnplug.graphs.runner"):
        runner = _fake_runner(world, dev, fail_bucket=2)
    failed = {(ForwardMode.DECODE, 2), (ForwardMode.TARGET_VERIFY, 2)}
    assert set(runner.capture_failures) == failed
    assert all("not permitted when stream is capturing" in r for r in runner.capture_failures.values())
    assert set(runner.graphs) == {(m, b) for m in runner.modes for b in (1, 4)}
    status = runner.status()
    assert status["failed"].keys() == {"DECODE/bs=2", "TARGET_VERIFY/bs=2"} and status["eager_modes"] == []
    assert status["captured"] == ["DECODE/bs=1", "DECODE/bs=4", "TARGET_VERIFY/bs=1", "TARGET_VERIFY/bs=4"]
    assert "DECODE/bs=2" in caplog.text and "not permitted" in caplog.text
    assert dev.allocator.recording == {} and dev.current is dev.default and dev.capturing is None
    # A later runner in the same process captures every bucket.
    again = _fake_runner(world, dev)
    assert again.capture_failures == {} and len(again.graphs) == 6


def test_warmup_runs_exactly_what_is_captured():
    """Every specialisation a bucket uses is met in warm-up: the captured step makes the same
    calls, with the same batch and the same tensors, as each warm-up run before it."""
    dev = FakeDevice()
    world = _world()
    calls = []
    original = world.backend.forward

    def spying_forward(q, k, v, layer_id, batch, save_kv_cache=True):
        calls.append(
            (
                "forward",
                layer_id,
                id(batch),
                q.data_ptr(),
                tuple(q.shape),
                q.dtype,
                k.data_ptr(),
                v.data_ptr(),
                dev.capturing is not None,
            )
        )
        return original(q, k, v, layer_id, batch, save_kv_cache)

    world.backend.forward = spying_forward
    runner = _fake_runner(world, dev, spy=calls)
    per_bucket = WARMUP_RUNS + 1
    runs, current = [], None
    for call in calls:
        if call[0] == "step":
            current = [call]
            runs.append(current)
        else:
            current.append(call)
    assert len(runs) == per_bucket * len(runner.graphs)
    for i in range(0, len(runs), per_bucket):
        group = runs[i : i + per_bucket]
        strip = [[c[:-1] for c in run] for run in group]  # all but the "capturing" flag
        assert all(s == strip[-1] for s in strip), "warm-up and capture made different calls"
        assert [run[0][-1] for run in group] == [False] * WARMUP_RUNS + [True]
        assert len(group[-1]) == 1 + SPEC.num_layers


# ---------------------------------------------------------------- deterministic release
@pytest.mark.parametrize("kind", ["eager", "stream"])
def test_dropping_a_runner_frees_its_graphs_without_the_collector(kind, gc_state):
    world = _world()
    dev = FakeDevice()
    if kind == "stream":
        world.backend.new_graph = lambda: _graph(dev)
    else:
        world.backend.new_graph = EagerGraph
    runner = world.graph_runner(max_bs=4, bucket_sizes=[1, 2, 4])
    graphs = [c.graph for c in runner.graphs.values()]
    refs = [weakref.ref(g) for g in graphs] + [weakref.ref(runner)]
    if kind == "stream":
        refs += [weakref.ref(g.graph) for g in graphs]
    del graphs
    gc.collect()
    gc.disable()
    del runner
    assert all(r() is None for r in refs), "a reference cycle keeps the runner's graphs alive"
    if kind == "stream":
        assert all(n == 0 for n in dev.allocator.refs.values())


# ---------------------------------------------------------------- a second engine in one process
def test_graphs_of_a_new_runner_capture_after_every_graph_of_the_last_is_gone(gc_state):
    """Dropping every graph of the shared pool lets the allocator release it; the next capture
    must use a fresh pool (capturing into the released one is refused, as PyTorch asserts)."""
    dev = FakeDevice()
    first = [_graph(dev) for _ in range(2)]
    for g in first:
        g.capture(_step(dev))
    pool = first[0].graph.pool
    assert first[1].graph.pool == pool  # captures share one pool while its graphs live
    del first, g
    assert pool in dev.allocator.released
    second = _graph(dev)
    second.capture(_step(dev))  # raised "use_count > 0 INTERNAL ASSERT FAILED" before
    assert second.graph.pool != pool
    third = _graph(dev)
    third.capture(_step(dev))
    assert third.graph.pool == second.graph.pool
    third.replay()
    assert third.graph.replays == 1


def test_runners_built_one_after_another_all_capture(gc_state):
    """Two GraphRunners over fresh worlds, the first dropped before the second captures:
    every bucket of both is captured (an engine per batch size in one process)."""
    dev = FakeDevice()
    for _ in range(2):
        world = _world()
        world.backend.new_graph = lambda: _graph(dev)
        runner = world.graph_runner(max_bs=4, bucket_sizes=[1, 2, 4])
        assert not runner.capture_failures
        assert all(isinstance(c.graph, StreamGraph) for c in runner.graphs.values())
        del runner, world
