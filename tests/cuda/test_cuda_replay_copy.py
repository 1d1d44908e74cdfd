"""The cuda backend's replay preparation that copies the engine's step into the graph's static
batch inside its one metadata launch (``copies_replay_batch``), under TRITON_INTERPRET=1 on
the CPU: the padded static buffers across growing and shrinking steps, the same tables as a
launch over the filled static buffers, strided and int32 step tensors, and the runner copying
only the model inputs."""

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("needs the Triton interpreter (set by conftest without a GPU)", allow_module_level=True)
pytest.importorskip("triton")

from attnplug import BatchError, ForwardBatch, ForwardMode  # noqa: E402
from attnplug.backends.reference import ReferenceBackend  # noqa: E402
from attnplug_conformance.harness import World  # noqa: E402
from attnplug_cuda.backend import CudaBackend  # noqa: E402
from worlds import kernel_spec  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SPEC = kernel_spec(max_reqs=8)


def _world(cls=CudaBackend, n_reqs=4):
    world = World(SPEC, cls, DEVICE, seed=6)
    reqs = [world.new_request() for _ in range(n_reqs)]
    step = world.plan(ForwardMode.EXTEND, reqs, [5 + 3 * i for i in range(n_reqs)])
    world.run_eager(step)
    world.commit(step)
    return world, reqs


def _tables(backend):
    t = backend.forward_metadata
    return [x.clone() for x in (t.cu_q_lens, t.window_start, t.token_pos, t.swa_out_cache_loc, t.swa_window_table)]


def _check_static(runner, batch, bucket, q):
    bs, n, nb = batch.batch_size, batch.num_tokens, bucket * q
    assert torch.equal(runner.req_pool_indices[:bs], batch.req_pool_indices.to(torch.int64))
    assert torch.equal(runner.seq_lens[:bs], batch.seq_lens.to(torch.int64))
    assert (runner.req_pool_indices[bs:bucket] == 0).all(), "padded requests: row 0"
    assert (runner.seq_lens[bs:bucket] == runner.fill_value).all(), "padded requests: the fill value"
    assert torch.equal(runner.out_cache_loc[:n], batch.out_cache_loc) and (runner.out_cache_loc[n:nb] == 0).all()
    assert torch.equal(runner.positions[:n], batch.positions) and (runner.positions[n:nb] == 0).all()


@pytest.mark.parametrize("mode,ndt", [(ForwardMode.DECODE, None), (ForwardMode.TARGET_VERIFY, 3)])
def test_one_launch_copies_the_step_padded_and_builds_the_same_tables(mode, ndt):
    world, reqs = _world()
    backend = world.backend
    assert backend.copies_replay_batch
    runner = world.graph_runner(max_bs=4, num_draft_tokens=ndt, bucket_sizes=[2, 4], modes=[mode])
    copied = []
    real_copy = runner._copy_all
    runner._copy_all = lambda dst, src: copied.append(len(dst)) or real_copy(dst, src)
    q = ndt or 1
    for k in (4, 3, 1, 4, 2):
        step = world.plan(mode, reqs[:k], num_draft_tokens=ndt)
        static = runner.graphs[(mode, runner.bucket_for(step.batch))].batch
        assert runner.prepare(step.batch, step.inputs)
        _check_static(runner, step.batch, static.batch_size, q)
        fused = _tables(backend)
        backend.init_forward_metadata_replay_cuda_graph(static)  # a launch over the filled static batch
        assert all(torch.equal(a, b) for a, b in zip(fused, _tables(backend))), f"{k} requests: tables differ"
    assert copied == [len(runner.inputs)] * 5, "the runner copies the model inputs only"


def test_strided_and_int32_step_tensors():
    world, reqs = _world()
    runner = world.graph_runner(max_bs=4, bucket_sizes=[4], modes=[ForwardMode.DECODE])
    step = world.plan(ForwardMode.DECODE, reqs[:3])
    b = step.batch
    wide = torch.stack([b.seq_lens, b.seq_lens + 100], dim=1)[:, 0]  # stride 2
    batch = ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=3,
        req_pool_indices=b.req_pool_indices.to(torch.int32),
        seq_lens=wide,
        out_cache_loc=torch.stack([b.out_cache_loc, b.out_cache_loc], dim=1)[:, 1],
        positions=b.positions,
    )
    assert batch.seq_lens.stride(0) == 2 and batch.out_cache_loc.stride(0) == 2
    out = runner.run(batch, step.inputs).clone()
    _check_static(runner, batch, 4, 1)
    ref = world.run_eager(step)
    assert torch.allclose(out.float(), ref.float(), atol=2e-3, rtol=2e-3)


def test_replay_matches_the_reference_backend_across_sizes():
    outs = {}
    for cls in (ReferenceBackend, CudaBackend):
        world, reqs = _world(cls)
        runner = world.graph_runner(max_bs=4, bucket_sizes=[2, 4], modes=[ForwardMode.DECODE])
        outs[cls] = []
        for k in (4, 3, 1, 4):
            step = world.plan(ForwardMode.DECODE, reqs[:k])
            outs[cls].append(runner.run(step.batch, step.inputs).double().clone())
            world.commit(step)
    for i, (a, b) in enumerate(zip(outs[CudaBackend], outs[ReferenceBackend])):
        err = (a - b).norm() / b.norm()
        assert err < 2e-3, f"step {i}: relative error {err:.2e}"


