"""Graph runner over the reference backend with the eager stand-in graph (CPU)."""

import dataclasses
import re

import pytest
import torch

from attnplug import BatchError, EagerGraph, ForwardMode, GraphRunner, GraphSupport
from attnplug.backends.reference import ReferenceBackend
from attnplug.graphs import GraphCaptureError, default_bucket_sizes, default_extend_tokens
from attnplug_conformance.harness import World
from fake_graph_device import use_tape_graphs
from oracle import assert_close_rel, dense_attention
from worlds import small_spec

SPEC = small_spec(sliding_window=6, max_reqs=12)


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


@pytest.mark.parametrize(
    "mode,ndt", [(ForwardMode.DECODE, None), (ForwardMode.TARGET_VERIFY, 4), (ForwardMode.DRAFT_EXTEND, 3)]
)
@pytest.mark.parametrize("n_reqs", [3, 4, 6], ids=["padded", "exact", "eager-fallback"])
@pytest.mark.parametrize("graph", ["eager-stand-in", "tape"])
def test_replay_equals_eager_and_dense(mode, ndt, n_reqs, graph):
    """``tape``: graphs that replay their captured work over the captured tensors, as a device
    graph does (tests/fake_graph_device.py), not by re-running the Python step."""
    world, reqs = _prefilled(n_reqs)
    if graph == "tape":
        use_tape_graphs(world.backend)
    runner = world.graph_runner(max_bs=4, num_draft_tokens=ndt, bucket_sizes=[1, 2, 4])
    step = world.plan(mode, reqs, num_draft_tokens=ndt)
    replayed = runner.run(step.batch, step.inputs).clone()
    assert (runner.bucket_for(step.batch) is None) == (n_reqs > 4)
    eager = world.run_eager(step)  # rewrites the same k/v at the same slots
    assert_close_rel(replayed, eager.double().cpu(), 1e-6, "replay vs eager")
    world.commit(step)
    for layer in range(SPEC.num_layers):
        window = SPEC.sliding_window if world.pool.is_swa_layer(layer) else None
        assert_close_rel(replayed[:, layer], dense_attention(step, layer, window=window), 2e-5)


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
        GraphRunner(world.backend, world.step_fn, max_bs=2, inputs=world.input_shapes(), modes=[ForwardMode.IDLE])
    with pytest.raises(ValueError, match="EXTEND needs extend_tokens"):
        GraphRunner(world.backend, world.step_fn, max_bs=2, inputs=world.input_shapes(), modes=[ForwardMode.EXTEND])
    uniform = _UniformGraphs(world.pool, world.rows, num_heads=SPEC.num_heads, sliding_window=6)
    with pytest.raises(ValueError, match="cannot capture EXTEND steps .graphs=UNIFORM"):
        GraphRunner(uniform, world.step_fn, max_bs=2, inputs=world.input_shapes(), extend_tokens=[8])


# ---------------------------------------------------------------- capture failures
class _RaisesAtCaptureEnd(EagerGraph):
    """Runs the step, then fails as a device graph can when its capture ends (instantiation)."""

    def capture(self, fn):
        super().capture(fn)
        raise RuntimeError("graph instantiation failed")


def _failing_runner(world, failure, ndt=3):
    """A runner whose DECODE bucket 2 fails to capture (buckets go largest first: 4, 2, 1)."""
    made = []
    if failure == "graph-raises-at-capture-end":
        world.backend.new_graph = lambda: (made.append(1), _RaisesAtCaptureEnd() if len(made) == 2 else EagerGraph())[1]
        step, why = world.step_fn, "graph instantiation failed"
    else:

        def step(batch, inputs):
            if batch.forward_mode is ForwardMode.DECODE and batch.batch_size == 2 and not made:
                made.append(1)
                raise RuntimeError("step failed inside capture")
            return world.step_fn(batch, inputs)

        why = "step failed inside capture"
    runner = GraphRunner(
        world.backend,
        step,
        max_bs=4,
        inputs=world.input_shapes(),
        num_draft_tokens=ndt,
        bucket_sizes=[1, 2, 4],
        modes=[ForwardMode.DECODE, ForwardMode.TARGET_VERIFY],
    )
    return runner, why


