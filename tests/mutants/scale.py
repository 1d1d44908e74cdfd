"""The scale mutant of issue 40 (a layer KV buffer past 2**31 elements), and two backends that
exercise the refusal side of ``check_large_kv_buffers``.

``Int32SlotOffsets`` is the kernel bug only a buffer that large shows: it reads each key and
value row at the flat element offset ``slot * num_kv_heads * head_dim`` computed in 32 bits,
through a flattened view of the layer's buffer. Below 2**31 elements every offset is exact and
the mutant is the reference; past it the product wraps (two's complement, as a kernel's ``int``
offset does) and the layer attends over other rows. It declares ``large_kv_buffers=True``: the
bug is the claim. Today's suite without ``check_large_kv_buffers`` never builds such a buffer
and passes it; that check fails it where the device has the memory
(``tests/conformance/test_scale_mutant.py`` shows both, and that it is really wrong).

It is not in the catalogue's ``SUBTLE`` list (``tests/mutants/__init__.py``), which must be
caught within the quick profile on any host: catching it needs pools of about 8.7 GB (14.5 GB free) on
the device. Name it ``mutants.scale:Int32SlotOffsets`` wherever a backend target is given.

``UndeclaredLargeKvBuffers`` (the reference declaring ``large_kv_buffers=False``: the core
constructor refuses the pool) and ``AcceptsUndeclaredLargeKvBuffers`` (its instances report
False while the class declares True, so the constructor's rule lets the pool through) are the
case ``undeclared_refused`` passing and failing.
"""

from __future__ import annotations

import dataclasses

import torch

from attnplug.backends.reference import ReferenceBackend
from attnplug.ops.portable import NO_KEY

__all__ = ["Int32SlotOffsets", "int32_offsets", "UndeclaredLargeKvBuffers", "AcceptsUndeclaredLargeKvBuffers"]


def int32_offsets(slots: torch.Tensor, row: int) -> torch.Tensor:
    """The element offsets ``slots * row`` as a signed 32-bit product holds them (int64 tensor of
    ``slots``' shape): exact up to ``2**31 - 1``, wrapped modulo ``2**32`` past it."""
    return (slots.long() * row + 2**31) % 2**32 - 2**31


def _read_rows(buf: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``buf[slots]`` (``buf`` ``[S, Hkv, D]``, ``slots`` int ``[bs, K]`` -> ``[bs, K, Hkv, D]``)
    read through the flat view of ``buf`` at ``int32_offsets``: a wrapped, negative offset
    reads from the view's end, as a wrapped pointer reads another row."""
    row = buf.shape[1] * buf.shape[2]
    index = int32_offsets(slots, row)[..., None] + torch.arange(row, device=buf.device)
    return buf.reshape(-1)[index].view(*slots.shape, buf.shape[1], buf.shape[2])


class Int32SlotOffsets(ReferenceBackend):
    """Scale: keys and values read at 32-bit element offsets (see the module docstring)."""

    WITNESS = ("scale",)

    @classmethod
    def declared_capabilities(cls):
        return dataclasses.replace(super().declared_capabilities(), large_kv_buffers=True)

    def forward(self, q, k, v, layer_id, batch, save_kv_cache=True, *, sinks=None):
        out = super().forward(q, k, v, layer_id, batch, save_kv_cache, sinks=sinks)  # checks, stores
        if batch.num_tokens == 0:
            return out
        md = self.forward_metadata
        is_swa = self.pool.is_swa_layer(layer_id)
        slots = md.swa_slots if is_swa else md.full_slots
        first = md.swa_start[:, None] if is_swa else 0
        key_pos = torch.where(slots > 0, first + torch.arange(slots.shape[1], device=q.device), NO_KEY)
        k_cache, v_cache = self.pool.get_kv_buffer(layer_id)
        window = self.sliding_window if is_swa else None
        keys, values = _read_rows(k_cache, slots), _read_rows(v_cache, slots)
        return self._attend(q, keys, values, key_pos, window, md, sinks=sinks)


class UndeclaredLargeKvBuffers(ReferenceBackend):
    """The reference declaring ``large_kv_buffers=False``: its constructor (the core's rule)
    refuses a pool whose largest layer buffer has more than 2**31 - 1 elements."""

    @classmethod
    def declared_capabilities(cls):
        return dataclasses.replace(super().declared_capabilities(), large_kv_buffers=False)


class AcceptsUndeclaredLargeKvBuffers(ReferenceBackend):
    """Its instances report ``large_kv_buffers=False`` while the class declares True (which the
    constructor's rule reads): it accepts the pool its capabilities say it cannot address."""

    def capabilities(self):
        return dataclasses.replace(super().capabilities(), large_kv_buffers=False)
