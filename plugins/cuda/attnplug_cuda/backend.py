"""The ``cuda`` backend: Triton (and optionally CUDA C++) kernels with PDL, CUDA graphs.

Per step, ONE kernel launch (``kernels.step_metadata``) builds everything the layers read:
the hoisted ``swa_out_cache_loc`` (translated once, tail zeroed), ``cu_q_lens``, the
window's start, each new token's position, and the window's SWA slot table (full-pool rows
translated once per step). Per layer: small decode and draft steps
(``kernels.store_attend.eligible``: up to 16 (token, q head) rows per request, at most two
(request, kv head) groups per SM) run ONE launch that stores the step's K/V, attends and merges
its KV splits: the Triton kernel ``store_attend`` (with ``ATTNPLUG_ONE_LAUNCH=cpp``, the
layers ``staged_attend.takes_layer`` names run the CUDA C++ kernels of ``staged_attend``
instead: the staged kernel, each CTA's keys copied into shared memory before the PDL wait,
where its CTAs cover the GPU; the resident kernel, one CTA a group holding its window in
registers, for windowed steps of several tokens a request on half the GPU; decided once per
step, ``_StepTables.staged``). Larger decode and draft steps run the paged attention alone,
storing the step's K/V at the hoisted slots in the same launch (``paged_attention_stores``,
``_StepTables.paged_store``); longer steps run two launches, the KV store and the paged
attention. A combine launch follows when the KV range is split for decode. With PDL, each
one-launch layer after a step's first reads its metadata and cached K/V before waiting for
the previous kernel and releases the next launch right after its wait, so consecutive layers
overlap (the kernels' ``prologue`` and ``release_early``;
class flags ``pdl_prologue`` / ``pdl_release_early``).

Graph mode keeps every buffer static (``init_cuda_graph_state``); replay preparation is one
launch on device tensors and reads nothing back (``needs_cpu_seq_lens = False``).

Options (environment, read at construction):

* ``ATTNPLUG_DISABLE_PDL=1``: launch without Programmatic Dependent Launch.
* ``ATTNPLUG_KV_STORE=cpp``: store KV with the CUDA C++ kernel (``csrc/kv_store.cu``, built
  JIT on first use; small steps then store with it and attend with a one-launch kernel that
  stores nothing); when it cannot be built the Triton store is used and the instance's
  ``kv_store_reason`` says why (``attnplug info`` checks the prerequisites only; it builds
  nothing). Default ``triton``.
* ``ATTNPLUG_ONE_LAUNCH=cpp``: run the one-launch small-step layers ``staged_attend.takes_layer``
  names with the CUDA C++ kernels (``csrc/staged_attend.cu``, ``csrc/resident_attend.cu``; the
  C++ extension is built JIT
  on the first backend's construction, cached across processes); when it cannot be built,
  ``store_attend`` runs every layer and the instance's ``one_launch_reason`` says why. Default
  ``triton``: ``store_attend`` on every layer (``staged_attend``'s module docstring gives the
  measurements behind the default).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Dict, Optional, Tuple

import torch

from attnplug import env
from attnplug.backend import AttentionBackend, Capabilities, GraphSupport
from attnplug.batch import BatchError, ForwardBatch
from attnplug.env import validation_enabled
from attnplug.graph_buffers import GraphBuffers

from .device import CudaDevice, kv_store_choice, one_launch_choice
from .kernels.interpret import interpreting
from .staged_attend import serves_layers as staged_serves
from .staged_attend import staged_attend
from .staged_attend import takes_layer as staged_takes_layer

__all__ = ["CudaBackend"]


@dataclass
class _StepTables:
    """Per-step tables (device tensors; graph mode: views of the static buffers)."""

    max_q_len: int  # host bound: most new tokens of one request
    cu_q_lens: torch.Tensor  # [bs + 1] int32
    window_start: torch.Tensor  # [bs] int32: position of column 0 of swa_window_table
    token_pos: torch.Tensor  # [T] int32: position of each new token
    swa_out_cache_loc: Optional[torch.Tensor]  # [T] int32: hoisted SWA slots of the new tokens
    swa_window_table: Optional[torch.Tensor]  # [bs, width] int32: SWA slots of the window
    workspace: Optional[torch.Tensor]  # fp32 split-KV scratch (graph mode: static)
    fused: bool = False  # each layer is one store_attend launch (small steps)
    paged_store: bool = False  # not fused: paged_attention stores the step's K/V in its launch
    staged: Tuple[bool, bool] = (False, False)  # (full, SWA) layers: staged_attend, not store_attend
    relaunch: Optional[object] = None  # graph mode: repeats the metadata launch (same buffers)
    relaunch_key: tuple = ()  # the batch tensors relaunch was built for
    # graph mode, copies from the engine's step: (step dtypes, positions given) ->
    # (the static tensors it writes, the Relaunch that takes each step's tensors)
    padded_launches: Dict[tuple, tuple] = field(default_factory=dict)


class CudaBackend(AttentionBackend):
    """Paged hybrid full + SWA attention on NVIDIA GPUs (see module docstring)."""

    name = "cuda"
    needs_cpu_seq_lens = False
    copies_replay_batch = True  # the one metadata launch also fills the runner's static batch
    device_part = CudaDevice()
    #: small decode steps run one ``store_attend`` launch per layer (False: always the KV
    #: store + attention launches; benchmarks compare the two)
    one_launch_small_steps: ClassVar[bool] = True
    #: decode and draft steps beyond the one-launch path (up to ``paged_attention``'s
    #: ``STORE_ROWS`` (token, q head) rows a request) store the step's K/V inside its launch,
    #: not in a KV store launch before it (False: a separate store; benchmarks compare the two)
    paged_attention_stores: ClassVar[bool] = True
    #: with PDL, ``paged_attention`` layers that store their step (``paged_attention_stores``)
    #: read the step's metadata before waiting for the previous kernel, except the first
    #: launch after the metadata launch (``paged_attention``'s ``prologue``); with
    #: ``paged_pdl_release_early`` they release the next launch right after their wait. An
    #: H200, 48-layer hybrid step, decode: both on 1520.7 / 2899.6 us at bs 64 / 128 against
    #: 1549.0 / 2929.9 us with both off (the prologue alone: 1554.0 / 2936.1)
    paged_pdl_prologue: ClassVar[bool] = True
    paged_pdl_release_early: ClassVar[bool] = True
    #: with PDL, one-launch layers read their metadata and cached K/V before waiting for the
    #: previous kernel (``store_attend``'s ``prologue``), except the first launch after the
    #: step's metadata launch (False: wait first; benchmarks compare the two)
    pdl_prologue: ClassVar[bool] = True
    #: with PDL, one-launch layers release the next launch right after their wait, so its
    #: prologue overlaps this layer's work (False: after their last store)
    pdl_release_early: ClassVar[bool] = True

    def __init__(self, pool, req_to_token_pool, *, num_heads, sliding_window=None, scaling=None, logit_softcap=None):
        super().__init__(
            pool,
            req_to_token_pool,
            num_heads=num_heads,
            sliding_window=sliding_window,
            scaling=scaling,
            logit_softcap=logit_softcap,
        )
        if self.device.type != "cuda" and not interpreting():
            raise ValueError(
                f"the cuda backend needs a pool on a CUDA device, got {self.device} "
                "(on the CPU it runs only under the Triton interpreter, TRITON_INTERPRET=1)"
            )
        from .kernels import load_kernels, pdl_supported

        kernels = load_kernels()
        self._kv_store_triton = kernels.kv_store
        self._paged_attention = kernels.paged_attention
        self._step_metadata = kernels.step_metadata
        self._per_step_args = kernels.step_metadata_per_step_args
        self._padded_copy = kernels.step_metadata_padded_copy
        self._workspace_numel = kernels.workspace_numel
        self._store_attend = kernels.store_attend
        self._fused_eligible = kernels.store_attend_eligible
        self._store_rows = kernels.paged_attention_store_rows
        self._num_sms = kernels.num_sms(self.device)
        self.pdl, self.pdl_reason = pdl_supported(self.device)
        self.kv_store_impl, self.kv_store_reason = kv_store_choice()
        if env.one_launch_kernel() == "cpp" and not staged_serves(pool.dtype, self.head_dim):
            self.one_launch_impl = "triton"
            self.one_launch_reason = (
                "ATTNPLUG_ONE_LAUNCH=cpp, but the layers are not served by the staged kernel (float16 / "
                f"bfloat16 at head dim 64 or 128; these are {pool.dtype} at head dim {self.head_dim})"
            )
        else:  # builds the C++ extension when it is asked for
            self.one_launch_impl, self.one_launch_reason = one_launch_choice()
        #: the staged C++ kernel (``store_attend``'s signature) for the one-launch layers whose
        #: CTAs cover the GPU, or None
        self._staged_attend = staged_attend if self.one_launch_impl == "cpp" else None
        self.has_swa = bool(pool.swa_layer_ids)
        width = req_to_token_pool.req_to_token.shape[1]
        self.max_context_len = width
        self.forward_metadata: Optional[_StepTables] = None
        self.cuda_graph_swa_out_cache_loc: Optional[torch.Tensor] = None
        self._graph_buffers: Optional[GraphBuffers] = None
        self._graph_tables: Dict[Tuple[int, int], _StepTables] = {}
        self._validate_replay = False
        self._after_metadata = True  # the next attention launch directly follows the metadata launch
        self._replay_source: Optional[Tuple[ForwardBatch, ForwardBatch]] = None  # set_replay_source
        # Row b of the window table belongs to request b: rows for as many requests as a step
        # can hold (eager: live requests; graphs: padded buckets, see init_cuda_graph_state).
        self._table_rows = torch.arange(req_to_token_pool.req_to_token.shape[0], dtype=torch.int32, device=self.device)
        # store_attend's split partials and its per-(request, kv head) tickets: allocated once,
        # shared by eager steps and graphs (every launch leaves the tickets at zero)
        self._fused_workspace = torch.empty(
            kernels.store_attend_workspace_numel(self.head_dim, self._num_sms),
            dtype=torch.float32,
            device=self.device,
        )
        self._tickets = torch.zeros(
            self._table_rows.shape[0] * self.num_kv_heads, dtype=torch.int32, device=self.device
        )

    # ------------------------------------------------------------------ description
    @classmethod
    def declared_capabilities(cls) -> Capabilities:
        """PDL where the device has it (each instance decides: ``capabilities().pdl``)."""
        return Capabilities(
            device_type=cls.device_part.device_type,
            needs_cpu_seq_lens=cls.needs_cpu_seq_lens,
            pdl=True,
            graphs=GraphSupport.UNIFORM,
            dtypes=(torch.float16, torch.bfloat16),
            head_dims=(64, 128, 256),
            page_sizes=(1, 2, 4, 8, 16, 32, 64),
            sliding_window=True,
            logit_softcap=True,
            attention_sinks=True,
        )

    def capabilities(self) -> Capabilities:
        return self.installed_capabilities().for_instance(device_type=self.device.type, pdl=self.pdl)

    # ------------------------------------------------------------------ metadata
    def _table_width(self, max_q_len: int) -> int:
        return min(self.max_context_len, self.sliding_window + max_q_len - 1)

    def _fill(self, batch: ForwardBatch, t: _StepTables, padded=None):
        """The step's ONE metadata launch, writing into ``t``'s tensors (and, with
        ``padded``, a ``PaddedCopy`` of the static batch, the step copied and padded into
        it); returns its ``Relaunch`` (repeats the launch with minimal host work)."""
        extend = batch.q_len if batch.q_len is not None else batch.extend_seq_lens
        return self._step_metadata(
            batch.req_pool_indices,
            batch.seq_lens,
            extend,
            batch.out_cache_loc,
            cu_q_lens=t.cu_q_lens,
            window_start=t.window_start,
            token_pos=t.token_pos,
            full_to_swa_index_mapping=self.pool.full_to_swa_index_mapping if self.has_swa else None,
            swa_out_cache_loc=t.swa_out_cache_loc,
            req_to_token=self.req_to_token_pool.req_to_token if self.has_swa else None,
            swa_window_table=t.swa_window_table,
            window=self.sliding_window if self.has_swa else None,
            pdl=self.pdl,
            positions=batch.positions if padded is not None else None,
            padded=padded,
            fill_value=self.get_cuda_graph_seq_len_fill_value(),
        )

    def _fused_step(self, bs: int, max_q_len: int) -> bool:
        """Whether a step of ``bs`` requests with up to ``max_q_len`` new tokens each runs one
        ``store_attend`` launch per layer (small steps) instead of a store + attention."""
        return self.one_launch_small_steps and self._fused_eligible(
            bs, self.num_kv_heads, max_q_len, self.num_heads // self.num_kv_heads, self._num_sms
        )

    def _paged_store(self, bs: int, max_q_len: int) -> bool:
        """Whether a step that is not one ``store_attend`` launch a layer stores its K/V inside
        ``paged_attention``'s launch (decode and draft steps: up to its ``STORE_ROWS`` rows a
        request; the Triton store)."""
        rows = max(1, max_q_len) * (self.num_heads // self.num_kv_heads)
        return (
            self.paged_attention_stores
            and self.kv_store_impl == "triton"
            and rows <= self._store_rows
            and not self._fused_step(bs, max_q_len)
        )

    def _staged_layers(self, bs: int, max_q_len: int) -> Tuple[bool, bool]:
        """Whether the full / SWA layers of a one-launch step of ``bs`` requests run the C++
        kernels of ``staged_attend`` (when they are on: ``takes_layer`` on the host bounds
        ``_attention_args`` passes)."""
        if self._staged_attend is None:
            return (False, False)
        shape = dict(
            num_reqs=bs,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            max_q_len=max_q_len,
            num_sms=self._num_sms,
        )
        full = staged_takes_layer(max_kv_len=self.max_context_len, window=None, **shape)
        swa = self.has_swa and staged_takes_layer(
            max_kv_len=self._table_width(max_q_len), window=self.sliding_window, **shape
        )
        return (full, swa)

    @staticmethod
    def _max_q_len(batch: ForwardBatch) -> int:
        """Most new tokens of one request, from host data only: the uniform q_len, else the
        host mirror or the host tensor of the extend lens (ForwardBatch guarantees one of
        them in EXTEND mode), else the step's token count (an upper bound)."""
        if batch.q_len is not None:
            return batch.q_len
        host_ext = batch.extend_seq_lens_cpu
        ext = batch.extend_seq_lens
        if host_ext is None and ext is not None and ext.device.type == "cpu":
            host_ext = ext.tolist()  # a host tensor: no device read
        if host_ext:
            return max(host_ext)
        return max(batch.num_tokens, 1)

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self.check_batch(batch)
        bs, T, dev = batch.batch_size, batch.num_tokens, self.device
        max_q = self._max_q_len(batch)
        i32 = dict(dtype=torch.int32, device=dev)
        t = _StepTables(
            max_q_len=max_q,
            cu_q_lens=torch.empty(bs + 1, **i32),
            window_start=torch.empty(bs, **i32),
            token_pos=torch.empty(T, **i32),
            swa_out_cache_loc=torch.empty(T, **i32) if self.has_swa else None,
            swa_window_table=torch.empty(bs, self._table_width(max_q), **i32) if self.has_swa else None,
            workspace=None,
            fused=self._fused_step(bs, max_q),
            paged_store=self._paged_store(bs, max_q),
            staged=self._staged_layers(bs, max_q),
        )
        if bs:
            self._fill(batch, t)
        self.forward_metadata = t
        self._note_prepared_batch(batch)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        dev = self.device
        i32 = dict(dtype=torch.int32)
        # The step_metadata launch writes the whole of cuda_graph_swa_out_cache_loc: [:n]
        # translated, [n:] zeroed, exactly GraphBuffers.expected_swa_out_cache_loc (tested).
        buffers = GraphBuffers(dev, max_bs, max_num_tokens)
        self.cuda_graph_swa_out_cache_loc = buffers.swa_out_cache_loc
        buffers.add("cu_q_lens", max_bs + 1, **i32)
        buffers.add("window_start", "requests", **i32)
        buffers.add("token_pos", "tokens", **i32)
        buffers.add(
            "workspace", self._workspace_numel(max_num_tokens, self.num_heads, self.head_dim), dtype=torch.float32
        )
        if self.has_swa:
            # Rows of any captured (bs, q_len) fit: bs * (W + q_len - 1) <= max_bs * W + max_num_tokens.
            buffers.add("swa_window_table", max_bs * self.sliding_window + max_num_tokens, **i32)
        if max_bs > self._table_rows.shape[0]:  # padded buckets may exceed the request table
            self._table_rows = torch.arange(max_bs, dtype=torch.int32, device=dev)
            self._tickets = torch.zeros(max_bs * self.num_kv_heads, dtype=torch.int32, device=dev)
        self._graph_buffers = buffers
        self._graph_tables = {}
        # Read once here, not per replay: the replay path does no new host work by default.
        self._validate_replay = validation_enabled()

    def _graph_views(self, batch: ForwardBatch) -> _StepTables:
        if self._graph_buffers is None:
            raise RuntimeError("init_cuda_graph_state() must run before capture or replay")
        if batch.q_len is None:
            raise ValueError(f"{batch.forward_mode.name} steps are not captured by the cuda backend (UNIFORM)")
        key = (batch.batch_size, batch.q_len)
        t = self._graph_tables.get(key)
        if t is None:
            bs, n, b = batch.batch_size, batch.num_tokens, self._graph_buffers
            b.check_fits(bs, n)
            table = None
            if self.has_swa:
                width = self._table_width(batch.q_len)
                table = b["swa_window_table"][: bs * width].view(bs, width)
            t = _StepTables(
                max_q_len=batch.q_len,
                cu_q_lens=b["cu_q_lens"][: bs + 1],
                window_start=b["window_start"][:bs],
                token_pos=b["token_pos"][:n],
                # The whole buffer: the launch translates [:n] and zeroes the tail.
                swa_out_cache_loc=self.cuda_graph_swa_out_cache_loc if self.has_swa else None,
                swa_window_table=table,
                workspace=b["workspace"],
                fused=self._fused_step(bs, batch.q_len),
                paged_store=self._paged_store(bs, batch.q_len),
                staged=self._staged_layers(bs, batch.q_len),
            )
            self._graph_tables[key] = t
        return t

    @staticmethod
    def _launch_key(batch: ForwardBatch) -> tuple:
        """Identity of the tensors a metadata launch reads (addresses, not contents)."""
        return tuple(
            (x.data_ptr(), x.dtype, x.shape[0]) if isinstance(x, torch.Tensor) else x
            for x in (batch.req_pool_indices, batch.seq_lens, batch.out_cache_loc, batch.extend_seq_lens, batch.q_len)
        )

    def init_forward_metadata_capture_cuda_graph(self, batch: ForwardBatch) -> None:
        t = self._graph_views(batch)
        t.relaunch, t.relaunch_key = self._fill(batch, t), self._launch_key(batch)
        self.forward_metadata = t
        self._note_prepared_batch(batch)

    def set_replay_source(self, batch: ForwardBatch, static: ForwardBatch) -> None:
        """The next replay metadata call of ``static`` copies ``batch`` into it, padded, in
        its one launch (``AttentionBackend.set_replay_source``). Host checks only."""
        if batch.out_cache_loc.device != self.device:
            raise BatchError(f"out_cache_loc is on {batch.out_cache_loc.device}, the KV pool on {self.device}")
        self._replay_source = (batch, static)

    def init_forward_metadata_replay_cuda_graph(self, batch: ForwardBatch) -> None:
        source = self._replay_source
        if source is not None:
            self._replay_source = None
            if source[1] is batch:
                self._replay_from(source[0], batch)
                return
        if self._validate_replay:  # ATTNPLUG_VALIDATE=1 at init_cuda_graph_state: reads (syncs)
            self.check_batch(batch, read_device=True)
        t = self._graph_views(batch)
        key = self._launch_key(batch)
        if t.relaunch is not None and key == t.relaunch_key:
            t.relaunch()  # the engine's static buffers: repeat the captured launch
        else:
            t.relaunch, t.relaunch_key = self._fill(batch, t), key
        self.forward_metadata = t
        self._note_prepared_batch(batch)

    def _replay_from(self, step: ForwardBatch, static: ForwardBatch) -> None:
        """Replay metadata of ``static`` that first copies the engine's ``step`` into it: the
        one launch reads the step's tensors (any addresses: they are per-step arguments of
        the launch) and writes the static batch, padded, with everything else."""
        if self._validate_replay:
            self.check_batch(step, read_device=True)
        t = self._graph_views(static)
        rows, lens, loc, pos = step.req_pool_indices, step.seq_lens, step.out_cache_loc, step.positions
        dst = (static.req_pool_indices, static.seq_lens, static.out_cache_loc, static.positions)
        key = (rows.dtype, lens.dtype, pos is None)
        entry = t.padded_launches.get(key)
        if entry is not None:
            e = entry[0]
            if e[0] is dst[0] and e[1] is dst[1] and e[2] is dst[2] and e[3] is dst[3]:
                entry[1](*self._per_step_args(rows, lens, loc, pos))
                self.forward_metadata = t
                self._note_prepared_batch(static)
                return
        t.padded_launches[key] = (dst, self._fill(step, t, padded=self._padded_copy(*dst)))
        self.forward_metadata = t
        self._note_prepared_batch(static)

    def _note_prepared_batch(self, batch: ForwardBatch) -> None:
        super()._note_prepared_batch(batch)
        self._after_metadata = True

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    # ------------------------------------------------------------------ the layer
    def _store(self, k, v, k_cache, v_cache, loc) -> None:
        if self.kv_store_impl == "cpp":
            from .cpp_ext import kv_store as cpp_kv_store

            cpp_kv_store(k, v, k_cache, v_cache, loc, self.pdl)
        else:
            self._kv_store_triton(k, v, k_cache, v_cache, loc, pdl=self.pdl)

    def _step_tables(self) -> _StepTables:
        """This step's tables (the last metadata call's)."""
        t = self.forward_metadata
        if t is None:
            raise RuntimeError("forward() before init_forward_metadata() for this step")
        return t

    def _attention_args(
        self, is_swa: bool, batch: ForwardBatch, t: _StepTables, window_table: Optional[torch.Tensor] = None
    ) -> dict:
        """The keyword arguments every attention call of one layer takes: full layers read
        ``req_to_token`` rows, SWA layers the window table (``t.swa_window_table`` unless
        ``window_table`` is given) from each request's window start."""
        if is_swa:
            table = t.swa_window_table if window_table is None else window_table
            where = dict(table_rows=self._table_rows, table_start=t.window_start, max_kv_len=table.shape[1])
            window = self.sliding_window
        else:
            table, window = self.req_to_token_pool.req_to_token, None
            where = dict(table_rows=batch.req_pool_indices, table_start=None, max_kv_len=self.max_context_len)
        return dict(
            where,
            table=table,
            window=window,
            cu_q_lens=t.cu_q_lens,
            seq_lens=batch.seq_lens,
            max_q_len=t.max_q_len,
            sm_scale=self.scaling,
        )

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        loc: Optional[torch.Tensor],
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        is_swa: bool,
        batch: ForwardBatch,
        t: _StepTables,
        sinks: Optional[torch.Tensor],
    ) -> torch.Tensor:
        """Attention of one layer: full layers through ``req_to_token`` rows, SWA layers
        through the window table (only the keys the window reaches); the backend's
        ``logit_softcap`` and the layer's ``sinks`` (float32 ``[num_heads]`` or None).
        Small steps (``t.fused``) run ``store_attend``, which also stores k/v at ``loc``
        (None: stored already, or not saved); ``paged_attention`` stores them too where
        ``t.paged_store`` (other steps get ``loc=None`` here)."""
        out = torch.empty_like(q)
        if batch.num_tokens == 0:
            return out
        common = dict(self._attention_args(is_swa, batch, t), softcap=self.logit_softcap, sinks=sinks, pdl=self.pdl)
        if t.fused:
            # Data read before gdc_wait must come from kernels two or more launches back:
            # not the metadata this step's first launch follows.
            prologue, self._after_metadata = self.pdl_prologue and not self._after_metadata, False
            kernel = self._staged_attend if t.staged[is_swa] else self._store_attend
            return kernel(
                q,
                k,
                v,
                loc,
                k_cache,
                v_cache,
                out,
                workspace=self._fused_workspace,
                tickets=self._tickets,
                prologue=prologue,
                release_early=self.pdl_release_early,
                **common,
            )
        if t.paged_store:
            prologue, self._after_metadata = self.paged_pdl_prologue and not self._after_metadata, False
            common.update(prologue=prologue, release_early=self.paged_pdl_release_early)
        if loc is not None:
            common.update(k=k, v=v, loc=loc)
        return self._paged_attention(q, k_cache, v_cache, out, workspace=t.workspace, **common)

    def forward(self, q, k, v, layer_id, batch, save_kv_cache=True, *, sinks=None):
        self.check_forward_inputs(q, k, v, batch, save_kv_cache, sinks=sinks)
        t = self._step_tables()
        is_swa = self.pool.is_swa_layer(layer_id)
        k_cache, v_cache = self.pool.get_kv_buffer(layer_id)
        loc = None
        if save_kv_cache:
            loc = t.swa_out_cache_loc[: batch.num_tokens] if is_swa else batch.out_cache_loc
            if not (t.fused and self.kv_store_impl == "triton") and not t.paged_store:  # a separate store launch
                self._store(k, v, k_cache, v_cache, loc)
                loc = None
        return self._attend(q, k, v, loc, k_cache, v_cache, is_swa, batch, t, sinks)
