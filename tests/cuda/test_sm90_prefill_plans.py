"""Which launches ``paged_prefill_sm90``'s Hopper tiles serve (``PagedPlan.WGMMA``), decided by
the planner from ``LaunchShape.wgmma`` (the device part's ``wgmma_support``, the pool's dtype,
the tuning's ``sm90_prefill``); their compile for sm_90 is ``sm90_compile.py``'s."""

import dataclasses
import functools

import pytest
import torch

from attnplug_cuda.planner import AttentionShape, LaunchShape, plan_paged, plan_step
from attnplug_cuda.triton_part import TritonDevicePart
from attnplug_cuda.tuning import CudaTuning

TUNING = CudaTuning()
#: a 16,384-token prompt of the prefill bench: 32 q / 8 kv heads at head dim 128, an H100
PROMPT = dict(num_reqs=1, num_tokens=16384, num_kv_heads=8, group=4, head_dim=128, max_q_len=16384,
              max_kv_len=16384, window=None, num_sms=132)  # fmt: skip


def plan(**changes):
    return plan_paged(LaunchShape(**{**PROMPT, "wgmma": True, **changes}), TUNING)


def test_long_prompts_run_the_wgmma_tiles_where_the_launch_may():
    p = plan()
    assert p.WGMMA and (p.BLOCK_M, p.BLOCK_N, p.NUM_SPLITS, p.num_warps) == (128, 128, 1, 8)
    assert p.num_stages == TUNING.sm90_prefill_stages
    assert plan(window=512).WGMMA  # an SWA layer's prefill too (windows are the tiles' masks)
    assert not plan(wgmma=False).WGMMA  # not a Hopper GPU, a float32 q, or the tuning's switch off


@pytest.mark.parametrize(
    "changes",
    [
        dict(head_dim=64),  # the tiles are head dim 128's
        dict(head_dim=256),
        dict(kv_fp8=True),  # an FP8 cache: converted in registers by paged_attention's tiles
        dict(num_tokens=1, max_q_len=1),  # decode: 16-row tiles
        dict(num_tokens=16, max_q_len=16),  # 64 rows: 64-row tiles
        # a short extend over a long prefix: its programs do not cover the SMs, so its keys split
        dict(num_tokens=200, max_q_len=200, max_kv_len=4096),
    ],
)
def test_other_launches_keep_paged_attention_tiles(changes):
    p = plan(**changes)
    assert not p.WGMMA
    assert p == plan_paged(LaunchShape(**{**PROMPT, **changes}), TUNING)  # as without the flag


def test_the_step_planner_passes_the_backend_shape_on():
    shape = AttentionShape(32, 8, 128, 16384, 1024, 132, wgmma=True)
    step = plan_step(shape, 1, 8192, 8192, TUNING, True)
    assert step.full.kernel.WGMMA and step.swa.kernel.WGMMA
    off = plan_step(dataclasses.replace(shape, wgmma=False), 1, 8192, 8192, TUNING, True)
    assert not off.full.kernel.WGMMA and not off.swa.kernel.WGMMA


def test_the_stages_are_two_or_three():
    assert dataclasses.replace(TUNING, sm90_prefill_stages=3).sm90_prefill_stages == 3
    for bad in (1, 4):
        with pytest.raises(ValueError, match="sm90_prefill_stages"):
            dataclasses.replace(TUNING, sm90_prefill_stages=bad)
    with pytest.raises(ValueError, match="sm90_prefill must be a bool"):
        dataclasses.replace(TUNING, sm90_prefill=1)


def test_only_a_cuda_device_of_compute_capability_9_0_has_the_tiles():
    from attnplug_cuda.device import CudaDevice

    assert not TritonDevicePart().wgmma_support(torch.device("cpu"))[0]
    ok, reason = CudaDevice().wgmma_support(torch.device("cpu"))
    assert not ok and "not a CUDA GPU" in reason
    if torch.cuda.is_available():
        ok, reason = CudaDevice().wgmma_support(torch.device("cuda"))
        assert ok == (torch.cuda.get_device_capability() == (9, 0)), reason


def _world(dtype, **backend_kw):
    from attnplug_conformance.harness import World, WorldSpec
    from attnplug_cuda.backend import CudaBackend

    spec = WorldSpec(num_layers=1, swa_layer_ids=(), num_heads=8, num_kv_heads=2, head_dim=128, size=256,
                     size_swa=256, max_reqs=2, max_context_len=128, dtype=dtype)  # fmt: skip
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return World(spec, functools.partial(CudaBackend, **backend_kw), device, seed=0)


