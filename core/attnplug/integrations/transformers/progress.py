"""A one-line progress display for ``Engine.generate`` on stderr.

``enabled=None`` shows it only on a terminal and only once a run has lasted ``delay_s``
seconds (short runs print nothing); True always shows it (throttled to one redraw per
``interval_s``); False never.
"""

from __future__ import annotations

import sys
import time
from typing import Optional, TextIO

__all__ = ["Progress"]


class Progress:
    """Redraws ``requests done/total, tokens, tok/s, running, waiting, steps`` in place."""

    def __init__(
        self,
        total_requests: int,
        *,
        enabled: Optional[bool] = None,
        stream: Optional[TextIO] = None,
        delay_s: float = 1.0,
        interval_s: float = 0.2,
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        is_tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.enabled = is_tty if enabled is None else bool(enabled)
        self._clear = "\033[K" if is_tty else ""  # erase the rest of the line (terminals only)
        self.delay_s = 0.0 if enabled else delay_s
        self.interval_s = interval_s
        self.total = total_requests
        self.start = time.perf_counter()
        self._last = -1.0
        self._drawn = False

    def update(self, *, done: int, tokens: int, running: int, waiting: int, steps: int, force: bool = False) -> None:
        """Redraw when enabled, past the delay and the interval (or ``force``)."""
        if not self.enabled:
            return
        now = time.perf_counter()
        elapsed = now - self.start
        if not force and (elapsed < self.delay_s or now - self._last < self.interval_s):
            return
        self._last = now
        rate = tokens / elapsed if elapsed > 0 else 0.0
        line = (
            f"generate: {done}/{self.total} requests, {tokens} tokens, {rate:.1f} tok/s, "
            f"running {running}, waiting {waiting}, {steps} steps"
        )
        self.stream.write("\r" + line + self._clear)
        self.stream.flush()
        self._drawn = True

    def close(self, **final) -> None:
        """Draw the final state (when anything was drawn) and end the line."""
        if self._drawn:
            self.update(force=True, **final)
            self.stream.write("\n")
            self.stream.flush()
