"""The portable backend base: attention over the hybrid paged KV cache in plain PyTorch.

``PortableBackend`` keeps every rule of the contract (docs/contract.md) with device tensors
only, so it runs unchanged on any device PyTorch supports. The reference backend (the
conformance suite's oracle) is this base under its own name; a plugin without fused kernels
(a new device's first backend, XPU's fallback without Triton for XPU) subclasses it and sets
its ``device_part``. It is
written for clarity, not speed: each layer gathers the keys of every request into a padded
``[bs, K, num_kv_heads, head_dim]`` block and runs a masked softmax (logits soft-capped when
the backend is built with ``logit_softcap``; the layer's ``sinks`` in the denominator).

Per step (``init_forward_metadata`` or the graph-replay path), from device tensors only:

* ``swa_out_cache_loc``: the SWA slots of the new tokens, translated once;
* the window's SWA slot table ``swa_slots[b, c]`` (position ``swa_start[b] + c``) — the
  full-pool rows are translated in the same single call, never per layer;
* the token -> (request, index) map that scatters q into the padded layout;
* the slots the layers store at: ``out_cache_loc`` and its translation with every entry
  outside ``[1, num_slots)`` (the sink 0, ``-1`` = no slot, garbage) sent to the sink, whose
  own value is written back, so such a token changes nothing.

Graph mode: ``init_cuda_graph_state`` creates a new ``GraphBuffers`` (every buffer at its
maximum size, ``cuda_graph_swa_out_cache_loc`` among them) and makes it the graph state in use;
capture and replay fill views of them in place, the hoisted SWA slots through
``GraphBuffers.fill_swa_out_cache_loc``. Each ``GraphRunner`` owns the state its constructor
made and switches the backend back to it (``set_cuda_graph_state``) before its captures and
replays, so several runners share one backend.

Out-of-range indices never wrap or fault: a ``req_pool_indices`` entry outside the table
reads row 0 (no keys), a table entry outside ``[1, num_slots)`` is no key. Key columns a
query must not see (causal, window, past ``seq_len``, no slot) contribute exactly zero
whatever their slot holds (NaN and Inf included): their keys and values are replaced with
``torch.where``, never multiplied by a zero weight.

``needs_cpu_seq_lens = False``: nothing here reads the device from the host.

A subclass sets ``name``, ``device_part`` and, where they differ, the class attributes
``dtypes``, ``head_dims`` and ``page_sizes``; ``declared_capabilities()`` is built from them
(graphs: ``ALWAYS``, EXTEND steps captured too: every table is built from device tensors with
the captured token count as the bound of one request's tokens; an install whose device part
cannot make graphs narrows it to ``NEVER``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Dict, Optional, Tuple

import torch

from ..backend import AttentionBackend, Capabilities, GraphSupport
from ..batch import ForwardBatch, ForwardMode
from ..env import validation_enabled
from ..graph_buffers import GraphBuffers
from ..memory.fp8 import FP8_KV_DTYPES
from ..ops.portable import NO_KEY as _NO_KEY
from ..ops.portable import PortableOps, attend_gathered, gather_rows, store_rows

__all__ = ["PortableBackend"]


def _in_slots(slots: torch.Tensor, num_slots: int) -> torch.Tensor:
    """``slots`` with every entry outside ``[1, num_slots)`` replaced by 0 (int64)."""
    slots = slots.long()
    return torch.where((slots >= 1) & (slots < num_slots), slots, 0)


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
    seq_lens: Optional[torch.Tensor] = None  # [bs] int64: KV length of each request
    full_store_loc: Optional[torch.Tensor] = None  # [T] int64: out_cache_loc, outside [1, S) -> 0
    swa_store_loc: Optional[torch.Tensor] = None  # [T] int64: swa_out_cache_loc, outside [1, S_swa) -> 0

    def copy_(self, other: "_StepMetadata") -> "_StepMetadata":
        """Write ``other``'s values into this metadata's (static) tensors, in place (a field
        that is None on either side is left as it is)."""
        for name in (
            "token_req",
            "token_idx",
            "q_start",
            "full_slots",
            "swa_out_cache_loc",
            "swa_slots",
            "swa_start",
            "seq_lens",
            "full_store_loc",
            "swa_store_loc",
        ):
            dst, src = getattr(self, name), getattr(other, name)
            if dst is not None and src is not None:
                dst.copy_(src)
        return self


class PortableBackend(AttentionBackend):
    """Pure-PyTorch attention over the hybrid paged KV cache (see module docstring)."""

    name = "portable"
    needs_cpu_seq_lens = False
    #: KV dtypes, head dims and pool page sizes this backend declares (the suite runs each)
    dtypes: ClassVar[Tuple[torch.dtype, ...]] = (torch.float16, torch.bfloat16, torch.float32)
    head_dims: ClassVar[Tuple[int, ...]] = (16, 32, 64, 80, 96, 128, 256)
    page_sizes: ClassVar[Tuple[int, ...]] = (1, 2, 4, 8, 16, 32, 64, 128)
    fp8_kv_dtypes: ClassVar[Tuple[torch.dtype, ...]] = FP8_KV_DTYPES

    def __init__(self, pool, req_to_token_pool, *, num_heads, sliding_window=None, scaling=None, logit_softcap=None):
        super().__init__(
            pool,
            req_to_token_pool,
            num_heads=num_heads,
            sliding_window=sliding_window,
            scaling=scaling,
            logit_softcap=logit_softcap,
        )
        self.has_swa = bool(pool.swa_layer_ids)
        self.forward_metadata: Optional[_StepMetadata] = None
        #: the static graph buffers (``init_cuda_graph_state``); None before
        self.graph_buffers: Optional[GraphBuffers] = None
        self._graph_metadata: Dict[Tuple[int, int], _StepMetadata] = {}
        self._validate_replay = False

    @classmethod
    def declared_capabilities(cls) -> Capabilities:
        return Capabilities(
            device_type=cls.device_part.device_type,
            needs_cpu_seq_lens=cls.needs_cpu_seq_lens,
            pdl=False,
            graphs=GraphSupport.ALWAYS,
            dtypes=tuple(cls.dtypes),
            head_dims=tuple(cls.head_dims),
            page_sizes=tuple(cls.page_sizes),
            sliding_window=True,
            logit_softcap=True,
            attention_sinks=True,
            large_kv_buffers=True,  # int64 slot tables, PyTorch indexing: 64-bit offsets in any buffer
            fp8_kv_dtypes=tuple(cls.fp8_kv_dtypes),
        )

    @classmethod
    def paged_ops(cls, device) -> PortableOps:
        """The portable op layer (``attnplug.ops.PortableOps``): this class's attention math
        over caches an engine owns, on ``device``."""
        return PortableOps(device, name=cls.name, dtypes=cls.dtypes, fp8_kv_dtypes=cls.fp8_kv_dtypes)

    @property
    def cuda_graph_swa_out_cache_loc(self) -> Optional[torch.Tensor]:
        """The contract's graph buffer of hoisted SWA slots (int32, ``[max_num_tokens]``),
        owned by ``graph_buffers``; None before ``init_cuda_graph_state``."""
        return self.graph_buffers.swa_out_cache_loc if self.graph_buffers is not None else None

    @cuda_graph_swa_out_cache_loc.setter
    def cuda_graph_swa_out_cache_loc(self, value: Optional[torch.Tensor]) -> None:
        if self.graph_buffers is None:
            raise RuntimeError("init_cuda_graph_state() must run before cuda_graph_swa_out_cache_loc is set")
        self.graph_buffers.swa_out_cache_loc = value

    # ------------------------------------------------------------------ metadata
    def _swa_table_width(self, q_len_max: int) -> int:
        width = self.req_to_token_pool.req_to_token.shape[1]
        return min(width, self.sliding_window + q_len_max - 1)

    def _build_metadata(self, batch: ForwardBatch, q_len_max: int) -> _StepMetadata:
        """Compute one step's metadata with device ops only (no host read, no sync), and record
        ``batch`` as the one ``forward`` must be called with."""
        self._note_prepared_batch(batch)
        dev = self.device
        bs, T = batch.batch_size, batch.num_tokens
        seq = batch.seq_lens.long()
        if batch.extend_seq_lens is not None and batch.forward_mode is not ForwardMode.DECODE:
            ext = batch.extend_seq_lens.long()
        else:  # DECODE: one new token per request, whatever a given extend_seq_lens says
            ext = torch.full((bs,), 1, dtype=torch.int64, device=dev)
        ends = torch.cumsum(ext, 0)  # [bs] exclusive end of each request's tokens
        tok = torch.arange(T, device=dev)
        token_req = torch.searchsorted(ends, tok, right=True).clamp_max(max(bs - 1, 0))
        token_idx = tok - (ends - ext)[token_req]
        q_start = seq - ext
        table = self.req_to_token_pool.req_to_token
        rpi = batch.req_pool_indices.long()
        rpi = torch.where((rpi >= 0) & (rpi < table.shape[0]), rpi, 0)  # outside the table: row 0, no keys
        rows = table[rpi]  # [bs, Kf] int32
        n_full = self.pool.size + self.pool.page_size  # rows of a full layer's buffers
        loc = batch.out_cache_loc

        swa_out_cache_loc = swa_slots = swa_start = swa_store_loc = None
        if self.has_swa:
            width = rows.shape[1]
            ks = self._swa_table_width(q_len_max)
            swa_start = (q_start - self.sliding_window + 1).clamp_min(0)
            cols = swa_start[:, None] + torch.arange(ks, device=dev)  # [bs, Ks] positions
            window_full = torch.gather(rows, 1, cols.clamp_max(width - 1)).long()
            # The ONE translation of this step: the new tokens and the window's rows together.
            # A full slot outside the pool becomes -1 first (translated to -1, "no slot").
            full = torch.cat([loc, window_full.flatten()])
            full = torch.where((full >= 0) & (full < n_full), full, -1)
            both = self.pool.translate_loc_from_full_to_swa(full)
            swa_out_cache_loc = both[:T]
            n_swa = self.pool.size_swa + self.pool.page_size
            swa_store_loc = _in_slots(swa_out_cache_loc, n_swa)
            swa_slots = torch.where(cols < seq[:, None], _in_slots(both[T:].view(bs, ks), n_swa), 0)
        return _StepMetadata(
            q_len_max=q_len_max,
            token_req=token_req,
            token_idx=token_idx,
            q_start=q_start,
            full_slots=_in_slots(rows, n_full),
            swa_out_cache_loc=swa_out_cache_loc,
            swa_slots=swa_slots,
            swa_start=swa_start,
            seq_lens=seq,
            full_store_loc=_in_slots(loc, n_full),
            swa_store_loc=swa_store_loc,
        )

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self.check_batch(batch)
        q_len = batch.q_len
        if q_len is None:  # EXTEND / IDLE: the widest request, known on the host by construction
            host_ext = batch.extend_seq_lens_cpu
            if host_ext is None and batch.extend_seq_lens is not None:
                host_ext = batch.extend_seq_lens.tolist()  # host tensor (validated), no device read
            q_len = max(host_ext, default=1) if host_ext is not None else 1
        self.forward_metadata = self._build_metadata(batch, q_len)

    # ------------------------------------------------------------------ graphs
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        width = self.req_to_token_pool.req_to_token.shape[1]
        buffers = GraphBuffers(self.device, max_bs, max_num_tokens)
        for name in ("token_req", "token_idx", "full_store_loc"):
            buffers.add(name, "tokens")
        for name in ("q_start", "seq_lens"):
            buffers.add(name, "requests")
        buffers.add("full_slots", "requests", width)
        if self.has_swa:
            buffers.add("swa_slots", "requests", self._swa_table_width(max_num_tokens))
            buffers.add("swa_start", "requests")
            buffers.add("swa_store_loc", "tokens")
        self._use_graph_buffers(buffers)  # a new state: earlier ones stay their runners'
        # Read once here, not per replay: replay does no new host work unless validation is on.
        self._validate_replay = validation_enabled()

    def get_cuda_graph_state(self) -> Optional[GraphBuffers]:
        """The ``GraphBuffers`` in use (with the per-shape metadata views kept in its ``views``)."""
        return self.graph_buffers

    def set_cuda_graph_state(self, state: GraphBuffers) -> None:
        if not isinstance(state, GraphBuffers) or state.device != self.device:
            raise TypeError(
                f"state must be the GraphBuffers of a {self.name} backend on {self.device} "
                f"(get_cuda_graph_state()), got {type(state).__name__}"
            )
        self._use_graph_buffers(state)

    def _use_graph_buffers(self, state: GraphBuffers) -> None:
        self.graph_buffers = state
        self._graph_metadata = state.views

    def _graph_views(self, batch: ForwardBatch) -> _StepMetadata:
        """The metadata of a captured step: a uniform ``(bs, q_len)`` bucket, or an EXTEND step
        of ``bs`` requests and up to ``num_tokens`` tokens, any request up to all of them (its
        lengths read from ``extend_seq_lens`` on the device): views of ``graph_buffers``, built
        once per shape and kept."""
        if self.graph_buffers is None:
            raise RuntimeError("init_cuda_graph_state() must run before capture or replay")
        q_len, n = batch.q_len, batch.num_tokens
        if q_len is None and batch.extend_seq_lens is None:
            raise ValueError(f"a captured {batch.forward_mode.name} step needs extend_seq_lens (a tensor)")
        key = (batch.batch_size, q_len) if q_len is not None else ("extend", batch.batch_size, n)
        md = self._graph_metadata.get(key)
        if md is None:
            b, bs = self.graph_buffers, batch.batch_size
            if q_len is None:  # EXTEND: one request may hold every token
                q_len = n
            view = lambda name: b.view(name, bs, q_len, n)  # noqa: E731
            ks = self._swa_table_width(q_len) if self.has_swa else 0
            md = _StepMetadata(
                q_len_max=q_len,
                token_req=view("token_req"),
                token_idx=view("token_idx"),
                q_start=view("q_start"),
                full_slots=view("full_slots"),
                swa_out_cache_loc=view("swa_out_cache_loc") if self.has_swa else None,
                swa_slots=view("swa_slots")[:, :ks] if self.has_swa else None,
                swa_start=view("swa_start") if self.has_swa else None,
                seq_lens=view("seq_lens"),
                full_store_loc=view("full_store_loc"),
                swa_store_loc=view("swa_store_loc") if self.has_swa else None,
            )
            self._graph_metadata[key] = md
        return md

    def _fill_graph_metadata(self, batch: ForwardBatch) -> None:
        """Capture and replay metadata: the step's tables into the static views, in place; the
        hoisted SWA slots through ``GraphBuffers.fill_swa_out_cache_loc`` (``[:n]`` and a
        zeroed tail, so padded tokens write to the sink)."""
        if self._validate_replay:  # ATTNPLUG_VALIDATE=1 at init_cuda_graph_state: reads (syncs)
            self.check_batch(batch, read_device=True)
        md = self._graph_views(batch)
        step = self._build_metadata(batch, md.q_len_max)
        swa = step.swa_out_cache_loc
        step.swa_out_cache_loc = None  # written below, through the rule's one place
        md.copy_(step)
        if swa is not None:  # without SWA layers the buffer stays all zeros
            self.graph_buffers.fill_swa_out_cache_loc(swa)
        self.forward_metadata = md

    def init_forward_metadata_capture_cuda_graph(self, batch: ForwardBatch) -> None:
        self._fill_graph_metadata(batch)

    def init_forward_metadata_replay_cuda_graph(self, batch: ForwardBatch) -> None:
        self._fill_graph_metadata(batch)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    # ------------------------------------------------------------------ the layer
    def forward(self, q, k, v, layer_id, batch, save_kv_cache=True, *, sinks=None):
        md = self.forward_metadata
        if md is None:
            raise RuntimeError("forward() before init_forward_metadata() for this step")
        T = batch.num_tokens
        self.check_forward_inputs(q, k, v, batch, save_kv_cache, sinks=sinks)
        is_swa = self.pool.is_swa_layer(layer_id)
        if save_kv_cache:
            self._store_kv(layer_id, is_swa, k, v, md)
        if T == 0:
            return q.new_empty(q.shape)

        k_cache, v_cache = self.pool.get_kv_buffer(layer_id)
        if is_swa:
            slots = md.swa_slots
            key_pos = md.swa_start[:, None] + torch.arange(slots.shape[1], device=q.device)
        else:
            slots = md.full_slots
            key_pos = torch.arange(slots.shape[1], device=q.device)[None, :]
        key_pos = torch.where(slots > 0, key_pos, _NO_KEY)  # slot 0 (sink / no slot): no key
        window = self.sliding_window if is_swa else None
        k_scale, v_scale = self.pool.kv_scales(layer_id)
        keys, values = gather_rows(k_cache, slots, k_scale), gather_rows(v_cache, slots, v_scale)
        return self._attend(q, keys, values, key_pos, window, md, sinks=sinks)

    def _store_kv(self, layer_id: int, is_swa: bool, k, v, md: _StepMetadata) -> None:
        """Store at the step's hoisted slots (an FP8 pool: quantised with the layer's scales). A
        token whose slot is outside the pool (mapped to 0 in metadata) writes the sink's own
        value back: nothing changes, nothing wraps."""
        loc = md.swa_store_loc if is_swa else md.full_store_loc
        k_cache, v_cache = self.pool.get_kv_buffer(layer_id)
        k_scale, v_scale = self.pool.kv_scales(layer_id)
        store_rows(k_cache, loc, k, k_scale)
        store_rows(v_cache, loc, v, v_scale)

    def _attend(self, q, keys, values, key_pos, window, md: _StepMetadata, *, sinks=None) -> torch.Tensor:
        """q [T, H, D]; keys/values [bs, K, Hkv, D]; key_pos [bs or 1, K] positions; sinks
        None or float32 [H]: the op layer's math (``attnplug.ops.attend_gathered``)."""
        return attend_gathered(
            q,
            keys,
            values,
            key_pos,
            q_start=md.q_start,
            seq_lens=md.seq_lens,
            token_req=md.token_req,
            token_idx=md.token_idx,
            q_len_max=md.q_len_max,
            scaling=self.scaling,
            window=window,
            softcap=self.logit_softcap,
            sinks=sinks,
        )