def test_the_backend_plans_them_where_the_device_part_allows(monkeypatch):
    """On the host the device part says no (the interpreter runs what is planned); where it
    says yes, a float16 / bfloat16 pool's shape takes them, a float32 one and a tuning with
    ``sm90_prefill=False`` do not."""
    from attnplug_cuda.backend import CudaBackend

    on = dataclasses.replace(CudaTuning(), sm90_prefill=True)
    hopper = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
    assert _world(torch.bfloat16, tuning=on).backend.shape.wgmma == hopper
    monkeypatch.setattr(CudaBackend.device_part, "wgmma_support", lambda device: (True, "stand-in"))
    assert _world(torch.bfloat16, tuning=on).backend.shape.wgmma
    assert _world(torch.float16, tuning=on).backend.shape.wgmma
    assert not _world(torch.float32, tuning=on).backend.shape.wgmma
    off = dataclasses.replace(CudaTuning(), sm90_prefill=False)
    assert not _world(torch.bfloat16, tuning=off).backend.shape.wgmma


def _prompt_args(dtype=torch.bfloat16, head_dim=128):
    from attnplug_cuda.kernels.common import AttentionInputs, KeyTable

    q = torch.zeros(256, 8, head_dim, dtype=dtype)
    cache = torch.zeros(300, 2, head_dim, dtype=dtype)
    cu = torch.tensor([0, 256], dtype=torch.int32)
    keys = KeyTable.of(torch.zeros(1, 256, dtype=torch.int32), torch.zeros(1, dtype=torch.int32))
    return q, cache, cache.clone(), torch.empty_like(q), AttentionInputs(cu, torch.tensor([256]), keys, 256)


WGMMA_PLAN = dict(BLOCK_M=128, BLOCK_N=128, NUM_SPLITS=1, PHASES=True, PREFETCH=0, num_warps=8, num_stages=2,
                  WGMMA=True)  # fmt: skip


@pytest.mark.parametrize(
    "args,plan,match",
    [
        (dict(dtype=torch.float32), {}, "float16 / bfloat16"),
        (dict(head_dim=64), {}, "head dims"),
        ({}, dict(NUM_SPLITS=2), "not a plan of these tiles"),
        ({}, dict(BLOCK_M=64), "not a plan of these tiles"),
    ],
)
def test_the_launcher_refuses_what_its_tiles_do_not_serve(args, plan, match):
    """Named errors before any launch (the plan is the planner's; these never come from it)."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    from attnplug_cuda.kernels.paged_prefill_sm90 import paged_prefill_sm90
    from attnplug_cuda.planner import PagedPlan

    with pytest.raises(AssertionError, match=match):
        paged_prefill_sm90(*_prompt_args(**args), PagedPlan(**{**WGMMA_PLAN, **plan}))


def test_paged_attention_hands_a_wgmma_plan_to_them_and_never_with_rows_to_store():
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    from attnplug_cuda.kernels.common import NewRows
    from attnplug_cuda.kernels.paged_attention import paged_attention
    from attnplug_cuda.planner import PagedPlan

    q, kc, vc, out, inputs = _prompt_args(dtype=torch.float32)
    with pytest.raises(AssertionError, match="float16 / bfloat16"):  # the Hopper launcher's own check
        paged_attention(q, kc, vc, out, inputs, PagedPlan(**WGMMA_PLAN))
    new = NewRows.of(torch.zeros(256, 2, 128), torch.zeros(256, 2, 128), torch.zeros(256, dtype=torch.int32))
    with pytest.raises(AssertionError, match="store no rows"):
        paged_attention(q, kc, vc, out, inputs, PagedPlan(**WGMMA_PLAN), new=new)


def test_the_prefill_bench_times_the_other_tiles_only_where_both_run():
    """``attnplug bench --only prefill``'s peer with ``sm90_prefill`` flipped: named after what it
    runs; unavailable (a row saying why) off a compute capability 9.0 GPU."""
    from attnplug.bench import Ctx
    from attnplug.bench.prefill import PrefillCase, build_prefill_world
    from attnplug.bench.step_spec import PeerUnavailable
    from attnplug_cuda.bench.prefill import tiles_peer

    peer = tiles_peer(rep_ms=1.0)
    assert peer.name == f"cuda sm90_prefill={'off' if CudaTuning().sm90_prefill else 'on'}"
    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        pytest.skip("a Hopper GPU runs both: the GPU bench times them")
    world = build_prefill_world(
        PrefillCase(128, (40,), 16), num_heads=8, num_kv_heads=2, dtype=torch.bfloat16, device=torch.device("cpu")
    )
    with pytest.raises(PeerUnavailable, match="one tile family here"):
        peer.measure(Ctx(), world)
