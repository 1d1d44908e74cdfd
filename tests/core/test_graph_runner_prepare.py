"""GraphRunner's replay preparation (CPU, reference backend, eager stand-in graph): the padded
static buffers across growing and shrinking steps, the device operations it issues, the
prepare/replay split, sync-freedom, and the ``copies_replay_batch`` hook."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from attnplug import ForwardMode
from attnplug.backends.reference import ReferenceBackend
from attnplug_conformance.harness import World
from attnplug_conformance.sync_detector import SyncDetector
from oracle import assert_close_rel
from worlds import tiny_spec

SPEC = tiny_spec(sliding_window=6, max_reqs=10, max_context_len=48)


def _world(cls=ReferenceBackend, n_reqs=5, seed=4):
    world = World(SPEC, cls, "cpu", seed=seed)
    reqs = [world.new_request() for _ in range(n_reqs)]
    step = world.plan(ForwardMode.EXTEND, reqs, [3 + 2 * i for i in range(n_reqs)])
    world.run_eager(step)
    world.commit(step)
    return world, reqs


def _assert_padded(runner, step, bucket, q=1):
    """The static buffers the bucket's graph reads hold the step, then padding."""
    b, bs, n, nb = step.batch, step.batch.batch_size, step.batch.num_tokens, bucket * q
    fill = runner.fill_value
    assert torch.equal(runner.req_pool_indices[:bs], b.req_pool_indices.to(torch.int64))
    assert torch.equal(runner.seq_lens[:bs], b.seq_lens.to(torch.int64))
    assert (runner.req_pool_indices[bs:bucket] == 0).all(), "padded requests must read row 0"
    assert (runner.seq_lens[bs:bucket] == fill).all(), f"padded requests must have seq_lens {fill}"
    assert torch.equal(runner.out_cache_loc[:n], b.out_cache_loc)
    assert (runner.out_cache_loc[n:nb] == 0).all(), "padded tokens must write slot 0"
    assert torch.equal(runner.positions[:n], b.positions)
    assert (runner.positions[n:nb] == 0).all(), "padded tokens must have position 0"
    for name, buf in runner.inputs.items():
        assert torch.equal(buf[:n], step.inputs[name]) and (buf[n:nb] == 0).all(), name


@pytest.mark.parametrize("mode,ndt", [(ForwardMode.DECODE, None), (ForwardMode.TARGET_VERIFY, 3)])
def test_padding_is_rewritten_when_a_step_shrinks_in_its_bucket(mode, ndt):
    """Sizes 4, 3, 1, 4, 2, 3 over buckets [2, 4]: each step's graph reads its own values and
    padding, never an earlier, larger step's rows (4 -> 3 in bucket 4 is the case a runner
    that skips the padding fill gets wrong)."""
    world, reqs = _world()
    runner = world.graph_runner(max_bs=4, num_draft_tokens=ndt, bucket_sizes=[2, 4], modes=[mode])
    q = ndt or 1
    for n_reqs in (4, 3, 1, 4, 2, 3):
        step = world.plan(mode, reqs[:n_reqs], num_draft_tokens=ndt)
        out = runner.run(step.batch, step.inputs).clone()
        bucket = runner.bucket_for(step.batch)
        _assert_padded(runner, step, bucket, q)
        assert_close_rel(out, world.run_eager(step).double(), 1e-6, f"replay vs eager, {n_reqs} requests")


def test_capture_resets_the_static_buffers_to_padding():
    world, reqs = _world()
    runner = world.graph_runner(max_bs=4, bucket_sizes=[4])
    step = world.plan(ForwardMode.DECODE, reqs[:4])
    runner.run(step.batch, step.inputs)
    runner.capture()  # recapture: must run on padding only (slot 0, row 0), not on the last step
    assert (runner.req_pool_indices == 0).all() and (runner.out_cache_loc == 0).all()
    assert (runner.seq_lens == runner.fill_value).all() and (runner.positions == 0).all()
    assert all((buf == 0).all() for buf in runner.inputs.values())
    step = world.plan(ForwardMode.DECODE, reqs[:3])
    runner.run(step.batch, step.inputs)
    _assert_padded(runner, step, 4)


class _OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _runner_ops(runner, step):
    """The aten ops of one ``prepare`` without the backend's own metadata ops."""
    backend = runner.backend
    real = backend.init_forward_metadata_replay_cuda_graph
    backend.init_forward_metadata_replay_cuda_graph = lambda batch: None
    try:
        with _OpLog() as log:
            assert runner.prepare(step.batch, step.inputs)
    finally:
        backend.init_forward_metadata_replay_cuda_graph = real
    return log.ops


def test_steady_state_preparation_is_one_grouped_copy_and_fills_only_when_needed():
    world, reqs = _world()
    runner = world.graph_runner(max_bs=4, bucket_sizes=[2, 4])
    four, three = (world.plan(ForwardMode.DECODE, reqs[:k]) for k in (4, 3))
    _runner_ops(runner, four)  # first use of a size: caches its views
    assert _runner_ops(runner, four) == ["_foreach_copy_"], "same size again: one grouped copy, no fill"
    shrink = _runner_ops(runner, three)
    assert shrink.count("_foreach_copy_") == 1 and "fill_" in shrink and "zero_" in shrink, shrink
    assert _runner_ops(runner, three) == ["_foreach_copy_"], "the padding is in place: no fill"
    assert _runner_ops(runner, four) == ["_foreach_copy_"], "growing overwrites the padding: no fill"


