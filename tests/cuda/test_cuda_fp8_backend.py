"""The cuda backend over FP8 KV pools (``float8_e4m3fn``, ``float8_e5m2``), its Triton kernels
under TRITON_INTERPRET=1 on the host (PDL off), and its op layer over FP8 caches an engine owns.

* End to end: every mode (EXTEND through the KV store, DECODE and verify / draft steps through
  ``store_attend``, or ``paged_attention`` storing the step with the one-launch path off, the
  C++ store asked for), eager and replayed through the graph runner, on SWA and full layers
  with per-head scales, equals the reference backend over the same FP8 pool: outputs within
  the model dtype's tolerance, the KV caches bit for bit.
* The worlds are the conformance harness's FP8 worlds (``WorldSpec.kv_cache_dtype``: per-head
  scales, part of the heads saturating on the inputs); the scales are read by address: set
  after graph capture, the replays use them.
* What is served where: both FP8 dtypes declared; ``float8_e4m3fn`` refused on ROCm and below
  compute capability 8.9, naming why; the C++ store never writes an FP8 pool.
* The planner keeps the paths and PDL schedules of a step for FP8, with its FP8 rules.
* The op layer (``CudaOps``) with one scale a layer (an engine's ``k_scale``) and per-head
  scales, over the K / V halves of an interleaved FP8 cache: the bytes and outputs of the
  portable op layer.
"""

import dataclasses
import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("needs the Triton interpreter (set by conftest without a GPU)", allow_module_level=True)
pytest.importorskip("triton")

from one_launch_cases import fp8_bytes_match, hard_values  # noqa: E402

from attnplug import ForwardMode  # noqa: E402
from attnplug.backend import BackendConfigError  # noqa: E402
from attnplug.backends.reference import ReferenceBackend  # noqa: E402
from attnplug.memory.fp8 import FP8_KV_DTYPES, quantize_kv  # noqa: E402
from attnplug.ops.base import OpsInputError  # noqa: E402
from attnplug.ops.portable import PortableOps  # noqa: E402
from attnplug_conformance.harness import World  # noqa: E402
from attnplug_cuda.backend import CudaBackend  # noqa: E402
from attnplug_cuda.device import CudaDevice  # noqa: E402
from attnplug_cuda.kernels.pdl import EARLY, PROLOGUE  # noqa: E402
from attnplug_cuda.planner import AttentionShape, LaunchShape, Path, plan_one_launch, plan_paged, plan_step  # noqa: E402
from attnplug_cuda.tuning import CudaTuning  # noqa: E402
from worlds import EVERY_MODE, kernel_spec  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = pytest.mark.parametrize("kv_dtype", FP8_KV_DTYPES, ids=["e4m3fn", "e5m2"])
#: one SWA layer (window 6) and one full layer, 4 q heads over 2 kv heads of 64
SPEC = kernel_spec(swa_layer_ids=(0,))
#: relative error of a step's outputs against the reference's, by model dtype
TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}


def drive(cls, kv_dtype, *, use_graphs, spec=SPEC, scales=None, modes=EVERY_MODE):
    """``(outputs per step, every KV buffer after)`` of three requests through ``modes`` on
    ``cls`` in a world over an FP8 pool of ``kv_dtype`` (the harness's per-head scales, part of
    the heads saturating), eagerly or replayed through a graph runner (buckets 2 and 4);
    ``scales``: per layer ``(k_scale, v_scale)`` set after the capture, before any store."""
    world = World(dataclasses.replace(spec, kv_cache_dtype=kv_dtype), cls, DEVICE, seed=5)
    reqs = [world.new_request() for _ in range(3)]
    runner = world.graph_runner(max_bs=4, num_draft_tokens=3, bucket_sizes=[2, 4]) if use_graphs else None
    for layer, (k_scale, v_scale) in enumerate(scales or ()):
        world.pool.set_kv_scales(layer, k_scale, v_scale)
    outs = []
    for name, lens in modes:
        mode = ForwardMode[name]
        step = world.plan(mode, reqs, lens, num_draft_tokens=3 if mode.is_speculative else None)
        out = runner.run(step.batch, step.inputs) if runner else world.run_eager(step)
        assert out.dtype == spec.dtype
        outs.append(out.clone())
        world.commit(step)
        for r in reqs:
            world.evict(r)
    caches = [t.clone() for layer in range(spec.num_layers) for t in world.pool.get_kv_buffer(layer)]
    return outs, caches


