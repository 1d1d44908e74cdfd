"""The FP8 KV cache in the core: the quantisation rule, the pool's scales and stores, the
capability gate, the forward checks, and the portable paths against a float64 oracle over the
dequantised cache."""

from __future__ import annotations

import math

import pytest
import torch

from attnplug import BackendConfigError, ForwardBatch, ForwardMode, ReqToTokenPool, SWAKVPool, SWATokenAllocator
from attnplug.backends.reference import ReferenceBackend
from attnplug.capabilities import Capabilities, GraphSupport
from attnplug.memory import KVSlotError
from attnplug.memory.fp8 import (
    FP8_KV_DTYPES,
    dequantize_kv,
    fp8_max,
    host_scales,
    quantize_kv,
    resolve_kv_cache_dtype,
)
from attnplug.ops.base import OpsInputError
from attnplug.ops.portable import PortableOps
from attnplug.oracle import exact_attention

CPU = torch.device("cpu")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


# ---------------------------------------------------------------------------- the rule
@pytest.mark.parametrize("dtype", FP8_KV_DTYPES, ids=str)
def test_quantize_saturates_and_keeps_nan(dtype):
    limit = fp8_max(dtype)
    x = torch.tensor([[[limit * 10, -limit * 10, math.inf, -math.inf, math.nan, 0.0]]])
    got = quantize_kv(x, torch.tensor([1.0]), dtype).float()[0, 0]
    assert got[:4].tolist() == [limit, -limit, limit, -limit]
    assert math.isnan(got[4].item()) and got[5].item() == 0.0


def test_quantize_rounds_to_nearest_even_with_the_scale_divided_first():
    # e4m3 around 64: representable 64, 72 (spacing 8); 68 is a tie -> 64 (even mantissa)
    x = torch.tensor([[[68.0, 76.0, 69.0, 126.5]]])
    assert quantize_kv(x, torch.tensor([1.0]), E4M3).float()[0, 0].tolist() == [64.0, 80.0, 72.0, 128.0]
    # the scale divides: 136 / 2 = 68 -> 64, dequantised 128
    c = quantize_kv(torch.tensor([[[136.0]]]), torch.tensor([2.0]), E4M3)
    assert dequantize_kv(c, torch.tensor([2.0])).item() == 128.0


def test_per_head_scales_apply_to_their_head():
    x = torch.full((3, 2, 4), 10.0)
    scale = torch.tensor([1.0, 0.01])  # head 1: 10 / 0.01 = 1000 saturates at 448
    c = quantize_kv(x, scale, E4M3)
    assert c[:, 0].float().unique().tolist() == [10.0]
    assert c[:, 1].float().unique().tolist() == [448.0]
    assert dequantize_kv(c, scale, torch.float64)[:, 1].unique().tolist() == [448.0 * float(torch.tensor(0.01))]


@pytest.mark.parametrize(
    "value, model, want",
    [
        (None, torch.bfloat16, torch.bfloat16),
        ("auto", torch.float16, torch.float16),
        ("fp8", torch.bfloat16, E4M3),
        ("fp8_e4m3", torch.bfloat16, E4M3),
        ("fp8_e5m2", torch.bfloat16, E5M2),
        (E5M2, torch.bfloat16, E5M2),
    ],
)
def test_resolve_kv_cache_dtype(value, model, want):
    assert resolve_kv_cache_dtype(value, model) is want


def test_resolve_kv_cache_dtype_refuses_unknown_names():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of .*'fp8_e5m2'.*got 'int8'"):
        resolve_kv_cache_dtype("int8", torch.bfloat16)


@pytest.mark.parametrize(
    "value, needle",
    [(0.0, "finite floats > 0"), (-1.0, "finite floats > 0"), (math.inf, "finite floats > 0"),
     (math.nan, "finite floats > 0"), (1e-50, "float32-representable"), ([1.0, 2.0, 3.0], "one value or 2"),
     (True, "bool"), ("x", "positive float")],
)  # fmt: skip
def test_host_scales_refuses_bad_values(value, needle):
    with pytest.raises(ValueError, match=needle):
        host_scales(value, 2, "k_scale")


# ---------------------------------------------------------------------------- the pool
def _fp8_pool(dtype=E4M3, **kw):
    args = dict(
        size=32, size_swa=16, num_layers=2, swa_layer_ids=[0], num_kv_heads=2, head_dim=8, dtype=dtype, device=CPU
    )
    args.update(kw)
    return SWAKVPool(**args)


