"""Mutants of the FP8 KV cache (issue 38): each a plausible bug of a backend's FP8 store path or
of its op layer's scales, caught only by the suite's FP8 axis (``...-kv_fp8_e4m3``,
``...-kv_fp8_e5m2``). Over an unquantised cache every one of them is the reference backend
(they change nothing but FP8 stores), so the suite without the FP8 axis passes them all.

* ``ScaleIgnoredOnStore``: the store converts k / v without dividing by the scale
  (``fp8(clamp(x))``); the attention reads the bytes as ``c * s``, as it should.
* ``StoreWithoutSaturation``: the store skips the clamp and converts with the non-saturating
  conversion (a kernel's ``cvt`` without ``.satfinite``): a value that rounds past the format's
  largest finite becomes NaN in float8_e4m3fn (which has no infinity) and ±Inf in float8_e5m2.
* ``StoreRoundsTowardZero``: the conversion truncates (rounds toward zero) instead of rounding
  to nearest even.
* ``StoreFirstHeadScale``: the store divides every KV head by head 0's scale (a kernel that
  takes one scale a layer, as engines pass ``k_scale``), the attention reads per head.
* ``OpsScaleFirstElement``: the op layer (``paged_ops``) reads ``k_scale`` / ``v_scale`` as one
  value a layer, its first element, for every head: right for an engine's per-layer scalar,
  wrong for per-head ``[Hkv]`` scales.

Two backends exercise the declaration side (``check_capabilities_honest[...-kv_cache_dtypes]``):
``WithoutFp8`` (the reference declaring no FP8 dtype: the constructor refuses FP8 pools, the axis
skips naming the declaration) passes; ``HidesServedFp8`` (the class declares both FP8 dtypes, so
the constructor accepts FP8 pools, while its instances report none) fails.

``tests/conformance/test_fp8_mutants.py`` shows each mutant wrong over an FP8 cache (its witness,
against float64 attention over the cache the rule writes, or the bytes the rule writes) and
right over an unquantised one, that the default suite with ``-x`` fails it naming a rule within
the quick profile (``CAUGHT_BY`` records the check that does), and that the suite without the
FP8 axis passes it. Name them ``mutants.fp8:ClassName`` wherever a backend target is given.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from attnplug.backends.reference import ReferenceBackend
from attnplug.memory.fp8 import fp8_max, quantize_kv
from attnplug.ops import PortableOps

__all__ = [
    "ScaleIgnoredOnStore",
    "StoreWithoutSaturation",
    "StoreRoundsTowardZero",
    "StoreFirstHeadScale",
    "OpsScaleFirstElement",
    "WithoutFp8",
    "HidesServedFp8",
    "FP8_MUTANTS",
    "CAUGHT_BY",
    "non_saturating",
    "toward_zero",
]


def non_saturating(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` ``[n, Hkv, D]`` / ``scale`` ``[Hkv]`` converted to ``dtype`` without saturation: round to
    nearest even, and a value that rounds past the largest finite overflows, to NaN in
    float8_e4m3fn (no infinity) and to ±Inf in float8_e5m2. It rounds past it beyond the midpoint
    ``max + ulp / 2`` (464 for e4m3fn, 61440 for e5m2), and at the midpoint where the largest
    finite's code is odd (ties to even: e5m2's 61440 overflows, e4m3fn's 464 rounds to 448)."""
    top = fp8_max(dtype)
    mid = top + 2.0 ** math.floor(math.log2(top)) * torch.finfo(dtype).eps / 2
    odd = bool(int(torch.tensor(top).to(dtype).view(torch.uint8)) & 1)
    y = x.float() / scale.float()[:, None]
    over = (y.abs() > mid) | ((y.abs() == mid) & odd)
    if dtype == torch.float8_e4m3fn:
        overflow = torch.full_like(y, math.nan)
    else:
        overflow = torch.copysign(torch.full_like(y, math.inf), y)
    return torch.where(over, overflow, y.clamp(-top, top)).to(dtype)