def assert_like_reference(got, want) -> None:
    outs, caches = got
    ref_outs, ref_caches = want
    for i, (a, b) in enumerate(zip(outs, ref_outs)):
        assert torch.isfinite(a).all(), f"step {i}: non-finite output"
        err = (a.double() - b.double()).norm() / b.double().norm()
        assert err < TOL[a.dtype], f"step {i}: relative error {err:.2e}"
    for i, (a, b) in enumerate(zip(caches, ref_caches)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"KV buffer {i} differs from the reference's"


def tuned(**changes):
    return lambda pool, rows, **kw: CudaBackend(pool, rows, tuning=dataclasses.replace(CudaTuning(), **changes), **kw)


def test_prefill_decode_verify_match_reference():
    """The quick one: a prefill (the KV store, then paged_attention), a decode step and a
    verify step (store_attend: the first block laid out before the wait; the draft's own keys
    in a block of their own), float8_e4m3fn."""
    modes = EVERY_MODE[:3]
    kv_dtype = torch.float8_e4m3fn
    got = drive(CudaBackend, kv_dtype, use_graphs=False, modes=modes)
    assert_like_reference(got, drive(ReferenceBackend, kv_dtype, use_graphs=False, modes=modes))


@pytest.mark.slow
@FP8
def test_every_mode_eager_matches_reference(kv_dtype):
    assert_like_reference(
        drive(CudaBackend, kv_dtype, use_graphs=False), drive(ReferenceBackend, kv_dtype, use_graphs=False)
    )


@pytest.mark.slow
@FP8
def test_every_mode_replayed_matches_reference_and_eager(kv_dtype):
    """Replays (padded buckets: other plans, the same stores) equal the reference, and write
    the bytes the eager steps write."""
    replayed = drive(CudaBackend, kv_dtype, use_graphs=True)
    assert_like_reference(replayed, drive(ReferenceBackend, kv_dtype, use_graphs=True))
    eager = drive(CudaBackend, kv_dtype, use_graphs=False)
    for a, b in zip(replayed[1], eager[1]):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), "replay wrote other bytes than eager steps"
    for i, (a, b) in enumerate(zip(replayed[0], eager[0])):
        err = (a.double() - b.double()).norm() / b.double().norm()
        assert err < TOL[a.dtype], f"step {i}: replay and eager differ by {err:.2e}"


@pytest.mark.slow
@pytest.mark.parametrize(
    "variant",
    ["paged-store", "cpp-store", "softcap-sinks", "bf16-crowded"],
)
def test_paths_match_reference(variant, monkeypatch):
    """The other store paths: paged_attention storing decode / draft steps (one launch off),
    the C++ store asked for (the Triton store runs: it quantises), soft cap and sinks over FP8,
    and a bfloat16 model whose decode groups outnumber the SMs (no first block laid out before
    the wait: the own key folded as a vector)."""
    spec, cls, kv_dtype = SPEC, CudaBackend, torch.float8_e4m3fn
    if variant == "paged-store":
        cls = tuned(one_launch=False)
    elif variant == "cpp-store":
        cls, kv_dtype = tuned(kv_store="cpp"), torch.float8_e5m2
    elif variant == "softcap-sinks":
        spec = dataclasses.replace(SPEC, logit_softcap=1.5, sinks=True)
    else:
        import attnplug_cuda.kernels.common as common

        monkeypatch.setattr(common, "num_sms", lambda device: 4)  # 6 groups on 4 SMs: crowded
        spec = dataclasses.replace(SPEC, dtype=torch.bfloat16)
        shape = AttentionShape(4, 2, 64, SPEC.max_context_len, SPEC.sliding_window, 4, kv_fp8=True)
        decode = plan_step(shape, 3, 3, 1, CudaTuning(), False)
        assert decode.path is Path.ONE_LAUNCH and not decode.full.kernel.OWN_BLOCK
    kw = dict(use_graphs=False, spec=spec)
    assert_like_reference(drive(cls, kv_dtype, **kw), drive(ReferenceBackend, kv_dtype, **kw))


