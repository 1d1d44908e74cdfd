"""A ``DeviceGraph`` for any PyTorch device module with stream-capture graphs.

PyTorch's device modules share one shape for graphs: a graph class, a ``graph(g, pool=...)``
capture context, ``graph_pool_handle()``, ``Stream``, ``stream(s)``, ``current_stream()``
and ``current_device()``. A plugin passes its module and graph class (found by feature
detection, e.g. ``getattr(module, "SomeGraph", None)``); the core never names a vendor.

Capture:

1. runs with the cyclic garbage collector paused (``collector.collector_paused``: one
   collection first, none during capture), so no unreachable graph is destroyed on a
   capturing stream;
2. warms the step up on a side stream, ``WARMUP_RUNS`` times, with exactly the callable (so
   the same static batch and input views) that is then captured: kernel compilation, module
   loading and allocator growth happen there, never inside the captured region;
3. captures it into a memory pool shared by the graphs of that module in the process, as an
   engine's graph runner does.

Capture is atomic. If anything raises between the start of capture and its end (the step, or
the graph class when the capture ends), ``capture`` ends what it began and re-raises: the
caller's current stream is restored, the allocator no longer records into the pool (some
PyTorch versions leave it recording when ending an invalidated capture fails; ``PoolOps``
ends it and drops the reference that capture took), and the pool is retired, so later
captures use a fresh one and never meet ``already recording to mempool_id``. Graphs already
captured into the retired pool keep working. The failed graph object is dropped, or kept
for the life of the process when the allocator may still refer to it.

A shared pool lives as long as a graph captured into it: once every such graph is gone, the
allocator releases the pool (PyTorch's caching allocator then refuses a new capture into the
same pool id while it still holds the pool's blocks), so the next capture starts a fresh one.
A process can thus drop an engine's graphs and capture another engine's.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field
from types import ModuleType
from typing import Callable, Dict, List, Optional

import torch

from . import collector

__all__ = ["PoolOps", "StreamGraph", "WARMUP_RUNS", "torch_pool_ops"]

logger = logging.getLogger(__name__)

#: runs of the step before capture
WARMUP_RUNS = 2


@dataclass
class _SharedPool:
    """A pool handle and the graphs captured into it (held weakly)."""

    handle: object
    graphs: "weakref.WeakSet" = field(default_factory=weakref.WeakSet)


#: module name -> the graph memory pool captures of that module share
_pools: Dict[str, _SharedPool] = {}
#: graph objects of failed captures the device allocator may still refer to
_kept_failed: List[object] = []


@dataclass(frozen=True)
class PoolOps:
    """The device caching allocator's pool calls, as ``fn(device_index, pool)``.

    ``end_recording`` stops routing allocations into ``pool`` and raises when the allocator is
    not recording into it; ``release`` drops one capture's reference to ``pool``.
    """

    end_recording: Callable[[int, object], None]
    release: Callable[[int, object], None]


def torch_pool_ops(module: ModuleType) -> Optional[PoolOps]:
    """``PoolOps`` of a ``torch.<name>`` device module, found by feature:
    ``torch._C._<name>_endAllocateToPool`` and ``torch._C._<name>_releasePool``; None if
    this PyTorch build has no such pair."""
    short = module.__name__.rsplit(".", 1)[-1]
    end = getattr(torch._C, f"_{short}_endAllocateToPool", None)
    release = getattr(torch._C, f"_{short}_releasePool", None)
    if callable(end) and callable(release):
        return PoolOps(end_recording=end, release=release)
    return None


def shared_pool(module: ModuleType) -> object:
    """The pool the next capture of ``module`` uses: the shared one while a graph captured into
    it lives, else a new one (on first use, and after every graph of the last one is gone)."""
    key = module.__name__
    entry = _pools.get(key)
    if entry is None or not len(entry.graphs):
        entry = _pools[key] = _SharedPool(module.graph_pool_handle())
    return entry.handle


def _retire_pool(module: ModuleType, pool: object) -> None:
    entry = _pools.get(module.__name__)
    if entry is not None and entry.handle is pool:
        del _pools[module.__name__]


class StreamGraph:
    """``DeviceGraph`` over ``graph_cls`` of ``module`` (see module docstring).

    ``pool_ops``: how to end the allocator's recording after a failed capture; default
    ``torch_pool_ops(module)``. Without it a failed capture still retires the pool.
    """

    def __init__(self, module: ModuleType, graph_cls: type, *, pool_ops: Optional[PoolOps] = None) -> None:
        self.module = module
        self.graph = graph_cls()
        self.pool_ops = pool_ops if pool_ops is not None else torch_pool_ops(module)
        self._state = "new"  # -> "captured" | "failed"

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        if self._state != "new":
            raise RuntimeError(f"a StreamGraph captures once (this one is {self._state})")
        mod = self.module
        with collector.collector_paused(collect=True):
            side = mod.Stream()
            side.wait_stream(mod.current_stream())
            with mod.stream(side):
                for _ in range(WARMUP_RUNS):
                    fn()
            mod.current_stream().wait_stream(side)
            pool = shared_pool(mod)
            entry = _pools[mod.__name__]
            device = mod.current_device()
            try:
                # The outer stream context restores the caller's stream even when the graph
                # context's exit raises before restoring it.
                with mod.stream(mod.current_stream()):
                    with mod.graph(self.graph, pool=pool):
                        out = fn()
            except BaseException:
                self._abandon(device, pool)
                raise
            entry.graphs.add(self)
        self._state = "captured"
        return out

    def _abandon(self, device: int, pool: object) -> None:
        """Undo a capture that raised (see module docstring)."""
        graph, self.graph = self.graph, None
        self._state = "failed"
        _retire_pool(self.module, pool)
        ops = self.pool_ops
        if ops is None:
            _kept_failed.append(graph)
            return
        try:
            ops.end_recording(device, pool)
        except Exception:
            return  # the runtime ended the recording; the graph releases its pool reference when dropped
        # The runtime left the pool recording: it also kept this capture's pool reference and
        # may still hold a filter that points at the graph object.
        _kept_failed.append(graph)
        try:
            ops.release(device, pool)
        except Exception as exc:  # the pool's memory stays cached; capture still works
            logger.warning("releasing the pool of a failed graph capture failed: %s: %s", type(exc).__name__, exc)

    def replay(self) -> None:
        if self._state != "captured":
            raise RuntimeError(f"replay() of a graph that is not captured (state: {self._state})")
        self.graph.replay()
