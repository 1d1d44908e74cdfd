"""``AttnplugBackend``: the class vLLM's selector validates and asks for the builder and impl.

Its capabilities are the chosen attnplug backend's (``declared_capabilities()``), read once per
process: dtypes, head sizes, sliding window, sinks; any block size (the op layer reads block
tables of any size); the KV cache dtypes: ``auto`` (the model's) and the FP8 names
(``fp8`` / ``fp8_e4m3``, ``fp8_e5m2``: ``attnplug.memory.fp8.KV_CACHE_DTYPE_NAMES``) whose dtype
the backend's op layer lists in ``fp8_kv_dtypes``, with per-layer or per-KV-head scales;
decoder attention only; CUDA graphs: none around attention (vLLM's piecewise graphs run it
eagerly). A slot other than ``CUSTOM`` gets a subclass whose ``get_name()`` is that slot's name
(``slot_class_path``).
"""

from __future__ import annotations

import functools
from typing import ClassVar

import torch
from vllm.v1.attention.backend import AttentionBackend, AttentionType, MultipleOf
from vllm.v1.kv_cache_layout import KVCacheLayout

from ...memory.fp8 import KV_CACHE_DTYPE_NAMES
from .selection import attnplug_class

__all__ = ["AttnplugBackend", "slot_class_path"]

_SLOT_PREFIX = "AttnplugBackend_"


class AttnplugBackend(AttentionBackend):
    """attnplug as a vLLM attention backend (module docstring)."""

    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list] = [torch.float16, torch.bfloat16, torch.float32]
    #: the names attnplug knows; ``supports_kv_cache_dtype`` keeps those the op layer serves
    supported_kv_cache_dtypes: ClassVar[list] = list(KV_CACHE_DTYPE_NAMES)
    #: the vLLM name this class answers to
    slot: ClassVar[str] = "CUSTOM"

    @classmethod
    def get_name(cls) -> str:
        return cls.slot

    @staticmethod
    def get_impl_cls():
        from .impl import AttnplugImpl

        return AttnplugImpl

    @staticmethod
    def get_builder_cls():
        from .metadata import AttnplugMetadataBuilder

        return AttnplugMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
        return [MultipleOf(1)]

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple:
        # one stride between the slots of a layer: [num_blocks, block_size, Hkv, 2 * D]
        return (KVCacheLayout.LBNHC,)

    @classmethod
    def get_supported_head_sizes(cls) -> list:
        return list(attnplug_class()[1].head_dims)

    @classmethod
    def supports_dtype(cls, dtype: torch.dtype) -> bool:
        return dtype in attnplug_class()[1].dtypes

    @classmethod
    def supports_kv_cache_dtype(cls, kv_cache_dtype) -> bool:
        from .metadata import served_kv_cache_dtypes

        return kv_cache_dtype is None or kv_cache_dtype in served_kv_cache_dtypes()

    @classmethod
    def supports_per_head_quant_scales(cls) -> bool:
        # the op layer takes a scale per KV head ([Hkv]) as well as one per layer
        from .metadata import served_kv_cache_dtypes

        return any(KV_CACHE_DTYPE_NAMES[name] is not None for name in served_kv_cache_dtypes())

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return bool(attnplug_class()[1].sliding_window)

    @classmethod
    def supports_sink(cls) -> bool:
        return bool(attnplug_class()[1].attention_sinks)

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER


def slot_class_path(slot: str) -> str:
    """The import path of the subclass that answers to vLLM's ``slot``."""
    return f"{__name__}.{_SLOT_PREFIX}{slot}"


@functools.lru_cache(maxsize=None)
def _slot_class(slot: str) -> type:
    return type(f"{_SLOT_PREFIX}{slot}", (AttnplugBackend,), {"slot": slot, "__module__": __name__})


def __getattr__(name: str):
    """``AttnplugBackend_<SLOT>``: made on first import by vLLM (``slot_class_path``)."""
    if name.startswith(_SLOT_PREFIX) and name[len(_SLOT_PREFIX) :]:
        return _slot_class(name[len(_SLOT_PREFIX) :])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
