"""The context a benchmark runs in: options, time budget, the rows it appends, logging."""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Type

import torch

from .timing import Timer

__all__ = ["Ctx", "Deadline"]


class Deadline:
    """A wall-clock budget in seconds (None: unlimited), started at construction."""

    def __init__(self, seconds: Optional[float]) -> None:
        self.start = time.monotonic()
        self.seconds = seconds

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        return float("inf") if self.seconds is None else self.seconds - self.elapsed()

    def expired(self, reserve: float = 0.0) -> bool:
        return self.left() <= reserve


@dataclass
class Ctx:
    """What a benchmark gets (``fn(ctx) -> rows``).

    * ``backend_cls`` / ``device``: the backend the run was asked for and its device
      (benchmarks of a plugin may construct their own backends instead);
    * ``timer``: how to time work on ``device`` (``attnplug.bench.timing.Timer``);
    * ``quick``: fewer sizes and iterations (a smoke pass);
    * ``deadline``: the run's budget; a benchmark skips its remaining cases when
      ``time_low()`` says so, recording a row per skipped case;
    * ``reserve_after_s``: seconds of the deadline kept for the benchmarks still to come;
    * ``options``: the suite's options (``Suite.options`` defaults, overridden by ``--set``);
    * ``rows``: the running benchmark appends its rows here; with ``rows_out`` set, every
      ``log`` also saves them to that JSON file, so a benchmark killed at its time limit
      keeps what it measured.
    """

    backend_cls: Optional[Type[Any]] = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    quick: bool = False
    deadline: Deadline = field(default_factory=lambda: Deadline(None))
    reserve_after_s: float = 0.0
    options: Dict[str, Any] = field(default_factory=dict)
    rows: List[dict] = field(default_factory=list)
    rows_out: Optional[str] = None
    t0: float = field(default_factory=time.monotonic)
    timer: Optional[Timer] = None

    def __post_init__(self) -> None:
        if self.timer is None:
            self.timer = Timer(self.device, self.backend_cls)

    def time_low(self, need_s: float = 30.0) -> bool:
        """Whether less than ``need_s`` seconds are left for this benchmark."""
        return self.deadline.expired(reserve=self.reserve_after_s + need_s)

    def log(self, msg: str) -> None:
        """A progress line (stdout, flushed) stamped with the seconds since the start."""
        print(f"[{time.monotonic() - self.t0:7.1f}s] {msg}", file=sys.stdout, flush=True)
        self.save_rows()

    def save_rows(self) -> None:
        if not self.rows_out:
            return
        try:
            tmp = f"{self.rows_out}.tmp"
            with open(tmp, "w") as f:
                json.dump(self.rows, f, default=str)
            os.replace(tmp, self.rows_out)
        except Exception as exc:  # bookkeeping never kills a measurement
            print(f"(could not save rows to {self.rows_out}: {exc})", file=sys.stderr, flush=True)
