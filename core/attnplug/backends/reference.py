"""The reference backend: pure PyTorch, device-generic, the numerical oracle.

It runs unchanged on any device PyTorch supports and keeps every rule of the contract, so it
is both the conformance suite's oracle and the embedded default on machines without an
accelerator. It is written for clarity, not speed: each layer gathers the keys of every
request into a padded ``[bs, K, num_kv_heads, head_dim]`` block and runs a masked softmax.

Per step (``init_forward_metadata`` or the graph-replay path), from device tensors only:

* ``swa_out_cache_loc``: the SWA slots of the new tokens, translated once;
* the window's SWA slot table ``swa_slots[b, c]`` (position ``swa_start[b] + c``) — the
  full-pool rows are translated in the same single call, never per layer;
* the token -> (request, index) map that scatters q into the padded layout.

``needs_cpu_seq_lens = False``: nothing here reads the device from the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from ..backend import AttentionBackend, Capabilities, GraphSupport
from ..batch import ForwardBatch, ForwardMode

__all__ = ["ReferenceBackend"]


@dataclass
class _StepMetadata:
    """Everything the layers of one step read. All tensors live on the pool's device."""

    q_len_max: int  # host: width of the padded q layout (max new tokens of one request)
    token_req: torch.Tensor  # [T] int64: request index of each new token
    token_idx: torch.Tensor  # [T] int64: index of the token among its request's new tokens
    q_start: torch.Tensor  # [bs] int64: position of each request's first new token
    full_slots: torch.Tensor  # [bs, Kf] int64: full-pool slot of positions 0..Kf-1
    swa_out_cache_loc: Optional[torch.Tensor]  # [T] int32: hoisted SWA slots of the new tokens
    swa_slots: Optional[torch.Tensor]  # [bs, Ks] int64: SWA slot of position swa_start + c (0 past seq_len)
    swa_start: Optional[torch.Tensor]  # [bs] int64: position of column 0 of swa_slots

    def copy_(self, other: "_StepMetadata") -> "_StepMetadata":
        """Write ``other``'s values into this metadata's (static) tensors, in place."""
        for name in ("token_req", "token_idx", "q_start", "full_slots", "swa_out_cache_loc", "swa_slots", "swa_start"):
            dst = getattr(self, name)
            if dst is not None:
                dst.copy_(getattr(other, name))
        return self


