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

FP8 caches (``fp8_kv_dtypes``, narrowed by the device part's ``fp8_kv_problem``): ``store_kv``
and ``attend`` take the engine's float32 ``k_scale`` / ``v_scale`` device tensors of one or
``Hkv`` elements; ``PagedOps.check_scales`` gives ``[Hkv]`` views (stride 0 for one value), which
the kernels read with their strides on the device, after their PDL wait: no copy, no host read,
so a graph replays whatever the scales hold then.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from attnplug.memory.fp8 import FP8_KV_DTYPES
from attnplug.ops.base import OpsInputError, PagedOps

from .kernels.interpret import interpreting
from .planner import LaunchShape, plan_paged
from .tuning import CudaTuning

__all__ = ["CudaOps"]


class CudaOps(PagedOps):
    """Store and attend over caller-owned paged caches with the cuda backend's kernels."""

    name = "cuda"
    fp8_kv_dtypes = FP8_KV_DTYPES

    def __init__(self, device, tuning: Optional[CudaTuning] = None, part=None, fp8_kv_dtypes=None) -> None:
        """``part``: the device's ``TritonDevicePart`` (the backend's; ``CudaDevice`` when None);
        ``fp8_kv_dtypes``: the backend class's (default: both FP8 dtypes), less those the part
        cannot run on ``device`` (refused naming the reason)."""
        super().__init__(device)
        if part is None:
            from .device import CudaDevice

            part = CudaDevice()
        wanted = tuple(self.fp8_kv_dtypes if fp8_kv_dtypes is None else fp8_kv_dtypes)
        #: FP8 dtypes the part cannot run here, and why
        self._fp8_refused = {d: part.fp8_kv_problem(d, self.device) for d in wanted}
        self._fp8_refused = {d: why for d, why in self._fp8_refused.items() if why is not None}
        self.fp8_kv_dtypes = tuple(d for d in wanted if d not in self._fp8_refused)
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
        self._inputs, self._key_table, self._scales = common.AttentionInputs, common.KeyTable, common.KVScales
        self._num_sms = part.compute_units(self.device)
        self._rows: Optional[torch.Tensor] = None

    def _table_rows(self, n: int) -> torch.Tensor:
        """``arange(n)`` int32 on the device, kept and grown (row ``b`` of the slot table is
        request ``b``'s)."""
        if self._rows is None or self._rows.shape[0] < n:
            self._rows = torch.arange(max(n, 64), dtype=torch.int32, device=self.device)
        return self._rows

    def _check_cache_dtype(self, cache, model_dtype, what) -> None:
        why = self._fp8_refused.get(cache.dtype)
        if why is not None:
            raise OpsInputError(f"the {self.name} ops cannot serve a {cache.dtype} cache on {self.device}: {why}")
        super()._check_cache_dtype(cache, model_dtype, what)

    def _kv_scales(self, k_scale, v_scale, cache):
        """``common.KVScales`` of an FP8 cache (``check_scales``' views), None otherwise."""
        ks, vs = self.check_scales(k_scale, v_scale, cache)
        return None if ks is None else self._scales.of(ks, vs)

    def store_kv(self, key, value, key_cache, value_cache, slot_mapping, *, k_scale=None, v_scale=None) -> None:
        kc, vc, n = self.check_store(key, value, key_cache, value_cache, slot_mapping)
        scales = self._kv_scales(k_scale, v_scale, kc)
        if n == 0:
            return
        self._kv_store(key[:n], value[:n], kc, vc, slot_mapping, scales=scales, pdl=self.pdl)

    def attend(
        self,
        query,
        key_cache,
        value_cache,
        step,
        *,
        scale,
        window=None,
        softcap=None,
        sinks=None,
        out=None,
        k_scale=None,
        v_scale=None,
    ):
        kc, vc, out = self.check_attend(query, key_cache, value_cache, step, scale, window, softcap, sinks, out)
        scales = self._kv_scales(k_scale, v_scale, kc)
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
            kv_fp8=scales is not None,
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
            scales,
        )
        return self._paged_attention(query, kc, vc, out, inputs, plan_paged(shape, self.tuning), pdl=self._schedule)
