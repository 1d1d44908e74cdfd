"""``AttnplugImpl``: one attention layer of a vLLM model on attnplug's op layer.

``do_kv_cache_update`` stores the step's K/V (``PagedOps.store_kv``: vLLM's ``-1`` padding is
skipped); ``forward`` attends (``PagedOps.attend``) into vLLM's ``output``. vLLM's cache of a
layer arrives as ``[num_blocks, Hkv, block_size, 2 * D]`` in logical order over the ``LBNHC``
layout; its K and V halves are views with one slot stride, read in place.

FP8 KV cache (``kv_cache_dtype`` ``"fp8"`` / ``"fp8_e4m3"``: float8_e4m3fn, ``"fp8_e5m2"``:
float8_e5m2, where the op layer lists the dtype in ``fp8_kv_dtypes``): vLLM allocates the cache
as bytes (uint8), read here as that FP8 dtype; ``store_kv`` quantises the model-dtype key and
value with the layer's ``_k_scale`` / ``_v_scale`` (float32 device tensors of one element, or
one per KV head: vLLM's per-head scales) by ``attnplug.memory.fp8``'s rule, and ``attend``
reads the dequantised cache. The scales stay on the device (no host read per call).

Refused at construction, with the reason (``NotImplementedError``): ALiBi, an attention type
other than decoder, a KV cache dtype other than the model's and the FP8 ones the op layer
serves, a soft-cap or sinks the chosen attnplug backend does not declare. ``calls`` counts
this process's stores and attends (what a test reads to prove attnplug ran in vLLM's worker).
"""

from __future__ import annotations

from collections import Counter
from typing import Optional

import torch
from vllm.v1.attention.backend import AttentionImpl, AttentionType

from ...memory.fp8 import KV_CACHE_DTYPE_NAMES
from .metadata import AttnplugMetadata, ops_for, platform_ops, served_kv_cache_dtypes
from .selection import attnplug_class

__all__ = ["AttnplugImpl", "calls"]

#: this process's op calls: "store", "attend", "layers" (impls built), "backend:<name>", the
#: layers built with each feature ("window", "softcap", "sinks") and with each FP8 cache dtype
#: ("kv_cache:<vLLM's name>")
calls: Counter = Counter()


def _refuse(what: str) -> None:
    cls, _ = attnplug_class()
    raise NotImplementedError(f"attnplug ({cls.name} backend) inside vLLM: {what}")


def _fp8_dtype(kv_cache_dtype) -> Optional[torch.dtype]:
    """The FP8 dtype of vLLM's ``kv_cache_dtype`` name (None: ``auto``, the model's dtype);
    refuses a name attnplug does not know or whose dtype the op layer does not serve."""
    name = "auto" if kv_cache_dtype is None else kv_cache_dtype
    served = served_kv_cache_dtypes()
    if name not in served:
        _refuse(
            f"kv_cache_dtype={kv_cache_dtype!r} is not supported (the {platform_ops().name} op layer serves "
            f"{', '.join(repr(n) for n in served)})"
        )
    return KV_CACHE_DTYPE_NAMES[name]


