"""What every benchmark module shares: the run context and the result-row format."""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from .timing import Deadline

__all__ = ["Ctx", "row", "NeedsCudaDevice"]


class NeedsCudaDevice(RuntimeError):
    """The benchmarks were asked for on a machine without a usable CUDA device."""


@dataclass
class Ctx:
    """Options of one run, handed to every benchmark.

    * ``quick``: fewer sizes and iterations (a smoke pass).
    * ``deadline``: the run's wall-clock budget; benchmarks skip remaining cases when it
      runs low (the skipped cases are recorded as rows).
    * ``skip_cpp``: do not build the CUDA C++ KV store.
    * ``flex_budget_s``: seconds allowed for compiling + timing flex_attention (0: skip).
    * ``reserve_after_s``: seconds of the deadline kept for the benchmarks still to come
      (in-process runs; a child process's deadline already excludes them).
    * ``rows``: the running benchmark appends its result rows here (the runner gives each
      benchmark a fresh list); with ``rows_out`` set, every ``log`` call also saves them to
      that JSON file, so a benchmark killed at its time limit keeps what it measured.
    """

    quick: bool = False
    deadline: Deadline = field(default_factory=lambda: Deadline(None))
    skip_cpp: bool = False
    flex_budget_s: float = 150.0
    reserve_after_s: float = 0.0
    rows: List[dict] = field(default_factory=list)
    rows_out: Optional[str] = None
    t0: float = field(default_factory=time.monotonic)

    def time_low(self, need_s: float = 30.0) -> bool:
        """Whether less than ``need_s`` seconds are left for this benchmark."""
        return self.deadline.expired(reserve=self.reserve_after_s + need_s)

    def log(self, msg: str) -> None:
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
        except Exception as exc:  # never let bookkeeping kill a measurement
            print(f"(could not save rows to {self.rows_out}: {exc})", file=sys.stderr, flush=True)


def row(
    benchmark: str,
    case: str,
    metric: str,
    value: Optional[float],
    unit: str,
    *,
    target: Optional[str] = None,
    met: Optional[bool] = None,
    error: Optional[str] = None,
    notes: str = "",
    detail: str = "",
    key: bool = False,
    **extra: Any,
) -> Dict[str, Any]:
    """One result: ``value`` (None when not measured), the ``target`` it is held to (text)
    and whether it is ``met`` (None: no target); ``error`` when the case failed; ``detail``:
    a short text shown next to the value in the printed table (e.g. the before path's
    number); ``notes``: why a value is missing or what to look at; any other numbers in
    ``extra`` (JSON only). The printed table shows the rows with a target, an error or
    ``key=True``; every row goes to the JSON."""
    return {
        "benchmark": benchmark,
        "case": case,
        "metric": metric,
        "value": None if value is None else float(value),
        "unit": unit,
        "target": target,
        "met": None if met is None else bool(met),
        "error": error,
        "notes": notes,
        "detail": detail,
        "key": bool(key),
        **extra,
    }