@pytest.mark.parametrize("failure", ["step-raises-in-capture", "graph-raises-at-capture-end"])
def test_a_failed_bucket_leaves_the_runner_usable_and_replay_equal_to_eager(failure, caplog):
    world, reqs = _prefilled(4)
    runner, why = _failing_runner(world, failure)
    with caplog.at_level("WARNING", logger="attnplug.graphs.runner"):
        failures = runner.capture()
    key = (ForwardMode.DECODE, 2)
    assert set(failures) == {key} and why in failures[key] and runner.capture_failures == failures
    assert "DECODE/bs=2" in caplog.text and why in caplog.text
    assert set(runner.graphs) == {(m, b) for m in runner.modes for b in (1, 2, 4)} - {key}
    assert runner.status()["failed"] == {"DECODE/bs=2": failures[key]}
    for mode, ndt in [(ForwardMode.DECODE, None), (ForwardMode.TARGET_VERIFY, 3)]:
        for n in (1, 2, 3, 4):
            step = world.plan(mode, reqs[:n], num_draft_tokens=ndt)
            expected_bucket = 4 if (mode, n) == (ForwardMode.DECODE, 2) else {1: 1, 2: 2, 3: 4, 4: 4}[n]
            assert runner.bucket_for(step.batch) == expected_bucket
            replayed = runner.run(step.batch, step.inputs).clone()
            eager = world.run_eager(step)
            assert_close_rel(replayed, eager.double().cpu(), 1e-6, f"{mode.name} bs={n}")
            world.commit(step)
            for r in reqs[:n]:
                world.evict(r)


def test_strict_capture_raises_after_trying_every_bucket():
    world, _ = _prefilled(2)
    runner, why = _failing_runner(world, "graph-raises-at-capture-end")
    with pytest.raises(GraphCaptureError, match="DECODE/bs=2") as raised:
        runner.capture(strict=True)
    assert set(raised.value.failures) == {(ForwardMode.DECODE, 2)}
    assert len(runner.graphs) == 5  # the other buckets were still captured


def test_status_before_and_after_capture():
    world, _ = _prefilled(1)
    runner = world.graph_runner(max_bs=2, bucket_sizes=[1, 2], capture=False)
    status = runner.status()
    assert {k: status[k] for k in ("backend", "capture_ran", "device_graphs", "captured", "failed", "eager_modes")} == {
        "backend": "reference",
        "capture_ran": False,
        "device_graphs": False,
        "captured": [],
        "failed": {},
        "eager_modes": ["DECODE"],
    }
    assert set(status["not_captured"]) == {"EXTEND", "IDLE", "TARGET_VERIFY", "DRAFT_EXTEND"}
    assert "num_draft_tokens" in status["not_captured"]["TARGET_VERIFY"] and status["eager_runs"] == {}
    runner.capture()
    assert runner.status()["captured"] == ["DECODE/bs=1", "DECODE/bs=2"] and runner.status()["eager_modes"] == []


# ---------------------------------------------------------------- never silently eager
def test_first_step_of_a_captured_mode_captures(caplog):
    world, reqs = _prefilled(3)
    runner = world.graph_runner(max_bs=4, bucket_sizes=[2, 4], capture=False)
    extend = world.plan(ForwardMode.EXTEND, reqs[:1], [2])
    with caplog.at_level("INFO", logger="attnplug.graphs.runner"):
        runner.run(extend.batch, extend.inputs)  # EXTEND is never captured: no capture yet
        assert not runner.capture_ran and runner.graphs == {}
        world.commit(extend)
        step = world.plan(ForwardMode.DECODE, reqs)
        assert "the DECODE graphs are not captured yet" in runner.why_eager(step.batch)
        replayed = runner.run(step.batch, step.inputs).clone()
    assert runner.capture_ran and set(runner.graphs) == {(ForwardMode.DECODE, 2), (ForwardMode.DECODE, 4)}
    assert runner.why_eager(step.batch) is None and "capturing on first use" in caplog.text
    assert runner.status()["eager_runs"] == {"EXTEND": {"steps": 1, "why": runner.why_eager(extend.batch)}}
    assert runner.status()["eager_runs"].keys() == {"EXTEND"}  # the DECODE step replayed
    eager = world.run_eager(step)
    assert_close_rel(replayed, eager.double().cpu(), 1e-6, "first-use replay vs eager")


