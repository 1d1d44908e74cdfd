"""Captured EXTEND steps on the cuda backend: the tile map ``step_metadata`` writes (every
request's row blocks, its last first, the tail marked as no work), the planner's tile-map
plans (a KV store launch, then unsplit ``paged_attention``), and EXTEND steps replayed in
token-count buckets through CUDA graphs (on the host: graphs that replay the captured launches
over the captured tensors, tests/fake_graph_device.py) equal the eager steps and dense attention, prefix, windows and
padding included; the KV they write equals the eager step's."""

import pytest
import torch

from attnplug_cuda.kernels.interpret import use_interpreter

if not torch.cuda.is_available():
    use_interpreter()  # before triton is imported (tests/conftest.py also arranges this)
pytest.importorskip("triton")

from attnplug import ForwardMode  # noqa: E402
from attnplug_conformance.harness import World  # noqa: E402
from attnplug_cuda.backend import CudaBackend  # noqa: E402
from attnplug_cuda.kernels.step_metadata import step_metadata  # noqa: E402
from attnplug_cuda.planner import AttentionShape, Path, plan_step  # noqa: E402
from attnplug_cuda.tuning import CudaTuning  # noqa: E402
from fake_graph_device import use_tape_graphs  # noqa: E402
from oracle import assert_close_rel, dense_attention  # noqa: E402
from worlds import kernel_spec  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def expected_tiles(ext, group, rows, count):
    tiles = []
    for b, e in enumerate(ext):
        n = -(-e * group // rows)
        tiles += [[b, n - 1 - j] for j in range(n)]
    return tiles + [[len(ext) - 1, count]] * (count - len(tiles))


@pytest.mark.parametrize("ext,group,rows", [([5, 0, 17, 1, 0], 4, 16), ([40], 1, 16), ([3, 3, 0, 9], 8, 128)])
def test_step_metadata_writes_the_tile_map(ext, group, rows):
    bs, T = len(ext), sum(ext) + 3  # 3 tokens of padding: no request's
    ext_t = torch.tensor(ext, dtype=torch.int64, device=DEVICE)
    count = -(-T * group // rows) + bs
    tiles = torch.full((count, 2), -7, dtype=torch.int32, device=DEVICE)
    i32 = dict(dtype=torch.int32, device=DEVICE)
    cu = torch.empty(bs + 1, **i32)
    step_metadata(
        torch.arange(bs, device=DEVICE),
        ext_t + 2,
        ext_t,
        torch.zeros(T, dtype=torch.int64, device=DEVICE),
        cu_q_lens=cu,
        window_start=torch.empty(bs, **i32),
        token_pos=torch.zeros(T, **i32),
        tiles=tiles,
        tile_rows=rows,
        group=group,
    )
    assert tiles.cpu().tolist() == expected_tiles(ext, group, rows, count)
    assert cu.cpu().tolist() == [0, *torch.tensor(ext).cumsum(0).tolist()]


def test_lengths_past_the_bucket_write_nothing_past_the_tile_map():
    """Device lengths that disagree with the bucket (a malformed batch the host cannot see)
    never make the metadata launch write past its tile map."""
    ext = torch.tensor([40, 40], dtype=torch.int64, device=DEVICE)  # 80 tokens in a map for 8
    T, group, rows = 8, 4, 16
    count = -(-T * group // rows) + 2
    whole = torch.full((count + 16, 2), -7, dtype=torch.int32, device=DEVICE)
    i32 = dict(dtype=torch.int32, device=DEVICE)
    step_metadata(
        torch.arange(2, device=DEVICE),
        ext,
        ext,
        torch.zeros(T, dtype=torch.int64, device=DEVICE),
        cu_q_lens=torch.empty(3, **i32),
        window_start=torch.empty(2, **i32),
        token_pos=torch.zeros(100, **i32),
        tiles=whole[:count],
        tile_rows=rows,
        group=group,
    )
    assert (whole[count:] == -7).all()


def test_tile_map_plans_are_two_launches_unsplit():
    shape = AttentionShape(32, 8, 128, 4096, 512, 132)
    for tokens in (16, 256, 8192):
        plan = plan_step(shape, 8, tokens, tokens, CudaTuning(), True, tile_map=True)
        assert plan.path is Path.TWO_LAUNCH
        assert plan.full.kernel.NUM_SPLITS == plan.swa.kernel.NUM_SPLITS == 1
        assert plan.full.kernel.BLOCK_M == plan.swa.kernel.BLOCK_M  # one tile map serves both kinds
    assert plan_step(shape, 1, 16, 16, CudaTuning(), True).full.kernel.NUM_SPLITS > 1  # the grid plan splits


@pytest.mark.parametrize("window", [6, None], ids=["hybrid", "full"])
def test_extend_graphs_replay_equal_eager_and_dense(window):
    spec = kernel_spec(sliding_window=window) if window else kernel_spec(swa_layer_ids=())
    world = World(spec, CudaBackend, DEVICE, seed=5)
    reqs = [world.new_request() for _ in range(4)]
    first = world.plan(ForwardMode.EXTEND, reqs, [3, 9, 5, 2])
    world.run_eager(first)
    world.commit(first)
    if DEVICE.type == "cpu":  # the host: graphs that replay the tape of the interpreter's launches
        use_tape_graphs(world.backend)
    runner = world.graph_runner(max_bs=4, bucket_sizes=[4], modes=[ForwardMode.EXTEND], extend_tokens=[8, 24])
    for lens in ([1, 6, 1], [8, 2, 11, 3], [4], [2, 2, 2, 2]):
        step = world.plan(ForwardMode.EXTEND, reqs[: len(lens)], lens)
        assert runner.bucket_for(step.batch) == (8 if sum(lens) <= 8 else 24)
        before = world.snapshot_kv()
        replayed = runner.run(step.batch, step.inputs).clone()
        after = world.snapshot_kv()
        world.restore_kv(before)
        eager = world.run_eager(step)
        assert_close_rel(replayed.double().cpu(), eager.double().cpu(), 2e-3, f"EXTEND {lens}: replay vs eager")
        for (kr, vr), (ke, ve) in zip(after, world.snapshot_kv()):
            assert torch.equal(kr[1:], ke[1:]) and torch.equal(vr[1:], ve[1:]), "KV differs (slot 0 excepted)"
        world.commit(step)
        for layer in range(spec.num_layers):
            w = spec.sliding_window if world.pool.is_swa_layer(layer) else None
            assert_close_rel(replayed[:, layer].double().cpu(), dense_attention(step, layer, window=w), 2e-3)
