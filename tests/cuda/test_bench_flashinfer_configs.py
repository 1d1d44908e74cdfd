"""The FlashInfer peers' host-side parts (``attnplug_cuda.bench.flashinfer_peer`` /
``flashinfer_prefill``) and the cuda suite's FP8 and prefill benchmarks, on a machine without a
GPU or FlashInfer:

* the configurations searched, and the choice of the best (fastest of those that computed the
  right attention, ties to the first);
* the paged copies a configuration reads hold exactly the keys the backends attend, in every
  page size and layout;
* the per-layer scales given to FlashInfer are the pool's;
* without FlashInfer both peers say "not installed";
* ``hybrid_step``'s FP8 variant and ``prefill``'s cases through the cuda backend, shrunk to CPU
  size under the Triton interpreter (slow).
"""

import importlib.util

import pytest
import torch

from attnplug_cuda.kernels.interpret import use_interpreter

if not torch.cuda.is_available():
    use_interpreter()  # before triton is imported (tests/conftest.py also arranges this)
pytest.importorskip("triton")

from attnplug import ForwardMode  # noqa: E402
from attnplug.bench import Ctx  # noqa: E402
from attnplug.bench.prefill import PrefillCase, build_prefill_world, run_prefill_benchmark  # noqa: E402
from attnplug.bench.step_case import PeerUnavailable, StepShape, run_step_benchmark  # noqa: E402
from attnplug.bench.world import bench_kv_scales, build_world, request_keys  # noqa: E402
from attnplug_cuda.bench.flashinfer_peer import (  # noqa: E402
    CONFIGS,
    ConfigResult,
    DecodeConfig,
    best_config,
    layer_scales,
    paged_cache,
)

ON_CPU = not torch.cuda.is_available()
HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None
FP8 = torch.float8_e4m3fn
WORLD = dict(num_layers=4, max_bs=3, context=40, window=20, num_draft=4, num_heads=4, num_kv_heads=2, head_dim=16)


def test_every_configuration_is_searched_once():
    assert len(CONFIGS) == len(set(CONFIGS)) == 16
    assert {(c.page_size, c.layout, c.tensor_cores, c.graph_wrapper) for c in CONFIGS} == {
        (p, lay, tc, g) for p in (1, 16) for lay in ("NHD", "HND") for tc in (True, False) for g in (True, False)
    }
    assert CONFIGS[0] == DecodeConfig(1, "NHD", True, True)  # what the bench measured before the search
    assert DecodeConfig(16, "HND", True, False).describe() == "page 16 HND, tensor cores, plain wrapper"
    assert DecodeConfig(1, "NHD", False, True).to_json() == {
        "page_size": 1,
        "layout": "NHD",
        "tensor_cores": False,
        "use_cuda_graph": True,
    }


def test_the_best_configuration_is_the_fastest_correct_one():
    a, b, c, d = CONFIGS[:4]
    results = {
        a: ConfigResult(us=500.0, diff=1e-3),
        b: ConfigResult(us=300.0, diff=0.5),  # fastest, but wrong: never the best
        c: ConfigResult(error="RuntimeError: no kernel"),
        d: ConfigResult(us=450.0, diff=2e-3),
    }
    assert best_config(results) == (d, results[d])
    tie = {a: ConfigResult(us=450.0, diff=0.0), d: ConfigResult(us=450.0, diff=0.0)}
    assert best_config(tie)[0] == a and best_config({d: tie[d], a: tie[a]})[0] == d  # ties: the first listed
    assert best_config({b: results[b], c: results[c]}) is None
    assert best_config({b: results[b]}, tolerance=1.0) == (b, results[b])


