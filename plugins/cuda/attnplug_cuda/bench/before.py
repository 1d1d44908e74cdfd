"""The "before" path of a step: what the cuda backend replaces, kept only as a benchmark baseline.

``BeforeBackend`` computes the same attention as ``CudaBackend`` (same paged-attention
kernel, same tables), but the way an engine did it before attnplug's hot-path rules:

* ``needs_cpu_seq_lens = True``: every step's metadata (``cu_q_lens``, the new tokens'
  positions, the window starts) is built on the HOST from ``batch.seq_lens_cpu`` and sent
  with ``torch.tensor(list, device=...)``, a blocking host-to-device copy that waits behind
  everything already queued on the GPU (it syncs; graph replays cannot be enqueued ahead);
* EVERY SWA layer translates ``out_cache_loc`` through
  ``pool.translate_loc_from_full_to_swa`` and rebuilds the window's SWA slot table with
  PyTorch ops (a handful of small kernels per layer instead of none);
* KV is stored with ``pool.set_kv_buffer`` (PyTorch ``index_put``), not the fused store;
* PDL is off.

It deliberately BREAKS the attnplug contract (docs/contract.md rules 1-3: per-layer translation,
host-built metadata, no PDL). It exists so the benchmark suite can measure the cuda backend
against its predecessor in the same run; never register it or use it in an engine.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional

import torch

from attnplug.batch import ForwardBatch

from ..backend import CudaBackend
from ..step_tables import StepTables
from ..tuning import CudaTuning

__all__ = ["BeforeBackend"]


def _host_ints(values, fallback: Optional[torch.Tensor]) -> List[int]:
    if values is not None:
        return [int(x) for x in values]
    # The before path reads the device when the engine gave no host mirror (a sync).
    return [int(x) for x in fallback.tolist()]


class BeforeBackend(CudaBackend):
    """Benchmark baseline: per-layer translation, host-built metadata, index_put stores, no
    PDL (see the module docstring). It breaks the contract on purpose."""

    name = "cuda-before"
    needs_cpu_seq_lens = True
    copies_replay_batch = False  # the graph runner copies the step into its static batch

    def __init__(self, pool, req_to_token_pool, *, num_heads, sliding_window=None, scaling=None):
        # every step's layers: paged_attention alone, without PDL (the store: index_put, below)
        tuning = dataclasses.replace(CudaTuning(), pdl=False, one_launch=False, paged_store=False)
        super().__init__(
            pool, req_to_token_pool, num_heads=num_heads, sliding_window=sliding_window, scaling=scaling, tuning=tuning
        )
        self.pdl_reason = "before path: PDL off"
        self.kv_store_impl = "index_put"
        self.kv_store_reason = "before path: pool.set_kv_buffer (PyTorch index_put)"

    # ------------------------------------------------------------------ metadata (host)
    def _fill(self, batch: ForwardBatch, t: StepTables) -> None:
        """Host lists -> ``torch.tensor(list, device=...)`` -> the step's tables. No SWA
        translation here: the before path translates in every SWA layer."""
        bs, T, dev = batch.batch_size, batch.num_tokens, self.device
        seq = _host_ints(batch.seq_lens_cpu, batch.seq_lens)
        if batch.q_len is not None:
            ext = [batch.q_len] * bs
        else:
            ext = _host_ints(batch.extend_seq_lens_cpu, batch.extend_seq_lens)
        cu = [0]
        for e in ext:
            cu.append(cu[-1] + e)
        pos = [s - e + i for s, e in zip(seq, ext) for i in range(e)]
        if self.has_swa:
            ws = [max(0, s - e - self.sliding_window + 1) for s, e in zip(seq, ext)]
        else:
            ws = [0] * bs
        i32 = dict(dtype=torch.int32, device=dev)
        t.cu_q_lens[: bs + 1].copy_(torch.tensor(cu, **i32))
        t.token_pos[:T].copy_(torch.tensor(pos, **i32))
        t.window_start[:bs].copy_(torch.tensor(ws, **i32))

    # ------------------------------------------------------------------ per-layer work
    def _window_table(self, batch: ForwardBatch, t: StepTables) -> torch.Tensor:
        """The window's SWA slot table, rebuilt with PyTorch ops (every SWA layer)."""
        r2t = self.req_to_token_pool.req_to_token
        cols_max = r2t.shape[1]
        width = self.shape.table_width(t.max_q_len)
        cols = torch.arange(width, dtype=torch.int64, device=self.device)
        pos = t.window_start[:, None].long() + cols[None, :]  # [bs, width]
        valid = (pos < batch.seq_lens[:, None]) & (pos < cols_max)
        full = r2t[batch.req_pool_indices.long()[:, None], pos.clamp(max=cols_max - 1)]
        swa = self.pool.translate_loc_from_full_to_swa(full.long())
        return torch.where(valid, swa, torch.zeros_like(swa)).to(torch.int32)

    def forward(self, q, k, v, layer_id, batch, save_kv_cache=True):
        t = self._step_tables()
        is_swa = self.pool.is_swa_layer(layer_id)
        k_cache, v_cache = self.pool.get_kv_buffer(layer_id)
        if save_kv_cache:
            if is_swa:
                # The before path: translate in EVERY SWA layer.
                swa_loc = self.pool.translate_loc_from_full_to_swa(batch.out_cache_loc)
                self.pool.set_kv_buffer(layer_id, batch.out_cache_loc, k, v, swa_loc=swa_loc)
            else:
                self.pool.set_kv_buffer(layer_id, batch.out_cache_loc, k, v)
        out = torch.empty_like(q)
        if batch.num_tokens == 0:
            return out
        window_table = self._window_table(batch, t) if is_swa else None
        keys = self.keys(is_swa, batch, t, window_table)
        window = self.sliding_window if is_swa else None
        inputs = self._inputs(t.cu_q_lens, batch.seq_lens, keys, t.max_q_len, self.scaling, window)
        return self._paged_attention(
            q, k_cache, v_cache, out, inputs, t.plan.layer(is_swa).kernel, workspace=t.workspace
        )