def toward_zero(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The rule's quantisation with truncation instead of rounding to nearest even: where the
    rounded code lies farther from zero than ``clamp(x / s)``, the code one step nearer zero
    (FP8 codes are ordered by magnitude within a sign, so that is the byte minus one)."""
    c = quantize_kv(x, scale, dtype)
    y = (x.float() / scale.float()[:, None]).clamp(-fp8_max(dtype), fp8_max(dtype))
    away = c.float().abs() > y.abs()
    bits = c.view(torch.uint8)
    return torch.where(away, bits - 1, bits).view(dtype)


class _Fp8Store(ReferenceBackend):
    """The reference backend whose FP8 stores quantise with ``convert(x, scale, dtype)``; the
    portable store then writes the given FP8 rows as they are. Unquantised pools: the reference."""

    WITNESS = ("store",)

    def convert(self, x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def _store_kv(self, layer_id, is_swa, k, v, md) -> None:
        if self.pool.is_fp8:
            k_scale, v_scale = self.pool.kv_scales(layer_id)
            k = self.convert(k, k_scale, self.pool.dtype)
            v = self.convert(v, v_scale, self.pool.dtype)
        super()._store_kv(layer_id, is_swa, k, v, md)


class ScaleIgnoredOnStore(_Fp8Store):
    """FP8 store: ``fp8(clamp(x))``, the scale never divides (see the module docstring)."""

    def convert(self, x, scale, dtype):
        return quantize_kv(x, torch.ones_like(scale), dtype)


class StoreWithoutSaturation(_Fp8Store):
    """FP8 store: no clamp, the non-saturating conversion (``non_saturating``)."""

    def convert(self, x, scale, dtype):
        return non_saturating(x, scale, dtype)


class StoreRoundsTowardZero(_Fp8Store):
    """FP8 store: truncation instead of round to nearest even (``toward_zero``)."""

    def convert(self, x, scale, dtype):
        return toward_zero(x, scale, dtype)


class StoreFirstHeadScale(_Fp8Store):
    """FP8 store: every KV head divided by head 0's scale."""

    def convert(self, x, scale, dtype):
        return quantize_kv(x, scale[:1].expand_as(scale), dtype)


class _ScaleFirstElement(PortableOps):
    def check_scales(self, k_scale, v_scale, cache):
        k, v = super().check_scales(k_scale, v_scale, cache)
        if k is None:
            return k, v
        return k[:1].expand_as(k), v[:1].expand_as(v)  # one value a layer, whatever the engine passed


class OpsScaleFirstElement(ReferenceBackend):
    """The op layer reads the scale tensors' first element for every head (see the module
    docstring); its pool-level path is the reference's."""

    WITNESS = ("ops",)

    @classmethod
    def paged_ops(cls, device):
        return _ScaleFirstElement(device, name=cls.name, dtypes=cls.dtypes, fp8_kv_dtypes=cls.fp8_kv_dtypes)


class WithoutFp8(ReferenceBackend):
    """The reference declaring no FP8 cache dtype: an honest backend without FP8."""

    fp8_kv_dtypes = ()


class HidesServedFp8(ReferenceBackend):
    """Its class declares both FP8 dtypes (the constructor's rule reads that) while its instances
    report none: it accepts FP8 pools its capabilities say it does not serve."""

    def capabilities(self):
        return dataclasses.replace(super().capabilities(), fp8_kv_dtypes=())


FP8_MUTANTS = [
    ScaleIgnoredOnStore,
    StoreWithoutSaturation,
    StoreRoundsTowardZero,
    StoreFirstHeadScale,
    OpsScaleFirstElement,
]

#: the check whose test fails first when the default suite runs with ``-x`` (its run order:
#: the first round's DECODE step over an FP8 cache, the op layer's FP8 case)
CAUGHT_BY = {
    "ScaleIgnoredOnStore": "check_attention_matches_reference[DECODE-gqa4-window_smaller-kv_fp8_e4m3]",
    "StoreWithoutSaturation": "check_attention_matches_reference[DECODE-gqa4-window_smaller-kv_fp8_e4m3]",
    "StoreRoundsTowardZero": "check_attention_matches_reference[DECODE-gqa4-window_smaller-kv_fp8_e4m3]",
    "StoreFirstHeadScale": "check_attention_matches_reference[DECODE-gqa4-window_smaller-kv_fp8_e4m3]",
    "OpsScaleFirstElement": "check_paged_ops[bs16-interleaved-window-kv_fp8_e4m3]",
}
