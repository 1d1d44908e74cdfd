"""Whole-step benchmarks over an FP8 KV cache (``attnplug.bench``), on the host with the reference
backend: the FP8 twin of a world holds the bf16 world's keys quantised by the pool's rule, the
floor counts one byte a cached element, an FP8 variant and a peer run on that twin beside the
model-dtype variants, its attention is checked against float32 attention over the dequantised
cache, and a backend that does not serve the cache leaves one error row."""

import math

import pytest
import torch

from attnplug import ForwardMode
from attnplug.backends.reference import ReferenceBackend
from attnplug.bench import Ctx
from attnplug.bench.floors import step_bytes
from attnplug.bench.step_case import StepPeer, StepRatio, StepVariant
from attnplug.bench.step_check import CHECK_TOLERANCE, decode_check, reference_attention
from attnplug.bench.world import bench_kv_scales, build_world, request_keys
from attnplug.memory.fp8 import dequantize_kv, quantize_kv
from bench_runs import quick_step_benchmark, small_step_shape

FP8 = torch.float8_e4m3fn
SHAPE = small_step_shape()
WORLD = dict(num_layers=4, max_bs=3, context=16, window=5, num_draft=4, num_heads=4, num_kv_heads=2, head_dim=16)


def test_the_fp8_floor_reads_one_byte_a_cached_element():
    """48 layers (36 SWA, W 256), 8 KV heads x 128, bs-1 decode at 1,021 keys: the cache's K and
    V at one byte an element, q / out / the new K/V inputs at bf16's two."""
    kw = dict(num_layers=48, swa_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, window=256)
    keys = 36 * 256 + 12 * 1021
    q_out = 2 * 32 * 128 * 2
    new_in, new_cached = 2 * 8 * 128 * 2, 2 * 8 * 128 * 1
    fp8 = step_bytes(bs=1, q_len=1, seq_len=1021, dtype=torch.bfloat16, kv_cache_dtype=FP8, **kw)
    assert fp8 == keys * 2 * 8 * 128 * 1 + 48 * (q_out + new_in + new_cached)
    bf16 = step_bytes(bs=1, q_len=1, seq_len=1021, dtype=torch.bfloat16, **kw)
    assert bf16 == step_bytes(bs=1, q_len=1, seq_len=1021, dtype=torch.bfloat16, kv_cache_dtype=torch.bfloat16, **kw)
    assert bf16 - fp8 == keys * 2 * 8 * 128 + 48 * 2 * 8 * 128  # the cache's bytes halve, nothing else
    assert step_bytes(bs=64, q_len=1, seq_len=1021, dtype=torch.bfloat16, kv_cache_dtype=FP8, **kw) == 64 * fp8
    assert SHAPE.step_bytes(ForwardMode.DECODE, 2, FP8) < SHAPE.step_bytes(ForwardMode.DECODE, 2)


def test_bench_scales_differ_on_every_layer_and_fit_e4m3():
    scales = bench_kv_scales(48)
    assert len(set(scales.values())) > 20 and all(k != v for k, v in list(scales.values())[:7])
    assert min(min(p) for p in scales.values()) == 1 / 32 and max(max(p) for p in scales.values()) == 7 / 128
    assert 6.0 / min(min(p) for p in scales.values()) < torch.finfo(FP8).max  # six sigma: no saturation


def test_the_fp8_world_holds_the_model_dtype_world_quantised():
    scales = bench_kv_scales(WORLD["num_layers"])
    plain = build_world(**WORLD, dtype=torch.bfloat16)
    twin = build_world(**WORLD, dtype=torch.bfloat16, kv_cache_dtype=FP8, kv_scales=scales)
    assert twin.pool.dtype == FP8 and twin.dtype == plain.dtype == plain.pool.dtype == torch.bfloat16
    assert torch.equal(twin.rows.req_to_token, plain.rows.req_to_token) and twin.req_rows == plain.req_rows
    for layer in range(WORLD["num_layers"]):
        k_scale, v_scale = twin.pool.kv_scales(layer)
        assert torch.equal(k_scale, torch.full((2,), scales[layer][0])) and v_scale[0].item() == scales[layer][1]
        for which, scale in ((0, k_scale), (1, v_scale)):
            want = quantize_kv(plain.pool.get_kv_buffer(layer)[which], scale, FP8)
            assert torch.equal(twin.pool.get_kv_buffer(layer)[which].view(torch.uint8), want.view(torch.uint8))
    with pytest.raises(ValueError, match="kv_scales apply to an FP8 cache"):
        build_world(**WORLD, dtype=torch.bfloat16, kv_scales=scales)


def test_reference_attention_reads_an_fp8_cache_dequantised():
    world = build_world(**WORLD, dtype=torch.float32, kv_cache_dtype=FP8, kv_scales=bench_kv_scales(4))
    full, _ = request_keys(world, 3, 13)
    q = torch.randn(3, 4, 16, generator=torch.Generator().manual_seed(3))
    k_cache, v_cache = world.pool.get_kv_buffer(3)
    k_scale, v_scale = world.pool.kv_scales(3)
    got = reference_attention(q, k_cache, v_cache, full, 0.25, k_scale, v_scale)
    k64, v64 = dequantize_kv(k_cache, k_scale, torch.float64), dequantize_kv(v_cache, v_scale, torch.float64)
    want = reference_attention(q.double(), k64, v64, full, 0.25)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    ignored = reference_attention(q, k_cache, v_cache, full, 0.25)  # the raw codes, scales ignored
    assert (ignored - got).abs().max() > 1.0


