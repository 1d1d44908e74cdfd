"""The launch floor of a step on a CUDA device (``attnplug.bench.floors.LaunchFloor``).

* ``count(run_step)``: the device operations one step runs (kernels, memcpy and memset),
  counted with ``torch.profiler`` (CUPTI reports every kernel of a replayed graph);
* ``empty_graph_us(n, pdl)``: a graph of ``n`` launches of an empty Triton kernel (one
  program), captured with the backend's graph and timed as steps are (``Timer.replay_us``).
  With ``pdl`` each launch uses Programmatic Dependent Launch and the kernel releases its
  dependent at once, then waits for its predecessor (``gdc_launch_dependents``,
  ``gdc_wait``): a chain of dependent launches with all the overlap PDL allows. Without PDL
  the kernel is empty and launched plainly.

Triton is imported when the floor is first used, never at import time.
"""

from __future__ import annotations

import collections
import functools
from typing import Any, Callable, Optional, Tuple

import torch

__all__ = ["EmptyKernelFloor", "empty_kernel_launcher"]


@functools.lru_cache(maxsize=None)
def _empty_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def _empty_kernel(x_ptr, PDL: tl.constexpr):
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()

    return _empty_kernel


def empty_kernel_launcher(device: torch.device, pdl: bool) -> Callable[[], None]:
    """``launch()``: one launch of the empty kernel on ``device`` (``pdl``: a PDL launch)."""
    kernel = _empty_kernel()
    buf = torch.zeros(1, dtype=torch.int32, device=device)
    extra = {"launch_pdl": True} if pdl else {}

    def launch() -> None:
        kernel[(1,)](buf, PDL=pdl, **extra)

    launch.buf = buf  # keep alive with the launcher
    return launch


class EmptyKernelFloor:
    """``LaunchFloor`` of a CUDA device (see the module docstring). ``timer``: the run's
    ``attnplug.bench.Timer``; ``calls`` / ``repeats``: replays per sample and samples."""

    def __init__(self, timer, *, calls: int = 200, repeats: int = 5) -> None:
        self.timer = timer
        self.calls = calls
        self.repeats = repeats

    def count(self, run_step: Callable[[], Any]) -> Tuple[Optional[int], str]:
        from .step_metadata import count_launches

        if self.timer.device.type != "cuda":
            return None, f"launches are counted with torch.profiler on a CUDA device, not {self.timer.device}"
        run_step()  # warm: nothing compiled or allocated inside the profiled call
        kernels, copies, names = count_launches(run_step)
        if kernels is None:
            return None, names[0] if names else "profiler gave no count"
        top = collections.Counter(names).most_common(6)
        listed = ", ".join(f"{n} x{c}" for n, c in top)
        return kernels + copies, f"torch.profiler: {kernels} kernels + {copies} copies ({listed})"

    def empty_graph_us(self, launches: int, pdl: bool) -> float:
        if launches < 1:
            raise ValueError(f"empty_graph_us needs launches >= 1, got {launches}")
        launch = empty_kernel_launcher(self.timer.device, pdl)

        def launches_fn() -> None:
            for _ in range(launches):
                launch()

        launches_fn()  # compile outside the capture
        self.timer.sync()
        return self.timer.replay_us(launches_fn, calls=self.calls, repeats=self.repeats)