@pytest.mark.slow
def test_scales_set_after_capture_are_the_ones_replayed():
    """The kernels read each layer's scales by address: scales set after the graphs were
    captured (before any store) are the ones the replays quantise and attend with."""
    kv_dtype = torch.float8_e4m3fn
    scales = [([0.01 * (layer + 1), 3.0], [0.05, 0.5 / (layer + 1)]) for layer in range(SPEC.num_layers)]
    got = drive(CudaBackend, kv_dtype, use_graphs=True, scales=scales)
    assert_like_reference(got, drive(ReferenceBackend, kv_dtype, use_graphs=False, scales=scales))


STORE_PATHS = {
    # name: (tuning changes, mode, requests, new tokens a request, the path the plan must take)
    "extend-kv-store": ({}, ForwardMode.EXTEND, 2, 12, Path.TWO_LAUNCH),
    "decode-store-attend": ({}, ForwardMode.DECODE, 6, 1, Path.ONE_LAUNCH),
    "verify-store-attend": ({}, ForwardMode.TARGET_VERIFY, 3, 3, Path.ONE_LAUNCH),
    "decode-paged-store": ({"one_launch": False}, ForwardMode.DECODE, 6, 1, Path.PAGED_STORE),
    "verify-paged-store": ({"one_launch": False}, ForwardMode.TARGET_VERIFY, 3, 3, Path.PAGED_STORE),
}


@FP8
@pytest.mark.parametrize("path", list(STORE_PATHS))
def test_every_store_path_writes_quantize_kv_bytes(kv_dtype, path):
    """One step's k / v made of the values a rounding rule gets wrong first (ties, subnormals,
    past the largest finite, +-inf, NaN; ``hard_values``), through each path that stores: the
    bytes at the step's slots (SWA layer: translated) are quantize_kv's, with per-head scales
    that keep the ties (1, 0.25) or round in the division (0.01, 3)."""
    changes, mode, n_reqs, q_len, want_path = STORE_PATHS[path]
    spec = dataclasses.replace(SPEC, kv_cache_dtype=kv_dtype, max_reqs=8)
    world = World(spec, tuned(**changes), DEVICE, seed=3)
    k_scale, v_scale = torch.tensor([1.0, 0.25]), torch.tensor([0.01, 3.0])
    for layer in range(spec.num_layers):
        world.pool.set_kv_scales(layer, k_scale, v_scale)
    reqs = [world.new_request() for _ in range(n_reqs)]
    num_draft = q_len if mode.is_speculative else None
    step = world.plan(mode, reqs, q_len if mode is ForwardMode.EXTEND else None, num_draft_tokens=num_draft)
    T, L, hkv, D = step.inputs["k"].shape
    values = hard_values(kv_dtype)
    values = torch.cat([values, values * 0.25, values * 0.01, values * 3.0])
    flat = torch.zeros(2 * T * L * hkv * D, dtype=torch.float64)
    flat[: min(values.numel(), flat.numel())] = values[: flat.numel()]
    k, v = (x.view(T, L, hkv, D).to(DEVICE, spec.dtype) for x in flat.chunk(2))
    step.inputs["k"], step.inputs["v"] = k, v
    world.run_eager(step)
    assert world.backend.forward_metadata.plan.path is want_path
    loc = step.batch.out_cache_loc.long()
    swa_loc = world.pool.translate_loc_from_full_to_swa(loc).long()
    for layer in range(L):
        slots = swa_loc if world.pool.is_swa_layer(layer) else loc
        k_cache, v_cache = world.pool.get_kv_buffer(layer)
        exact = DEVICE == "cpu"
        fp8_bytes_match(k_cache[slots], quantize_kv(k[:, layer].cpu(), k_scale, kv_dtype), exact=exact)
        fp8_bytes_match(v_cache[slots], quantize_kv(v[:, layer].cpu(), v_scale, kv_dtype), exact=exact)