class ReferenceBackend(AttentionBackend):
    """Pure-PyTorch attention over the hybrid paged KV cache (see module docstring)."""

    name = "reference"
    needs_cpu_seq_lens = False

    def __init__(self, pool, req_to_token_pool, *, num_heads, sliding_window=None, scaling=None):
        super().__init__(pool, req_to_token_pool, num_heads=num_heads, sliding_window=sliding_window, scaling=scaling)
        self.has_swa = bool(pool.swa_layer_ids)
        self.forward_metadata: Optional[_StepMetadata] = None
        self.cuda_graph_swa_out_cache_loc: Optional[torch.Tensor] = None
        self._graph_buffers: Optional[Dict[str, torch.Tensor]] = None
        self._graph_metadata: Dict[Tuple[int, int], _StepMetadata] = {}

    def capabilities(self) -> Capabilities:
        return Capabilities(
            device_type=self.device.type,
            needs_cpu_seq_lens=self.needs_cpu_seq_lens,
            pdl=False,
            graphs=GraphSupport.UNIFORM,
            dtypes=(torch.float16, torch.bfloat16, torch.float32),
            head_dims=(16, 32, 64, 80, 96, 128, 256),
            page_sizes=(1, 2, 4, 8, 16, 32, 64, 128),
            sliding_window=True,
        )

    @classmethod
    def describe(cls) -> dict:
        """What ``attnplug info`` shows without building a pool."""
        return {"pdl": False, "graphs": GraphSupport.UNIFORM.name, "needs_cpu_seq_lens": cls.needs_cpu_seq_lens}

    # ------------------------------------------------------------------ metadata
    def _swa_table_width(self, q_len_max: int) -> int:
        width = self.req_to_token_pool.req_to_token.shape[1]
        return min(width, self.sliding_window + q_len_max - 1)

    def _build_metadata(self, batch: ForwardBatch, q_len_max: int) -> _StepMetadata:
        """Compute one step's metadata with device ops only (no host read, no sync)."""
        dev = self.device
        bs, T = batch.batch_size, batch.num_tokens
        seq = batch.seq_lens.long()
        if batch.extend_seq_lens is not None:
            ext = batch.extend_seq_lens.long()
        else:  # DECODE: one new token per request
            ext = torch.full((bs,), 1, dtype=torch.int64, device=dev)
        ends = torch.cumsum(ext, 0)  # [bs] exclusive end of each request's tokens
        tok = torch.arange(T, device=dev)
        token_req = torch.searchsorted(ends, tok, right=True)
        token_idx = tok - (ends - ext)[token_req]
        q_start = seq - ext
        rows = self.req_to_token_pool.req_to_token[batch.req_pool_indices.long()]  # [bs, Kf] int32

        swa_out_cache_loc = swa_slots = swa_start = None
        if self.has_swa:
            width = rows.shape[1]
            ks = self._swa_table_width(q_len_max)
            swa_start = (q_start - self.sliding_window + 1).clamp_min(0)
            cols = swa_start[:, None] + torch.arange(ks, device=dev)  # [bs, Ks] positions
            window_full = torch.gather(rows, 1, cols.clamp_max(width - 1)).long()
            # The ONE translation of this step: the new tokens and the window's rows together.
            both = self.pool.translate_loc_from_full_to_swa(torch.cat([batch.out_cache_loc, window_full.flatten()]))
            swa_out_cache_loc = both[:T]
            swa_slots = torch.where(cols < seq[:, None], both[T:].view(bs, ks).long(), 0)
        return _StepMetadata(
            q_len_max=q_len_max,
            token_req=token_req,
            token_idx=token_idx,
            q_start=q_start,
            full_slots=rows.long(),
            swa_out_cache_loc=swa_out_cache_loc,
            swa_slots=swa_slots,
            swa_start=swa_start,
        )

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        q_len = batch.q_len
        if q_len is None:  # EXTEND / IDLE: the widest request, known on the host by construction
            host_ext = batch.extend_seq_lens_cpu
            if host_ext is None and batch.extend_seq_lens is not None:
                host_ext = batch.extend_seq_lens.tolist()  # host tensor (validated), no device read
            q_len = max(host_ext, default=1) if host_ext is not None else 1
        self.forward_metadata = self._build_metadata(batch, q_len)

    # ------------------------------------------------------------------ graphs
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        dev = self.device
        width = self.req_to_token_pool.req_to_token.shape[1]
        i64 = dict(dtype=torch.int64, device=dev)
        buffers = {
            "token_req": torch.zeros(max_num_tokens, **i64),
            "token_idx": torch.zeros(max_num_tokens, **i64),
            "q_start": torch.zeros(max_bs, **i64),
            "full_slots": torch.zeros(max_bs, width, **i64),
        }
        self.cuda_graph_swa_out_cache_loc = torch.zeros(max_num_tokens, dtype=torch.int32, device=dev)
        if self.has_swa:
            buffers["swa_slots"] = torch.zeros(max_bs, self._swa_table_width(max_num_tokens), **i64)
            buffers["swa_start"] = torch.zeros(max_bs, **i64)
        self._graph_buffers = buffers
        self._graph_metadata = {}

    def _graph_views(self, batch: ForwardBatch) -> _StepMetadata:
        if self._graph_buffers is None:
            raise RuntimeError("init_cuda_graph_state() must run before capture or replay")
        q_len = batch.q_len
        if q_len is None:
            raise ValueError(f"{batch.forward_mode.name} steps are not captured by the reference backend (UNIFORM)")
        key = (batch.batch_size, q_len)
        md = self._graph_metadata.get(key)
        if md is None:
            bs, n, b = batch.batch_size, batch.num_tokens, self._graph_buffers
            if n > self.cuda_graph_swa_out_cache_loc.shape[0] or bs > b["q_start"].shape[0]:
                raise ValueError(f"batch of {bs} requests / {n} tokens exceeds the graph state "
                                 f"({b['q_start'].shape[0]} / {self.cuda_graph_swa_out_cache_loc.shape[0]})")
            ks = self._swa_table_width(q_len) if self.has_swa else 0
            md = _StepMetadata(
                q_len_max=q_len,
                token_req=b["token_req"][:n],
                token_idx=b["token_idx"][:n],
                q_start=b["q_start"][:bs],
                full_slots=b["full_slots"][:bs],
                swa_out_cache_loc=self.cuda_graph_swa_out_cache_loc[:n] if self.has_swa else None,
                swa_slots=b["swa_slots"][:bs, :ks] if self.has_swa else None,
                swa_start=b["swa_start"][:bs] if self.has_swa else None,
            )
            self._graph_metadata[key] = md
        return md

    def _fill_graph_metadata(self, batch: ForwardBatch) -> None:
        md = self._graph_views(batch)
        md.copy_(self._build_metadata(batch, md.q_len_max))
        self.cuda_graph_swa_out_cache_loc[batch.num_tokens:].zero_()  # padding writes go to slot 0
        self.forward_metadata = md

    def init_forward_metadata_capture_cuda_graph(self, batch: ForwardBatch) -> None:
        self._fill_graph_metadata(batch)

    def init_forward_metadata_replay_cuda_graph(self, batch: ForwardBatch) -> None:
        self._fill_graph_metadata(batch)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    # ------------------------------------------------------------------ the layer
    def forward(self, q, k, v, layer_id, batch, save_kv_cache=True):
        md = self.forward_metadata
        if md is None:
            raise RuntimeError("forward() before init_forward_metadata() for this step")
        T = batch.num_tokens
        if q.dim() != 3 or q.shape[0] != T or q.shape[1] != self.num_heads or q.shape[2] != self.head_dim:
            raise ValueError(f"q must be [{T}, {self.num_heads}, {self.head_dim}], got {tuple(q.shape)}")
        kv_shape = (T, self.num_kv_heads, self.head_dim)
        if tuple(k.shape) != kv_shape or tuple(v.shape) != kv_shape:
            raise ValueError(f"k and v must be {list(kv_shape)}, got {tuple(k.shape)} and {tuple(v.shape)}")
        is_swa = self.pool.is_swa_layer(layer_id)
        if save_kv_cache:
            if is_swa:
                self.pool.set_kv_buffer(layer_id, batch.out_cache_loc, k, v, swa_loc=md.swa_out_cache_loc)
            else:
                self.pool.set_kv_buffer(layer_id, batch.out_cache_loc, k, v)
        if T == 0:
            return q.new_empty(q.shape)

        k_cache, v_cache = self.pool.get_kv_buffer(layer_id)
        if is_swa:
            slots = md.swa_slots
            key_pos = md.swa_start[:, None] + torch.arange(slots.shape[1], device=q.device)
        else:
            slots = md.full_slots
            key_pos = torch.arange(slots.shape[1], device=q.device)[None, :]
        window = self.sliding_window if is_swa else None
        return self._attend(q, k_cache[slots], v_cache[slots], key_pos, window, md)

    def _attend(self, q, keys, values, key_pos, window, md: _StepMetadata) -> torch.Tensor:
        """q [T, H, D]; keys/values [bs, K, Hkv, D]; key_pos [bs or 1, K] positions."""
        T, H, D = q.shape
        bs, K, Hkv, _ = keys.shape
        G, Q = H // Hkv, md.q_len_max
        cdt = torch.promote_types(q.dtype, torch.float32)
        qp = torch.zeros(bs, Q, H, D, dtype=cdt, device=q.device)
        qp[md.token_req, md.token_idx] = q.to(cdt)
        q_pos = md.q_start[:, None] + torch.arange(Q, device=q.device)  # [bs, Q]
        kp, qq = key_pos[:, None, :], q_pos[:, :, None]
        mask = kp <= qq  # causal (also excludes positions at or past seq_len)
        if window is not None:
            mask = mask & (kp > qq - window)
        scores = torch.einsum("bqhgd,bkhd->bhgqk", qp.view(bs, Q, Hkv, G, D), keys.to(cdt)) * self.scaling
        scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
        row_max = scores.amax(-1, keepdim=True)
        row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
        p = torch.exp(scores - row_max)
        denom = p.sum(-1, keepdim=True)
        out = torch.einsum("bhgqk,bkhd->bqhgd", p / denom.clamp_min(torch.finfo(cdt).tiny), values.to(cdt))
        return out.reshape(bs, Q, H, D)[md.token_req, md.token_idx].to(q.dtype)
