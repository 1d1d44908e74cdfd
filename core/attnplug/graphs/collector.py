"""Keep Python's cyclic garbage collector out of graph capture.

A device graph that has become unreachable inside a reference cycle is destroyed whenever the
cyclic collector next runs. If that happens while another graph is being captured, the
destructor's device calls (freeing the graph, releasing its memory pool) are illegal on a
capturing stream: the device runtime rejects them and invalidates the capture in progress.
Recent PyTorch no longer collects when a capture begins, so the capture code must do it.

``collector_paused()`` is what engines do around capture: collect once, before the first
capture, then keep the automatic collector from running until the capture work is done, and
restore the collector's previous state (enabled or not) on the way out, also on failure.
Pauses nest: only the outermost one restores the state, and a pause collects only if no
enclosing pause has collected already (so a runner capturing many graphs collects once).
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator

__all__ = ["collector_paused"]

_depth = 0  # nesting depth of collector_paused blocks (capture is single-threaded)
_collected = False  # whether the current outermost pause has collected


@contextlib.contextmanager
def collector_paused(*, collect: bool = True) -> Iterator[None]:
    """Pause the automatic cyclic collector for the block.

    ``collect``: run ``gc.collect()`` first, unless an enclosing pause already did. Must wrap
    every region where a device graph is captured. Explicit ``gc.collect()`` calls inside
    the block still run (nothing may make them there).
    """
    global _depth, _collected
    outermost = _depth == 0
    was_enabled = gc.isenabled()
    if outermost:
        _collected = False
    if collect and not _collected:
        gc.collect()
        _collected = True
    gc.disable()
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if outermost and was_enabled:
            gc.enable()
