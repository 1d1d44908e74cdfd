"""How the harness times work, on any device.

``Timer(device, backend_cls)`` picks one method per run and records it (``Timer.method``):

* ``"triton.testing"``: Triton is importable and its active driver drives ``device``'s torch
  module: eager device time with ``triton.testing.do_bench`` and graph-replay time with
  ``triton.testing.do_bench_cudagraph`` (median, in microseconds);
* ``"device graph"``: the backend's graph class (``backend_cls.new_graph()``) is a real
  device graph: captured once, replays timed by wall clock between synchronisations;
* ``"wall clock"``: anything else (the host): median wall-clock time of calls, the device
  synchronised through ``backend_cls.synchronize`` around every sample.

Nothing here touches a device at import time.
"""

from __future__ import annotations

import functools
import gc
import os
import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Type

import torch

__all__ = ["Timer", "median", "copy_bandwidth", "free_memory"]


def median(values: List[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def _triton_drives(device: torch.device) -> bool:
    """Whether ``triton.testing`` can time work on ``device`` (compiled kernels, a real driver)."""
    if device.type == "cpu" or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False
    try:
        from triton.runtime import driver

        interface = driver.active.get_device_interface()
    except Exception:
        return False
    return interface is getattr(torch, device.type, None)


class Timer:
    """Times callables on ``device`` (see the module docstring). ``backend_cls`` supplies the
    graph class and the synchronisation (``new_graph``, ``synchronize``); without it the
    eager stand-in graph and ``torch.accelerator`` are used."""

    def __init__(self, device: Any = "cpu", backend_cls: Optional[Type[Any]] = None) -> None:
        self.device = torch.device(device)
        self.backend_cls = backend_cls
        self._method: Optional[str] = None

    # ------------------------------------------------------------------ services
    def new_graph(self):
        if self.backend_cls is not None:
            return self.backend_cls.new_graph()
        from ..graphs.device_graph import EagerGraph

        return EagerGraph()

    def sync(self) -> None:
        """Wait for all work queued on the device (nothing on the host)."""
        if self.backend_cls is not None:
            self.backend_cls.synchronize(self.device)
        elif self.device.type != "cpu" and hasattr(torch, "accelerator"):
            torch.accelerator.synchronize(self.device)

    @property
    def method(self) -> str:
        if self._method is None:
            from ..graphs.device_graph import EagerGraph

            if _triton_drives(self.device):
                self._method = "triton.testing"
            elif not isinstance(self.new_graph(), EagerGraph):
                self._method = "device graph"
            else:
                self._method = "wall clock"
        return self._method

    # ------------------------------------------------------------------ timings (microseconds)
    def device_us(self, fn: Callable[[], object], *, rep_ms: float = 100.0, warmup: int = 3, iters: int = 20) -> float:
        """Median time of one eager ``fn()``: ``do_bench`` (``rep_ms`` of repetitions), or
        ``iters`` wall-clock samples of one call each, synchronised."""
        if self.method == "triton.testing":
            import triton.testing

            return 1e3 * float(
                triton.testing.do_bench(fn, warmup=max(1, rep_ms // 4), rep=rep_ms, return_mode="median")
            )
        return self.wall_us(fn, calls=1, repeats=iters, warmup=warmup)

    def graph_us(self, fn: Callable[[], object], *, rep_ms: float = 50.0, repeats: int = 20, inner: int = 5) -> float:
        """Median time of one ``fn()`` replayed from a graph: ``do_bench_cudagraph`` (``fn``
        unrolled over ``rep_ms`` in one graph), or ``fn`` captured once in the backend's
        graph and ``repeats`` samples of ``inner`` back-to-back replays each."""
        if self.method == "triton.testing" and self.backend_cls is not None:
            from ..graphs.device_graph import EagerGraph

            if not isinstance(self.new_graph(), EagerGraph):
                import triton.testing

                return 1e3 * float(triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median"))
        return self.replay_us(fn, calls=inner, repeats=repeats, warmup=2)

    def replay_us(self, fn: Callable[[], object], *, calls: int, repeats: int, warmup: int = 2) -> float:
        """``fn`` captured once in the backend's graph, then timed as whole steps are
        (``wall_us`` of back-to-back replays): what one replay costs with the device kept busy."""
        marker = torch.zeros(1, device=self.device)

        def step() -> torch.Tensor:
            fn()
            return marker

        graph = self.new_graph()
        graph.capture(step)
        try:
            return self.wall_us(graph.replay, calls=calls, repeats=repeats, warmup=warmup)
        finally:
            del graph

    def wall_us(self, fn: Callable[[], object], *, calls: int, repeats: int, warmup: int = 2) -> float:
        """Median over ``repeats`` of (wall clock of ``calls`` back-to-back ``fn()``, then one
        synchronisation) / ``calls``: what a caller pays per call with the device kept busy."""
        for _ in range(warmup):
            fn()
        self.sync()
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            self.sync()
            samples.append((time.perf_counter() - t0) * 1e6 / calls)
        return median(samples)

    def host_us(self, fn: Callable[[], object], *, iters: int = 1000, warmup: int = 50, sync_every: int = 100) -> float:
        """Median host time of one ``fn()`` call (no synchronisation inside the timed region).
        The device is synchronised every ``sync_every`` calls, outside it, so queued work
        never fills the launch queue and blocks a timed call."""
        for _ in range(warmup):
            fn()
        self.sync()
        samples: List[float] = []
        clock = time.perf_counter_ns
        for i in range(iters):
            t0 = clock()
            fn()
            samples.append((clock() - t0) / 1e3)
            if (i + 1) % sync_every == 0:
                self.sync()
        self.sync()
        return median(samples)


def copy_bandwidth(timer: Timer, nbytes: int = 2 << 30, *, rep_ms: float = 100.0) -> Dict[str, float]:
    """Device-to-device copy bandwidth of ``timer.device``: ``dst.copy_(src)`` of ``nbytes``
    counting the bytes read AND written. Returns ``{"bytes", "us", "tb_s"}``."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=timer.device).random_(0, 255)
    dst = torch.empty_like(src)
    us = timer.device_us(functools.partial(dst.copy_, src), rep_ms=rep_ms)
    moved = 2 * src.numel()
    del src, dst
    free_memory(timer)
    return {"bytes": float(moved), "us": us, "tb_s": moved / (us * 1e-6) / 1e12}


def free_memory(timer: Optional[Timer] = None) -> None:
    """Drop unreferenced tensors and give the device allocator's cached blocks back."""
    gc.collect()
    if timer is None or timer.device.type == "cpu":
        return
    timer.sync()
    module = getattr(torch, timer.device.type, None)
    empty = getattr(module, "empty_cache", None)
    if callable(empty):
        empty()
