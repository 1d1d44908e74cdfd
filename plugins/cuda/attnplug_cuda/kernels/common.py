"""What the attention kernels share: the key table, the logits and online-softmax steps, the
host checks and the scales.

Both attention kernels (``paged_attention``, ``store_attend``) read keys through a slot table
and fold key blocks into a running base-2 softmax the same way; this module is the one place
that says how.

* ``KeyTable``: where each request's keys are. The slot of key position ``j`` of request
  ``b`` is ``table[rows[b], j - start[b]]`` (``start`` None: 0). Full layers pass
  ``req_to_token`` with ``rows = req_pool_indices``; SWA layers the step's window table with
  ``rows = arange(bs)`` and ``start = window_start``, so they read only the keys the window
  reaches. A ``rows`` entry outside ``[0, num_rows)`` reads row 0; a slot outside ``[1, S)``
  (0 = the padding sink, -1 = no slot) is no key.
* Logits: ``s = sm_scale * q.k`` in base 2 (``qk_scale = sm_scale * log2(e)``), or with a
  soft cap ``c``: ``c * tanh(sm_scale * q.k / c)`` (``qk_scale = sm_scale / c``,
  ``softcap_log2 = c * log2(e)``: ``log2_scales``). A column with no key gets ``-inf`` (a
  bias folded into the scaling multiply-add, never a multiplication by a zero weight), so it
  contributes exactly zero whatever its slot holds, NaN and Inf included.
* Sinks: float32 ``[H]`` per-head logits (natural log) that join the softmax denominator
  once (``fold_sink``).
* FP8 caches (``attnplug.memory.fp8``: ``float8_e4m3fn`` / ``float8_e5m2``, per-KV-head float32
  scales, ``KVScales``): whether a cache is FP8 is a constexpr of each kernel, read off the
  cache's element type, so an unquantised cache compiles no scale load and no quantisation.
  Stores quantise with ``quantize_kv`` (the one rule, bit for bit); K/V tiles are loaded as
  FP8 and converted (exact: every FP8 value is a float16, bfloat16 and float32 value): in
  ``paged_attention`` in registers to float16 for a half-precision q, which meets them in
  float16 products (q converted once a program; a q beyond float16's range, 65504, is not
  served over an FP8 cache), else to float32; in ``store_attend`` the same, by PTX where they
  are loaded, where its plan says ``FP8_PTX`` (``product_tile``), else to q's dtype. Attention
  never multiplies a key or a value by its scale: a program serves one KV head ``h``, so
  ``k_scale[h]`` joins the logit scale (``s = (sm_scale * k_scale[h]) * q.c``, soft cap
  applied to that dequantised logit) and
  ``v_scale[h]`` multiplies the program's output accumulator (a split's partial included, so
  the merge of the splits is unchanged). The step's own keys, where a kernel reads them from
  ``k`` / ``v`` instead of the cache, are quantised there too: attention always sees what the
  cache holds.

Optional inputs are ``None`` in a kernel's arguments (Triton compiles the branch out), never a
flag beside a placeholder tensor.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl

from attnplug.memory.fp8 import FP8_KV_DTYPES, is_fp8

__all__ = [
    "AttentionInputs",
    "KeyTable",
    "KVScales",
    "NewRows",
    "check_attention_args",
    "check_kv_scales",
    "check_new_rows",
    "log2_scales",
    "num_sms",
    "DTYPES",
    "FP8_KV_DTYPES",
]

LOG2E = 1.4426950408889634
#: the attention kernels' integer arguments that are compared or multiplied, never part of an
#: address whose alignment matters: Triton does not specialise on them (``do_not_specialize``),
#: so a world whose cache holds 513 slots, or whose window is 16, compiles no kernel of its own
VALUES_ONLY = ("window", "num_kv_heads", "num_slots")
#: the dtypes of q, k, v, an unquantised cache and the output every kernel serves (a cache may
#: also store one of ``FP8_KV_DTYPES``, with ``KVScales``)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class KeyTable(NamedTuple):
    """Where each request's keys are (module docstring); a kernel argument as it is.

    ``table`` [R, width] int32 (contiguous rows), ``rows`` [>= bs] int32/int64, ``start``
    [>= bs] int32/int64 or None; ``stride``, ``width`` and ``num_rows`` are the table's
    (``KeyTable.of`` fills them in)."""

    table: torch.Tensor
    rows: torch.Tensor
    start: Optional[torch.Tensor]
    stride: int
    width: int
    num_rows: int

    @classmethod
    def of(cls, table: torch.Tensor, rows: torch.Tensor, start: Optional[torch.Tensor] = None) -> "KeyTable":
        return cls(table, rows, start, table.stride(0), table.shape[1], table.shape[0])


class KVScales(NamedTuple):
    """An FP8 cache's scales (``attnplug.memory.fp8``); a kernel argument as it is.

    ``k``, ``v``: float32 ``[Hkv]`` device tensors, a stored byte ``c`` of KV head ``h`` meaning
    ``c * k[h]`` (keys) or ``c * v[h]`` (values); ``stride_k`` / ``stride_v`` their element
    strides (0 for one value expanded over every head: ``PagedOps.check_scales``' views, passed
    without a copy). Read on the device only, after the launch's PDL wait, so a graph replays
    whatever they hold then (``KVScales.of`` fills the strides in)."""

    k: torch.Tensor
    v: torch.Tensor
    stride_k: int
    stride_v: int

    @classmethod
    def of(cls, k_scale: torch.Tensor, v_scale: torch.Tensor) -> "KVScales":
        return cls(k_scale, v_scale, k_scale.stride(0), v_scale.stride(0))


class AttentionInputs(NamedTuple):
    """What one layer's attention reads besides q, the cache and the output (host side; the
    launchers pass its fields on): ``cu_q_lens`` [bs + 1] int32 (exclusive prefix sum of the
    new tokens per request), ``seq_lens`` [bs] int32/int64 (each request's KV length INCLUDING
    its new tokens), ``keys`` (``KeyTable``), ``max_q_len`` (a host bound of a request's new
    tokens), ``sm_scale`` (None: ``1 / sqrt(D)``), ``window`` (None: a full layer), ``softcap``
    (None, or ``c > 0``: logits ``c * tanh(s / c)``), ``sinks`` (None, or float32 ``[H]``),
    ``kv_scales`` (``KVScales`` of an FP8 cache; None for an unquantised one)."""

    cu_q_lens: torch.Tensor
    seq_lens: torch.Tensor
    keys: KeyTable
    max_q_len: int
    sm_scale: Optional[float] = None
    window: Optional[int] = None
    softcap: Optional[float] = None
    sinks: Optional[torch.Tensor] = None
    kv_scales: Optional[KVScales] = None


class NewRows(NamedTuple):
    """The step's new K/V rows a kernel stores before it attends: ``k``, ``v`` [T, Hkv, D] in
    q's dtype (last dim contiguous, heads dense, token strides free; an FP8 cache stores them
    quantised: ``quantize_kv``), ``loc`` [>= T] int32/int64 (a slot in ``[1, S)`` is stored,
    anything else skipped)."""

    k: torch.Tensor
    v: torch.Tensor
    loc: torch.Tensor
    stride_k: int
    stride_v: int

    @classmethod
    def of(cls, k: torch.Tensor, v: torch.Tensor, loc: torch.Tensor) -> "NewRows":
        if not (isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
            raise ValueError("k and v are needed with loc (the rows to store)")
        return cls(k, v, loc, k.stride(0), v.stride(0))


# ----------------------------------------------------------------------------- device code
@triton.jit
def tanh(x):
    """tanh(x) = 1 - 2 / (exp(2x) + 1), with exp through exp2 of x clamped to [-15, 15]
    (tanh(15) rounds to 1 in fp32): never inf, never NaN."""
    e = tl.math.exp2(tl.minimum(tl.maximum(x, -15.0), 15.0) * 2.8853900817779268)  # 2 * log2(e)
    return 1.0 - 2.0 / (e + 1.0)


@triton.jit
def quantize_kv(x, scale, FP8: tl.constexpr):
    """``x`` (any float tensor) stored as the FP8 type ``FP8`` (``tl.float8e4nv`` for
    ``float8_e4m3fn``, ``tl.float8e5`` for ``float8_e5m2``) with ``scale`` (float32 > 0, a scalar
    or ``x``'s shape): ``attnplug.memory.fp8.quantize_kv``'s rule, bit for bit,
    ``c = fp8(clamp(float32(x) / scale, -max, max))``, NaN staying NaN.

    No float-to-FP8 conversion is used (the interpreter's rounds half up and wraps a mantissa
    carry, and neither saturates): the byte is computed in integers and bitcast. With ``M``
    mantissa bits, ``E`` the smallest normal exponent (e4m3fn: ``M = 3, E = -6``; e5m2:
    ``M = 2, E = -14``) and ``y = div_rn(float32(x), scale)`` (IEEE division; its bits ``a``
    without the sign):

    * saturate: ``a = min(a, bits(max))`` (ordered like the magnitudes for every non-NaN,
      ``+-inf`` included); a NaN (``a > 0x7F800000``) becomes the format's NaN, ``0x7F``;
    * ``y``'s significand ``m = 1.f`` as a 24-bit integer (``f`` the 23 fraction bits; a zero
      or float32 subnormal shifts out entirely) and unbiased exponent ``e``: the FP8 grid at
      ``e`` has spacing ``2**(max(e, E) - M)``, i.e. ``m >> s`` with
      ``s = 23 - M + max(E - e, 0)`` (capped at 31: everything below half the smallest
      subnormal rounds to 0);
    * round to nearest, ties to even: ``q = m >> s``, plus 1 when the remainder
      ``r = m - (q << s)`` is above half (``1 << (s - 1)``), or equal to it with ``q`` odd;
    * the byte: ``(max(e - E, 0) << M) + q`` (a normal ``q`` holds the implicit bit, which
      adds the exponent field's 1; a carry to ``q = 2 << M`` moves to the next exponent, a
      subnormal rounding up to ``1 << M`` becomes the smallest normal), ``| sign`` (``x``'s
      sign bit: a scale is positive).

    Returns ``x``'s shape of ``FP8``; ``.to(dtype)`` of it is exact for float16, bfloat16 and
    float32."""
    MANT: tl.constexpr = 3 if FP8 == tl.float8e4nv else 2
    E_MIN: tl.constexpr = -6 if FP8 == tl.float8e4nv else -14
    MAX_BITS: tl.constexpr = 0x43E00000 if FP8 == tl.float8e4nv else 0x47600000  # 448.0 / 57344.0
    xf = x.to(tl.float32)
    sign = (xf.to(tl.int32, bitcast=True) >> 24) & 0x80
    a = tl.math.div_rn(xf, scale).to(tl.int32, bitcast=True) & 0x7FFFFFFF
    is_nan = a > 0x7F800000
    a = tl.minimum(a, MAX_BITS)
    e = (a >> 23) - 127
    m = (a & 0x7FFFFF) | 0x800000
    s = tl.minimum(23 - MANT + tl.maximum(E_MIN - e, 0), 31)
    q = m >> s
    r = m - (q << s)
    half = 1 << (s - 1)
    q += ((r > half) | ((r == half) & ((q & 1) == 1))).to(tl.int32)
    code = (tl.maximum(e - E_MIN, 0) << MANT) + q
    code = tl.where(is_nan, 0x7F, code) | sign
    return code.to(tl.uint8).to(FP8, bitcast=True)


@triton.jit
def product_tile(x, dtype, PTX: tl.constexpr):
    """A loaded K/V tile ``x`` as the products' ``dtype`` (exact for an FP8 tile).

    With ``PTX``, an FP8 tile bound for float16 products is converted by inline PTX, four
    elements a call: ``cvt.rn.f16x2.e4m3x2`` a pair for e4m3 (compute capability >= 8.9, where
    an e4m3 cache runs at all), byte moves for e5m2 (the high byte of a float16, ``prmt``).
    The PTX is declared impure so that Triton leaves it where the tile is loaded: the tile
    then reaches the products as a 16-bit tile through shared memory (``ldmatrix``, transposed
    for V). Triton's own cast is an elementwise op that it moves to the products' operand
    layout, which reads the FP8 tile from shared memory a byte at a time for V (whose operand
    pairs run along the keys, rows 128 bytes apart at head dim 128) and K's fragments in an
    order that costs register moves. (That saves ``store_attend`` time; ``paged_attention``'s
    decode tiles, which hold four programs an SM under a register cap, measured slower with
    the tiles' round trip through shared memory: docs/benchmarks.md.) Otherwise (other
    devices, the interpreter, other dtypes): Triton's cast."""
    if PTX and x.dtype.is_fp8() and dtype == tl.float16:
        if x.dtype == tl.float8e4nv:
            return tl.inline_asm_elementwise(
                "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
                "=r,=r,r", [x], dtype=tl.float16, is_pure=False, pack=4
            )  # fmt: skip
        return tl.inline_asm_elementwise(
            "prmt.b32 $0, $2, 0, 0x1404; prmt.b32 $1, $2, 0, 0x3424;",
            "=r,=r,r", [x], dtype=tl.float16, is_pure=False, pack=4
        )  # fmt: skip
    return x.to(dtype)