def test_fp8_pool_has_unit_scales_and_set_kv_scales_validates_without_changing_anything():
    pool = _fp8_pool()
    assert pool.is_fp8 and pool.k_scale.shape == (2, 2) and pool.k_scale.dtype == torch.float32
    assert pool.k_scale.eq(1).all() and pool.v_scale.eq(1).all()
    pool.set_kv_scales(1, 0.5, [0.25, 2.0])
    assert pool.kv_scales(1)[0].tolist() == [0.5, 0.5] and pool.kv_scales(1)[1].tolist() == [0.25, 2.0]
    before = (pool.k_scale.clone(), pool.v_scale.clone())
    with pytest.raises(ValueError, match="v_scale must hold finite floats > 0"):
        pool.set_kv_scales(0, 2.0, [1.0, -1.0])
    assert torch.equal(pool.k_scale, before[0]) and torch.equal(pool.v_scale, before[1])
    plain = _fp8_pool(dtype=torch.bfloat16)
    assert not plain.is_fp8 and plain.k_scale is None and plain.kv_scales(0) == (None, None)
    with pytest.raises(ValueError, match="not an FP8 dtype"):
        plain.set_kv_scales(0, 1.0, 1.0)


@pytest.mark.parametrize("dtype", FP8_KV_DTYPES, ids=str)
def test_set_kv_buffer_quantises_with_the_layers_scales(dtype):
    pool = _fp8_pool(dtype)
    pool.set_kv_scales(1, [0.5, 3.0], [0.02, 1.5])
    k = torch.randn(5, 2, 8, dtype=torch.bfloat16) * 50
    v = torch.randn(5, 2, 8, dtype=torch.bfloat16) * 50
    loc = torch.tensor([3, 4, -1, 7, 9])
    pool.set_kv_buffer(1, loc, k, v)
    kb, vb = pool.get_kv_buffer(1)
    keep = loc != -1
    assert torch.equal(_bits(kb[loc[keep]]), _bits(quantize_kv(k[keep], pool.k_scale[1], dtype)))
    assert torch.equal(_bits(vb[loc[keep]]), _bits(quantize_kv(v[keep], pool.v_scale[1], dtype)))
    # already-quantised rows are stored as they are
    pool.set_kv_buffer(1, torch.tensor([11]), kb[3:4].clone(), vb[3:4].clone())
    assert torch.equal(_bits(kb[11]), _bits(kb[3]))


def test_set_kv_buffer_on_fp8_refuses_mixed_or_integer_inputs_and_writes_nothing():
    pool = _fp8_pool()
    before = [_bits(b).clone() for b in pool.k_buffer]
    k = torch.randn(2, 2, 8, dtype=torch.bfloat16)
    with pytest.raises(KVSlotError, match="k and v the same"):
        pool.set_kv_buffer(1, torch.tensor([3, 4]), k, k.half())
    with pytest.raises(KVSlotError, match="float8_e4m3fn"):
        pool.set_kv_buffer(1, torch.tensor([3, 4]), k.to(torch.int8), k.to(torch.int8))
    assert all(torch.equal(_bits(b), a) for b, a in zip(pool.k_buffer, before))


def test_pool_refuses_unserved_fp8_formats():
    with pytest.raises(ValueError, match="float8_e4m3fnuz"):
        _fp8_pool(dtype=torch.float8_e4m3fnuz)


# ---------------------------------------------------------------------------- the backend gate
class _NoFp8(ReferenceBackend):
    name = "no-fp8"

    @classmethod
    def declared_capabilities(cls):
        import dataclasses

        return dataclasses.replace(super().declared_capabilities(), fp8_kv_dtypes=(E5M2,))


def test_backend_refuses_an_fp8_pool_it_does_not_declare():
    pool = _fp8_pool(E4M3)
    with pytest.raises(BackendConfigError, match="stores float8_e4m3fn.*fp8_kv_dtypes: float8_e5m2"):
        _NoFp8(pool, ReqToTokenPool(4, 16, CPU), num_heads=4, sliding_window=4)
    _NoFp8(_fp8_pool(E5M2), ReqToTokenPool(4, 16, CPU), num_heads=4, sliding_window=4)  # declared: built


def test_capabilities_list_fp8_kv_dtypes():
    caps = ReferenceBackend.declared_capabilities()
    assert caps.fp8_kv_dtypes == FP8_KV_DTYPES
    assert caps.kv_dtypes == tuple(caps.dtypes) + FP8_KV_DTYPES
    assert caps.to_json()["fp8_kv_dtypes"] == ["float8_e4m3fn", "float8_e5m2"]
    bare = Capabilities("cpu", False, False, GraphSupport.NEVER, (torch.float32,), (64,), (1,), False)
    assert bare.fp8_kv_dtypes == () and bare.kv_dtypes == (torch.float32,)


# ---------------------------------------------------------------------------- the reference backend
def _step(pool, rows, alloc, lens):
    """One EXTEND step of fresh requests of ``lens`` tokens on CPU."""
    reqs = [rows.alloc() for _ in lens]
    locs = [alloc.alloc(n) for n in lens]
    for r, loc in zip(reqs, locs):
        rows.req_to_token[r, : loc.numel()] = loc.to(torch.int32)
    T = sum(lens)
    return ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=len(lens),
        req_pool_indices=torch.tensor(reqs, dtype=torch.int64),
        seq_lens=torch.tensor(lens, dtype=torch.int64),
        out_cache_loc=torch.cat(locs).to(torch.int64),
        positions=torch.cat([torch.arange(n) for n in lens]),
        extend_seq_lens=torch.tensor(lens, dtype=torch.int64),
        extend_seq_lens_cpu=list(lens),
        seq_lens_cpu=torch.tensor(lens, dtype=torch.int64),
    ), T


