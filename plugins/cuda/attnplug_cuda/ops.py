"""``CudaOps``: the cuda backend's kernels over caches an engine owns (``attnplug.ops``).

The same Triton kernels as ``CudaBackend``, with no pool: ``store_kv`` is ``kv_store``
(``_kv_store_kernel``), ``attend`` is ``paged_attention`` (``_paged_attention_kernel`` and,
when the planner splits a long KV range, ``_split_combine_kernel``) over the step's slot table
(``PagedOps.plan``: one device op per step and cache group). The caches may be the K and V
halves of one interleaved cache (vLLM's ``[num_blocks, block_size, Hkv, 2 * D]`` seen through
``[..., :D]`` and ``[..., D:]``): the kernels take the slot and head strides. The plan comes
from ``planner.plan_paged`` and host ints only; with PDL (``pdl_supported``) both launches run
the ``PLAIN`` schedule (wait before the first load, release after the last store), safe after
any kernel an engine launches before them.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from attnplug.ops.base import PagedOps

from .kernels.interpret import interpreting
from .planner import LaunchShape, plan_paged
from .tuning import CudaTuning

__all__ = ["CudaOps"]


class CudaOps(PagedOps):
    """Store and attend over caller-owned paged caches with the cuda backend's kernels."""

    name = "cuda"

    def __init__(self, device, tuning: Optional[CudaTuning] = None, part=None) -> None:
        """``part``: the device's ``TritonDevicePart`` (the backend's; ``CudaDevice`` when None)."""
        super().__init__(device)
        if part is None:
            from .device import CudaDevice

            part = CudaDevice()
        if self.device.type != part.device_type and not interpreting():
            raise ValueError(
                f"the {part.device_type} ops need a {part.device_type} device, got {self.device} "
                "(on the CPU they run only under the Triton interpreter, TRITON_INTERPRET=1)"
            )
        from .kernels import common, kv_store, paged_attention, pdl

        tuning = tuning if tuning is not None else part.default_tuning()
        ok, self.pdl_reason = part.pdl_support(self.device)
        #: the tuning these ops run with (the Triton KV store: the C++ one needs contiguous caches)
        self.tuning = dataclasses.replace(tuning, kv_store="triton")
        self.pdl = ok and tuning.pdl
        self._schedule = pdl.PLAIN if self.pdl else None
        self._kv_store, self._paged_attention = kv_store.kv_store, paged_attention.paged_attention
        self._inputs, self._key_table = common.AttentionInputs, common.KeyTable
        self._num_sms = part.compute_units(self.device)
        self._rows: Optional[torch.Tensor] = None

    def _table_rows(self, n: int) -> torch.Tensor:
        """``arange(n)`` int32 on the device, kept and grown (row ``b`` of the slot table is
        request ``b``'s)."""
        if self._rows is None or self._rows.shape[0] < n:
            self._rows = torch.arange(max(n, 64), dtype=torch.int32, device=self.device)
        return self._rows

    def store_kv(self, key, value, key_cache, value_cache, slot_mapping) -> None:
        kc, vc, n = self.check_store(key, value, key_cache, value_cache, slot_mapping)
        if n == 0:
            return
        self._kv_store(key[:n], value[:n], kc, vc, slot_mapping, pdl=self.pdl)

    def attend(self, query, key_cache, value_cache, step, *, scale, window=None, softcap=None, sinks=None, out=None):
        kc, vc, out = self.check_attend(query, key_cache, value_cache, step, scale, window, softcap, sinks, out)
        B = step.num_reqs
        if step.num_tokens == 0 or B == 0:
            return out
        table = step.slot_table
        hkv = kc.shape[1]
        T, H, D = query.shape
        shape = LaunchShape(
            num_reqs=B,
            num_tokens=T,
            num_kv_heads=hkv,
            group=H // hkv,
            head_dim=D,
            max_q_len=max(1, step.max_query_len),
            max_kv_len=max(1, table.shape[1]),
            window=window,
            num_sms=self._num_sms,
        )
        inputs = self._inputs(
            step.query_start_loc,
            step.seq_lens,
            self._key_table.of(table, self._table_rows(B)),
            shape.max_q_len,
            float(scale),
            window,
            None if softcap is None else float(softcap),
            sinks,
        )
        return self._paged_attention(query, kc, vc, out, inputs, plan_paged(shape, self.tuning), pdl=self._schedule)
