"""The device graph API the graph runner drives, and the eager stand-in.

A plugin supplies its device's graph class through ``AttentionBackend.new_graph()``. A graph
object captures one callable once and replays it; the callable's output tensor is static:
``replay()`` leaves the new results in the same tensor that ``capture`` returned.

Capture is atomic: when it raises, the graph has ended any capture it began and released
what it held, leaves no device state behind that could make a later capture fail, and is
never replayed (``GraphRunner`` drops it and records why).

Devices without graphs (and the host) get ``EagerGraph``: it keeps the callable and re-runs it
on ``replay()`` over the same static buffers, so the capture/replay metadata path of every
backend is exercised even on a machine with no accelerator.
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol, runtime_checkable

import torch

__all__ = ["DeviceGraph", "EagerGraph"]


@runtime_checkable
class DeviceGraph(Protocol):
    """What the graph runner needs of a device graph."""

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Run ``fn`` under capture (after whatever warm-up the device needs: warm-up must
        call this same ``fn``) and return its output, a tensor that every later
        ``replay()`` overwrites in place. On failure: raise, leaving nothing captured."""

    def replay(self) -> None:
        """Re-execute the captured work over the current contents of the static buffers."""


class EagerGraph:
    """Stand-in graph: capture runs the step once and remembers it; replay runs it again
    and copies the result into the tensor capture returned."""

    def __init__(self) -> None:
        self._fn: Optional[Callable[[], torch.Tensor]] = None
        self._out: Optional[torch.Tensor] = None

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        out = fn()  # if this raises, nothing is kept
        self._fn, self._out = fn, out
        return out

    def replay(self) -> None:
        if self._fn is None:
            raise RuntimeError("replay() before capture()")
        self._out.copy_(self._fn())
