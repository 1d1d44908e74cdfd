"""Timing helpers of the benchmark suite: CUDA-event medians, CUDA-graph capture and replay
timing, host wall-clock medians, the device-to-device copy bandwidth of the GPU, and the
environment record written next to every result.

Everything touches CUDA only when called, so the module imports on any machine.
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional

import torch

__all__ = [
    "Deadline",
    "median",
    "sync",
    "cuda_time_us",
    "capture_graph",
    "graph_replay_us",
    "host_time_us",
    "copy_bandwidth",
    "environment",
    "free_cuda",
]


class Deadline:
    """A wall-clock budget shared by the benchmarks of one run (seconds)."""

    def __init__(self, seconds: Optional[float]) -> None:
        self.start = time.monotonic()
        self.seconds = seconds

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        if self.seconds is None:
            return float("inf")
        return self.seconds - self.elapsed()

    def expired(self, reserve: float = 0.0) -> bool:
        return self.left() <= reserve


def sync() -> None:
    """Wait for the GPU (no-op without CUDA, so host-only paths run in CPU tests)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def median(values: List[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def cuda_time_us(fn: Callable[[], object], *, iters: int = 50, warmup: int = 5) -> float:
    """Median GPU time of ``fn()`` in microseconds, one pair of CUDA events per call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return median([s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)])


def capture_graph(fn: Callable[[], object], *, warmup: int = 3) -> "torch.cuda.CUDAGraph":
    """Warm ``fn`` up on a side stream (compiles Triton kernels, fills caches), then capture
    it into a fresh ``torch.cuda.CUDAGraph``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph


def graph_replay_us(graph, *, reps: int = 100, inner: int = 10, warmup: int = 20) -> float:
    """Median GPU time of one replay of ``graph`` in microseconds: ``reps`` samples, each
    ``inner`` back-to-back replays between two CUDA events, divided by ``inner``."""
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        s.record()
        for _ in range(inner):
            graph.replay()
        e.record()
    torch.cuda.synchronize()
    return median([s.elapsed_time(e) * 1e3 / inner for s, e in zip(starts, ends)])


def host_time_us(fn: Callable[[], object], *, iters: int = 1000, warmup: int = 50, sync_every: int = 100) -> float:
    """Median host (wall-clock) time of one ``fn()`` call in microseconds. The device is
    synchronised every ``sync_every`` calls, outside the timed region, so queued work never
    fills the launch queue and blocks a timed call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples: List[float] = []
    clock = time.perf_counter_ns
    for i in range(iters):
        t0 = clock()
        fn()
        samples.append((clock() - t0) / 1e3)
        if (i + 1) % sync_every == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return median(samples)


def copy_bandwidth(nbytes: int = 2 << 30, *, iters: int = 20) -> Dict[str, float]:
    """Device-to-device copy bandwidth: ``dst.copy_(src)`` of ``nbytes``, counting the bytes
    read AND written. Returns ``{"bytes": ..., "us": median, "tb_s": ...}``."""
    def measure() -> Dict[str, float]:
        src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
        dst = torch.empty_like(src)
        us = cuda_time_us(lambda: dst.copy_(src), iters=iters, warmup=3)
        moved = 2 * src.numel() * src.element_size()
        return {"bytes": float(moved), "us": us, "tb_s": moved / (us * 1e-6) / 1e12}

    result = measure()
    free_cuda()
    return result


def free_cuda() -> None:
    """Drop unreferenced tensors and give cached blocks back to the driver."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _git_commit() -> Optional[str]:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None if out.returncode == 0 else None
    except Exception:
        return None


def _driver_version() -> Optional[str]:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10,
        )
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except Exception:
        return None


def environment(argv: Optional[List[str]] = None) -> Dict[str, object]:
    """What the numbers were measured on: GPU, versions, date, command."""
    env: Dict[str, object] = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.executable)] + list(argv if argv is not None else sys.argv)),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": getattr(torch.version, "cuda", None),
        "git_commit": _git_commit(),
    }
    try:
        import triton

        env["triton"] = getattr(triton, "__version__", "?")
    except Exception as exc:
        env["triton"] = f"unavailable ({type(exc).__name__}: {exc})"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        env["gpu"] = props.name
        env["compute_capability"] = f"{props.major}.{props.minor}"
        env["sm_count"] = props.multi_processor_count
        env["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        env["driver"] = _driver_version()
        try:
            from ..kernels.pdl import pdl_supported

            pdl, reason = pdl_supported(torch.device("cuda", torch.cuda.current_device()))
            env["pdl"] = pdl
            env["pdl_reason"] = reason
        except Exception as exc:
            env["pdl"] = None
            env["pdl_reason"] = f"{type(exc).__name__}: {exc}"
    else:
        env["gpu"] = None
    for var in ("ATTNPLUG_DISABLE_PDL", "ATTNPLUG_KV_STORE", "ATTNPLUG_DISABLE_CPP", "CUDA_VISIBLE_DEVICES"):
        if os.environ.get(var) is not None:
            env[var] = os.environ[var]
    return env
