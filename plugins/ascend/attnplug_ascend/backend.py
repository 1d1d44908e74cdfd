"""The ``ascend`` backend: attention through torch_npu's fused operators, with NPU graphs.

Per layer (``forward``):

* **KV store**: ``npu_scatter_pa_kv_cache`` into the layer's pool buffers, viewed
  ``[blocks, block_size, Hkv, D]`` (a pool layer is ``[slots, Hkv, D]`` with
  ``slots = blocks * block_size``, page 0 the sink). SWA layers store at the step's hoisted
  ``swa_out_cache_loc``, full layers at ``out_cache_loc``. A token whose slot is outside the
  pool (``-1``, the sink, garbage) writes the sink's own value back: nothing changes (the
  operator takes slots in ``[0, blocks * block_size)`` only, and no host read decides);
* **attention**: ``npu_fused_infer_attention_score_v2`` (``npu_fused_infer_attention_score``
  on a torch_npu without ``_v2``: no sinks then) in layout ``TND`` over the paged cache
  (``[blocks, block_size, Hkv * D]``), with the step's cumulative query lengths
  (``actual_seq_qlen``), each request's KV length (``actual_seq_kvlen``: per request, as paged
  attention takes it) and a block table. Full layers: ``sparse_mode=3`` (causal, aligned to
  the last key) over the request's full pages. SWA layers: ``sparse_mode=4`` (band) with
  ``pre_tokens = W - 1`` and ``next_tokens = 0`` (``W`` keys including the query's own) over a
  table of the window's SWA pages, clipped to start at the page of the first new token's
  window (every page from there on is live: eviction frees whole pages below it), so the
  translated positions keep their offsets and the band is exact. Sinks go in as ``_v2``'s
  ``learnable_sink``. The operators have no logit soft-cap: ``logit_softcap`` is refused.

Per step (``init_forward_metadata``, or capture / replay metadata), ONCE for every layer:

* the host lengths (``HostLengths``: cumulative query lengths, full-layer and SWA-layer KV
  lengths), from ``seq_lens_cpu`` and the host extend lengths: the operators take host
  integer lists, so the backend declares ``needs_cpu_seq_lens = True``;
* the ONE translation of the step (rule 1): ``out_cache_loc`` and the first full slot of each
  window page, gathered together into ``translate_loc_from_full_to_swa``; the SWA block table
  is those pages' SWA page numbers. In graph mode the translated slots land in
  ``cuda_graph_swa_out_cache_loc`` (``GraphBuffers.fill_swa_out_cache_loc``: ``[:T]``, tail
  zeroed);
* the block tables and store slots on the device.

Graphs (``GraphSupport.UNIFORM``, through ``StreamGraph`` over ``torch.npu.NPUGraph``): a
captured fused-attention task keeps the host lengths it was captured with, so each layer's
call is captured as a task group (``graph_task_group_begin/end``, behind an ``ExternalEvent``
wait, with a workspace sized by ``_get_max_workspace``), and replay metadata re-issues every
task of the replayed graph with the step's lengths on a side stream
(``graph_task_update_begin/end``, then records the event the task waits on). The block tables,
store slots and the hoisted SWA slots are static buffers updated in place.

The operators are resolved in ``ops`` (``load_ops``; torch_npu imported when the backend is
constructed, never when this package is imported). ``ops_module`` is the injection point: a
zero-argument callable returning a module with the same operators (tests/ascend's stand-in).
The limits, keywords, mask and store the backend calls them with live in ``fused``, shared with
the op layer over caches an engine owns (``paged_ops``: ``paged_ops.AscendOps``).

Not yet run on Ascend hardware by this project: verified on the host through a stand-in of the
operators' documented semantics (tests/ascend, "emulated"); see docs/ascend.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Dict, List, Optional, Tuple

import torch

from attnplug.backend import AttentionBackend, BackendConfigError, Capabilities, GraphSupport
from attnplug.batch import ForwardBatch
from attnplug.env import validation_enabled
from attnplug.graph_buffers import GraphBuffers

from .device import AscendDevice
from .fused import (
    FIA_BLOCK_SIZES,
    FIA_DTYPES,
    compressed_mask,
    is_capturing,
    layer_kwargs,
    operator_problems,
    store_skipping,
)
from .ops import NpuOps, load_ops

if TYPE_CHECKING:
    from .paged_ops import AscendOps

__all__ = ["AscendBackend", "HostLengths", "FIA_BLOCK_SIZES"]

#: what ``attnplug info`` says about where this backend was verified
VERIFIED = "emulated on the host (tests/ascend), not yet run on Ascend hardware"


@dataclass
class HostLengths:
    """A step's host lengths, built once in metadata and shared by every layer: ``q_cum``
    (cumulative new tokens, ``actual_seq_qlen``), ``kv_full`` (each request's KV length on full
    layers) and ``kv_swa`` (its KV length in the clipped SWA table; None without SWA layers).
    A padded request's KV length is at least its query length (the operator refuses fewer)."""

    q_cum: List[int]
    kv_full: List[int]
    kv_swa: Optional[List[int]]