@pytest.mark.parametrize("dtype", FP8_KV_DTYPES, ids=str)
def test_reference_backend_over_fp8_matches_float64_over_the_dequantised_cache(dtype):
    torch.manual_seed(0)
    pool = SWAKVPool(64, 64, 2, [0], 2, 16, dtype, CPU)
    pool.set_kv_scales(0, [0.004, 0.02], [0.01, 0.5])  # head 0 of K saturates on N(0, 3) data
    pool.set_kv_scales(1, 0.05, 0.03)
    rows = ReqToTokenPool(4, 32, CPU)
    alloc = SWATokenAllocator(pool)
    backend = ReferenceBackend(pool, rows, num_heads=4, sliding_window=5)
    batch, T = _step(pool, rows, alloc, [7, 12])
    backend.init_forward_metadata(batch)
    for layer in (0, 1):
        q = torch.randn(T, 4, 16, dtype=torch.bfloat16)
        k = (torch.randn(T, 2, 16) * 3).to(torch.bfloat16)
        v = torch.randn(T, 2, 16, dtype=torch.bfloat16)
        out = backend.forward(q, k, v, layer, batch)
        assert out.dtype == torch.bfloat16
        ks, vs = pool.kv_scales(layer)
        kd = dequantize_kv(quantize_kv(k, ks, dtype), ks, torch.float64)
        vd = dequantize_kv(quantize_kv(v, vs, dtype), vs, torch.float64)
        window = 5 if layer == 0 else None
        want = torch.cat(
            [
                exact_attention(q[a:b].double(), kd[None, a:b], vd[None, a:b], [n], [n], window, backend.scaling)
                for a, b, n in ((0, 7, 7), (7, 19, 12))
            ]
        )
        err = (out.double() - want).abs().max().item()
        assert err < 3e-2, err
        # the cache holds exactly the rule's bytes
        loc = batch.out_cache_loc
        if layer == 0:  # the SWA layer stores at the translated slots
            loc = pool.translate_loc_from_full_to_swa(loc).long()
        stored = pool.get_key_buffer(layer)[loc]
        assert torch.equal(_bits(stored), _bits(quantize_kv(k, ks, dtype)))


def test_forward_over_fp8_checks_the_model_dtype():
    pool = _fp8_pool()
    rows = ReqToTokenPool(4, 16, CPU)
    alloc = SWATokenAllocator(pool)
    backend = ReferenceBackend(pool, rows, num_heads=4, sliding_window=4)
    batch, T = _step(pool, rows, alloc, [3])
    backend.init_forward_metadata(batch)
    before = [_bits(b).clone() for b in pool.k_buffer]
    q = torch.randn(T, 4, 8, dtype=torch.bfloat16)
    k = torch.randn(T, 2, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="v is float16, q is bfloat16"):
        backend.forward(q, k, k.half(), 1, batch)
    with pytest.raises(ValueError, match="q is float64: over an FP8 KV cache q, k and v must be one of"):
        backend.forward(q.double(), k.double(), k.double(), 1, batch)
    assert all(torch.equal(_bits(b), a) for b, a in zip(pool.k_buffer, before))


# ---------------------------------------------------------------------------- the op layer
def test_portable_ops_need_scales_for_fp8_and_store_the_rules_bytes():
    ops = PortableOps(CPU)
    kc = torch.zeros(4, 8, 2, 16, dtype=E4M3)  # [N, P, Hkv, D]
    vc = torch.zeros_like(kc)
    key = torch.randn(5, 2, 16, dtype=torch.bfloat16) * 4
    slots = torch.tensor([8, 9, -1, 10, 0])
    with pytest.raises(OpsInputError, match="k_scale: an FP8 cache"):
        ops.store_kv(key, key, kc, vc, slots)
    with pytest.raises(OpsInputError, match="k_scale must be float32 with 1 or 2"):
        ops.store_kv(key, key, kc, vc, slots, k_scale=torch.ones(3), v_scale=torch.ones(1))
    assert not _bits(kc).any()  # refused: nothing written
    ks = torch.tensor([0.02])
    ops.store_kv(key, key, kc, vc, slots, k_scale=ks, v_scale=torch.tensor([0.5, 2.0]))
    flat = kc.flatten(0, 1)
    want = quantize_kv(key, ks.expand(2), E4M3)
    assert torch.equal(_bits(flat[[8, 9, 10]]), _bits(want[[0, 1, 3]]))
    assert not _bits(flat[0]).any()  # slot 0 (skipped) keeps its own value
    # an unquantised cache ignores scales; a mismatched model dtype is refused
    plain = torch.zeros(16, 2, 16, dtype=torch.bfloat16)
    ops.store_kv(key, key, plain, plain.clone(), slots, k_scale=ks, v_scale=ks)
    with pytest.raises(OpsInputError, match="key is torch.float16, the cache is torch.bfloat16"):
        ops.store_kv(key.half(), key.half(), plain, plain.clone(), slots)
