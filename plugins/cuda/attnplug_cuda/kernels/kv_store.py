"""Store one step's new K and V rows into a layer's paged KV cache.

``k_cache[loc[t]] = k[t]`` and ``v_cache[loc[t]] = v[t]`` for every new token ``t``: all
``Hkv`` heads of a token in one program, vectorised over ``Hkv * D`` elements. An FP8 cache
(``float8_e4m3fn`` / ``float8_e5m2``) stores ``quantize_kv(k[t], k_scale)`` (``common``: the
rule of ``attnplug.memory.fp8``, bit for bit) with each element's KV head's scale.

Layout and shapes (``T`` new tokens, ``Hkv`` kv heads, ``D`` head dim, ``S`` cache slots):

==========  ===========================  ==============================================
tensor      shape / dtype                notes
==========  ===========================  ==============================================
k, v        [T, Hkv, D] fp16/bf16/fp32   the cache's dtype (an FP8 cache: any of these,
                                         both the same); last dim contiguous and heads
                                         dense (``stride(1) == D``), token stride free
                                         (views of a fused qkv tensor are fine)
k_cache,    [S, Hkv, D], k's dtype       last dim contiguous; slot and head strides
v_cache     or an FP8 dtype              free, the same for both (contiguous caches
                                         take the dense path: one row of Hkv * D)
scales      ``common.KVScales``          an FP8 cache's float32 [Hkv] k / v scales
                                         (strides free: 0 for one shared value); None
                                         for an unquantised cache
loc         [T] int32 or int64           cache slot of each token: the hoisted int32
                                         ``swa_out_cache_loc`` on SWA layers, the int64
                                         ``out_cache_loc`` on full layers
==========  ===========================  ==============================================

A token is stored only when its slot is in ``[1, S)``. Everything else is skipped, on the
device, with no host check: slot 0 (the padding sink, where padded tokens point), ``-1`` ("no
slot", what ``full_to_swa_index_mapping`` gives for ``-1``) and any garbage value, negative
or ``>= S``. The CUDA C++ store (``csrc/kv_store.cu``) applies the same rule.

PDL (``pdl.PLAIN``): the kernel waits before reading k, v or loc, which its predecessor (the
projection, the step's metadata) wrote, and releases its dependents after its stores.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .common import DTYPES, FP8_KV_DTYPES, KVScales, check_kv_scales, pdl_release, pdl_wait, quantize_kv
from .interpret import ensure_interpreter_compat
from .pdl import PLAIN, launch_options

__all__ = ["kv_store"]

_MAX_BLOCK = 4096  # elements one program handles per chunk (Hkv * D is usually <= 2048)

ensure_interpreter_compat()


@triton.jit(do_not_specialize=("num_slots",))
def _kv_store_kernel(
    K,
    V,
    KCache,
    VCache,
    Loc,
    Scales,  # common.KVScales of an FP8 cache, or None
    num_slots,  # S: rows of the cache
    stride_kt,
    stride_vt,
    stride_cs,  # the cache's elements between two slots
    stride_ch,  # the cache's elements between two kv heads of a slot
    HD: tl.constexpr,  # Hkv * D: one token's row
    HEAD_DIM: tl.constexpr,
    DENSE: tl.constexpr,  # the cache's slots are rows of HD elements (stride_cs == HD, stride_ch == D)
    BLOCK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    PDL: tl.constexpr,  # pdl.Schedule, or None
):
    KV_FP8: tl.constexpr = KCache.dtype.element_ty.is_fp8()
    t = tl.program_id(0).to(tl.int64)
    pdl_wait(PDL, "entry")
    slot = tl.load(Loc + t).to(tl.int64)
    if (slot >= 1) & (slot < num_slots):  # the sink, -1 and garbage are skipped
        k_row = K + t * stride_kt
        v_row = V + t * stride_vt
        kc_row = KCache + slot * stride_cs
        vc_row = VCache + slot * stride_cs
        for c in tl.static_range(NUM_CHUNKS):
            offs = c * BLOCK + tl.arange(0, BLOCK)
            mask = offs < HD
            if DENSE:
                dst = offs
            else:
                # (the head's offset in 64 bits: a head-major cache's head stride times a
                # head index passes 2**31 in a buffer of more than 2**31 elements)
                dst = (offs // HEAD_DIM).to(tl.int64) * stride_ch + offs % HEAD_DIM
            k = tl.load(k_row + offs, mask=mask)
            v = tl.load(v_row + offs, mask=mask)
            if KV_FP8:  # each element with its kv head's scales
                head = offs // HEAD_DIM
                k_scale = tl.load(Scales.k + head * Scales.stride_k, mask=mask, other=1.0)
                v_scale = tl.load(Scales.v + head * Scales.stride_v, mask=mask, other=1.0)
                k = quantize_kv(k, k_scale, KCache.dtype.element_ty)
                v = quantize_kv(v, v_scale, VCache.dtype.element_ty)
            tl.store(kc_row + dst, k, mask=mask)
            tl.store(vc_row + dst, v, mask=mask)
    pdl_release(PDL, "end")


def _check_rows(name: str, t: torch.Tensor, hkv: int, d: int) -> None:
    assert t.dim() == 3 and t.shape[1:] == (hkv, d), f"{name} must be [T, {hkv}, {d}], got {tuple(t.shape)}"
    assert t.stride(2) == 1 and (hkv == 1 or t.stride(1) == d), (
        f"{name} must have a contiguous last dim and dense heads, got strides {t.stride()}"
    )


def kv_store(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    loc: torch.Tensor,
    *,
    scales: Optional[KVScales] = None,
    pdl: bool = False,
) -> None:
    """Write ``k[t]`` / ``v[t]`` (all kv heads) into ``k_cache[loc[t]]`` / ``v_cache[loc[t]]``
    for every ``t`` with ``1 <= loc[t] < S``; other tokens are skipped. An FP8 cache needs
    ``scales`` and stores the rows quantised (module docstring).

    One launch, one program per token; nothing is read back to the host. ``pdl=True`` only
    where ``pdl_supported(device)`` said so.
    """
    assert k_cache.dim() == 3, f"k_cache must be [S, Hkv, D], got {tuple(k_cache.shape)}"
    _, hkv, d = k_cache.shape
    assert v_cache.shape == k_cache.shape, f"v_cache {tuple(v_cache.shape)} != k_cache {tuple(k_cache.shape)}"
    assert k_cache.stride(2) == 1 and v_cache.stride() == k_cache.stride(), (
        f"k_cache and v_cache need a contiguous last dim and the same strides, got {k_cache.stride()} and "
        f"{v_cache.stride()}"
    )
    _check_rows("k", k, hkv, d)
    _check_rows("v", v, hkv, d)
    T = k.shape[0]
    assert v.shape[0] == T, f"k has {T} tokens, v has {v.shape[0]}"
    assert loc.dim() == 1 and loc.shape[0] == T, f"loc must be [{T}], got {tuple(loc.shape)}"
    assert loc.dtype in (torch.int32, torch.int64), f"loc must be int32 or int64, got {loc.dtype}"
    assert k.dtype in DTYPES and v.dtype == k.dtype, f"k / v are {k.dtype} / {v.dtype}: one of {DTYPES}"
    assert v_cache.dtype == k_cache.dtype, f"v_cache is {v_cache.dtype}, k_cache is {k_cache.dtype}"
    assert k_cache.dtype == k.dtype or k_cache.dtype in FP8_KV_DTYPES, (
        f"the cache is {k_cache.dtype}, k is {k.dtype}: a cache stores k's dtype or one of {FP8_KV_DTYPES}"
    )
    check_kv_scales(scales, k_cache)
    device = k_cache.device
    for name, t in (("k", k), ("v", v), ("v_cache", v_cache), ("loc", loc)):
        assert t.device == device, f"{name} is on {t.device}, k_cache on {device}"
    if T == 0:
        return
    hd = hkv * d
    block = min(triton.next_power_of_2(hd), _MAX_BLOCK)
    num_chunks = triton.cdiv(hd, block)
    # 16-byte accesses per thread: 8 fp16/bf16 (4 fp32) elements each (an FP8 cache: as many
    # elements as the rows read, 8-byte stores; the quantisation is integer work per element).
    per_thread = 16 // max(k.element_size(), k_cache.element_size())
    num_warps = max(1, min(8, block // (32 * per_thread)))
    schedule = PLAIN if pdl else None
    _kv_store_kernel[(T,)](
        k,
        v,
        k_cache,
        v_cache,
        loc,
        scales,
        k_cache.shape[0],
        k.stride(0),
        v.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        HD=hd,
        HEAD_DIM=d,
        DENSE=k_cache.is_contiguous(),
        BLOCK=block,
        NUM_CHUNKS=num_chunks,
        PDL=schedule,
        num_warps=num_warps,
        **launch_options(schedule),
    )