def test_cpp_store_is_never_asked_to_write_fp8(monkeypatch):
    """An FP8 pool gets the Triton store whatever the tuning asks, without building the C++
    extension, and says why."""

    def no_build(*a, **k):
        raise AssertionError("the C++ store was considered for an FP8 pool")

    monkeypatch.setattr(CudaDevice, "kv_store_choice", no_build)
    world = World(dataclasses.replace(SPEC, kv_cache_dtype=torch.float8_e4m3fn), tuned(kv_store="cpp"), DEVICE)
    backend = world.backend
    assert backend.kv_store_impl == "triton" and backend.tuning.kv_store == "triton"
    assert "does not quantise" in backend.kv_store_reason


# ----------------------------------------------------------------------------- where it is served
def test_declared_fp8_dtypes():
    assert CudaBackend.declared_capabilities().fp8_kv_dtypes == FP8_KV_DTYPES
    assert "fp8_kv_dtypes" in CudaBackend.describe().get("capabilities", CudaBackend.describe())
    from attnplug_xpu.triton_backend import XpuTritonBackend

    assert XpuTritonBackend.declared_capabilities().fp8_kv_dtypes == FP8_KV_DTYPES


def test_rocm_serves_e5m2_only_and_says_why(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "6.2.0", raising=False)
    assert CudaBackend.declared_capabilities().fp8_kv_dtypes == (torch.float8_e5m2,)
    with pytest.raises(BackendConfigError, match="ROCm 6.2.0: float8_e4m3fn is the OCP format"):
        World(dataclasses.replace(SPEC, kv_cache_dtype=torch.float8_e4m3fn), CudaBackend, DEVICE)
    ops = CudaBackend.paged_ops(torch.device(DEVICE))
    assert ops.fp8_kv_dtypes == (torch.float8_e5m2,)
    rocm = CudaBackend.device_part.default_tuning()
    assert rocm.fp8_decode_registers is None and not rocm.fp8_ptx_convert  # NVIDIA options
    assert not rocm.settle_flash_products
    cache = torch.zeros(4, 2, 2, 16, dtype=torch.float8_e4m3fn, device=DEVICE)
    k = torch.zeros(1, 2, 16, dtype=torch.float16, device=DEVICE)
    one = torch.ones(1, device=DEVICE)
    with pytest.raises(OpsInputError, match="ROCm"):
        ops.store_kv(k, k, cache, cache.clone(), torch.tensor([5], device=DEVICE), k_scale=one, v_scale=one)


