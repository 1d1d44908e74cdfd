"""The CUDA device's parts the core asks a plugin for: a graph and a sync guard.

* ``cuda_graph()``: a ``DeviceGraph`` over ``torch.cuda.CUDAGraph`` (core's ``StreamGraph``:
  garbage collector paused, warm-up on a side stream, capture into a shared pool; a failed
  capture is ended, its pool recording stopped through the caching allocator's
  ``endAllocateToPool`` / ``releasePool`` and the pool retired). Stream capture keeps the
  programmatic (PDL) edges between kernels.
* ``strict_sync_guard()``: any host-device synchronisation inside the block raises
  (``torch.cuda.set_sync_debug_mode("error")``).

Everything here touches CUDA only when called, so the module imports on any machine.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from attnplug.graphs import PoolOps, StreamGraph

__all__ = ["cuda_graph", "strict_sync_guard"]


def _pool_ops() -> PoolOps:
    # The caching allocator's calls that torch.cuda.graph's exit makes (or, after a failed
    # cudaStreamEndCapture, may skip) and CUDAGraph.reset makes.
    return PoolOps(end_recording=torch._C._cuda_endAllocateToPool, release=torch._C._cuda_releasePool)


def cuda_graph() -> StreamGraph:
    return StreamGraph(torch.cuda, torch.cuda.CUDAGraph, pool_ops=_pool_ops())


@contextlib.contextmanager
def strict_sync_guard() -> Iterator[None]:
    """Make every host-device sync inside the block raise."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)
