"""``AttnplugMetadataBuilder``: one ``PagedOps.plan`` per step and KV cache group.

vLLM gives each KV cache group (full attention, each sliding-window group) its own block table
and slot mapping; the builder of a group plans the step over them once, and every layer of the
group reads that plan. Only device tensors and the host bounds vLLM already has
(``max_query_len``, ``max_seq_len``) are read: no ``seq_lens_cpu``, no host sync.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.v1.attention.backend import AttentionCGSupport, AttentionMetadataBuilder, CommonAttentionMetadata

from ...memory.fp8 import KV_CACHE_DTYPE_NAMES
from ...ops import PagedOps, PagedStep
from .selection import attnplug_class

__all__ = ["AttnplugMetadata", "AttnplugMetadataBuilder", "ops_for", "platform_ops", "served_kv_cache_dtypes"]


@functools.lru_cache(maxsize=None)
def _ops(device_type: str, index) -> PagedOps:
    cls, _ = attnplug_class(device_type)
    return cls.paged_ops(torch.device(device_type, index) if index is not None else torch.device(device_type))


def ops_for(device) -> PagedOps:
    """The chosen attnplug backend's op layer on ``device`` (one per device and process)."""
    device = torch.device(device)
    return _ops(device.type, device.index)


def platform_ops() -> PagedOps:
    """The op layer on vLLM's platform device type (what the backend class and the impls check
    a configuration against, e.g. the FP8 cache dtypes it serves)."""
    from vllm.platforms import current_platform

    return ops_for(current_platform.device_type or "cpu")


def served_kv_cache_dtypes() -> list:
    """vLLM's ``kv_cache_dtype`` names attnplug serves on vLLM's platform: ``auto``, and each FP8
    name whose dtype the chosen backend's op layer lists in ``fp8_kv_dtypes``."""
    fp8 = platform_ops().fp8_kv_dtypes
    return [name for name, dtype in KV_CACHE_DTYPE_NAMES.items() if dtype is None or dtype in fp8]


@dataclass
class AttnplugMetadata:
    """One step of one KV cache group: ``num_actual_tokens`` (the rows of q that are real) and
    the op layer's ``step``."""

    num_actual_tokens: int
    step: PagedStep


class AttnplugMetadataBuilder(AttentionMetadataBuilder[AttnplugMetadata]):
    """Plans each step of one KV cache group with the op layer (module docstring)."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.block_size = int(kv_cache_spec.block_size)
        self.ops = ops_for(device)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> AttnplugMetadata:
        cm = common_attn_metadata
        if isinstance(cm.causal, torch.Tensor) or not cm.causal:
            raise NotImplementedError("attnplug serves causal decoder attention only (this batch is not causal)")
        n = int(cm.num_actual_tokens)
        step = self.ops.plan(
            cm.query_start_loc[: cm.num_reqs + 1],
            cm.seq_lens[: cm.num_reqs],
            cm.block_table_tensor[: cm.num_reqs],
            self.block_size,
            num_tokens=n,
            max_query_len=int(cm.max_query_len),
            max_seq_len=int(cm.max_seq_len),
        )
        return AttnplugMetadata(num_actual_tokens=n, step=step)
