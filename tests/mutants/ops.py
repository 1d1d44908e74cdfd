"""Mutants of the op layer (``paged_ops``: store and attend over caches an engine owns): each
backend is the reference, whose ``paged_ops`` returns ops with one plausible engine-adapter bug.
Their pool-level ``forward`` is the reference's, so only the op-layer check can see them."""

from __future__ import annotations

import torch

from attnplug.backends.reference import ReferenceBackend
from attnplug.ops import PortableOps
from attnplug.ops.base import PagedStep


class _WrapsPadding(PortableOps):
    def store_kv(self, key, value, key_cache, value_cache, slot_mapping):
        kc, vc, n = self.check_store(key, value, key_cache, value_cache, slot_mapping)
        slots = slot_mapping.long()  # -1 padding indexes the last slot, as Python indexing does
        kc[slots], vc[slots] = key[:n], value[:n]


class OpsStoreWrapsPadding(ReferenceBackend):
    """The store takes the engine's ``-1`` padding as an index: the cache's last slot receives
    the padded token's k/v."""

    WITNESS = ("ops",)

    @classmethod
    def paged_ops(cls, device):
        return _WrapsPadding(device)


class _BlockOffsetDropped(PortableOps):
    def plan(self, query_start_loc, seq_lens, block_table, block_size, **kw):
        step = super().plan(query_start_loc, seq_lens, block_table, block_size, **kw)
        slots = step.slot_table.long()
        first = torch.where(slots > 0, slots - slots % block_size, 0)  # every key of a block reads its first slot
        return PagedStep(**{**step.__dict__, "slot_table": first.to(torch.int32)})


class OpsBlockOffsetDropped(ReferenceBackend):
    """The block table is expanded to slots without the offset inside a block (right at block
    size 1, wrong above)."""

    WITNESS = ("ops",)

    @classmethod
    def paged_ops(cls, device):
        return _BlockOffsetDropped(device)


class _DenseHeads(PortableOps):
    def attend(self, query, key_cache, value_cache, step, **kw):
        def dense(cache):
            flat = cache.flatten(0, 1) if cache.dim() == 4 else cache
            return flat.as_strided(flat.shape, (flat.stride(0), flat.shape[2], 1))  # head stride D assumed

        return super().attend(query, dense(key_cache), dense(value_cache), step, **kw)


class OpsDenseHeadStride(ReferenceBackend):
    """Attention assumes dense heads (head stride ``D``): right for separate K and V caches,
    wrong for the halves of an interleaved ``[..., 2 * D]`` cache (it reads the other half)."""

    WITNESS = ("ops",)

    @classmethod
    def paged_ops(cls, device):
        return _DenseHeads(device)


class _WindowIgnored(PortableOps):
    def attend(self, query, key_cache, value_cache, step, **kw):
        kw["window"] = None
        return super().attend(query, key_cache, value_cache, step, **kw)


class OpsWindowIgnored(ReferenceBackend):
    """The op layer drops the window an engine passes (its pool-level forward keeps it)."""

    WITNESS = ("ops",)

    @classmethod
    def paged_ops(cls, device):
        return _WindowIgnored(device)
