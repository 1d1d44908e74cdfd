"""A ``DeviceGraph`` for any PyTorch device module with stream-capture graphs.

PyTorch's device modules share one shape for graphs: a graph class, a ``graph(g, pool=...)``
capture context, ``graph_pool_handle()``, ``Stream``, ``stream(s)`` and
``current_stream()``. A plugin passes its module and graph class (found by feature
detection, e.g. ``getattr(module, "SomeGraph", None)``); the core never names a vendor.

Capture warms the step up on a side stream first (kernel compilation and allocator caches
happen there, never during capture), then captures it into a memory pool shared by every
graph of that module in the process, as an engine's graph runner does.
"""

from __future__ import annotations

from types import ModuleType
from typing import Callable, Dict

import torch

__all__ = ["StreamGraph", "WARMUP_RUNS"]

#: runs of the step before capture
WARMUP_RUNS = 2
_pools: Dict[str, object] = {}


class StreamGraph:
    """``DeviceGraph`` over ``graph_cls`` of ``module`` (see module docstring)."""

    is_device_graph = True

    def __init__(self, module: ModuleType, graph_cls: type) -> None:
        self.module = module
        self.graph = graph_cls()
        self._captured = False

    def _pool(self):
        key = self.module.__name__
        if key not in _pools:
            _pools[key] = self.module.graph_pool_handle()
        return _pools[key]

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        mod = self.module
        side = mod.Stream()
        side.wait_stream(mod.current_stream())
        with mod.stream(side):
            for _ in range(WARMUP_RUNS):
                fn()
        mod.current_stream().wait_stream(side)
        with mod.graph(self.graph, pool=self._pool()):
            out = fn()
        self._captured = True
        return out

    def replay(self) -> None:
        if not self._captured:
            raise RuntimeError("replay() before capture()")
        self.graph.replay()