def test_e4m3fn_needs_compute_capability_8_9(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    why = CudaDevice().fp8_kv_problem(torch.float8_e4m3fn, torch.device("cuda", 0))
    assert why is not None and "compute capability 8.0" in why and ">= 8.9" in why
    assert CudaDevice().fp8_kv_problem(torch.float8_e5m2, torch.device("cuda", 0)) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert CudaDevice().fp8_kv_problem(torch.float8_e4m3fn, torch.device("cuda", 0)) is None


def test_fp8_pool_needs_a_declared_model_dtype():
    """Over an FP8 pool q, k and v are float16 or bfloat16 (the declared dtypes): float32 is
    refused before anything is stored."""
    spec = dataclasses.replace(SPEC, dtype=torch.float32, kv_cache_dtype=torch.float8_e5m2)
    world = World(spec, CudaBackend, DEVICE)
    reqs = [world.new_request()]
    step = world.plan(ForwardMode.EXTEND, reqs, [3])
    before = [t.clone() for t in world.pool.get_kv_buffer(0)]
    with pytest.raises(ValueError, match="must be one of the backend's dtypes"):
        world.run_eager(step)
    assert all(
        torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(before, world.pool.get_kv_buffer(0))
    )


# ----------------------------------------------------------------------------- the planner
SHAPE = AttentionShape(num_heads=32, num_kv_heads=8, head_dim=128, max_context_len=4096, window=256, num_sms=132)


@pytest.mark.parametrize("bs,q_len", [(1, 1), (4, 1), (16, 1), (4, 4), (64, 1), (8, 16)])
def test_fp8_steps_keep_their_paths_and_schedules(bs, q_len):
    """The path, and the PDL schedules of each layer, of a step over an FP8 cache are the
    16-bit ones: only tiles and splits may differ."""
    fp8 = dataclasses.replace(SHAPE, kv_fp8=True)
    for pdl in (False, True):
        a = plan_step(SHAPE, bs, bs * q_len, q_len, CudaTuning(), pdl)
        b = plan_step(fp8, bs, bs * q_len, q_len, CudaTuning(), pdl)
        assert a.path is b.path
        for is_swa in (False, True):
            la, lb = a.layer(is_swa), b.layer(is_swa)
            assert (la.first, la.later) == (lb.first, lb.later)
            assert type(la.kernel) is type(lb.kernel)
    assert plan_step(fp8, 1, 1, 1, CudaTuning(), True).full.first == EARLY


def test_fp8_decode_tiles_cap_their_registers_at_head_dim_128():
    """``paged_attention``'s decode tiles over an FP8 cache: at head dim 128 the 16-bit tiles'
    64 keys under ``fp8_decode_registers``, in three pipeline stages (the key table's read two
    blocks ahead); below 128 (or uncapped) twice the keys a block (the 16-bit tiles' bytes),
    uncapped, in the 16-bit tiles' stages; at 256 the 16-bit tiles. Its flash-attention tiles
    and every 16-bit tile are the same plans, uncapped."""
    t = CudaTuning()
    uncapped = dataclasses.replace(t, fp8_decode_registers=None)
    for d in (64, 128, 256):
        decode = LaunchShape(64, 64, 8, 4, d, 1, 1024, None, 132)
        fp8, bf16 = plan_paged(decode._replace(kv_fp8=True), t), plan_paged(decode, t)
        assert bf16.max_registers is None
        if d == 128:
            assert (fp8.BLOCK_N, fp8.max_registers) == (bf16.BLOCK_N, t.fp8_decode_registers)
            assert (fp8.num_stages, bf16.num_stages) == (3, 2)
        else:
            assert (fp8.BLOCK_N, fp8.max_registers) == ((2 if d < 128 else 1) * bf16.BLOCK_N, None)
            assert fp8.num_stages == bf16.num_stages
        wide = plan_paged(decode._replace(kv_fp8=True), uncapped)
        assert (wide.BLOCK_N, wide.max_registers) == ((2 if d <= 128 else 1) * bf16.BLOCK_N, None)
        assert wide.num_stages == bf16.num_stages
        extend = LaunchShape(1, 2048, 8, 4, d, 2048, 2048, None, 132)
        assert plan_paged(extend._replace(kv_fp8=True), t) == plan_paged(extend, t)
        assert plan_paged(extend, t).max_registers is None


def test_paged_decode_tiles_of_one_token_mask_no_position():
    """``paged_attention``'s decode tiles whose requests have one new token (``ONE_TOKEN``)
    mask no key by position, over any cache; drafts and extends do."""
    t = CudaTuning()
    for d in (64, 128, 256):
        decode = LaunchShape(64, 64, 8, 4, d, 1, 1024, None, 132)
        draft = decode._replace(num_tokens=256, max_q_len=4)
        extend = LaunchShape(1, 2048, 8, 4, d, 2048, 2048, None, 132)
        for shape in (decode, draft, extend):
            for kv_fp8 in (False, True):
                assert plan_paged(shape._replace(kv_fp8=kv_fp8), t).ONE_TOKEN == (shape.max_q_len == 1)


def test_fp8_register_cap_reaches_the_launch_and_is_an_nvidia_option(monkeypatch):
    """The planned cap is the launch's ``maxnreg`` (and no 16-bit launch has one); the NVIDIA
    default has it, XPU's none (ROCm's: ``test_rocm_serves_e5m2_only_and_says_why``); a cap
    out of [24, 255] is refused, naming the field."""
    from paged_cases import attend

    from attnplug_cuda.kernels import paged_attention as pa
    from attnplug_cuda.kernels.common import KVScales
    from attnplug_xpu.device import xpu_tuning

    seen = []
    real = pa._paged_attention_kernel

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append(kwargs.get("maxnreg"))
                return real[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(pa, "_paged_attention_kernel", Recorder())
    bs, hkv, d = 2, 2, 128
    ints = dict(device=DEVICE, dtype=torch.int32)
    for kv_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        fp8 = kv_dtype != torch.bfloat16
        q = torch.randn(bs, 2 * hkv, d, device=DEVICE, dtype=torch.bfloat16)
        k = torch.randn(17, hkv, d, device=DEVICE).to(kv_dtype)
        scales = KVScales.of(torch.ones(hkv, device=DEVICE), torch.ones(hkv, device=DEVICE)) if fp8 else None
        attend(q, k, k, torch.empty_like(q), cu_q_lens=torch.arange(bs + 1, **ints),
               seq_lens=torch.full((bs,), 8, **ints), table=torch.arange(1, 17, **ints).view(bs, 8),
               rows=torch.arange(bs, **ints), max_q_len=1, max_kv_len=8, kv_scales=scales)  # fmt: skip
    t = CudaTuning()
    assert seen == [None, t.fp8_decode_registers]
    assert CudaBackend.device_part.default_tuning().fp8_decode_registers == 128
    assert xpu_tuning().fp8_decode_registers is None
    for bad in (0, 16, 256, 1.5, True):
        with pytest.raises(ValueError, match="fp8_decode_registers"):
            CudaTuning(fp8_decode_registers=bad)


def test_fp8_split_keys_count_twice():
    """A split's key bound stands for the bytes it streams: FP8 keys (half the bytes) count
    ``fp8_split_keys_factor`` times; factor 1 gives the 16-bit splits back."""
    shape = LaunchShape(2, 2, 8, 4, 128, 1, 4096, None, 132)
    fp8 = shape._replace(kv_fp8=True)
    t = CudaTuning()
    assert plan_paged(fp8, t).NUM_SPLITS < plan_paged(shape, t).NUM_SPLITS
    one = dataclasses.replace(t, fp8_split_keys_factor=1)
    assert plan_paged(fp8, one).NUM_SPLITS == plan_paged(shape, one).NUM_SPLITS
    short = LaunchShape(1, 1, 8, 4, 128, 1, 600, None, 132)
    assert plan_one_launch(short._replace(kv_fp8=True), t).NUM_SPLITS < plan_one_launch(short, t).NUM_SPLITS
    assert plan_one_launch(short._replace(kv_fp8=True), one).NUM_SPLITS == plan_one_launch(short, one).NUM_SPLITS


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("bs,max_kv_len,window", [(1, 300, 256), (1, 900, None), (24, 4096, None), (200, 4096, None)])
def test_fp8_store_attend_blocks_fit_the_registers(head_dim, bs, max_kv_len, window):
    """``store_attend``'s FP8 key blocks of a draft step hold at most ``fp8_block_elems``
    elements a 4-warp program and twice that an 8-warp one (what compiles for sm_90 without
    spilling); a decode step's keep the 16-bit plan whole (its trips are the step's chain)."""
    t = CudaTuning()
    draft = LaunchShape(bs, 4 * bs, 1, 4, head_dim, 4, max_kv_len, window, 132)
    plan16, plan8 = plan_one_launch(draft, t), plan_one_launch(draft._replace(kv_fp8=True), t)
    per_warp = plan8.BLOCK_N * head_dim // plan8.num_warps
    assert per_warp <= t.fp8_block_elems // 4 or plan8.BLOCK_N == 16
    assert plan8.ROWS == plan16.ROWS and plan8.OWN_BLOCK == plan16.OWN_BLOCK
    decode = draft._replace(num_tokens=bs, max_q_len=1)
    # with FP8 keys counted as 16-bit ones in the split bounds, the very plan of a 16-bit cache
    # (but for its tiles' conversion)
    one = dataclasses.replace(t, fp8_split_keys_factor=1)
    assert plan_one_launch(decode._replace(kv_fp8=True), one)._replace(FP8_PTX=False) == plan_one_launch(decode, one)


def test_fp8_store_attend_tiles_convert_by_ptx_but_a_large_first_block_laid_out_before_the_wait():
    """``store_attend`` over an FP8 cache converts its K/V tiles by PTX into float16 products
    (``OneLaunchPlan.FP8_PTX``), decode and drafts, but where a decode step lays out a first
    block of 128 x 128 before the wait (compiled for sm_90 by Triton 3.9 that spills) or a
    tile holds fewer than four elements a thread; never over 16-bit caches or where the tuning
    turns it off (XPU's and ROCm's defaults)."""
    from attnplug_xpu.device import xpu_tuning

    t = CudaTuning()
    off = dataclasses.replace(t, fp8_ptx_convert=False)
    seen = set()
    for bs in (1, 8, 32, 200):
        for max_q_len in (1, 4):
            for d in (64, 128, 256):
                shape = LaunchShape(bs, bs * max_q_len, 8, 4, d, max_q_len, 1024, None, 132)
                assert not plan_one_launch(shape, t).FP8_PTX
                assert not plan_one_launch(shape._replace(kv_fp8=True), off).FP8_PTX
                plan = plan_one_launch(shape._replace(kv_fp8=True), t)
                large_first = plan.OWN_BLOCK and plan.BLOCK_N * d >= 128 * 128
                assert plan.FP8_PTX == (not large_first), (bs, max_q_len, d, plan)
                seen.add(plan.FP8_PTX)
    assert seen == {True, False}
    assert t.fp8_ptx_convert and CudaBackend.device_part.default_tuning().fp8_ptx_convert
    assert not xpu_tuning().fp8_ptx_convert
    # a tile of fewer than four elements a thread (the PTX's unit) keeps Triton's cast
    tiny = LaunchShape(1, 1, 8, 4, 16, 1, 1024, None, 132, True)
    assert plan_one_launch(tiny, t).FP8_PTX
    assert not plan_one_launch(tiny, dataclasses.replace(t, max_block_n=16)).FP8_PTX


def test_tuning_checks_its_fp8_fields():
    with pytest.raises(ValueError, match="fp8_block_elems must be a power of two"):
        CudaTuning(fp8_block_elems=6000)
    with pytest.raises(ValueError, match="fp8_split_keys_factor must be an int >= 1"):
        CudaTuning(fp8_split_keys_factor=0)


def test_prologue_schedules_stay_for_fp8():
    fp8 = dataclasses.replace(SHAPE, kv_fp8=True)
    plan = plan_step(fp8, 4, 4, 1, CudaTuning(), True)
    assert plan.path is Path.ONE_LAUNCH and plan.full.first == EARLY and plan.full.later.wait == PROLOGUE.wait


# ----------------------------------------------------------------------------- the op layer
@FP8
@pytest.mark.parametrize("per_head", [False, True], ids=["one-scale", "per-head"])
def test_ops_match_the_portable_ops(kv_dtype, per_head):
    """``store_kv`` writes the portable op layer's bytes into the K / V halves of an
    interleaved FP8 cache (-1 padding skipped); ``attend`` over it (a window on the second
    call) matches the portable one, which dequantises in float32."""
    device = torch.device(DEVICE)
    cuda, portable = CudaBackend.paged_ops(device), PortableOps(device)
    g = torch.Generator().manual_seed(4)
    P, hkv, D, H = 4, 2, 32, 4
    if per_head:
        k_scale, v_scale = torch.tensor([0.02, 2.0], device=device), torch.tensor([0.3, 0.05], device=device)
    else:  # an engine's one scale a layer
        k_scale, v_scale = torch.tensor([0.04], device=device), torch.tensor([0.2], device=device)
    caches = []
    table = torch.tensor([[3, 1, 5, 0], [2, 0, 0, 0]], dtype=torch.int32, device=device)
    seq = [11, 3]
    slots = torch.tensor([3 * P + o for o in range(4)] + [1 * P + o for o in range(4)] + [5 * P + o for o in range(3)])
    slots = torch.cat([slots, 2 * P + torch.arange(3), torch.tensor([-1, -1])]).to(device)
    k = (torch.randn(16, hkv, D, generator=g) * 3).to(device, torch.bfloat16)
    v = torch.randn(16, hkv, D, generator=g).to(device, torch.bfloat16)
    for ops in (cuda, portable):
        inter = torch.zeros(6, P, hkv, 2 * D, dtype=kv_dtype, device=device)
        ops.store_kv(k, v, inter[..., :D], inter[..., D:], slots, k_scale=k_scale, v_scale=v_scale)
        caches.append(inter)
    assert torch.equal(caches[0].view(torch.uint8), caches[1].view(torch.uint8))
    inter = caches[0]
    qsl = torch.tensor([0, 2, 5], dtype=torch.int32, device=device)
    q = torch.randn(5, H, D, generator=g).to(device, torch.bfloat16)
    for window in (None, 4):
        outs = []
        for ops in (cuda, portable):
            step = ops.plan(
                qsl, torch.tensor(seq, device=device), table, P, num_tokens=5, max_query_len=3, max_seq_len=11
            )
            outs.append(
                ops.attend(
                    q, inter[..., :D], inter[..., D:], step, scale=0.2, window=window, k_scale=k_scale, v_scale=v_scale
                )
            )
        assert outs[0].dtype == torch.bfloat16
        err = (outs[0].double() - outs[1].double()).norm() / outs[1].double().norm()
        assert err < 2e-2, f"window {window}: relative error {err:.2e}"


def test_ops_refuse_missing_or_bad_scales():
    ops = CudaBackend.paged_ops(torch.device(DEVICE))
    cache = torch.zeros(4, 2, 2, 16, dtype=torch.float8_e4m3fn, device=DEVICE)
    k = torch.zeros(1, 2, 16, dtype=torch.float16, device=DEVICE)
    loc = torch.tensor([5], device=DEVICE)
    with pytest.raises(OpsInputError, match="k_scale: an FP8 cache"):
        ops.store_kv(k, k, cache, cache.clone(), loc)
    with pytest.raises(OpsInputError, match="must be float32 with 1 or 2"):
        ops.store_kv(k, k, cache, cache.clone(), loc, k_scale=torch.ones(3, device=DEVICE), v_scale=torch.ones(1))
    assert int(cache.view(torch.uint8).count_nonzero()) == 0