@dataclass
class _Tables:
    """The device tensors the layers read (eager: this step's; graphs: static views)."""

    full_table: torch.Tensor  # [bs, Wf] int32: block of each full page of the request
    full_store: torch.Tensor  # [T] int64: out_cache_loc, outside [1, slots) -> 0
    full_keep: torch.Tensor  # [T] bool: the token's full slot is in [1, slots)
    swa_out_cache_loc: Optional[torch.Tensor] = None  # [T] int32: hoisted SWA slots
    swa_table: Optional[torch.Tensor] = None  # [bs, Ws] int32: SWA block of each window page
    swa_store: Optional[torch.Tensor] = None  # [T] int64: swa_out_cache_loc, outside [1, slots) -> 0
    swa_keep: Optional[torch.Tensor] = None  # [T] bool

    def copy_(self, other: "_Tables") -> None:
        for f in dataclasses.fields(self):
            dst, src = getattr(self, f.name), getattr(other, f.name)
            if dst is not None and src is not None:
                dst.copy_(src)


@dataclass
class _Step:
    """One step's metadata: host lengths, device tables, and the attention keywords of a
    full and an SWA layer (built once; a layer adds only its sinks)."""

    host: HostLengths
    tables: _Tables
    kwargs_full: Dict[str, Any]
    kwargs_swa: Optional[Dict[str, Any]]


@dataclass
class _Task:
    """One captured attention call: the task-group handle, the event it waits on, and the
    tensors (by address) its re-issued call uses."""

    handle: Any
    event: Any
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    is_swa: bool
    sinks: Optional[torch.Tensor]
    workspace: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor


class AscendBackend(AttentionBackend):
    """Attention on Ascend NPUs through torch_npu's fused operators (see module docstring)."""

    name = "ascend"
    needs_cpu_seq_lens = True  # the fused attention takes host length lists
    device_part = AscendDevice()
    #: the device as a refusal names it
    device_label: ClassVar[str] = "an NPU device"
    #: what the class declares (the conformance suite runs each)
    dtypes: ClassVar[Tuple[torch.dtype, ...]] = FIA_DTYPES
    head_dims: ClassVar[Tuple[int, ...]] = (64, 128, 256)
    page_sizes: ClassVar[Tuple[int, ...]] = (128, 256, 512)
    #: where the operators come from: None imports torch_npu; a zero-argument callable returns
    #: a module with the same operators (the injection point of tests/ascend's stand-in)
    ops_module: ClassVar[Optional[Callable[[], Any]]] = None

    def __init__(self, pool, req_to_token_pool, **kwargs) -> None:
        maker = type(self).ops_module
        #: the resolved operators (``ops.NpuOps``)
        self.ops: NpuOps = load_ops(maker() if maker is not None else None)
        if pool.device.type != self.device_part.device_type:
            raise ValueError(f"the {self.name} backend needs a pool on {self.device_label}, got {pool.device}")
        super().__init__(pool, req_to_token_pool, **kwargs)
        self._check_operator_limits()
        self._accepts_sinks = self._accepts_sinks and self.ops.has_sinks
        self.has_swa = bool(pool.swa_layer_ids)
        self.block_size = pool.page_size
        self.width = req_to_token_pool.req_to_token.shape[1]  # positions a request row holds
        self.full_blocks = -(-self.width // self.block_size)  # columns of a full block table
        self.forward_metadata: Optional[_Step] = None
        #: the static graph buffers (``init_cuda_graph_state``); None before
        self.graph_buffers: Optional[GraphBuffers] = None
        self._mask: Optional[torch.Tensor] = None
        self._validate_replay = False
        self._update_stream = None
        self._capture_key: Optional[tuple] = None  # (mode, bs, q_len) while capture metadata is current

    # ------------------------------------------------------------------ description
    @classmethod
    def declared_capabilities(cls) -> Capabilities:
        return Capabilities(
            device_type=cls.device_part.device_type,
            needs_cpu_seq_lens=cls.needs_cpu_seq_lens,
            pdl=False,
            graphs=GraphSupport.UNIFORM,
            dtypes=tuple(cls.dtypes),
            head_dims=tuple(cls.head_dims),
            page_sizes=tuple(cls.page_sizes),
            sliding_window=True,
            logit_softcap=False,  # the fused attention has no soft-cap argument
            attention_sinks=True,  # _v2's learnable_sink
            large_kv_buffers=False,  # paged attention: each cache tensor's elements must fit int32
        )

    def capabilities(self) -> Capabilities:
        graphs = None if self.ops.graph_ready else GraphSupport.NEVER
        caps = self.installed_capabilities().for_instance(device_type=self.device.type, graphs=graphs)
        if not self.ops.has_sinks:  # a torch_npu without _v2: no learnable_sink
            caps = dataclasses.replace(caps, attention_sinks=False)
        return caps

    @classmethod
    def describe(cls) -> Dict[str, Any]:
        facts = super().describe()
        facts["attention"] = (
            "torch_npu fused operators: npu_fused_infer_attention_score_v2 (TND, paged, sparse_mode 3 / band 4, "
            "learnable_sink), npu_scatter_pa_kv_cache"
        )
        facts["verified"] = VERIFIED
        return facts

    @classmethod
    def paged_ops(cls, device) -> "AscendOps":
        """The op layer over caches an engine owns (``paged_ops.AscendOps``): the same fused
        operators where they can serve a call (block sizes ``page_sizes``, contiguous caches,
        the declared head dims), the portable PyTorch path where they cannot (docs/ascend.md).
        Resolves the operators now (torch_npu, or ``ops_module``)."""
        from .paged_ops import AscendOps

        maker = cls.ops_module
        return AscendOps(
            device,
            load_ops(maker() if maker is not None else None),
            name=cls.name,
            dtypes=cls.dtypes,
            head_dims=cls.head_dims,
            native_block_sizes=cls.page_sizes,
            device_type=cls.device_part.device_type,
        )

    def _check_operator_limits(self) -> None:
        """What the fused attention refuses, refused at construction (``BackendConfigError``)."""
        problems = operator_problems(self.pool.dtype, self.head_dim, self.num_heads, self.num_kv_heads)
        if problems:
            raise BackendConfigError(f"the {self.name} backend's fused attention cannot serve " + "; ".join(problems))

    def _check_block_size(self) -> None:
        """The pool's page size is the operators' block size; refused unless declared (before
        anything is written). Checked at the first metadata call, not at construction: the
        conformance suite reads capabilities from a backend built over a page-size-1 pool."""
        if self.block_size not in type(self).page_sizes:
            raise BackendConfigError(
                f"page_size={self.block_size}: the {self.name} backend's paged attention takes block sizes "
                f"{list(type(self).page_sizes)} (the pool's page is the operator's block; its fused attention needs "
                "a multiple of 128 in [128, 512])"
            )

    # ------------------------------------------------------------------ the step's host lengths
    @staticmethod
    def _host_extend_lens(batch: ForwardBatch) -> List[int]:
        if batch.q_len is not None:
            return [batch.q_len] * batch.batch_size
        if batch.extend_seq_lens_cpu is not None:
            return list(batch.extend_seq_lens_cpu)
        if batch.extend_seq_lens is None:  # IDLE
            return []
        return batch.extend_seq_lens.tolist()  # a host tensor (ForwardBatch requires one of the two)

    def _host_seq_lens(self, batch: ForwardBatch, *, replay: bool) -> List[int]:
        """``seq_lens_cpu``; without it the host tensor, or (an eager step on the device) one
        read of ``seq_lens``: a sync, which an engine avoids by passing ``seq_lens_cpu``."""
        if batch.seq_lens_cpu is not None:
            return list(batch.seq_lens_cpu)
        if replay and batch.seq_lens.device.type != "cpu":
            raise ValueError(
                f"the {self.name} backend needs seq_lens_cpu in graph replay (needs_cpu_seq_lens is True): "
                "the fused attention takes host lengths"
            )
        return batch.seq_lens.tolist()

    def _host_lengths(self, seq: List[int], ext: List[int]) -> HostLengths:
        """The step's lengths for every layer (called ONCE per metadata call)."""
        q_cum: List[int] = []
        kv_full: List[int] = []
        kv_swa: Optional[List[int]] = [] if self.has_swa else None
        total, ps, w = 0, self.block_size, self.sliding_window
        for s, e in zip(seq, ext):
            total += e
            q_cum.append(total)
            kv_full.append(max(s, e))
            if kv_swa is not None:
                start = max(s - e - w + 1, 0) // ps * ps  # first position of the clipped table
                kv_swa.append(max(s - start, e))
        return HostLengths(q_cum, kv_full, kv_swa)

    # ------------------------------------------------------------------ the step's device tables
    def _swa_width(self, q_len_max: int) -> int:
        """Columns of a clipped SWA table: the pages from the first new token's window start to
        the last new token (at most ``W - 1 + q_len`` positions after a partial first page)."""
        return min(self.full_blocks, -(-(self.sliding_window + q_len_max - 1) // self.block_size) + 1)

    def _device_tables(self, batch: ForwardBatch, q_len_max: int) -> _Tables:
        """Every device table of the step, from device tensors; the step's ONE translation."""
        dev, ps = self.device, self.block_size
        bs, T = batch.batch_size, batch.num_tokens
        n_full = self.pool.size + ps
        seq = batch.seq_lens.long()
        table = self.req_to_token_pool.req_to_token
        rpi = batch.req_pool_indices.long()
        rpi = torch.where((rpi >= 0) & (rpi < table.shape[0]), rpi, 0)  # outside the table: row 0
        rows = table[rpi]  # [bs, width] int32
        pages = torch.arange(self.full_blocks, device=dev) * ps  # first position of each page
        first = rows[:, pages].long()
        ok = (pages[None, :] < seq[:, None]) & (first >= 0) & (first < n_full)
        full_table = torch.where(ok, first // ps, 0).to(torch.int32)
        loc = batch.out_cache_loc
        full_keep = (loc >= 1) & (loc < n_full)
        t = _Tables(full_table=full_table, full_store=torch.where(full_keep, loc, 0), full_keep=full_keep)
        if not self.has_swa:
            return t
        if batch.q_len is not None or batch.extend_seq_lens is None:
            ext = torch.full((bs,), batch.q_len or 1, dtype=torch.int64, device=dev)
        else:
            ext = batch.extend_seq_lens.long()
        ws = self._swa_width(q_len_max)
        start = (seq - ext - self.sliding_window + 1).clamp_min(0) // ps  # first page of the window
        pos = (start[:, None] + torch.arange(ws, device=dev)) * ps  # [bs, Ws] first position of each page
        firsts = torch.gather(rows, 1, pos.clamp_max(self.width - 1)).long()
        firsts = torch.where((pos < seq[:, None]) & (firsts >= 0) & (firsts < n_full), firsts, -1)
        # The ONE translation of this step: the new tokens and the window's pages together.
        in_pool = torch.where((loc >= 0) & (loc < n_full), loc, -1)  # the sink translates to 0, garbage to -1
        both = self.pool.translate_loc_from_full_to_swa(torch.cat([in_pool, firsts.flatten()]))
        n_swa = self.pool.size_swa + ps
        swa_loc = both[:T]
        swa_pages = both[T:].view(bs, ws).long()
        t.swa_out_cache_loc = swa_loc
        t.swa_table = torch.where((swa_pages >= ps) & (swa_pages < n_swa), swa_pages // ps, 0).to(torch.int32)
        t.swa_keep = (swa_loc >= 1) & (swa_loc < n_swa)
        t.swa_store = torch.where(t.swa_keep, swa_loc, 0).long()
        return t

    def _atten_mask(self) -> torch.Tensor:
        if self._mask is None:
            self._mask = compressed_mask(self.device)
        return self._mask

    def _step(self, host: HostLengths, tables: _Tables) -> _Step:
        common = dict(
            q_cum=host.q_cum,
            block_size=self.block_size,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            scale=self.scaling,
            mask=self._atten_mask(),
        )
        full = layer_kwargs(self.ops, window=None, kv_lens=host.kv_full, block_table=tables.full_table, **common)
        swa = None
        if self.has_swa:
            swa = layer_kwargs(
                self.ops, window=self.sliding_window, kv_lens=host.kv_swa, block_table=tables.swa_table, **common
            )
        return _Step(host, tables, full, swa)

    # ------------------------------------------------------------------ eager steps
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self.check_batch(batch)
        self._check_block_size()
        self._capture_key = None
        ext = self._host_extend_lens(batch)
        seq = self._host_seq_lens(batch, replay=False)
        self._note_prepared_batch(batch)
        host = self._host_lengths(seq, ext)
        self.forward_metadata = self._step(host, self._device_tables(batch, max(ext, default=1)))

    # ------------------------------------------------------------------ graphs
    @property
    def cuda_graph_swa_out_cache_loc(self) -> Optional[torch.Tensor]:
        """The contract's graph buffer of hoisted SWA slots (int32, ``[max_num_tokens]``)."""
        return self.graph_buffers.swa_out_cache_loc if self.graph_buffers is not None else None

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self._check_block_size()
        buffers = GraphBuffers(self.device, max_bs, max_num_tokens)
        buffers.add("full_table", "requests", self.full_blocks, dtype=torch.int32)
        buffers.add("full_store", "tokens")
        buffers.add("full_keep", "tokens", dtype=torch.bool)
        if self.has_swa:
            # flat, so that the [bs, Ws] head of every captured shape is one contiguous view
            buffers.add("swa_table", max_bs * self._swa_width(max_num_tokens), dtype=torch.int32)
            buffers.add("swa_store", "tokens")
            buffers.add("swa_keep", "tokens", dtype=torch.bool)
        self.graph_buffers = buffers  # a new state: earlier ones stay their runners'
        self._atten_mask()  # before any capture: graphs read it by address
        if self._update_stream is None and self.ops.graph_ready:
            self._update_stream = self.ops.runtime.Stream()  # task updates: never the capture stream
        self._validate_replay = validation_enabled()

    def get_cuda_graph_state(self) -> Optional[GraphBuffers]:
        """The ``GraphBuffers`` in use (its ``views`` also keep the per-shape views and the
        captured attention tasks of each graph)."""
        return self.graph_buffers

    def set_cuda_graph_state(self, state: GraphBuffers) -> None:
        if not isinstance(state, GraphBuffers) or state.device != self.device:
            raise TypeError(
                f"state must be the GraphBuffers of a {self.name} backend on {self.device} "
                f"(get_cuda_graph_state()), got {type(state).__name__}"
            )
        self.graph_buffers = state

    def _graph_views(self, bs: int, q_len: int) -> _Tables:
        b = self.graph_buffers
        if b is None:
            raise RuntimeError("init_cuda_graph_state() must run before capture or replay")
        key = ("tables", bs, q_len)
        views = b.views.get(key)
        if views is None:
            tok = lambda name: b.view(name, bs, q_len)  # noqa: E731
            views = _Tables(full_table=tok("full_table"), full_store=tok("full_store"), full_keep=tok("full_keep"))
            if self.has_swa:
                ws = self._swa_width(q_len)
                views.swa_out_cache_loc = tok("swa_out_cache_loc")
                views.swa_table = b["swa_table"][: bs * ws].view(bs, ws)
                views.swa_store = tok("swa_store")
                views.swa_keep = tok("swa_keep")
            b.views[key] = views
        return views

    def _fill_graph_metadata(self, batch: ForwardBatch) -> Tuple[Any, ...]:
        """Capture and replay metadata: the step's tables into the static views, in place (the
        hoisted SWA slots through ``GraphBuffers.fill_swa_out_cache_loc``), the host lengths
        once. Returns the graph's key ``(mode, bs, q_len)``."""
        q_len = batch.q_len
        if q_len is None:
            raise ValueError(f"{batch.forward_mode.name} steps are not captured by the {self.name} backend")
        if self._validate_replay:  # ATTNPLUG_VALIDATE=1 at init_cuda_graph_state
            self.check_batch(batch, read_device=True)
        bs = batch.batch_size
        self.graph_buffers.check_fits(bs, batch.num_tokens)
        views = self._graph_views(bs, q_len)
        self._note_prepared_batch(batch)
        host = self._host_lengths(self._host_seq_lens(batch, replay=True), [q_len] * bs)
        step = self._device_tables(batch, q_len)
        swa = step.swa_out_cache_loc
        step.swa_out_cache_loc = None  # written below, through the rule's one place
        views.copy_(step)
        if swa is not None:
            self.graph_buffers.fill_swa_out_cache_loc(swa)
        self.forward_metadata = self._step(host, views)
        return (batch.forward_mode, bs, q_len)

    def _tasks(self, key: tuple) -> List[_Task]:
        return self.graph_buffers.views.setdefault(("tasks", *key), [])

    def init_forward_metadata_capture_cuda_graph(self, batch: ForwardBatch) -> None:
        key = self._fill_graph_metadata(batch)
        self.graph_buffers.views[("tasks", *key)] = []  # a (re)capture records this graph's tasks anew
        self._capture_key = key

    def init_forward_metadata_replay_cuda_graph(self, batch: ForwardBatch) -> None:
        key = self._fill_graph_metadata(batch)
        self._capture_key = None
        md = self.forward_metadata
        rt, stream = self.ops.runtime, self._update_stream
        for task in self._tasks(key):  # re-issue each captured attention with this step's lengths
            kwargs = md.kwargs_swa if task.is_swa else md.kwargs_full
            if task.sinks is not None:
                kwargs = self.ops.with_sinks(kwargs, task.sinks)
            with rt.stream(stream):
                rt.graph_task_update_begin(stream, task.handle)
                self.ops.attention_out(
                    task.query, task.key, task.value, kwargs, workspace=task.workspace, out=(task.out, task.lse)
                )
                rt.graph_task_update_end(stream)
                task.event.record(stream)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    def _capturing(self) -> bool:
        return is_capturing(self.ops)

    def _captured_attention(self, query, key, value, kwargs, is_swa: bool, sinks) -> torch.Tensor:
        """One layer's attention inside a graph capture: a task group the replay re-issues."""
        rt = self.ops.runtime
        stream = rt.current_stream()
        event = rt.ExternalEvent()
        # one workspace per graph and layer kind, shared by its layers: their tasks run one after another
        ws_key = ("workspace", *self._capture_key, is_swa, sinks is not None)
        workspace = self.graph_buffers.views.get(ws_key)
        if workspace is None:
            workspace = self.graph_buffers.views[ws_key] = self.ops.workspace(query, key, value, kwargs)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        lse = torch.empty(1, dtype=torch.float32, device=query.device)
        event.wait(stream)  # the task waits for its update of each replay
        event.reset(stream)
        rt.graph_task_group_begin(stream)
        self.ops.attention_out(query, key, value, kwargs, workspace=workspace, out=(out, lse))
        handle = rt.graph_task_group_end(stream)
        self._tasks(self._capture_key).append(
            _Task(handle, event, query, key, value, is_swa, sinks, workspace, out, lse)
        )
        return out

    # ------------------------------------------------------------------ the layer
    def _store(self, layer_id: int, is_swa: bool, k, v, t: _Tables) -> None:
        """Store at the step's hoisted slots. A token whose slot is outside the pool writes
        the sink's own value back (the operator takes no -1: nothing changes, nothing wraps)."""
        loc, keep = (t.swa_store, t.swa_keep) if is_swa else (t.full_store, t.full_keep)
        kc, vc = self.pool.get_kv_buffer(layer_id)
        blocks = kc.shape[0] // self.block_size
        shape = (blocks, self.block_size, self.num_kv_heads, self.head_dim)
        store_skipping(self.ops, k, v, kc.view(shape), vc.view(shape), loc, keep)

    def forward(self, q, k, v, layer_id, batch, save_kv_cache=True, *, sinks=None):
        md = self.forward_metadata
        if md is None:
            raise RuntimeError("forward() before init_forward_metadata() for this step")
        self.check_forward_inputs(q, k, v, batch, save_kv_cache, sinks=sinks)
        is_swa = self.pool.is_swa_layer(layer_id)
        if save_kv_cache:
            self._store(layer_id, is_swa, k, v, md.tables)
        if batch.num_tokens == 0:
            return q.new_empty(q.shape)
        kc, vc = self.pool.get_kv_buffer(layer_id)
        blocks = kc.shape[0] // self.block_size
        shape = (blocks, self.block_size, self.num_kv_heads * self.head_dim)  # (blocknum, blocksize, H)
        key, value = kc.view(shape), vc.view(shape)
        kwargs = md.kwargs_swa if is_swa else md.kwargs_full
        if sinks is not None:
            kwargs = self.ops.with_sinks(kwargs, sinks)
        query = q.contiguous()  # TND: the operator takes contiguous tensors only
        if self._capture_key is not None and self._capturing():
            return self._captured_attention(query, key, value, kwargs, is_swa, sinks)
        return self.ops.attention(query, key, value, kwargs)