def test_eager_steps_say_why_and_are_logged_once(caplog):
    world, reqs = _prefilled(4)
    runner = world.graph_runner(max_bs=2, bucket_sizes=[1, 2], num_draft_tokens=2)
    decode = world.plan(ForwardMode.DECODE, reqs)
    with caplog.at_level("INFO", logger="attnplug.graphs.runner"):
        for _ in range(2):
            runner.run(decode.batch, decode.inputs)
        extend = world.plan(ForwardMode.EXTEND, reqs[:1], [1])
        runner.run(extend.batch, extend.inputs)
    why = runner.why_eager(decode.batch)
    assert "batch_size 4 exceeds the largest captured DECODE bucket 2" in why
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and why in warnings[0].getMessage()
    infos = [r.getMessage() for r in caplog.records if r.levelname == "INFO"]
    assert any("EXTEND" in m and "built without extend_tokens" in m for m in infos)
    assert runner.status()["eager_runs"]["DECODE"] == {"steps": 2, "why": why}
    other = world.plan(ForwardMode.TARGET_VERIFY, reqs[:1], num_draft_tokens=3)
    assert "num_draft_tokens=3, the graphs are captured for num_draft_tokens=2" in runner.why_eager(other.batch)


def test_a_mode_whose_every_capture_failed_says_so():
    world, reqs = _prefilled(1)

    def step(batch, inputs):
        if batch.forward_mode is ForwardMode.DECODE:
            raise RuntimeError("no DECODE graph here")
        return world.step_fn(batch, inputs)

    runner = GraphRunner(world.backend, step, max_bs=2, inputs=world.input_shapes(), bucket_sizes=[1, 2])
    runner.capture()
    decode = world.plan(ForwardMode.DECODE, reqs)
    assert "every DECODE capture failed" in runner.why_eager(decode.batch)
    assert "no DECODE graph here" in runner.why_eager(decode.batch)


class _UniformGraphs(ReferenceBackend):
    def capabilities(self):
        return dataclasses.replace(super().capabilities(), graphs=GraphSupport.UNIFORM)


class _NeverGraphs(ReferenceBackend):
    def capabilities(self):
        return dataclasses.replace(super().capabilities(), graphs=GraphSupport.NEVER)


def test_a_backend_without_graphs_is_reported_at_construction(caplog):
    world = World(SPEC, _NeverGraphs, "cpu", seed=5)
    reqs = world.prefill([3, 5])
    with caplog.at_level("WARNING", logger="attnplug.graphs.runner"):
        runner = world.graph_runner(max_bs=2, num_draft_tokens=2, capture=False)
    assert "graphs=NEVER: every step runs eagerly" in caplog.text
    assert runner.modes == () and set(runner.status()["not_captured"]) == {m.name for m in ForwardMode}
    step = world.plan(ForwardMode.DECODE, reqs)
    out = runner.run(step.batch, step.inputs)
    assert not runner.capture_ran and "graphs=NEVER" in runner.why_eager(step.batch)
    assert_close_rel(out, world.run_eager(step).double().cpu(), 1e-6, "eager through the runner")


def test_speculative_modes_without_num_draft_tokens_are_refused():
    world, _ = _prefilled(1)
    with pytest.raises(ValueError, match="need num_draft_tokens"):
        GraphRunner(
            world.backend,
            world.step_fn,
            max_bs=2,
            inputs=world.input_shapes(),
            modes=[ForwardMode.DECODE, ForwardMode.TARGET_VERIFY],
        )