@triton.jit
def settle(x):
    """``x`` itself, once the asynchronous products that made it are done: Triton waits for a
    product's result before its first use that is not a product, and this empty inline asm
    (NVIDIA's; the interpreter runs none) is such a use. A flash tile's accumulator settled
    at the end of each key block is not in flight across the loop's back edge, where ptxas
    (sm_90) would otherwise serialise every ``wgmma`` of the kernel."""
    return tl.inline_asm_elementwise("", "=r,0", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def table_entry(keys, b):
    """Request ``b``'s row index in the key table and its ``start`` (0 without one)."""
    t_idx = tl.load(keys.rows + b).to(tl.int64)
    if keys.start is not None:
        t_start = tl.load(keys.start + b).to(tl.int32)
    else:
        t_start = 0
    return t_idx, t_start


@triton.jit
def table_row(keys, t_idx):
    """The key table's row ``t_idx`` (a row outside the table reads row 0)."""
    t_idx = tl.where((t_idx >= 0) & (t_idx < keys.num_rows), t_idx, 0)
    return keys.table + t_idx * keys.stride


@triton.jit
def key_slots(t_row, start, s_hi, t_start, width, num_slots, BLOCK_N: tl.constexpr, IN_RANGE: tl.constexpr):
    """Positions ``start + [0, BLOCK_N)``, their cache slots and which of them are keys. A
    column outside the table, or with ``IN_RANGE`` a position at or past ``s_hi``, reads slot
    0; a slot outside ``[1, num_slots)`` is no key."""
    offs_n = start + tl.arange(0, BLOCK_N)
    col = offs_n - t_start
    if IN_RANGE:
        slot = tl.load(t_row + col, mask=(offs_n < s_hi) & (col >= 0) & (col < width), other=0)
    else:
        slot = tl.load(t_row + col, mask=(col >= 0) & (col < width), other=0)
    return offs_n, slot, slot_is_key(slot, num_slots)


@triton.jit
def slot_is_key(slot, num_slots):
    """Which cache slots hold keys: those in ``[1, num_slots)`` (slot 0 is the sink; a table
    entry outside the cache is no key)."""
    return (slot >= 1) & (slot < num_slots)


@triton.jit
def scaled_logits(qk, no_key, qk_scale, softcap_log2):
    """Base-2 logits of a ``[rows, keys]`` product plus ``no_key`` (``[keys]``: 0, or ``-inf``
    where a column has no key)."""
    if softcap_log2 is not None:
        return tanh(qk * qk_scale) * softcap_log2 + no_key[None, :]
    return qk * qk_scale + no_key[None, :]


@triton.jit
def causal_window(qk, offs_n, in_range, pos, lo, window):
    """``-inf`` for each (row, key) a row must not see: past its position ``pos``, outside the
    range, and with a window below its ``lo``."""
    keep = (offs_n[None, :] <= pos[:, None]) & in_range[None, :]
    if window is not None:
        keep = keep & (offs_n[None, :] >= lo[:, None])
    return tl.where(keep, qk, float("-inf"))


@triton.jit
def softmax_block(qk, m_i, l_i):
    """One block's logits into the running max ``m_i`` and sum ``l_i``: ``(p, alpha, m, l)``,
    the accumulator then becomes ``acc * alpha + p @ v``."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(qk - m_new[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def fold_sink(m_i, l_i, acc, Sinks, head, row_valid):
    """The heads' sinks into an unsplit result's denominator: ``(l_i, acc)``."""
    sink = tl.load(Sinks + head, mask=row_valid, other=0.0) * 1.4426950408889634
    m_fin = tl.maximum(m_i, sink)
    alpha = tl.math.exp2(m_i - m_fin)
    return l_i * alpha + tl.math.exp2(sink - m_fin), acc * alpha[:, None]


@triton.jit
def pdl_wait(PDL: tl.constexpr, AT: tl.constexpr):
    """``gdc_wait`` here when the launch's PDL schedule (``pdl.Schedule``) waits at ``AT``."""
    if PDL is not None:
        if PDL.wait == AT:
            tl.extra.cuda.gdc_wait()


@triton.jit
def pdl_release(PDL: tl.constexpr, AT: tl.constexpr):
    """``gdc_launch_dependents`` here when the launch's PDL schedule releases at ``AT``."""
    if PDL is not None:
        if PDL.release == AT:
            tl.extra.cuda.gdc_launch_dependents()


# ----------------------------------------------------------------------------- host side
@functools.lru_cache(maxsize=None)
def _sm_count(device_type: str, index: Optional[int]) -> int:
    if device_type == "cuda":
        return torch.cuda.get_device_properties(
            index if index is not None else torch.cuda.current_device()
        ).multi_processor_count
    return 8  # the interpreter on the host: a small stand-in


def num_sms(device: torch.device) -> int:
    """SMs of ``device`` (8 off CUDA: the interpreter's stand-in)."""
    return _sm_count(device.type, device.index)


def log2_scales(sm_scale: Optional[float], softcap: Optional[float], head_dim: int) -> Tuple[float, Optional[float]]:
    """``(qk_scale, softcap_log2)`` the kernels take (module docstring); ``softcap_log2`` is
    None without a cap. ``sm_scale`` None: ``1 / sqrt(head_dim)``."""
    scale = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(head_dim)
    if softcap is not None:
        return scale / softcap, float(softcap) * LOG2E
    return scale * LOG2E, None


def check_attention_args(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor, inputs: AttentionInputs
) -> Tuple[int, int, int, int, int, int]:
    """The host checks of every attention launcher (shapes, dtypes, devices, layouts, the
    scalar options, an FP8 cache's ``inputs.kv_scales``: ``check_kv_scales``); returns
    ``(T, H, D, Hkv, G, bs)``. The caches may be strided views (slot and head strides free,
    the same for K and V); a launcher that needs them contiguous says so."""
    assert q.dim() == 3 and out.shape == q.shape, f"q {tuple(q.shape)} and out {tuple(out.shape)} must be [T, H, D]"
    T, H, D = q.shape
    assert k_cache.dim() == 3 and k_cache.shape[2] == D, f"k_cache must be [S, Hkv, {D}], got {tuple(k_cache.shape)}"
    assert v_cache.shape == k_cache.shape, f"v_cache {tuple(v_cache.shape)} != k_cache {tuple(k_cache.shape)}"
    assert k_cache.stride(2) == 1 and v_cache.stride() == k_cache.stride(), (
        f"k_cache and v_cache need a contiguous last dim and the same strides, got {k_cache.stride()} and "
        f"{v_cache.stride()}"
    )
    hkv = k_cache.shape[1]
    assert H % hkv == 0, f"{H} q heads are not a multiple of {hkv} kv heads"
    assert q.dtype in DTYPES, f"q dtype {q.dtype} is not one of {DTYPES}"
    assert out.dtype == q.dtype, f"out is {out.dtype}, q is {q.dtype}"
    assert v_cache.dtype == k_cache.dtype, f"v_cache is {v_cache.dtype}, k_cache is {k_cache.dtype}"
    assert k_cache.dtype == q.dtype or is_fp8(k_cache.dtype), (
        f"the cache is {k_cache.dtype}, q is {q.dtype}: a cache stores q's dtype or one of {FP8_KV_DTYPES}"
    )
    assert q.stride(2) == 1 and out.stride(2) == 1, "q and out need a contiguous last dim"
    assert D >= 16, f"head_dim {D} < 16 is not supported"
    check_kv_scales(inputs.kv_scales, k_cache)
    cu_q_lens, seq_lens, keys, max_q_len = inputs.cu_q_lens, inputs.seq_lens, inputs.keys, inputs.max_q_len
    window, softcap, sinks = inputs.window, inputs.softcap, inputs.sinks
    bs = cu_q_lens.shape[0] - 1
    assert isinstance(max_q_len, int), "max_q_len is a host int"
    assert cu_q_lens.dim() == 1 and bs >= 0 and cu_q_lens.dtype == torch.int32, "cu_q_lens must be [bs + 1] int32"
    assert seq_lens.dim() == 1 and seq_lens.shape[0] >= bs and seq_lens.dtype in (torch.int32, torch.int64)
    table = keys.table
    assert table.dim() == 2 and table.dtype == torch.int32 and (table.stride(1) == 1 or table.shape[1] <= 1), (
        f"table must be [R, width] int32 with contiguous rows, got {tuple(table.shape)} {table.dtype}"
    )
    assert keys.rows.dim() == 1 and keys.rows.shape[0] >= bs and keys.rows.dtype in (torch.int32, torch.int64)
    if keys.start is not None:
        assert keys.start.dim() == 1 and keys.start.shape[0] >= bs
        assert keys.start.dtype in (torch.int32, torch.int64)
    named = (("k_cache", k_cache), ("v_cache", v_cache), ("out", out), ("cu_q_lens", cu_q_lens))
    named += (("seq_lens", seq_lens), ("table", table), ("table_rows", keys.rows), ("table_start", keys.start))
    for name, t in named:
        assert t is None or t.device == q.device, f"{name} is on {t.device}, q on {q.device}"
    if window is not None:
        assert isinstance(window, int) and window >= 1, f"window must be None or an int >= 1, got {window!r}"
    if softcap is not None:
        assert math.isfinite(softcap) and softcap > 0, f"softcap must be None or a finite float > 0, got {softcap!r}"
    if sinks is not None:
        assert sinks.shape == (H,) and sinks.dtype == torch.float32 and sinks.is_contiguous(), (
            f"sinks must be contiguous float32 [{H}], got {tuple(sinks.shape)} {sinks.dtype}"
        )
        assert sinks.device == q.device, f"sinks is on {sinks.device}, q on {q.device}"
    return T, H, D, hkv, H // hkv, bs


def check_kv_scales(scales: Optional[KVScales], k_cache: torch.Tensor) -> None:
    """An FP8 cache needs ``scales`` (``KVScales``: float32 ``[Hkv]`` tensors on the cache's
    device, strides as ``KVScales.of`` reads them); an unquantised cache takes None (no kernel
    of it loads a scale)."""
    if not is_fp8(k_cache.dtype):
        assert scales is None, f"kv_scales are for an FP8 cache, the cache is {k_cache.dtype}"
        return
    assert isinstance(scales, KVScales), f"an FP8 cache ({k_cache.dtype}) needs KVScales, got {type(scales).__name__}"
    hkv = k_cache.shape[1]
    for name, t, stride in (("k_scale", scales.k, scales.stride_k), ("v_scale", scales.v, scales.stride_v)):
        assert isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.shape == (hkv,), (
            f"{name} must be float32 [{hkv}] (one per kv head), got "
            + (f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__)
        )
        assert stride == t.stride(0) and stride >= 0, f"{name}: stride {stride} is not the tensor's {t.stride(0)}"
        assert t.device == k_cache.device, f"{name} is on {t.device}, the cache on {k_cache.device}"


def check_new_rows(k: torch.Tensor, v: torch.Tensor, loc: torch.Tensor, q: torch.Tensor, num_kv_heads: int) -> None:
    """The host checks of the step's new K/V rows an attention kernel stores (``NewRows``):
    ``k``, ``v`` ``[T, Hkv, D]`` in q's dtype on q's device with a contiguous last dim and
    dense heads, ``loc`` ``[>= T]`` int32/int64 on q's device."""
    T, _, D = q.shape
    for name, t in (("k", k), ("v", v)):
        assert t is not None, f"{name} is needed with loc (the rows to store)"
        assert t.dim() == 3 and t.shape == (T, num_kv_heads, D), (
            f"{name} must be [{T}, {num_kv_heads}, {D}], got {tuple(t.shape)}"
        )
        assert t.stride(2) == 1 and (num_kv_heads == 1 or t.stride(1) == D), (
            f"{name} needs a contiguous last dim, dense heads"
        )
        assert t.dtype == q.dtype and t.device == q.device, (
            f"{name} is {t.dtype} on {t.device}, q {q.dtype} on {q.device}"
        )
    assert loc.dim() == 1 and loc.shape[0] >= T and loc.dtype in (torch.int32, torch.int64), (
        f"loc must be [>= {T}] int32/int64, got {tuple(loc.shape)} {loc.dtype}"
    )
    assert loc.device == q.device, f"loc is on {loc.device}, q on {q.device}"
