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

This module holds the contract itself; what a backend claims is in ``capabilities``, the
checks of its arguments and inputs in ``input_checks``.
"""

from __future__ import annotations

import abc
import math
from typing import TYPE_CHECKING, Any, ClassVar, ContextManager, Dict, Iterable, Optional

import torch

from .batch import ForwardBatch
from .capabilities import GRAPH_MODES, Capabilities, GraphSupport
from .device_part import DevicePart
from .input_checks import (
    BackendConfigError,
    InputChecks,
    check_config,
    check_kv_buffer_size,
    check_kv_cache_dtype,
    check_positive_float,
)

if TYPE_CHECKING:  # pragma: no cover
    from .graphs.device_graph import DeviceGraph
    from .memory import ReqToTokenPool, SWAKVPool
    from .ops import PagedOps

__all__ = [
    "AttentionBackend",
    "Capabilities",
    "GraphSupport",
    "GRAPH_MODES",
    "BackendConfigError",
    "decide_needs_cpu_seq_lens",
]


def decide_needs_cpu_seq_lens(backends: Iterable["AttentionBackend"]) -> bool:
    """OR of ``needs_cpu_seq_lens`` over every backend an engine runs (target, draft,
    draft-extend). When False, the engine passes ``seq_lens_cpu=None`` and never syncs to
    build it. Accepts backend instances or classes."""
    return any(bool(getattr(b, "needs_cpu_seq_lens", True)) for b in backends)


class AttentionBackend(InputChecks, abc.ABC):
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

    An FP8 pool (``attnplug.memory.fp8``) is served only by a class that lists its dtype in
    ``Capabilities.fp8_kv_dtypes``; q, k and v are then of one of ``Capabilities.dtypes`` (k / v
    are quantised at store with the pool's per-head scales) and the output is in q's dtype.

    A pool whose largest layer buffer has more than ``2**31 - 1`` elements is refused
    (``BackendConfigError``) unless the class declares ``Capabilities.large_kv_buffers``
    (64-bit offsets; ``input_checks.check_kv_buffer_size``).

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
        check_config(pool, req_to_token_pool, num_heads=num_heads, sliding_window=sliding_window)
        self.pool = pool
        self.req_to_token_pool = req_to_token_pool
        self.device: torch.device = pool.device
        self.num_heads = num_heads
        self.num_kv_heads: int = pool.num_kv_heads
        self.head_dim: int = pool.head_dim
        self.sliding_window = sliding_window
        if scaling is not None:
            check_positive_float(scaling, "scaling")
        self.scaling = float(scaling) if scaling is not None else 1.0 / math.sqrt(pool.head_dim)
        declared = type(self).declared_capabilities()
        check_kv_buffer_size(pool, declared, type(self).name)
        check_kv_cache_dtype(pool, declared, type(self).name)
        if logit_softcap is not None:
            check_positive_float(logit_softcap, "logit_softcap")
            if declared is None or not declared.logit_softcap:
                raise BackendConfigError(
                    f"logit_softcap={logit_softcap!r}: the {type(self).name} backend does not support logit "
                    "soft-capping (its capabilities declare logit_softcap=False)"
                )
        #: ``c`` of the logit soft-cap ``c * tanh(s / c)``; None: logits are not capped
        self.logit_softcap: Optional[float] = float(logit_softcap) if logit_softcap is not None else None
        self._accepts_sinks = bool(declared is not None and declared.attention_sinks)
        #: the q / k / v dtypes ``forward`` takes over an FP8 pool (the declared ``dtypes``)
        self._model_dtypes = tuple(declared.dtypes) if declared is not None else ()
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
        A backend that supports several ``GraphRunner``s makes a new graph state on every call
        and leaves the buffers of earlier states to the runners that own them
        (``get_cuda_graph_state``).
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

    def get_cuda_graph_state(self) -> Optional[Any]:
        """The graph state the backend uses now: the buffers of the last
        ``init_cuda_graph_state`` (and the views the backend keeps of them), as an opaque handle
        for ``set_cuda_graph_state``; None before ``init_cuda_graph_state``.

        A captured graph reads its buffers at fixed addresses for as long as it lives. So that
        several ``GraphRunner``s can share one backend, each runner keeps the state its
        constructor's ``init_cuda_graph_state`` made and hands it back before each of its
        captures and replays: a later runner never replaces the buffers under an earlier
        runner's graphs. Default: None, always (the backend keeps one set of buffers):
        ``GraphRunner`` then refuses a second runner on the backend while the first one lives.
        """
        return None

    def set_cuda_graph_state(self, state: Any) -> None:
        """Make ``state`` (a ``get_cuda_graph_state()`` handle of this backend) the state that
        capture and replay metadata fill and that ``cuda_graph_swa_out_cache_loc`` names.
        Must: switch references only (no allocation, no device work, sync-free); refuse an
        object that is not such a handle. Default: raises ``NotImplementedError`` (one state
        per backend: see ``get_cuda_graph_state``)."""
        raise NotImplementedError(f"{type(self).__name__} keeps one graph state (get_cuda_graph_state() is None)")

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
        static positions stay as they are; ``GraphRunner`` never announces such a batch: it
        refuses a step without positions). Then it prepares ``static`` as usual.
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

    # ------------------------------------------------------------------ the op layer
    @classmethod
    def paged_ops(cls, device: Any) -> "PagedOps":
        """This backend's kernels over caches an engine owns (``attnplug.ops.PagedOps``:
        ``plan`` per step, ``store_kv`` and ``attend`` per layer), for ``device``. The layer
        serves what ``declared_capabilities()`` declares (dtypes, head dims, window, soft-cap,
        sinks), any block size, and is what the engine integrations (vLLM, SGLang) call.
        Must: compute what ``forward`` computes (the same kernels or math, no second copy).
        Default: raises ``NotImplementedError`` naming the class."""
        raise NotImplementedError(f"{cls.__name__} ({cls.name}) has no op layer (paged_ops)")

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