def _unpage(paged, table, layout, n):
    """The keys a paged cache holds for each request, read page by page: ``[bs, n, Hkv, D]``."""
    indptr, indices, last = (t.tolist() for t in table)
    out = []
    for b in range(len(last)):
        keys = []
        pages = indices[indptr[b] : indptr[b + 1]]
        for i, page in enumerate(pages):
            block = paged[page] if layout == "NHD" else paged[page].transpose(0, 1)  # [P, Hkv, D]
            keys.append(block[: last[b] if i == len(pages) - 1 else block.shape[0]])
        out.append(torch.cat(keys))
    assert all(k.shape[0] == n for k in out)
    return torch.stack(out)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_paged_caches_hold_the_keys_the_backends_attend(page_size, layout):
    world = build_world(**WORLD, dtype=torch.bfloat16)
    full, swa = request_keys(world, 3, 37)
    for layer, slots in ((0, swa), (3, full)):
        cache = world.pool.get_kv_buffer(layer)[0]
        paged, table = paged_cache(cache, slots, page_size, layout)
        assert all(t.dtype == torch.int32 for t in table)
        assert torch.equal(_unpage(paged, table, layout, slots.shape[1]), cache[slots.long()])
        if page_size == 1:  # attnplug's own cache, not a copy
            assert paged.data_ptr() == cache.data_ptr() and paged.shape[1 if layout == "NHD" else 2] == 1
        else:
            expected = (
                (3 * -(-slots.shape[1] // 16), 16, 2, 16)
                if layout == "NHD"
                else (3 * -(-slots.shape[1] // 16), 2, 16, 16)
            )
            assert paged.shape == expected and paged.is_contiguous()
    with pytest.raises(ValueError, match="layout"):
        paged_cache(cache, full, 16, "NDH")


def test_flashinfer_gets_the_pools_scales_one_a_layer():
    scales = bench_kv_scales(4)
    twin = build_world(**WORLD, dtype=torch.bfloat16, kv_cache_dtype=FP8, kv_scales=scales)
    assert layer_scales(twin) == [scales[layer] for layer in range(4)]
    assert layer_scales(build_world(**WORLD, dtype=torch.bfloat16)) is None
    twin.pool.set_kv_scales(2, [0.5, 0.25], 1.0)
    with pytest.raises(ValueError, match="layer 2: per-head scales"):
        layer_scales(twin)


@pytest.mark.skipif(HAS_FLASHINFER, reason="checks what the peers say without flashinfer")
def test_both_peers_say_flashinfer_is_not_installed():
    from attnplug_cuda.bench import flashinfer_peer, flashinfer_prefill

    twin = build_world(**WORLD, dtype=torch.bfloat16, kv_cache_dtype=FP8, kv_scales=bench_kv_scales(4))
    for world in (build_world(**WORLD, dtype=torch.bfloat16), twin):
        with pytest.raises(PeerUnavailable, match="flashinfer not installed"):
            flashinfer_peer.measure(Ctx(), world, ForwardMode.DECODE, 1)
    world = build_prefill_world(
        PrefillCase(16, (8,), 4), num_heads=4, num_kv_heads=2, dtype=torch.bfloat16, device="cpu"
    )
    with pytest.raises(PeerUnavailable, match="flashinfer not installed"):
        flashinfer_prefill.peer([16]).measure(Ctx(), world)


def test_the_prefill_benchmark_cases_and_targets():
    from attnplug_cuda.bench import prefill

    full = prefill.cases(quick=False)
    assert len(full) == 2 * 6 * 2 and full[0] == PrefillCase(128, (16384,), 1)
    assert {c.head_dim for c in full} == {128, 256} and {c.page_size for c in full} == {1, 16}
    assert {c.q_lens for c in full} == {(16384,), (8192,), (4096,), (2048,), (1024,), (1024,) * 8}
    held = [c for c in full if prefill.tflops_target(c)]
    assert sorted({(c.head_dim, c.q_lens) for c in held}) == [(128, (8192,)), (128, (16384,))]
    assert all(c.head_dim == 128 for c in prefill.cases(quick=True))
    assert "616" in prefill.ANCHORS and "370" in prefill.ANCHORS and "not measured" in prefill.ANCHORS


@pytest.mark.skipif(not ON_CPU, reason="CPU plumbing check (the GPU runs the real benchmark)")
@pytest.mark.slow
def test_prefill_through_the_cuda_backend_interpreted():
    """The EXTEND path of the cuda backend over a one-layer pool, both page sizes, checked
    against float32 attention; the FlashInfer peer's row says whether it ran."""
    from attnplug_cuda.backend import CudaBackend
    from attnplug_cuda.bench import flashinfer_prefill

    ctx = Ctx(device=torch.device("cpu"))
    rows = run_prefill_benchmark(
        ctx,
        name="prefill",
        make=CudaBackend,
        cases=[PrefillCase(64, (40,), 16), PrefillCase(64, (24, 17), 1)],
        num_heads=4,
        num_kv_heads=2,
        dtype=torch.bfloat16,
        peers=[flashinfer_prefill.peer([64])],
        iters=1,
        need_s=0,
    )
    assert not [r for r in rows if r.get("error")], [r["error"] for r in rows if r.get("error")]
    checks = [r for r in rows if r["metric"] == "max |out diff|" and " cuda " in r["case"]]
    assert len(checks) == 2 and all(r["met"] for r in checks), checks
    if not HAS_FLASHINFER:
        assert [r["case"] for r in rows if "not installed" in (r.get("notes") or "")] == ["peer: flashinfer"]


@pytest.mark.skipif(not ON_CPU, reason="CPU plumbing check (the GPU runs the real benchmark)")
@pytest.mark.slow
def test_hybrid_step_fp8_variant_and_peer_interpreted():
    """``new`` and ``new-fp8`` of ``hybrid_step`` (interpreted, CPU size) with the FP8 ratio and
    the FlashInfer FP8 peer: where the cuda backend serves float8_e4m3fn its FP8 step is checked
    against float32 attention over the dequantised cache; where not, one row says why."""
    from attnplug_cuda.backend import CudaBackend
    from attnplug_cuda.bench import hybrid_step

    shape = StepShape(
        num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16, context=16, window=5, num_draft=4, dtype=torch.bfloat16
    )
    variants = {k: v for k, v in hybrid_step.variants().items() if k in ("new", "new-fp8")}
    rows = run_step_benchmark(
        Ctx(device=torch.device("cpu")),
        name="hybrid_step",
        shape=shape,
        variants=variants,
        baseline="new",
        modes=(ForwardMode.DECODE,),
        sizes=(2,),
        steps=lambda bs: 1,
        repeats=1,
        warmup=0,
        need_s=0,
        copy_bytes=1 << 16,
        ratios=[hybrid_step.StepRatio("new", "new-fp8", target=1e-9, held_at=(2,))],
        peers=[hybrid_step.flashinfer_fp8_peer()],
    )
    served = FP8 in CudaBackend.declared_capabilities().fp8_kv_dtypes
    errors = [r for r in rows if r.get("error")]
    if served:
        assert not errors, [r["error"] for r in errors]
        fp8 = [r for r in rows if r["metric"] == "time per step" and r.get("variant") == "new-fp8"]
        assert len(fp8) == 1 and fp8[0]["floor_bytes"] == shape.step_bytes(ForwardMode.DECODE, 2, FP8)
        check = [r for r in rows if r["case"] == "decode bs=2 new-fp8 vs float32 torch (same keys)"]
        assert len(check) == 1 and check[0]["met"], check
        assert [r["metric"] for r in rows if r["metric"] == "speedup (new / new-fp8)"] == ["speedup (new / new-fp8)"]
    else:
        assert [r["case"] for r in errors] == ["new-fp8 (every case)"] and "float8_e4m3fn" in errors[0]["error"]
    if not HAS_FLASHINFER:
        assert [r["case"] for r in rows if "not installed" in (r.get("notes") or "")] == ["peer: flashinfer-fp8"]


def test_hybrid_step_modes_option():
    from attnplug_cuda.bench import SUITE, hybrid_step

    assert hybrid_step.modes(SUITE.options["hybrid_modes"]) == (ForwardMode.DECODE, ForwardMode.DRAFT_EXTEND)
    assert hybrid_step.modes("decode") == (ForwardMode.DECODE,)
    assert hybrid_step.modes(" draft_extend , decode") == (ForwardMode.DECODE, ForwardMode.DRAFT_EXTEND)
    assert SUITE.parse_options(["hybrid_modes=decode"])["hybrid_modes"] == "decode"
    for bad in ("", "verify", "decode,prefill"):
        with pytest.raises(ValueError, match="hybrid_modes"):
            hybrid_step.modes(bad)
    assert hybrid_step.batch_sizes(SUITE.options["hybrid_sizes"]) == (1, 8, 32, 64, 128)
    assert hybrid_step.batch_sizes(" 128, 8,64") == (8, 64, 128)
    for bad in ("", "0", "8,x", "-1"):
        with pytest.raises(ValueError, match="hybrid_sizes"):
            hybrid_step.batch_sizes(bad)
    fp8 = hybrid_step.variants()["new-fp8"]
    assert fp8.kv_cache_dtype is FP8 and fp8.floor and fp8.check_attention and not fp8.vs_baseline
    assert (
        hybrid_step.flashinfer_fp8_peer().kv_cache_dtype is FP8 and hybrid_step.flashinfer_peer().kv_cache_dtype is None
    )