def _half_scaled(*args, **kwargs):
    return ReferenceBackend(*args, scaling=0.5 / math.sqrt(16), **kwargs)


def test_decode_check_passes_the_backend_and_catches_another_attention():
    world = build_world(**WORLD, dtype=torch.float32, kv_cache_dtype=FP8, kv_scales=bench_kv_scales(4))
    good = decode_check(ReferenceBackend(world.pool, world.rows, num_heads=4, sliding_window=5), world, 3)
    assert set(good) == {"SWA", "full"} and good["SWA"][0] == 0 and good["full"][0] == 3
    assert max(d for _, d in good.values()) < 1e-5
    bad = decode_check(_half_scaled(world.pool, world.rows, num_heads=4, sliding_window=5), world, 3)
    assert min(d for _, d in bad.values()) > CHECK_TOLERANCE


def test_an_fp8_variant_and_peer_run_beside_the_model_dtype_ones():
    seen = []

    def peer(ctx, world, mode, bs):
        seen.append((world.pool.dtype, world.dtype))
        return 1e6, "one second", {"config": {"page_size": 16}}

    variants = {
        "base": StepVariant(make=ReferenceBackend, graph=False),
        "new": StepVariant(make=ReferenceBackend, floor=True),
        "new-fp8": StepVariant(
            make=ReferenceBackend, floor=True, kv_cache_dtype=FP8, vs_baseline=False, check_attention=True
        ),
    }
    ctx = Ctx(backend_cls=ReferenceBackend)
    rows = quick_step_benchmark(
        ctx,
        name="t",
        shape=SHAPE,
        variants=variants,
        baseline="base",
        sizes=(1, 2),
        ratios=[StepRatio(slow="new", fast="new-fp8", target=1e-9, held_at=(2,))],
        peers=[StepPeer("peer-fp8", peer, against="new-fp8", kv_cache_dtype=FP8)],
    )
    assert not [r for r in rows if r.get("error")], [r["error"] for r in rows if r.get("error")]
    assert seen == [(FP8, torch.float32)] * 2
    times = {(r["variant"], r["bs"]): r for r in rows if r["metric"] == "time per step"}
    for bs in (1, 2):
        assert times[("new-fp8", bs)]["floor_bytes"] == SHAPE.step_bytes(ForwardMode.DECODE, bs, FP8)
        assert times[("new", bs)]["floor_bytes"] == SHAPE.step_bytes(ForwardMode.DECODE, bs)
        assert times[("peer-fp8", bs)]["config"] == {"page_size": 16}
    checks = [r for r in rows if r["metric"] == "max |out diff|"]
    assert [r["case"] for r in checks] == [f"decode bs={bs} new-fp8 vs float32 torch (same keys)" for bs in (1, 2)]
    assert all(r["met"] and r["value"] < 1e-5 and "float8_e4m3fn" in r["detail"] for r in checks)
    ratio = {r["bs"]: r for r in rows if r["metric"] == "speedup (new / new-fp8)"}
    assert ratio[1]["target"] is None and ratio[2]["target"] == ">= 1e-09x" and ratio[2]["met"] is True
    # the same keys, quantised: the outputs differ by the quantisation, not by anything else
    assert all(0 < r["max_abs_out_diff"] < 0.2 for r in ratio.values())
    assert [r for r in rows if r["metric"] == "speedup (peer-fp8 / new-fp8)"]
    assert not [r for r in rows if r["metric"] == "speedup (base / new-fp8)"]  # not against the bf16 baseline


class NoFP8(ReferenceBackend):
    """A backend that serves no FP8 cache."""

    fp8_kv_dtypes = ()


def test_a_backend_that_does_not_serve_the_cache_leaves_one_error_row():
    variants = {
        "base": StepVariant(make=ReferenceBackend, graph=False),
        "new": StepVariant(make=ReferenceBackend),
        "new-fp8": StepVariant(make=NoFP8, kv_cache_dtype=FP8, vs_baseline=False),
    }
    rows = quick_step_benchmark(
        Ctx(backend_cls=ReferenceBackend),
        name="t",
        shape=SHAPE,
        variants=variants,
        baseline="base",
        ratios=[StepRatio(slow="new", fast="new-fp8")],
    )
    errors = [r for r in rows if r.get("error")]
    assert [r["case"] for r in errors] == ["new-fp8 (every case)"]
    assert "float8_e4m3fn" in errors[0]["error"] and "does not serve" in errors[0]["error"]
    assert {r["variant"] for r in rows if r["metric"] == "time per step" and r.get("value")} == {"base", "new"}
    assert not [r for r in rows if "new-fp8" in r["metric"]]


def test_ratio_targets_hold_where_asked():
    r = StepRatio(slow="a", fast="b", target=1.6, held_at=(64, 128))
    assert [r.target_at(bs) for bs in (1, 64, 128)] == [None, 1.6, 1.6]
    assert StepRatio(slow="a", fast="b", target=2.0).target_at(3) == 2.0
    assert StepRatio(slow="a", fast="b").target_at(64) is None