@pytest.mark.parametrize(
    "change, needle",
    [
        (lambda x: x[:1], "the captured buffer takes [>= 2"),  # fewer rows than tokens: broadcast before
        (lambda x: x[:, None], "the captured buffer takes"),  # an extra dimension
        (lambda x: x.double(), "torch.float64 on cpu; the captured buffer is torch.float32"),  # cast before
        (lambda x: None, "must be a tensor"),
    ],
)
def test_replay_refuses_inputs_the_captured_buffers_cannot_take(change, needle):
    """Trust II: an input that does not fit the captured buffers is refused, naming it, before
    anything is copied (it was broadcast or cast silently)."""
    world, reqs = _prefilled(2)
    runner = world.graph_runner(max_bs=2, bucket_sizes=[2], modes=[ForwardMode.DECODE])
    step = world.plan(ForwardMode.DECODE, reqs)
    inputs = dict(step.inputs)
    inputs["q"] = change(inputs["q"])
    before = runner.inputs["q"].clone()
    with pytest.raises(ValueError, match=re.escape(needle)):
        runner.run(step.batch, inputs)
    assert torch.equal(runner.inputs["q"], before)


# ---------------------------------------------------------------- EXTEND graphs (token buckets)
@pytest.mark.parametrize("graph", ["eager-stand-in", "tape"])
def test_extend_replay_equals_eager_and_dense(graph):
    """Chunks of uneven lengths on top of a prefix, replayed in token-count buckets: one filling
    a bucket exactly, ones padded (a request and tokens of padding), one past the largest
    bucket (eager), one request alone; each equals the eager step and dense attention."""
    world, reqs = _prefilled(4)
    if graph == "tape":
        use_tape_graphs(world.backend)
    runner = world.graph_runner(max_bs=4, bucket_sizes=[1, 2, 4], extend_tokens=[8, 16])
    for lens, bucket in (([4, 1, 2, 1], 8), ([5, 9, 1], 16), ([3], 8), ([9, 2, 7, 1], None), ([1, 1], 8)):
        step = world.plan(ForwardMode.EXTEND, reqs[: len(lens)], lens)
        assert runner.bucket_for(step.batch) == bucket
        replayed = runner.run(step.batch, step.inputs).clone()
        assert replayed.shape[0] == sum(lens)
        eager = world.run_eager(step)
        assert_close_rel(replayed, eager.double().cpu(), 1e-6, f"EXTEND {lens}: replay vs eager")
        world.commit(step)
        for layer in range(SPEC.num_layers):
            window = SPEC.sliding_window if world.pool.is_swa_layer(layer) else None
            assert_close_rel(replayed[:, layer], dense_attention(step, layer, window=window), 2e-5)
    assert runner.status()["captured"][-2:] == ["EXTEND/tokens=8", "EXTEND/tokens=16"]
    assert "19 tokens exceed the largest captured EXTEND bucket 16" in runner.status()["eager_runs"]["EXTEND"]["why"]


def test_extend_rows_requests_returns_a_row_per_request():
    world, reqs = _prefilled(3)
    last = {}

    def step(batch, inputs):
        out = world.step_fn(batch, inputs)
        ends = torch.cumsum(batch.extend_seq_lens, 0) - 1
        last[batch.num_tokens] = ends
        return out[ends.clamp_min(0)]

    runner = GraphRunner(
        world.backend,
        step,
        max_bs=4,
        inputs=world.input_shapes(),
        modes=[ForwardMode.EXTEND],
        extend_tokens=[16],
        extend_rows="requests",
    )
    plan = world.plan(ForwardMode.EXTEND, reqs, [2, 6, 3])
    rows = runner.run(plan.batch, plan.inputs).clone()
    eager = world.run_eager(plan)
    assert rows.shape[0] == 3
    assert_close_rel(rows, eager[torch.tensor([1, 7, 10])].double().cpu(), 1e-6, "last token of each request")


