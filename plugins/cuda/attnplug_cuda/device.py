"""The CUDA device's parts the core asks a plugin for: a graph class and a sync guard.

``CudaGraph`` wraps ``torch.cuda.CUDAGraph``: it warms the step up on a side stream (Triton
compiles and autotuning caches fill there, never during capture), then captures it into a
memory pool shared by every graph of the process, like an engine's graph runner does.
Programmatic-dependent-launch edges between kernels are kept by stream capture.

``strict_sync_guard`` turns any host-device synchronisation into an error
(``torch.cuda.set_sync_debug_mode("error")``) for the duration of a block.

Everything here touches CUDA only when called, so the module imports on any machine.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

import torch

__all__ = ["CudaGraph", "strict_sync_guard", "WARMUP_RUNS"]

#: runs of the step before capture (compiles kernels, fills allocator caches)
WARMUP_RUNS = 2
_shared_pool = None


def _graph_pool():
    global _shared_pool
    if _shared_pool is None:
        _shared_pool = torch.cuda.graph_pool_handle()
    return _shared_pool


class CudaGraph:
    """``DeviceGraph`` over ``torch.cuda.CUDAGraph`` (see module docstring)."""

    is_device_graph = True

    def __init__(self) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self._captured = False

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(self.graph, pool=_graph_pool()):
            out = fn()
        self._captured = True
        return out

    def replay(self) -> None:
        if not self._captured:
            raise RuntimeError("replay() before capture()")
        self.graph.replay()


@contextlib.contextmanager
def strict_sync_guard() -> Iterator[None]:
    """Make every host-device sync inside the block raise."""
    previous: Optional[int] = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)