def test_a_source_on_another_device_is_refused():
    world, reqs = _world()
    runner = world.graph_runner(max_bs=4, bucket_sizes=[4], modes=[ForwardMode.DECODE])
    static = runner.graphs[(ForwardMode.DECODE, 4)].batch
    meta = ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=1,
        req_pool_indices=torch.zeros(1, dtype=torch.int64, device="meta"),
        seq_lens=torch.ones(1, dtype=torch.int64, device="meta"),
        out_cache_loc=torch.zeros(1, dtype=torch.int64, device="meta"),
        validate=False,
    )
    with pytest.raises(BatchError, match="out_cache_loc is on meta"):
        world.backend.set_replay_source(meta, static)


def test_a_stale_source_is_never_used_for_another_static_batch():
    """set_replay_source applies to the next replay call of that static batch only."""
    world, reqs = _world()
    runner = world.graph_runner(max_bs=4, bucket_sizes=[2, 4], modes=[ForwardMode.DECODE])
    backend = world.backend
    four = runner.graphs[(ForwardMode.DECODE, 4)].batch
    two = runner.graphs[(ForwardMode.DECODE, 2)].batch
    step = world.plan(ForwardMode.DECODE, reqs[:1])
    assert runner.prepare(step.batch, step.inputs)  # bucket 2: the static buffers hold the step
    before = (runner.req_pool_indices.clone(), runner.out_cache_loc.clone())
    backend.set_replay_source(world.plan(ForwardMode.DECODE, reqs[:3]).batch, four)
    backend.init_forward_metadata_replay_cuda_graph(two)  # not the announced batch: plain replay
    assert torch.equal(runner.req_pool_indices, before[0]) and torch.equal(runner.out_cache_loc, before[1])
    backend.init_forward_metadata_replay_cuda_graph(four)  # the announcement was dropped
    assert torch.equal(runner.req_pool_indices, before[0]) and torch.equal(runner.out_cache_loc, before[1])


class _FakeCompiled:
    packed_metadata, function = "meta", "fn"

    def __init__(self):
        self.launches = []
        self.metadata_calls = 0

    def launch_metadata(self, grid, stream, *args):
        self.metadata_calls += 1
        return "launch-metadata"

    def run(self, g0, g1, g2, stream, function, packed, launch_meta, enter, exit_, *args):
        self.launches.append(args)
        self.seen_metadata = launch_meta


class _FakeTensor:
    """What the launcher reads from a tensor argument: its address."""

    def __init__(self, address):
        self.address = address

    def data_ptr(self):
        return self.address


class _FakeJit:
    arg_names = ["A", "B", "n", "C", "K"]

    def __init__(self):
        self.compiled = _FakeCompiled()

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.compiled.launches.append(args) or self.compiled


class _FakeDriver:
    class active:
        @staticmethod
        def get_current_device():
            return 0

        @staticmethod
        def get_current_stream(device):
            return 7


def test_relaunch_replaces_only_the_per_step_arguments():
    from attnplug_cuda.kernels.relaunch import Relaunch

    jit = _FakeJit()
    rl = Relaunch(jit, (3,), ("a", "b", 4, "c"), {"K": 2}, per_step=3)
    rl._driver = _FakeDriver
    rl()
    rl("x", "y", 9)
    assert jit.compiled.launches == [("a", "b", 4, "c"), ("a", "b", 4, "c", 2), ("x", "y", 9, "c", 2)]
    with pytest.raises(ValueError, match="expected 3 per-step arguments"):
        rl("x")
    with pytest.raises(ValueError, match="per_step"):
        Relaunch(_FakeJit(), (1,), ("a",), {}, per_step=2)


def test_relaunch_passes_captured_tensors_as_addresses_and_per_step_tensors_as_tensors():
    """The captured tensors go to the launcher as their addresses (no per-launch ``data_ptr``
    and driver query), and are held so the addresses stay theirs; per-step tensors stay tensors,
    so the launcher still checks each new step's."""
    from attnplug_cuda.kernels.relaunch import Relaunch

    jit = _FakeJit()
    a, c, x = _FakeTensor(0x1000), _FakeTensor(0x2000), _FakeTensor(0x3000)
    rl = Relaunch(jit, (3,), (a, "b", 4, c), {"K": 2}, per_step=1)
    rl._driver = _FakeDriver
    rl()
    rl(x)
    assert jit.compiled.launches[1:] == [(0x1000, "b", 4, 0x2000, 2), (x, "b", 4, 0x2000, 2)]
    assert rl.args[0] is a and rl.args[3] is c


def test_relaunch_asks_for_launch_metadata_only_when_a_launch_hook_is_set():
    from types import SimpleNamespace

    from attnplug_cuda.kernels.relaunch import Relaunch

    jit = _FakeJit()
    rl = Relaunch(jit, (1,), (_FakeTensor(0x1000), "b", 4, "c"), {"K": 2})
    rl._driver = _FakeDriver
    rl._knobs = SimpleNamespace(runtime=SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None))
    rl()
    assert jit.compiled.metadata_calls == 0 and jit.compiled.seen_metadata is None
    rl._knobs.runtime.launch_enter_hook = lambda metadata: None
    rl()
    assert jit.compiled.metadata_calls == 1 and jit.compiled.seen_metadata == "launch-metadata"


def test_the_step_metadata_kernel_never_specialises_on_per_step_arguments():
    """Relaunch may swap them only because the compiled kernel does not depend on their values."""
    from attnplug_cuda.kernels import step_metadata as sm

    kernel = sm._step_metadata_kernel
    assert tuple(kernel.arg_names[: len(sm._PER_STEP)]) == sm._PER_STEP
    # a JITFunction keeps the list itself; the interpreter's stand-in keeps the decorator's kwargs
    declared = getattr(kernel, "do_not_specialize", None) or kernel.kwargs["do_not_specialize"]
    assert set(sm._PER_STEP) <= set(declared)
