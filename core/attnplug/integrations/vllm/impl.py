"""``AttnplugImpl``: one attention layer of a vLLM model on attnplug's op layer.

``do_kv_cache_update`` stores the step's K/V (``PagedOps.store_kv``: vLLM's ``-1`` padding is
skipped); ``forward`` attends (``PagedOps.attend``) into vLLM's ``output``. vLLM's cache of a
layer arrives as ``[num_blocks, Hkv, block_size, 2 * D]`` in logical order over the ``LBNHC``
layout; its K and V halves are views with one slot stride, read in place.

Refused at construction, with the reason (``NotImplementedError``): ALiBi, an attention type
other than decoder, a KV cache dtype other than the model's, a soft-cap or sinks the chosen
attnplug backend does not declare. ``calls`` counts this process's stores and attends (what a
test reads to prove attnplug ran in vLLM's worker).
"""

from __future__ import annotations

from collections import Counter
from typing import Optional

import torch
from vllm.v1.attention.backend import AttentionImpl, AttentionType

from .metadata import AttnplugMetadata, ops_for
from .selection import attnplug_class

__all__ = ["AttnplugImpl", "calls"]

#: this process's op calls: "store", "attend", "layers" (impls built), "backend:<name>", and the
#: layers built with each feature ("window", "softcap", "sinks")
calls: Counter = Counter()


def _refuse(what: str) -> None:
    cls, _ = attnplug_class()
    raise NotImplementedError(f"attnplug ({cls.name} backend) inside vLLM: {what}")


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
        if kv_cache_dtype not in ("auto", None):
            _refuse(f"kv_cache_dtype={kv_cache_dtype!r} is not supported (the model's dtype only)")
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
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.sinks = sinks
        self._sinks_f32: Optional[torch.Tensor] = None
        calls["layers"] += 1
        calls[f"backend:{cls.name}"] += 1
        for feature, used in (("window", self.sliding_window), ("softcap", self.logits_soft_cap), ("sinks", sinks)):
            if used is not None:
                calls[feature] += 1

    def _caches(self, kv_cache: torch.Tensor):
        """The K and V halves of vLLM's ``[num_blocks, Hkv, block_size, 2 * D]`` cache, as
        ``[num_blocks, block_size, Hkv, D]`` views."""
        kv = kv_cache.transpose(1, 2)
        return kv[..., : self.head_size], kv[..., self.head_size :]

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
        ops_for(kv_cache.device).store_kv(key, value, k_cache, v_cache, slot_mapping)
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
        )
        calls["attend"] += 1
        return output
