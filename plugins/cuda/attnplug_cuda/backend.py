"""``TritonBackend``, the device-neutral Triton backend, and the ``cuda`` backend over it:
Triton (and optionally a CUDA C++ KV store) kernels with PDL, CUDA graphs.

``TritonBackend`` is the one home of the Triton path on every device: it runs this package's
kernels, planner and step tables and takes every device decision from its class's
``device_part`` (a ``triton_part.TritonDevicePart``: PDL compiled in or out, compute units,
the C++ KV store, the plan defaults, the graph class). ``CudaBackend`` names ``CudaDevice``
(NVIDIA; AMD on a ROCm torch, PDL compiled out); ``attnplug_xpu.triton_backend`` names the
XPU's part.

Per step, ONE kernel launch (``kernels.step_metadata``) builds everything the layers read: the
hoisted ``swa_out_cache_loc`` (translated once, tail zeroed), ``cu_q_lens``, the window's
start, each new token's position and the window's SWA slot table (full-pool rows translated
once per step), and ``planner.plan_step`` decides, from host ints only, how the step's layers
run. Per layer, by the step's plan:

* small decode and draft steps: ONE ``store_attend`` launch (store, attention, split merge);
* other decode and draft steps: ONE ``paged_attention`` launch that also stores the step;
* extends (and what the tuning turns off): a KV store launch, then ``paged_attention`` (and
  its split combine when decode splits the KV range).

With PDL, every attention launch after a step's first reads its metadata and cached K/V
before waiting for the previous kernel, so consecutive layers overlap (``pdl.Schedule``).

FP8 KV caches (``attnplug.memory.fp8``: ``float8_e4m3fn``, ``float8_e5m2``; q, k, v and the
output in float16 or bfloat16): the same paths, plans (``AttentionShape.kv_fp8``), PDL
schedules and graphs; every store quantises (``kernels.common.quantize_kv``, bit for bit the
pool's rule) and every attention kernel reads the FP8 tiles with the layer's per-head scales
folded in (``kernels.common``). Each layer's scales are the pool's ``kv_scales(layer_id)``
views, taken once at construction: their addresses never change, so graphs replay whatever
``set_kv_scales`` last wrote. Where the device's Triton cannot run a dtype
(``TritonDevicePart.fp8_kv_problem``: ``float8_e4m3fn`` below compute capability 8.9 and on
ROCm) the constructor refuses the pool, saying why.
Graph mode keeps every buffer static (``init_cuda_graph_state``: a new graph state per call,
owned by the ``GraphRunner`` that made it and switched back to with ``set_cuda_graph_state``);
replay preparation is one launch on device tensors and reads nothing back
(``needs_cpu_seq_lens = False``). EXTEND steps are captured too (``GraphSupport.ALWAYS``): a
captured EXTEND step of ``bs`` requests and up to ``T`` tokens (``StepTables.view_extend``) is
planned for one request holding all ``T`` (``plan_step``'s ``tile_map``), and its metadata
launch also writes the tile map ``paged_attention`` runs over, so its grid never depends on the
lengths of a replay and holds no program for rows no request has.

Choices (``tuning.CudaTuning``, ``CudaTuning.from_env()`` by default):
``ATTNPLUG_DISABLE_PDL=1`` launches without PDL; ``ATTNPLUG_KV_STORE=cpp`` stores K/V with the
CUDA C++ kernel (``csrc/kv_store.cu``, built JIT on first use; where it cannot be built the
Triton store is used and ``kv_store_reason`` says why; an FP8 pool always gets the Triton
store, which quantises: the C++ store does not, and refuses FP8 caches). A variant for a
benchmark or a test is ``CudaBackend(..., tuning=dataclasses.replace(tuning, ...))``.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Dict, Optional, Tuple

import torch

from attnplug.backend import AttentionBackend, BackendConfigError, Capabilities, GraphSupport
from attnplug.batch import BatchError, ForwardBatch
from attnplug.env import validation_enabled
from attnplug.graph_buffers import GraphBuffers
from attnplug.memory.fp8 import FP8_KV_DTYPES, is_fp8

from .device import CudaDevice
from .planner import (
    AttentionShape,
    Path,
    one_launch_workspace_numel,
    paged_workspace_numel,
    plan_step,
)
from .step_tables import StepTables, graph_buffers
from .triton_part import TritonDevicePart
from .tuning import CudaTuning

__all__ = ["TritonBackend", "CudaBackend"]


#: the device decisions of a backend whose device part is not a ``TritonDevicePart``
_CUDA_PART = CudaDevice()

#: the smallest head dim the kernels tile (a dot of a 16-wide K block)
MIN_HEAD_DIM = 16


class TritonBackend(AttentionBackend):
    """Paged hybrid full + SWA attention through this package's Triton kernels on the device
    of its ``device_part`` (see module docstring). Subclasses set ``name``, ``device_part``
    and ``device_label``."""

    needs_cpu_seq_lens = False
    copies_replay_batch = True  # the one metadata launch also fills the runner's static batch
    device_part: ClassVar[TritonDevicePart]
    #: the device as a refused pool's message names it
    device_label: ClassVar[str] = "a CUDA device"
    #: the FP8 KV cache dtypes the kernels serve (narrowed by the device part's
    #: ``fp8_kv_problem``: ``declared_capabilities``, the constructor, ``paged_ops``)
    fp8_kv_dtypes: ClassVar[Tuple[torch.dtype, ...]] = FP8_KV_DTYPES

    def __init__(self, pool, req_to_token_pool, *, tuning: Optional[CudaTuning] = None, **layer):
        """``layer``: what every backend takes (``num_heads``, ``sliding_window``, ``scaling``,
        ``logit_softcap``: ``AttentionBackend``); ``tuning``: the device part's
        ``default_tuning()`` when None."""
        part = self.triton_part()
        dtype = getattr(pool, "dtype", None)
        if is_fp8(dtype):  # before the core's check, which cannot say why a dtype is not served
            problem = part.fp8_kv_problem(dtype, getattr(pool, "device", None))
            if problem is not None:
                raise BackendConfigError(f"the {self.name} backend cannot serve a {dtype} KV pool here: {problem}")
        super().__init__(pool, req_to_token_pool, **layer)
        if not part.serves(self.device):
            raise ValueError(
                f"the {self.name} backend needs a pool on {self.device_label}, got {self.device} "
                "(on the CPU it runs only under the Triton interpreter, TRITON_INTERPRET=1)"
            )
        if self.head_dim < MIN_HEAD_DIM:
            raise BackendConfigError(
                f"head_dim={self.head_dim}: the {self.name} backend's kernels need head_dim >= {MIN_HEAD_DIM} "
                f"(it declares {list(self.declared_capabilities().head_dims)})"
            )
        self._check_runtime()
        from .kernels import common, kv_store, paged_attention, step_metadata, store_attend

        tuning = tuning if tuning is not None else part.default_tuning()
        if not isinstance(tuning, CudaTuning):
            raise TypeError(f"tuning must be a CudaTuning, got {type(tuning).__name__}")
        if pool.is_fp8 and tuning.kv_store == "cpp":  # (nothing is built for a store that cannot run)
            self.kv_store_impl = "triton"
            self.kv_store_reason = (
                f"the CUDA C++ KV store does not quantise: the {pool.dtype} pool is stored by the Triton kernels"
            )
        else:
            self.kv_store_impl, self.kv_store_reason = part.kv_store_choice(tuning.kv_store)
        # PDL is decided here, once, from the device part: the plans carry it into every
        # kernel as a constexpr (None without PDL), so no PDL code is compiled without it.
        ok, self.pdl_reason = part.pdl_support(self.device)
        self.pdl = ok and tuning.pdl
        if ok and not tuning.pdl:
            self.pdl_reason = "turned off by the tuning (pdl=False)"
        #: the tuning this instance runs with (the KV store it could load)
        self.tuning = dataclasses.replace(tuning, kv_store=self.kv_store_impl)
        self._step_metadata = step_metadata.step_metadata
        self._per_step_args, self._padded_copy = step_metadata.per_step_args, step_metadata.PaddedCopy
        self._kv_store = kv_store.kv_store
        self._paged_attention = paged_attention.paged_attention
        self._store_attend = store_attend.store_attend
        self._inputs, self._key_table, self._new_rows = common.AttentionInputs, common.KeyTable, common.NewRows
        # each layer's FP8 scales: views of the pool's rows, fixed addresses (None: unquantised)
        self._kv_scales = [
            common.KVScales.of(*pool.kv_scales(layer)) if pool.is_fp8 else None for layer in range(pool.num_layers)
        ]
        self.has_swa = bool(pool.swa_layer_ids)
        self.max_context_len = req_to_token_pool.req_to_token.shape[1]
        #: what this instance fixes for every step's plan
        self.shape = AttentionShape(
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            max_context_len=self.max_context_len,
            window=self.sliding_window if self.has_swa else None,
            num_sms=part.compute_units(self.device),
            kv_fp8=pool.is_fp8,
        )
        self.forward_metadata: Optional[StepTables] = None
        self.cuda_graph_swa_out_cache_loc: Optional[torch.Tensor] = None
        self._graph_buffers: Optional[GraphBuffers] = None
        self._graph_tables: Dict[Tuple[int, int], StepTables] = {}
        self._validate_replay = False
        self._after_metadata = True  # the next attention launch directly follows the metadata launch
        self._replay_source: Optional[Tuple[ForwardBatch, ForwardBatch]] = None  # set_replay_source
        # Row b of the window table belongs to request b: rows for as many requests as a step
        # can hold (eager: live requests; graphs: padded buckets, see init_cuda_graph_state).
        self._table_rows = torch.arange(req_to_token_pool.req_to_token.shape[0], dtype=torch.int32, device=self.device)
        # store_attend's split partials and its per-(request, kv head) tickets: allocated once,
        # shared by eager steps and graphs (every launch leaves the tickets at zero)
        self._one_launch_workspace = torch.empty(
            one_launch_workspace_numel(self.head_dim, self.shape.num_sms, self.tuning),
            dtype=torch.float32,
            device=self.device,
        )
        self._tickets = torch.zeros(
            self._table_rows.shape[0] * self.num_kv_heads, dtype=torch.int32, device=self.device
        )

    @classmethod
    def triton_part(cls) -> TritonDevicePart:
        """The device decisions: ``device_part`` where it is a ``TritonDevicePart``; CUDA's
        otherwise (a subclass that swapped in a plain ``DevicePart`` for its graphs)."""
        part = cls.device_part
        return part if isinstance(part, TritonDevicePart) else _CUDA_PART

    def _check_runtime(self) -> None:
        """Refuse, naming what is missing, where the device's Triton cannot run (default: none)."""

    @classmethod
    def paged_ops(cls, device, tuning: Optional[CudaTuning] = None):
        """The same kernels over caches an engine owns (``attnplug_cuda.ops.CudaOps``)."""
        from .ops import CudaOps

        return CudaOps(device, tuning, part=cls.triton_part(), fp8_kv_dtypes=cls.fp8_kv_dtypes)

    # ------------------------------------------------------------------ description
    @classmethod
    def declared_capabilities(cls) -> Capabilities:
        """PDL where the device has it (each instance decides: ``capabilities().pdl``); the FP8
        KV dtypes this install's Triton can run on the device type (``fp8_kv_problem``)."""
        part = cls.triton_part()
        return Capabilities(
            device_type=cls.device_part.device_type,
            needs_cpu_seq_lens=cls.needs_cpu_seq_lens,
            pdl=part.declares_pdl,
            graphs=GraphSupport.ALWAYS,
            dtypes=(torch.float16, torch.bfloat16),
            head_dims=(64, 128, 256),
            page_sizes=(1, 2, 4, 8, 16, 32, 64),
            sliding_window=True,
            logit_softcap=True,
            attention_sinks=True,
            # every offset into a layer buffer that multiplies a slot or a head index is 64-bit
            # (the Triton kernels and the C++ store)
            large_kv_buffers=True,
            fp8_kv_dtypes=tuple(d for d in cls.fp8_kv_dtypes if part.fp8_kv_problem(d) is None),
        )

    def capabilities(self) -> Capabilities:
        return self.installed_capabilities().for_instance(device_type=self.device.type, pdl=self.pdl)

    # ------------------------------------------------------------------ metadata
    def _plan(self, bs: int, num_tokens: int, max_q_len: int, tile_map: bool = False):
        return plan_step(self.shape, bs, num_tokens, max_q_len, self.tuning, self.pdl, tile_map)

    def _fill(self, batch: ForwardBatch, t: StepTables, padded=None):
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
            window=self.shape.window,
            pdl=self.pdl,
            positions=batch.positions if padded is not None else None,
            padded=padded,
            fill_value=self.get_cuda_graph_seq_len_fill_value(),
            tiles=t.tiles,
            tile_rows=t.plan.full.kernel.BLOCK_M if t.tiles is not None else 16,
            group=self.shape.group,
        )

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
        bs, T = batch.batch_size, batch.num_tokens
        max_q = self._max_q_len(batch)
        t = StepTables.allocate(self._plan(bs, T, max_q), self.shape, bs, T, max_q, self.device)
        if bs:
            self._fill(batch, t)
        self.forward_metadata = t
        self._note_prepared_batch(batch)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        workspace = paged_workspace_numel(max_num_tokens, self.num_heads, self.head_dim, self.tuning)
        buffers = graph_buffers(self.shape, self.device, max_bs, max_num_tokens, workspace)
        rows, tickets = self._table_rows, self._tickets
        if max_bs > rows.shape[0]:  # padded buckets may exceed the request table
            rows = torch.arange(max_bs, dtype=torch.int32, device=self.device)
            tickets = torch.zeros(max_bs * self.num_kv_heads, dtype=torch.int32, device=self.device)
        # This state's graphs read these by address: the state keeps them (an earlier state
        # keeps its own, so a later, larger runner never frees what an earlier one's graphs read).
        buffers.shared.update(table_rows=rows, tickets=tickets)
        self._use_graph_buffers(buffers)  # a new state: earlier ones stay their runners'
        # Read once here, not per replay: the replay path does no new host work by default.
        self._validate_replay = validation_enabled()

    def get_cuda_graph_state(self) -> Optional[GraphBuffers]:
        """The ``GraphBuffers`` in use (its ``views``: the per-shape step tables)."""
        return self._graph_buffers

    def set_cuda_graph_state(self, state: GraphBuffers) -> None:
        if not isinstance(state, GraphBuffers) or state.device != self.device or "table_rows" not in state.shared:
            raise TypeError(
                f"state must be the GraphBuffers of a {self.name} backend on {self.device} "
                f"(get_cuda_graph_state()), got {type(state).__name__}"
            )
        self._use_graph_buffers(state)

    def _use_graph_buffers(self, state: GraphBuffers) -> None:
        self._graph_buffers = state
        self._graph_tables = state.views
        self.cuda_graph_swa_out_cache_loc = state.swa_out_cache_loc
        self._table_rows, self._tickets = state.shared["table_rows"], state.shared["tickets"]

    def _graph_views(self, batch: ForwardBatch) -> StepTables:
        """The tables of a captured step: a uniform ``(bs, q_len)`` bucket, or an EXTEND step of
        ``bs`` requests and up to ``num_tokens`` tokens (lengths from the device, the grid a tile
        map: ``planner.plan_step``'s ``tile_map``)."""
        if self._graph_buffers is None:
            raise RuntimeError("init_cuda_graph_state() must run before capture or replay")
        bs, n, q = batch.batch_size, batch.num_tokens, batch.q_len
        if q is None and batch.extend_seq_lens is None:
            raise ValueError(f"a captured {batch.forward_mode.name} step needs extend_seq_lens (a tensor)")
        key = (bs, q) if q is not None else ("extend", bs, n)
        t = self._graph_tables.get(key)
        if t is None:
            if q is not None:
                t = StepTables.view(self._plan(bs, n, q), self.shape, self._graph_buffers, bs, q)
            else:
                plan = self._plan(bs, n, n, tile_map=True)
                t = StepTables.view_extend(plan, self.shape, self._graph_buffers, bs, n)
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
    def _store(self, k, v, k_cache, v_cache, loc, scales) -> None:
        if self.tuning.kv_store == "cpp":  # never an FP8 pool (the constructor chose the Triton store)
            from .cpp_ext import kv_store as cpp_kv_store

            cpp_kv_store(k, v, k_cache, v_cache, loc, self.pdl)
        else:
            self._kv_store(k, v, k_cache, v_cache, loc, scales=scales, pdl=self.pdl)

    def _step_tables(self) -> StepTables:
        """This step's tables (the last metadata call's)."""
        t = self.forward_metadata
        if t is None:
            raise RuntimeError("forward() before init_forward_metadata() for this step")
        return t

    def keys(self, is_swa: bool, batch: ForwardBatch, t: StepTables, window_table: Optional[torch.Tensor] = None):
        """Where a layer's keys are (``kernels.common.KeyTable``): full layers read
        ``req_to_token`` rows, SWA layers the window table (``t.swa_window_table`` unless
        ``window_table`` is given) from each request's window start."""
        if is_swa:
            table = t.swa_window_table if window_table is None else window_table
            return self._key_table.of(table, self._table_rows, t.window_start)
        return self._key_table.of(self.req_to_token_pool.req_to_token, batch.req_pool_indices)

    def forward(self, q, k, v, layer_id, batch, save_kv_cache=True, *, sinks=None):
        self.check_forward_inputs(q, k, v, batch, save_kv_cache, sinks=sinks)
        t = self._step_tables()
        is_swa = self.pool.is_swa_layer(layer_id)
        k_cache, v_cache = self.pool.get_kv_buffer(layer_id)
        scales = self._kv_scales[layer_id]
        path = t.plan.path
        loc = None
        if save_kv_cache:
            loc = t.swa_out_cache_loc[: batch.num_tokens] if is_swa else batch.out_cache_loc
            stored_by_attention = path is Path.PAGED_STORE or (
                path is Path.ONE_LAUNCH and self.tuning.kv_store == "triton"
            )
            if not stored_by_attention:  # a separate store launch
                self._store(k, v, k_cache, v_cache, loc, scales)
                loc = None
        out = torch.empty_like(q)
        if batch.num_tokens == 0:
            return out
        layer = t.plan.layer(is_swa)
        pdl = layer.schedule(self._after_metadata)
        if path is not Path.TWO_LAUNCH:
            self._after_metadata = False
        inputs = self._inputs(
            t.cu_q_lens,
            batch.seq_lens,
            self.keys(is_swa, batch, t),
            t.max_q_len,
            self.scaling,
            self.sliding_window if is_swa else None,
            self.logit_softcap,
            sinks,
            scales,
        )
        if path is Path.ONE_LAUNCH:
            workspace, tickets = self._one_launch_workspace, self._tickets
            return self._store_attend(
                q, k, v, loc, k_cache, v_cache, out, inputs, layer.kernel, workspace=workspace, tickets=tickets, pdl=pdl
            )
        new = self._new_rows.of(k, v, loc) if loc is not None else None
        return self._paged_attention(
            q, k_cache, v_cache, out, inputs, layer.kernel, new=new, workspace=t.workspace, pdl=pdl, tiles=t.tiles
        )


class CudaBackend(TritonBackend):
    """Paged hybrid full + SWA attention on NVIDIA GPUs, and on AMD GPUs through a ROCm build
    of torch with PDL compiled out (see module docstring)."""

    name = "cuda"
    device_part = CudaDevice()
    device_label = "a CUDA device"
