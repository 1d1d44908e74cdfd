"""The ``hybrid_step`` benchmark's floor, PDL and FlashInfer parts, on a machine without a GPU:

* the FlashInfer peer's keys are the keys the backends attend: float32 attention over
  ``request_keys`` equals the reference backend's layer outputs (SWA and full layers);
* without FlashInfer the peer says "not installed" (one row, no error);
* the empty-kernel launch floor runs under the Triton interpreter and its graph replays;
* the whole benchmark plumbing (floors, PDL-off variant, peer, replay preparation), shrunk to
  CPU size, gives bit-identical outputs with PDL off and the expected rows.
"""

import importlib.util
import math

import pytest
import torch

from attnplug_cuda.kernels.interpret import use_interpreter

if not torch.cuda.is_available():
    use_interpreter()  # before triton is imported (tests/conftest.py also arranges this)
pytest.importorskip("triton")

from attnplug import ForwardMode  # noqa: E402
from attnplug.backends.reference import ReferenceBackend  # noqa: E402
from attnplug.bench import Ctx  # noqa: E402
from attnplug.bench.step_case import PeerUnavailable, StepShape, layer_outputs, run_step_benchmark  # noqa: E402
from attnplug.bench.world import build_world, make_step  # noqa: E402

ON_CPU = not torch.cuda.is_available()
HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None


def _world(max_bs=3, context=16, window=5):
    return build_world(
        num_layers=4,
        max_bs=max_bs,
        context=context,
        window=window,
        num_draft=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        dtype=torch.float32,
        device="cpu",
    )


def test_peer_keys_are_the_keys_the_backend_attends():
    from attnplug.bench.step_check import reference_attention
    from attnplug.bench.world import request_keys

    world = _world()
    bs = 3
    backend = ReferenceBackend(world.pool, world.rows, num_heads=4, sliding_window=5)
    outs = layer_outputs(backend, world, ForwardMode.DECODE, bs)
    q_all = make_step(backend, world, bs).tensors[0]  # the same seed: the q the step used
    seq_len = world.context - world.num_draft + 1
    full, swa = request_keys(world, bs, seq_len)
    assert full.shape == (bs, seq_len) and swa.shape == (bs, 5) and full.dtype == swa.dtype == torch.int32
    for layer in (0, 3):  # SWA, full
        slots = swa if world.pool.is_swa_layer(layer) else full
        k_cache, v_cache = world.pool.get_kv_buffer(layer)
        ref = reference_attention(q_all[layer, :bs], k_cache, v_cache, slots, 1 / math.sqrt(16))
        torch.testing.assert_close(ref, outs[layer].float(), rtol=1e-5, atol=1e-5)
    # a window one key short attends something else: the comparison above would notice
    k_cache, v_cache = world.pool.get_kv_buffer(0)
    short = reference_attention(q_all[0, :bs], k_cache, v_cache, swa[:, 1:], 1 / math.sqrt(16))
    assert (short - outs[0].float()).abs().max() > 1e-3


@pytest.mark.skipif(HAS_FLASHINFER, reason="checks the row given without flashinfer")
def test_flashinfer_peer_says_not_installed():
    from attnplug_cuda.bench.flashinfer_peer import measure

    with pytest.raises(PeerUnavailable, match="flashinfer not installed"):
        measure(Ctx(), _world(), ForwardMode.DECODE, 1)


@pytest.mark.skipif(not ON_CPU, reason="the interpreter path (the GPU runs the real floor)")
def test_empty_kernel_floor_runs_interpreted():
    from attnplug.bench import Timer
    from attnplug_cuda.bench.floor import EmptyKernelFloor, empty_kernel_launcher

    floor = EmptyKernelFloor(Timer("cpu"), calls=2, repeats=1)
    assert floor.empty_graph_us(3, False) > 0
    launch = empty_kernel_launcher(torch.device("cpu"), False)
    launch()
    assert torch.equal(launch.buf, torch.zeros(1, dtype=torch.int32))  # empty: writes nothing
    with pytest.raises(ValueError, match="launches >= 1"):
        floor.empty_graph_us(0, False)
    n, why = floor.count(lambda: None)
    assert n is None and "CUDA device" in why


@pytest.mark.skipif(not ON_CPU, reason="CPU plumbing check (the GPU runs the real benchmark)")
@pytest.mark.slow
def test_hybrid_step_plumbing_with_floors_pdl_and_peer():
    from attnplug_cuda.bench import hybrid_step
    from attnplug_cuda.bench.floor import EmptyKernelFloor

    shape = StepShape(
        num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16, context=16, window=5, num_draft=4, dtype=torch.float32
    )
    ctx = Ctx(device=torch.device("cpu"))
    variants = hybrid_step.variants()
    variants = {k: variants[k] for k in ("new", "new-no-pdl")}
    rows = run_step_benchmark(
        ctx,
        name="hybrid_step",
        shape=shape,
        variants=variants,
        baseline="before",
        modes=(ForwardMode.DECODE,),
        sizes=(1,),
        steps=lambda bs: 1,
        repeats=1,
        warmup=0,
        need_s=0,
        copy_bytes=1 << 16,
        time_targets=hybrid_step.TIME_TARGETS_US,
        launch_floor=EmptyKernelFloor(ctx.timer, calls=1, repeats=1),
        ratios=[hybrid_step.StepRatio("new-no-pdl", "new", target=hybrid_step.PDL_TARGET, identical=True)],
        peers=[hybrid_step.flashinfer_peer()],
        prep=hybrid_step.PrepCheck(variant="new", bs=1, target_us=1e9, iters=3),
    )
    assert not [r for r in rows if r.get("error")], [r.get("error") for r in rows if r.get("error")]
    new = [r for r in rows if r["metric"] == "time per step" and r.get("variant") == "new"]
    assert len(new) == 1 and new[0]["floor"] > 0 and new[0]["target"] == "<= 150 us"
    assert new[0]["launches"] is None and "CUDA device" in new[0]["launches_how"]
    ident = [r for r in rows if r["metric"] == "new-no-pdl vs new: outputs"]
    assert len(ident) == 1 and ident[0]["met"] is True
    assert [r["metric"] for r in rows if r["metric"].startswith("speedup (new-no-pdl")] == [
        "speedup (new-no-pdl / new)"
    ]
    assert [r for r in rows if r["metric"] == "host replay preparation"]
    if not HAS_FLASHINFER:
        peer = [r for r in rows if r["case"] == "peer: flashinfer"]
        assert len(peer) == 1 and "not installed" in peer[0]["notes"]