def test_extend_steps_that_do_not_fit_are_refused_naming_the_field():
    world, reqs = _prefilled(2)
    runner = world.graph_runner(max_bs=4, bucket_sizes=[1, 2, 4], extend_tokens=[8], capture=False)
    step = world.plan(ForwardMode.EXTEND, reqs, [2, 3])
    bad = dataclasses.replace(step.batch, extend_seq_lens=step.batch.extend_seq_lens.to(torch.float32), validate=False)
    with pytest.raises(ValueError, match="batch.extend_seq_lens is torch.float32"):
        runner.run(bad, step.inputs)
    short = dataclasses.replace(step.batch, extend_seq_lens=step.batch.extend_seq_lens[:1], validate=False)
    with pytest.raises(ValueError, match=r"batch.extend_seq_lens is \(1,\).*takes \[2\]"):
        runner.run(short, step.inputs)
    assert not runner.capture_ran  # refused before anything was captured


@pytest.mark.parametrize(
    "extend_tokens,match",
    [([], "at least one token count"), ([8, 8], "strictly increasing"), ([0], "extend_tokens entry"), ("8", "seq")],
)
def test_bad_extend_tokens_are_refused(extend_tokens, match):
    world, _ = _prefilled(1)
    with pytest.raises(ValueError, match=match):
        GraphRunner(world.backend, world.step_fn, max_bs=2, inputs=world.input_shapes(), extend_tokens=extend_tokens)
    with pytest.raises(ValueError, match="extend_rows must be 'tokens' or 'requests'"):
        GraphRunner(world.backend, world.step_fn, max_bs=2, inputs=world.input_shapes(), extend_rows="rows")


def test_default_extend_tokens():
    assert default_extend_tokens(100) == (100,)
    assert default_extend_tokens(8192) == (256, 512, 1024, 2048, 4096, 8192)
    assert default_extend_tokens(3000) == (256, 512, 1024, 2048, 3000)


def test_first_use_captures_only_the_steps_mode():
    """A prefill-only run captures its EXTEND buckets and no DECODE graph; the first DECODE
    step then captures DECODE's, leaving the EXTEND graphs as they were."""
    world, reqs = _prefilled(2)
    runner = world.graph_runner(max_bs=2, bucket_sizes=[1, 2], extend_tokens=[8], capture=False)
    step = world.plan(ForwardMode.EXTEND, reqs, [2, 3])
    assert "EXTEND graphs are not captured yet" in runner.why_eager(step.batch)
    runner.run(step.batch, step.inputs)
    world.commit(step)
    assert runner.status()["captured"] == ["EXTEND/tokens=8"]
    extend_graph = runner.graphs[(ForwardMode.EXTEND, 8)]
    decode = world.plan(ForwardMode.DECODE, reqs)
    assert "DECODE graphs are not captured yet" in runner.why_eager(decode.batch)
    runner.run(decode.batch, decode.inputs)
    assert runner.status()["captured"] == ["DECODE/bs=1", "DECODE/bs=2", "EXTEND/tokens=8"]
    assert runner.graphs[(ForwardMode.EXTEND, 8)] is extend_graph


def test_extend_graphs_under_validation(monkeypatch):
    """ATTNPLUG_VALIDATE=1: the padded batch of an EXTEND graph (padded requests without new
    tokens, tokens of no request) passes the backend's checks, so every bucket is captured and
    replays; a real slot on a token of no request is still refused."""
    monkeypatch.setenv("ATTNPLUG_VALIDATE", "1")
    world, reqs = _prefilled(3)
    runner = world.graph_runner(max_bs=4, bucket_sizes=[4], extend_tokens=[8, 16])
    assert runner.capture_failures == {}
    step = world.plan(ForwardMode.EXTEND, reqs, [5, 1, 3])
    replayed = runner.run(step.batch, step.inputs).clone()
    assert runner.bucket_for(step.batch) == 16
    assert_close_rel(replayed, world.run_eager(step).double().cpu(), 1e-6, "replay vs eager")
    world.commit(step)
    static = runner.graphs[(ForwardMode.EXTEND, 16)].batch
    runner.out_cache_loc[12] = step.batch.out_cache_loc[0]  # a token of no request holding a real slot
    with pytest.raises(BatchError, match=r"out_cache_loc\[12\] = \d+ belongs to no request \(past the 9 new tokens"):
        world.backend.check_batch(static, read_device=True)
