"""The FP8 KV cache: its dtypes, the quantisation rule every store path follows, and the scales.

A pool (or an engine's cache through the op layer) may store K and V as ``float8_e4m3fn``
(4 exponent bits, 3 mantissa bits, largest finite 448) or ``float8_e5m2`` (5 and 2, largest
finite 57344). Each layer has a float32 scale per KV head for K and one for V (an engine's
per-layer ``k_scale`` / ``v_scale`` is the same value for every head). With ``s`` the head's
scale, a stored byte ``c`` means the value ``c * s``.

Quantisation (the one rule; the Triton store kernels and the portable paths compute exactly
this, bit for bit):

    c = fp8(clamp(float32(x) / s, -max, max))

* ``float32(x) / s`` is an IEEE float32 division (correctly rounded);
* ``clamp`` saturates: a value past the format's largest finite (an outlier, ``+-inf``)
  stores as ``+-max``, never NaN or Inf; NaN stays NaN;
* ``fp8(.)`` rounds to the nearest representable value, ties to even (subnormals included).

Dequantisation: ``float32(c) * s`` (exact in float64, ``fp8`` values have 4 significant bits).
Attention over an FP8 cache is attention over the dequantised keys and values; a backend may
fold ``s`` into the logit scale and the output instead of multiplying every key.

Scales are set before the first store of a layer (``SWAKVPool.set_kv_scales``): changing them
later changes what the stored bytes mean. Nothing here reads a device value on the host except
``host_scales``, which is setup-time (it validates the values).
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional, Tuple, Union

import torch

__all__ = [
    "FP8_KV_DTYPES",
    "KV_CACHE_DTYPE_NAMES",
    "is_fp8",
    "fp8_max",
    "resolve_kv_cache_dtype",
    "quantize_kv",
    "dequantize_kv",
    "host_scales",
]

#: the quantised KV dtypes a pool may store (a backend declares the ones it serves:
#: ``Capabilities.fp8_kv_dtypes``)
FP8_KV_DTYPES: Tuple[torch.dtype, ...] = (torch.float8_e4m3fn, torch.float8_e5m2)

#: the engines' names of a KV cache dtype (vLLM's and SGLang's ``kv_cache_dtype``); "auto":
#: the model's dtype
KV_CACHE_DTYPE_NAMES: Dict[str, Optional[torch.dtype]] = {
    "auto": None,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def is_fp8(dtype: Any) -> bool:
    """Whether ``dtype`` is one of ``FP8_KV_DTYPES``."""
    return dtype in FP8_KV_DTYPES


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of an FP8 KV dtype (448.0 for e4m3fn, 57344.0 for e5m2)."""
    if not is_fp8(dtype):
        raise ValueError(f"{dtype} is not an FP8 KV dtype ({', '.join(_name(d) for d in FP8_KV_DTYPES)})")
    return float(torch.finfo(dtype).max)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def resolve_kv_cache_dtype(value: Union[None, str, torch.dtype], model_dtype: torch.dtype) -> torch.dtype:
    """The dtype a KV cache stores for ``kv_cache_dtype=value``: None or ``"auto"`` is
    ``model_dtype``; ``"fp8"`` / ``"fp8_e4m3"`` float8_e4m3fn, ``"fp8_e5m2"`` float8_e5m2; a
    ``torch.dtype`` is taken as it is. Anything else raises ``ValueError`` naming the choices."""
    if value is None:
        return model_dtype
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and value in KV_CACHE_DTYPE_NAMES:
        dtype = KV_CACHE_DTYPE_NAMES[value]
        return model_dtype if dtype is None else dtype
    raise ValueError(f"kv_cache_dtype must be one of {sorted(KV_CACHE_DTYPE_NAMES)} or a torch.dtype, got {value!r}")


def quantize_kv(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` ``[n, Hkv, D]`` (any floating dtype) stored as ``dtype`` (an FP8 KV dtype) with the
    per-head float32 ``scale`` ``[Hkv]`` (same device): ``fp8(clamp(float32(x) / s, -max, max))``,
    round to nearest even, saturating (module docstring). Returns ``[n, Hkv, D]`` of ``dtype``."""
    limit = fp8_max(dtype)
    y = x.to(torch.float32) / scale.to(torch.float32)[:, None]
    return y.clamp(-limit, limit).to(dtype)


def dequantize_kv(c: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values an FP8 cache holds: ``c`` ``[..., Hkv, D]`` times the per-head ``scale``
    ``[Hkv]``, computed in ``dtype`` (float32: what a kernel computes; float64: exact)."""
    return c.to(dtype) * scale.to(dtype)[:, None]


def host_scales(value: Any, num_kv_heads: int, name: str) -> torch.Tensor:
    """A layer's scales as a float32 CPU tensor ``[num_kv_heads]``: ``value`` is one number
    (every head), a sequence of ``num_kv_heads`` numbers, or a tensor of one or
    ``num_kv_heads`` elements (read on the host: a setup-time call). Each must be a finite
    float > 0 and representable in float32 (neither 0 nor inf once rounded), else
    ``ValueError`` naming ``name`` and the value."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a positive float or {num_kv_heads} of them, got the bool {value!r}")
    try:
        if isinstance(value, torch.Tensor):
            if value.dtype == torch.bool or value.device.type == "meta":
                raise TypeError
            values = value.detach().to("cpu", torch.float64).reshape(-1)
        elif isinstance(value, (int, float)):
            values = torch.tensor([float(value)], dtype=torch.float64)
        else:
            items = list(value)
            if any(isinstance(v, bool) for v in items):
                raise TypeError
            values = torch.tensor([float(v) for v in items], dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"{name} must be a positive float or {num_kv_heads} of them, got {value!r}") from None
    if values.numel() == 1:
        values = values.expand(num_kv_heads)
    if values.numel() != num_kv_heads:
        raise ValueError(f"{name} must be one value or {num_kv_heads} (one per KV head), got {values.numel()}")
    as32 = values.to(torch.float32)
    bad = [
        v
        for v, v32 in zip(values.tolist(), as32.tolist())
        if not (math.isfinite(v) and v > 0 and math.isfinite(v32) and v32 > 0)
    ]
    if bad:
        raise ValueError(f"{name} must hold finite floats > 0 (float32-representable), got {bad[:4]}")
    return as32.contiguous()
