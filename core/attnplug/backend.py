"""The attention-backend contract every plugin implements.

An engine builds one backend per model (target, draft, ...) over a shared ``SWAKVPool`` and
``ReqToTokenPool``, then for each step calls ``init_forward_metadata`` (or, in graph mode,
``init_forward_metadata_replay_cuda_graph``) once and ``forward`` once per layer.

The three hot-path rules (../shared/DESIGN.md) in terms of this class:

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
import contextlib
import enum
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, ContextManager, Iterable, Optional, Tuple

import torch

from .batch import ForwardBatch

if TYPE_CHECKING:  # pragma: no cover
    from .graphs.device_graph import DeviceGraph
    from .memory import ReqToTokenPool, SWAKVPool

__all__ = [
    "AttentionBackend",
    "Capabilities",
    "GraphSupport",
    "BackendConfigError",
    "decide_needs_cpu_seq_lens",
]


class BackendConfigError(ValueError):
    """A backend was constructed with arguments it cannot serve (names the argument)."""


class GraphSupport(enum.IntEnum):
    """Which steps a backend can run inside a captured device graph (ordered)."""

    NEVER = 0
    DECODE_ONLY = 1  # DECODE
    UNIFORM = 2  # DECODE, TARGET_VERIFY, DRAFT_EXTEND (same q_len for every request)
    ALWAYS = 3  # every mode, EXTEND included


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
    """

    device_type: str
    needs_cpu_seq_lens: bool
    pdl: bool
    graphs: GraphSupport
    dtypes: Tuple[torch.dtype, ...]
    head_dims: Tuple[int, ...]
    page_sizes: Tuple[int, ...]
    sliding_window: bool

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
        }


def decide_needs_cpu_seq_lens(backends: Iterable["AttentionBackend"]) -> bool:
    """OR of ``needs_cpu_seq_lens`` over every backend an engine runs (target, draft,
    draft-extend). When False, the engine passes ``seq_lens_cpu=None`` and never syncs to
    build it. Accepts backend instances or classes."""
    return any(bool(getattr(b, "needs_cpu_seq_lens", True)) for b in backends)


class AttentionBackend(abc.ABC):
    """Attention over the hybrid full + SWA paged KV cache.

    Construction: ``BackendCls(pool, req_to_token_pool, *, num_heads, sliding_window=None,
    scaling=None)``. The device, KV dtype, ``num_kv_heads`` and ``head_dim`` come from
    ``pool``. Tensors seen by ``forward``: q ``[T, num_heads, head_dim]``, k and v
    ``[T, num_kv_heads, head_dim]`` in the pool's dtype, output ``[T, num_heads, head_dim]``.
    ``sliding_window=W`` means a query at position p on an SWA layer attends to keys
    ``p - W < j <= p``; full layers attend to ``0 <= j <= p``.

    Subclasses set the class attributes ``name`` and ``needs_cpu_seq_lens`` and implement
    every abstract method. The base ``__init__`` validates and stores the common arguments.
    """

    #: registry name of the backend (``attnplug info`` shows it)
    name: ClassVar[str] = "abstract"
    #: True unless the backend promises sync-free replay metadata from device tensors
    needs_cpu_seq_lens: ClassVar[bool] = True

    def __init__(
        self,
        pool: "SWAKVPool",
        req_to_token_pool: "ReqToTokenPool",
        *,
        num_heads: int,
        sliding_window: Optional[int] = None,
        scaling: Optional[float] = None,
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
            raise BackendConfigError(
                f"the pool has SWA layers {sorted(pool.swa_layer_ids)} but sliding_window is None"
            )
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
        self.scaling = float(scaling) if scaling is not None else 1.0 / math.sqrt(pool.head_dim)

    # ------------------------------------------------------------------ description
    @abc.abstractmethod
    def capabilities(self) -> Capabilities:
        """Describe this instance.

        Must: return a frozen ``Capabilities`` whose ``needs_cpu_seq_lens`` equals the class
        attribute and whose ``pdl`` reflects what the kernels really do in this process.
        Must not: touch the device or allocate.
        """

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
    ) -> torch.Tensor:
        """One layer's attention for the step prepared by the last metadata call.

        Must: when ``save_kv_cache``, store k/v at the hoisted ``swa_out_cache_loc`` on SWA
        layers and at ``out_cache_loc`` on full layers, and nowhere else; then attend for
        every request (q_len >= 1, causal within the step, GQA, window on SWA layers) and
        return ``[T, num_heads, head_dim]`` in q's dtype.
        Must not: translate slots, read the host, or allocate graph-visible state.
        """

    # ------------------------------------------------------------------ device services
    # Defaults for a device without graphs or sync guards; plugins override them so the
    # graph runner and the conformance suite stay device-neutral.
    @classmethod
    def new_graph(cls) -> "DeviceGraph":
        """A fresh graph object of this backend's device (default: the eager stand-in)."""
        from .graphs.device_graph import EagerGraph

        return EagerGraph()

    @classmethod
    def sync_guard(cls) -> ContextManager:
        """A context that makes a host-device sync an error on this device, where the device
        runtime offers one (default: nothing; the suite's own detector still runs)."""
        return contextlib.nullcontext()

    @classmethod
    def run_benchmarks(cls, *, only=None, quick: bool = False, json_path: Optional[str] = None) -> dict:
        """Run the benchmarks this backend's plugin ships (``attnplug bench``): print a table,
        write JSON to ``json_path``, return the results. Default: none are shipped."""
        raise NotImplementedError(f"backend {cls.name!r} ships no benchmarks")

    @classmethod
    def synchronize(cls, device: torch.device) -> None:
        """Wait for all work queued on ``device`` (default: ``torch.accelerator`` when the
        device is an accelerator, nothing for the host)."""
        if device.type != "cpu" and hasattr(torch, "accelerator"):
            torch.accelerator.synchronize(device)
