"""The attention-backend contract every plugin implements.

An engine builds one backend per model (target, draft, ...) over a shared ``SWAKVPool`` and
``ReqToTokenPool``, then for each step calls ``init_forward_metadata`` (or, in graph mode,
``init_forward_metadata_replay_cuda_graph``) once and ``forward`` once per layer.

The three hot-path rules (docs/contract.md) in terms of this class:

1. Hoisted SWA writes: ``out_cache_loc`` is translated to SWA slots ONCE per step, inside the
   metadata methods, never in ``forward``. In graph mode the result lives in
   ``self.cuda_graph_swa_out_cache_loc`` (int32, length ``max_num_tokens``), allocated by
   ``init_cuda_graph_state``; replay fills ``[:n]`` and zeroes ``[n:]``.
2. ``needs_cpu_seq_lens = False`` is a promise: replay metadata is built from device tensors
   with no host read (no ``.item()``, ``.cpu()``, ``.tolist()``, ``nonzero``, boolean masks,
   ``torch.tensor(list, device=...)``).
3. PDL is a run-time capability (``Capabilities.pdl``), never assumed.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, ContextManager, Dict, Iterable, Optional, Tuple

import torch

from .batch import BatchError, ForwardBatch, ForwardMode
from .device_part import DevicePart

if TYPE_CHECKING:  # pragma: no cover
    from .graphs.device_graph import DeviceGraph
    from .memory import ReqToTokenPool, SWAKVPool

__all__ = [
    "AttentionBackend",
    "Capabilities",
    "GraphSupport",
    "GRAPH_MODES",
    "BackendConfigError",
    "decide_needs_cpu_seq_lens",
]


class BackendConfigError(ValueError):
    """A backend was constructed with arguments it cannot serve (names the argument)."""


class GraphSupport(enum.IntEnum):
    """Which steps a backend can run inside a captured device graph (ordered); ``modes``
    lists them (the one table, ``GRAPH_MODES``):

    * ``NEVER``: none;
    * ``DECODE_ONLY``: DECODE;
    * ``UNIFORM``: the modes with the same number of new tokens for every request (DECODE,
      TARGET_VERIFY, DRAFT_EXTEND);
    * ``ALWAYS``: every mode with new tokens, EXTEND included (the backend's metadata and
      kernels take variable per-request lengths from device tensors inside a graph).

    ``GraphRunner`` captures only the uniform modes (one graph per batch-size bucket fixes the
    tokens per request), so under it EXTEND steps run eagerly whatever the level; ``ALWAYS``
    matters to an engine that captures EXTEND steps itself.
    """

    NEVER = 0
    DECODE_ONLY = 1
    UNIFORM = 2
    ALWAYS = 3

    @property
    def modes(self) -> Tuple[ForwardMode, ...]:
        """The forward modes this level lets a backend run inside a captured graph."""
        return GRAPH_MODES[self]


#: GraphSupport level -> the forward modes a backend at that level runs inside a captured graph
GRAPH_MODES: Dict[GraphSupport, Tuple[ForwardMode, ...]] = {
    GraphSupport.NEVER: (),
    GraphSupport.DECODE_ONLY: (ForwardMode.DECODE,),
    GraphSupport.UNIFORM: (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND),
    GraphSupport.ALWAYS: (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND, ForwardMode.EXTEND),
}


@dataclass(frozen=True)
class Capabilities:
    """What a backend instance can do, as pure data. The conformance suite skips a check
    only when these say the backend does not claim it, and it checks that every claim holds.

    * ``device_type``: ``torch.device(...).type`` of the pool the backend runs on.
    * ``needs_cpu_seq_lens``: False promises sync-free metadata from device tensors.
    * ``pdl``: kernels use Programmatic Dependent Launch in this process (decided at run time).
    * ``graphs``: the ``GraphSupport`` level.
    * ``dtypes`` / ``head_dims`` / ``page_sizes``: the KV dtypes, head dims and pool page sizes
      that are supported.
    * ``sliding_window``: SWA layers (``sliding_window=W``) are supported.
    * ``logit_softcap``: the constructor accepts ``logit_softcap=c`` (logits capped to
      ``c * tanh(s / c)`` before masking and softmax). Default False.
    * ``attention_sinks``: ``forward`` accepts ``sinks=`` (one learned logit per q head that
      joins the softmax denominator). Default False.
    """

    device_type: str
    needs_cpu_seq_lens: bool
    pdl: bool
    graphs: GraphSupport
    dtypes: Tuple[torch.dtype, ...]
    head_dims: Tuple[int, ...]
    page_sizes: Tuple[int, ...]
    sliding_window: bool
    logit_softcap: bool = False
    attention_sinks: bool = False

    def to_json(self) -> dict:
        return {
            "device_type": self.device_type,
            "needs_cpu_seq_lens": self.needs_cpu_seq_lens,
            "pdl": self.pdl,
            "graphs": self.graphs.name,
            "dtypes": [str(d).replace("torch.", "") for d in self.dtypes],
            "head_dims": list(self.head_dims),
            "page_sizes": list(self.page_sizes),
            "sliding_window": self.sliding_window,
            "logit_softcap": self.logit_softcap,
            "attention_sinks": self.attention_sinks,
        }

    def for_instance(
        self, *, device_type: str, pdl: bool = False, graphs: Optional[GraphSupport] = None
    ) -> "Capabilities":
        """These declared (class-level) capabilities narrowed to one instance: the pool's
        ``device_type``, whether this instance's kernels really use PDL, and optionally a lower
        graph level. Raises ``ValueError`` when the instance would claim more than the
        declaration (PDL not declared, a higher graph level), so an instance can never
        disagree with what ``describe()`` shows."""
        if pdl and not self.pdl:
            raise ValueError("pdl=True but the declared capabilities say pdl=False")
        graphs = self.graphs if graphs is None else GraphSupport(graphs)
        if graphs > self.graphs:
            raise ValueError(f"graphs={graphs.name} is above the declared {self.graphs.name}")
        return dataclasses.replace(self, device_type=device_type, pdl=bool(pdl), graphs=graphs)


def decide_needs_cpu_seq_lens(backends: Iterable["AttentionBackend"]) -> bool:
    """OR of ``needs_cpu_seq_lens`` over every backend an engine runs (target, draft,
    draft-extend). When False, the engine passes ``seq_lens_cpu=None`` and never syncs to
    build it. Accepts backend instances or classes."""
    return any(bool(getattr(b, "needs_cpu_seq_lens", True)) for b in backends)


class AttentionBackend(abc.ABC):
    """Attention over the hybrid full + SWA paged KV cache.

    Construction: ``BackendCls(pool, req_to_token_pool, *, num_heads, sliding_window=None,
    scaling=None, logit_softcap=None)``. The device, KV dtype, ``num_kv_heads`` and
    ``head_dim`` come from ``pool``. Tensors seen by ``forward``: q ``[T, num_heads, head_dim]``,
    k and v ``[T, num_kv_heads, head_dim]`` in the pool's dtype, output
    ``[T, num_heads, head_dim]``. ``sliding_window=W`` means a query at position p on an SWA
    layer attends to keys ``p - W < j <= p``; full layers attend to ``0 <= j <= p``.

    Logits are ``s = scaling * q.k``; with ``logit_softcap=c`` (a model constant, e.g.
    Gemma2's ``attn_logit_softcapping``) they become ``c * tanh(s / c)`` before masking and
    softmax. ``forward(..., sinks=...)`` adds one learned logit per q head to the softmax
    denominator only (GPT-OSS): ``p_j = exp(s_j - m) / (sum_i exp(s_i - m) + exp(sink_h - m))``.
    Each is accepted only when the class declares it (``Capabilities.logit_softcap`` /
    ``Capabilities.attention_sinks``).

    Subclasses set the class attributes ``name`` and ``needs_cpu_seq_lens`` and implement
    every abstract method. The base ``__init__`` validates and stores the common arguments.
    """

    #: registry name of the backend (``attnplug info`` shows it)
    name: ClassVar[str] = "abstract"
    #: True unless the backend promises sync-free replay metadata from device tensors
    needs_cpu_seq_lens: ClassVar[bool] = True
    #: True when replay metadata also writes the engine's batch, padded, into the graph's
    #: static batch (``set_replay_source``); ``GraphRunner`` then copies only the model inputs
    copies_replay_batch: ClassVar[bool] = False
    #: the device's part: graphs, sync guard, synchronisation, what ``attnplug info`` shows
    #: (``attnplug.device_part.DevicePart``; the default serves any device with eager graphs)
    device_part: ClassVar[DevicePart] = DevicePart()

    def __init__(
        self,
        pool: "SWAKVPool",
        req_to_token_pool: "ReqToTokenPool",
        *,
        num_heads: int,
        sliding_window: Optional[int] = None,
        scaling: Optional[float] = None,
        logit_softcap: Optional[float] = None,
    ) -> None:
        if not isinstance(num_heads, int) or num_heads < 1:
            raise BackendConfigError(f"num_heads must be a positive int, got {num_heads!r}")
        if num_heads % pool.num_kv_heads:
            raise BackendConfigError(
                f"num_heads={num_heads} is not a multiple of the pool's num_kv_heads={pool.num_kv_heads} (GQA)"
            )
        if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
            raise BackendConfigError(f"sliding_window must be None or an int >= 1, got {sliding_window!r}")
        if pool.swa_layer_ids and sliding_window is None:
            raise BackendConfigError(f"the pool has SWA layers {sorted(pool.swa_layer_ids)} but sliding_window is None")
        if not (isinstance(pool.dtype, torch.dtype) and pool.dtype.is_floating_point):
            raise BackendConfigError(f"the KV pool's dtype must be a floating dtype, got {pool.dtype}")
        if req_to_token_pool.req_to_token.device != pool.device:
            raise BackendConfigError(
                f"req_to_token_pool is on {req_to_token_pool.req_to_token.device}, the KV pool on {pool.device}"
            )
        self.pool = pool
        self.req_to_token_pool = req_to_token_pool
        self.device: torch.device = pool.device
        self.num_heads = num_heads
        self.num_kv_heads: int = pool.num_kv_heads
        self.head_dim: int = pool.head_dim
        self.sliding_window = sliding_window
        if scaling is not None:
            if (
                isinstance(scaling, bool)
                or not isinstance(scaling, (int, float))
                or not math.isfinite(scaling)
                or scaling <= 0
            ):
                raise BackendConfigError(f"scaling must be None or a finite float > 0, got {scaling!r}")
        self.scaling = float(scaling) if scaling is not None else 1.0 / math.sqrt(pool.head_dim)
        declared = type(self).declared_capabilities()
        if logit_softcap is not None:
            if (
                isinstance(logit_softcap, bool)
                or not isinstance(logit_softcap, (int, float))
                or not math.isfinite(logit_softcap)
                or logit_softcap <= 0
            ):
                raise BackendConfigError(f"logit_softcap must be None or a finite float > 0, got {logit_softcap!r}")
            if declared is None or not declared.logit_softcap:
                raise BackendConfigError(
                    f"logit_softcap={logit_softcap!r}: the {type(self).name} backend does not support logit "
                    "soft-capping (its capabilities declare logit_softcap=False)"
                )
        #: ``c`` of the logit soft-cap ``c * tanh(s / c)``; None: logits are not capped
        self.logit_softcap: Optional[float] = float(logit_softcap) if logit_softcap is not None else None
        self._accepts_sinks = bool(declared is not None and declared.attention_sinks)
        self._prepared_batch: Optional[ForwardBatch] = None

    # ------------------------------------------------------------------ description
    @classmethod
    def declared_capabilities(cls) -> Optional[Capabilities]:
        """What the backend claims as a class, read without an instance or a device.

        ``device_type`` is ``cls.device_part.device_type`` (``"any"`` for a portable backend),
        ``needs_cpu_seq_lens`` the class attribute, ``pdl`` True when the kernels use PDL where
        the device has it (an instance decides at run time), ``graphs`` the level on an install
        whose device graph class is present. It is the same on every machine (docs/capabilities.md
        is generated from it). ``describe()`` and ``capabilities()`` are both derived from it
        (through ``installed_capabilities()``), so they cannot disagree.
        Must not: touch the device, start its runtime, import a compiler or build anything.
        Default: None (nothing declared; override ``capabilities()`` then).
        """
        return None

    @classmethod
    def installed_capabilities(cls) -> Optional[Capabilities]:
        """``declared_capabilities()`` narrowed to this install: ``graphs=NEVER`` when the
        device part cannot make graphs here (``device_part.graphs_available()`` is False, e.g.
        its graph class is missing from this version of the device's torch). ``describe()``
        shows it; ``capabilities()`` narrows it to one instance. None when nothing is declared."""
        declared = cls.declared_capabilities()
        if declared is None or cls.device_part.graphs_available():
            return declared
        return declared.for_instance(device_type=declared.device_type, pdl=declared.pdl, graphs=GraphSupport.NEVER)

    def capabilities(self) -> Capabilities:
        """Describe this instance.

        Must: return a frozen ``Capabilities`` whose ``needs_cpu_seq_lens`` equals the class
        attribute and whose ``pdl`` reflects what the kernels really do in this process.
        Must not: touch the device or allocate.
        Default: ``installed_capabilities()`` narrowed to this instance (the pool's device
        type, no PDL); a backend whose kernels use PDL narrows with its own decision
        (``installed_capabilities().for_instance(device_type=..., pdl=...)``).
        """
        installed = type(self).installed_capabilities()
        if installed is None:
            raise NotImplementedError(f"{type(self).__name__} must implement declared_capabilities() or capabilities()")
        return installed.for_instance(device_type=self.device.type)

    @classmethod
    def describe(cls) -> Dict[str, Any]:
        """What ``attnplug info`` shows for the class: ``installed_capabilities()`` in JSON form
        (``pdl`` is ``"run time"`` when the backend uses PDL where the device has it: each
        instance decides) plus the device part's facts. Starts no device runtime and builds
        nothing. Empty when the class declares nothing."""
        declared = cls.installed_capabilities()
        facts: Dict[str, Any] = {}
        if declared is not None:
            facts = declared.to_json()
            facts["pdl"] = "run time" if declared.pdl else False
        for key, value in cls.device_part.describe().items():
            facts.setdefault(key, value)  # the device part adds facts, never overrides a flag
        return facts

    # ------------------------------------------------------------------ eager steps
    @abc.abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Prepare the metadata of one eager step, before the layer loop.

        Must: translate ``batch.out_cache_loc`` to SWA slots exactly once (when the pool has
        SWA layers) and keep the result for every layer; build every per-step table (the
        window's SWA slots included) here, not per layer; accept ``seq_lens_cpu=None`` when
        ``needs_cpu_seq_lens`` is False.
        Must not: modify the KV cache or ``req_to_token``.
        """

    # ------------------------------------------------------------------ graphs
    @abc.abstractmethod
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Allocate every graph-static buffer at its maximum size, once.

        Must: create ``self.cuda_graph_swa_out_cache_loc`` (int32, ``[max_num_tokens]``,
        zero-filled) under exactly that name, and every other buffer the captured kernels
        read. Must not: allocate any graph-read buffer later (capture and replay reuse these).
        """

    @abc.abstractmethod
    def init_forward_metadata_capture_cuda_graph(self, batch: ForwardBatch) -> None:
        """Metadata for capturing one graph; ``batch`` holds views of the runner's static
        input buffers (padded size). Must: point the layers at views of the buffers from
        ``init_cuda_graph_state``. Must not: allocate graph-read tensors or read the host."""

    @abc.abstractmethod
    def init_forward_metadata_replay_cuda_graph(self, batch: ForwardBatch) -> None:
        """Metadata for one replay; ``batch`` is the padded static batch with real values.

        Must: translate once into ``cuda_graph_swa_out_cache_loc[:n]`` and zero ``[n:]``
        (n = ``batch.num_tokens``); update every graph-read buffer in place; be sync-free
        when ``needs_cpu_seq_lens`` is False (device ops only, ``torch.full`` for constants).
        Must not: reallocate a buffer, call ``.item()`` / ``.cpu()`` / ``.tolist()`` /
        ``nonzero`` / boolean-mask indexing, or build tensors from Python lists.
        """

    @abc.abstractmethod
    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """``seq_lens`` value given to padded requests in a captured batch (>= 1)."""

    def set_replay_source(self, batch: ForwardBatch, static: ForwardBatch) -> None:
        """Only for a class with ``copies_replay_batch = True``; ``GraphRunner`` calls it
        right before ``init_forward_metadata_replay_cuda_graph(static)``.

        ``batch`` is the engine's step (same mode and q_len, ``batch_size <= static.batch_size``),
        ``static`` the captured bucket's padded batch (views of the runner's buffers). That
        next replay metadata call, and only it, must first write ``batch`` into ``static``'s
        tensors exactly as the runner would: ``req_pool_indices`` and ``seq_lens`` of the
        ``batch_size`` real requests, then row 0 and ``get_cuda_graph_seq_len_fill_value()``
        for the padded ones; ``out_cache_loc`` of the ``T`` real tokens, then slot 0; and,
        when ``batch.positions`` is not None, ``positions`` then 0 (when it is None, the
        static positions stay as they are). Then it prepares ``static`` as usual.
        Must: read ``batch``'s tensors on the device only (sync-free), refuse a batch on
        another device (``BatchError``), drop ``batch`` after that call.
        Must not: write any other tensor of ``batch`` or ``static``.
        Default: raises ``NotImplementedError`` (the runner copies the batch itself).
        """
        raise NotImplementedError(
            f"{type(self).__name__} does not copy the replay batch (copies_replay_batch is False)"
        )

    # ------------------------------------------------------------------ the layer
    @abc.abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        batch: ForwardBatch,
        save_kv_cache: bool = True,
        *,
        sinks: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """One layer's attention for the step prepared by the last metadata call.

        ``sinks``: this layer's learned sink logits, float32 ``[num_heads]`` on the backend's
        device, in natural-log units (not multiplied by ``scaling``); each joins its head's
        softmax denominator as ``exp(sink_h - m)`` and adds nothing to the numerator. A backend
        whose capabilities declare ``attention_sinks=False`` refuses a non-None value
        (``check_forward_inputs``).
        Must: validate the inputs (``check_forward_inputs``) before any store; when
        ``save_kv_cache``, store k/v at the hoisted ``swa_out_cache_loc`` on SWA layers and at
        ``out_cache_loc`` on full layers, and nowhere else; then attend for every request
        (q_len >= 1, causal within the step, GQA, window on SWA layers, ``logit_softcap`` and
        ``sinks`` where given) and return ``[T, num_heads, head_dim]`` in q's dtype.
        Must not: translate slots, read the host, or allocate graph-visible state.
        """

    # ------------------------------------------------------------------ input checks
    # Helpers every backend calls; host-side only unless validation is on (ATTNPLUG_VALIDATE=1).
    def check_batch(self, batch: ForwardBatch, *, read_device: Optional[bool] = None) -> None:
        """Refuse a batch that does not fit this backend's pools (``BatchError`` naming the
        field and value): device, slot ranges, live rows, ``seq_lens`` bounds. Values on the
        host are always checked; device values only when ``read_device`` (default:
        ``validation_enabled()``), because reading them synchronises.
        Call it from the metadata methods; replay calls it only when validation is on."""
        from .batch_checks import check_batch_against_pools
        from .env import validation_enabled

        if read_device is None:
            read_device = validation_enabled()
        check_batch_against_pools(batch, self.pool, self.req_to_token_pool, read_device=read_device)

    def _note_prepared_batch(self, batch: ForwardBatch) -> None:
        """Record the batch the last metadata call prepared (``forward`` checks it)."""
        self._prepared_batch = batch

    def _check_prepared_batch(self, batch: ForwardBatch) -> None:
        """``batch`` must be the one the last metadata call prepared: the same object, or a
        batch over the very same tensors (e.g. a copy that only adds ``seq_lens_cpu``)."""
        prepared = self._prepared_batch
        if batch is prepared:
            return
        if prepared is None:
            raise RuntimeError("forward() before init_forward_metadata() for this step")
        if not isinstance(batch, ForwardBatch) or _batch_identity(batch) != _batch_identity(prepared):
            raise BatchError(
                "forward() got a batch other than the one prepared by the last metadata call "
                "(init_forward_metadata / init_forward_metadata_*_cuda_graph): call the metadata "
                "method for this batch first; the old metadata is never reused for another batch"
            )

    def check_forward_inputs(
        self, q, k, v, batch: ForwardBatch, save_kv_cache: bool = True, *, sinks: Optional[torch.Tensor] = None
    ) -> None:
        """Host-side checks of one layer's inputs: the prepared batch, q/k/v shapes, dtypes
        (q, k and v in the pool's floating dtype) and devices, and ``sinks`` (None, or a
        float32 ``[num_heads]`` tensor on the pool's device, only when the backend declares
        ``attention_sinks``). Raises ``ValueError`` / ``BatchError`` naming the argument.
        Reads no device value."""
        if sinks is not None:
            self._check_sinks(sinks)
        self._check_prepared_batch(batch)
        T = batch.num_tokens
        expected = {"q": (T, self.num_heads, self.head_dim)}
        if save_kv_cache or k is not None or v is not None:
            expected["k"] = expected["v"] = (T, self.num_kv_heads, self.head_dim)
        for name, t in (("q", q), ("k", k), ("v", v)):
            if name not in expected:
                continue
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if tuple(t.shape) != expected[name]:
                raise ValueError(f"{name} must be {list(expected[name])}, got {tuple(t.shape)}")
            if t.dtype != self.pool.dtype:
                raise ValueError(
                    f"{name} is {str(t.dtype).replace('torch.', '')}, the KV pool holds "
                    f"{str(self.pool.dtype).replace('torch.', '')} (q, k and v must match it)"
                )
            if t.device != self.device:
                raise ValueError(f"{name} is on {t.device}, the KV pool on {self.device}")

    def _check_sinks(self, sinks) -> None:
        if not getattr(self, "_accepts_sinks", False):
            raise ValueError(
                f"sinks: the {type(self).name} backend does not support attention sinks (its capabilities "
                "declare attention_sinks=False); pass sinks=None"
            )
        if not isinstance(sinks, torch.Tensor):
            raise ValueError(f"sinks must be None or a torch.Tensor, got {type(sinks).__name__}")
        if tuple(sinks.shape) != (self.num_heads,):
            raise ValueError(f"sinks must be [{self.num_heads}] (one logit per q head), got {tuple(sinks.shape)}")
        if sinks.dtype != torch.float32:
            raise ValueError(f"sinks must be float32, got {str(sinks.dtype).replace('torch.', '')}")
        if sinks.device != self.device:
            raise ValueError(f"sinks is on {sinks.device}, the KV pool on {self.device}")

    # ------------------------------------------------------------------ device services
    # They delegate to ``device_part`` so the graph runner and the conformance suite stay
    # device-neutral; a plugin sets ``device_part`` rather than overriding these.
    @classmethod
    def new_graph(cls) -> "DeviceGraph":
        """A fresh graph object of this backend's device (``device_part.new_graph()``)."""
        return cls.device_part.new_graph()

    @classmethod
    def sync_guard(cls) -> ContextManager:
        """A context that makes a host-device sync an error on this device, where the device
        runtime offers one (``device_part.sync_guard()``)."""
        return cls.device_part.sync_guard()

    @classmethod
    def synchronize(cls, device: torch.device) -> None:
        """Wait for all work queued on ``device`` (``device_part.synchronize(device)``)."""
        cls.device_part.synchronize(device)


def _batch_identity(batch: ForwardBatch) -> tuple:
    """What a step's metadata was built from: the mode, the sizes and the tensors (by storage)."""
    return (
        batch.forward_mode,
        batch.batch_size,
        batch.num_tokens,
        batch.num_draft_tokens,
        *(
            (t.data_ptr(), t.shape[0]) if isinstance(t, torch.Tensor) else None
            for t in (batch.req_pool_indices, batch.seq_lens, batch.out_cache_loc, batch.extend_seq_lens)
        ),
    )