class AttnplugImpl(AttentionImpl[AttnplugMetadata]):
    """One layer's store and attention through the op layer (module docstring)."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: Optional[int] = None,
        alibi_slopes=None,
        sliding_window: Optional[int] = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: Optional[float] = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: Optional[str] = None,
        sinks: Optional[torch.Tensor] = None,
        **unused,
    ) -> None:
        cls, caps = attnplug_class()
        if alibi_slopes is not None:
            _refuse("ALiBi slopes are not supported")
        if attn_type != AttentionType.DECODER:
            _refuse(f"attention type {attn_type!r} is not supported (decoder only)")
        fp8_dtype = _fp8_dtype(kv_cache_dtype)
        if logits_soft_cap not in (None, 0, 0.0) and not caps.logit_softcap:
            _refuse("logit soft-capping is not declared by this backend")
        if sinks is not None and not caps.attention_sinks:
            _refuse("attention sinks are not declared by this backend")
        if sliding_window is not None and not caps.sliding_window:
            _refuse("sliding windows are not declared by this backend")
        if head_size not in caps.head_dims:
            _refuse(f"head size {head_size} is not one of {caps.head_dims}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads if num_kv_heads is not None else num_heads
        self.sliding_window = int(sliding_window) if sliding_window else None
        self.logits_soft_cap = float(logits_soft_cap) if logits_soft_cap else None
        self.kv_cache_dtype = kv_cache_dtype
        #: the FP8 dtype the cache's bytes hold (None: the cache is in the model's dtype)
        self.fp8_dtype = fp8_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.sinks = sinks
        self._sinks_f32: Optional[torch.Tensor] = None
        calls["layers"] += 1
        calls[f"backend:{cls.name}"] += 1
        for feature, used in (("window", self.sliding_window), ("softcap", self.logits_soft_cap), ("sinks", sinks)):
            if used is not None:
                calls[feature] += 1
        if fp8_dtype is not None:
            calls[f"kv_cache:{kv_cache_dtype}"] += 1

    def _caches(self, kv_cache: torch.Tensor):
        """The K and V halves of vLLM's ``[num_blocks, Hkv, block_size, 2 * D]`` cache, as
        ``[num_blocks, block_size, Hkv, D]`` views (an FP8 cache: its bytes read as the FP8
        dtype)."""
        if self.fp8_dtype is not None and kv_cache.dtype != self.fp8_dtype:
            if kv_cache.dtype != torch.uint8:
                raise ValueError(
                    f"attnplug inside vLLM: kv_cache_dtype={self.kv_cache_dtype!r} but the layer's cache is "
                    f"{kv_cache.dtype} (expected vLLM's uint8 bytes or {self.fp8_dtype})"
                )
            kv_cache = kv_cache.view(self.fp8_dtype)
        kv = kv_cache.transpose(1, 2)
        return kv[..., : self.head_size], kv[..., self.head_size :]

    def _scales(self, layer) -> dict:
        """The layer's FP8 scales as the op layer takes them (``k_scale`` / ``v_scale``: vLLM's
        ``layer._k_scale`` / ``layer._v_scale``, float32 on the device); nothing for a cache in
        the model's dtype."""
        if self.fp8_dtype is None:
            return {}
        k, v = getattr(layer, "_k_scale", None), getattr(layer, "_v_scale", None)
        if k is None or v is None:
            raise ValueError(
                f"attnplug inside vLLM: an FP8 KV cache ({self.kv_cache_dtype}) needs the layer's _k_scale and "
                f"_v_scale (vLLM's attention layer sets them), got a {type(layer).__name__} without them"
            )
        return {"k_scale": k, "v_scale": v}

    def _sinks(self) -> Optional[torch.Tensor]:
        """The layer's sinks as the op layer takes them (float32, contiguous), converted once
        (vLLM loads the weights after the impl is built)."""
        if self.sinks is None:
            return None
        if self._sinks_f32 is None:
            self._sinks_f32 = self.sinks.detach().to(torch.float32).contiguous()
        return self._sinks_f32

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        if self.kv_sharing_target_layer_name is not None:
            return  # the layer reads another layer's cache, which that layer stores
        k_cache, v_cache = self._caches(kv_cache)
        ops_for(kv_cache.device).store_kv(key, value, k_cache, v_cache, slot_mapping, **self._scales(layer))
        calls["store"] += 1

    def forward(
        self,
        layer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: Optional[AttnplugMetadata],
        output: torch.Tensor,
        output_scale: Optional[torch.Tensor] = None,
        output_block_scale: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("attnplug inside vLLM: fused output quantization is not supported")
        if attn_metadata is None:  # vLLM's profiling and warm-up runs
            return output
        n = attn_metadata.num_actual_tokens
        out = output.view(-1, self.num_heads, self.head_size)
        k_cache, v_cache = self._caches(kv_cache)
        ops_for(query.device).attend(
            query[:n],
            k_cache,
            v_cache,
            attn_metadata.step,
            scale=self.scale,
            window=self.sliding_window,
            softcap=self.logits_soft_cap,
            sinks=self._sinks(),
            out=out[:n],
            **self._scales(layer),
        )
        calls["attend"] += 1
        return output