def test_prepare_then_replay_is_run():
    world, reqs = _world()
    runner = world.graph_runner(max_bs=4, bucket_sizes=[2, 4])
    with pytest.raises(RuntimeError, match="prepare"):
        runner.replay()
    step = world.plan(ForwardMode.DECODE, reqs[:3])
    assert runner.prepare(step.batch, step.inputs) is True
    out = runner.replay().clone()
    with pytest.raises(RuntimeError, match="prepare"):
        runner.replay()  # one replay per preparation
    assert_close_rel(out, world.run_eager(step).double(), 1e-6, "prepare + replay vs eager")
    big = world.plan(ForwardMode.DECODE, reqs[:5])  # no bucket holds 5: eager, nothing prepared
    before = runner.req_pool_indices.clone()
    assert runner.prepare(big.batch, big.inputs) is False
    assert torch.equal(runner.req_pool_indices, before)
    with pytest.raises(RuntimeError, match="prepare"):
        runner.replay()


def test_prepare_reads_no_device_value():
    world, reqs = _world()
    runner = world.graph_runner(max_bs=4, bucket_sizes=[2, 4])
    for k in (4, 3, 1, 4):
        step = world.plan(ForwardMode.DECODE, reqs[:k])
        detector = SyncDetector("GraphRunner.prepare", device=world.device)
        with detector:
            assert runner.prepare(step.batch, step.inputs)
        assert not detector.violations
        runner.replay()


class _CopiesBatch(ReferenceBackend):
    """Declares ``copies_replay_batch`` and copies the step into the static batch itself."""

    copies_replay_batch = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sources = []
        self._source = None

    def set_replay_source(self, batch, static):
        self.sources.append((batch.batch_size, static.batch_size))
        self._source = (batch, static)

    def init_forward_metadata_replay_cuda_graph(self, batch):
        source, self._source = self._source, None
        assert source is not None and source[1] is batch, "set_replay_source must announce this static batch"
        step, bs, n = source[0], source[0].batch_size, source[0].num_tokens
        batch.req_pool_indices.zero_()[:bs].copy_(step.req_pool_indices)
        batch.seq_lens.fill_(self.get_cuda_graph_seq_len_fill_value())[:bs].copy_(step.seq_lens)
        batch.out_cache_loc.zero_()[:n].copy_(step.out_cache_loc)
        batch.positions.zero_()[:n].copy_(step.positions)
        super().init_forward_metadata_replay_cuda_graph(batch)


def test_a_backend_that_copies_the_batch_gets_it_announced_and_the_runner_copies_only_inputs():
    world, reqs = _world(_CopiesBatch)
    runner = world.graph_runner(max_bs=4, bucket_sizes=[2, 4])
    assert runner.backend_copies_batch
    copied = []
    real_copy = runner._copy_all
    runner._copy_all = lambda dst, src: copied.append([d.data_ptr() for d in dst]) or real_copy(dst, src)
    for k in (4, 3, 1):
        step = world.plan(ForwardMode.DECODE, reqs[:k])
        out = runner.run(step.batch, step.inputs).clone()
        _assert_padded(runner, step, runner.bucket_for(step.batch))
        assert_close_rel(out, world.run_eager(step).double(), 1e-6, f"replay vs eager, {k} requests")
    assert world.backend.sources == [(4, 4), (3, 4), (1, 2)]
    batch_ptrs = {t.data_ptr() for t in (runner.req_pool_indices, runner.seq_lens, runner.out_cache_loc)}
    assert copied and all(not batch_ptrs & set(ptrs) for ptrs in copied), "the runner copied batch fields"


def test_backends_copy_nothing_by_default():
    world, _ = _world()
    assert ReferenceBackend.copies_replay_batch is False
    with pytest.raises(NotImplementedError, match="copies_replay_batch"):
        world.backend.set_replay_source(None, None)


def test_inputs_written_in_place_into_the_static_buffers_are_not_copied():
    world, reqs = _world()
    runner = world.graph_runner(max_bs=4, bucket_sizes=[4])
    step = world.plan(ForwardMode.DECODE, reqs[:3])
    n = step.batch.num_tokens
    in_place = {}
    for name, x in step.inputs.items():
        runner.inputs[name][:n].copy_(x)  # the engine writes its inputs straight into the runner
        in_place[name] = runner.inputs[name][:n]
    copied = []
    real_copy = runner._copy_all
    runner._copy_all = lambda dst, src: copied.extend(d.data_ptr() for d in dst) or real_copy(dst, src)
    out = runner.run(step.batch, in_place).clone()
    assert not {b.data_ptr() for b in runner.inputs.values()} & set(copied), "an in-place input was copied"
    assert_close_rel(out, world.run_eager(step).double(), 1e-6, "in-place inputs vs eager")
