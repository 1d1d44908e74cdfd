"""Result rows of a benchmark run, and the run's summary.

A row is a plain dict (JSON as written): ``benchmark, case, metric, value, unit, target,
met, error, notes, detail, key`` plus any extra numbers. Rows that a plot draws also carry
``variant`` (the implementation measured, e.g. ``new`` / ``before``), ``bs`` (batch size) and
``series`` (what else the point depends on, e.g. the forward mode). A row measured against a
hardware floor carries ``floor`` (same unit as ``value``) and ``pct_of_floor``.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, Optional

__all__ = ["row", "summarize", "benchmark_error_row", "failure_row", "error_row", "bandwidth_row"]


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
    floor: Optional[float] = None,
    **extra: Any,
) -> Dict[str, Any]:
    """One result.

    ``value``: the measurement (None when not measured); ``target``: the text of the target
    it is held to and ``met`` whether it holds (None: no target); ``error``: why the case
    failed; ``notes``: why a value is missing or what to look at; ``detail``: short context
    shown next to the value in the printed table (e.g. the baseline's number); ``key``: show
    the row in the printed table even without a target; ``floor``: the best time the
    hardware allows for this case (``pct_of_floor = 100 * floor / value``); ``extra``: more
    numbers (JSON only), or the plot keys ``variant``, ``bs``, ``series``. The printed table
    shows the rows with a target, an error or ``key=True``; every row goes to the JSON.
    """
    out: Dict[str, Any] = {
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
    }
    if floor is not None:
        out["floor"] = float(floor)
        out["pct_of_floor"] = 100.0 * float(floor) / float(value) if value else None
    out.update(extra)
    return out


def _first_line(text: Optional[str]) -> str:
    lines = (text or "").strip().splitlines()
    return lines[0] if lines else ""


def summarize(rows: Iterable[Dict[str, Any]]) -> Dict[str, Any]:
    """``targets`` (rows with a target), ``met``, ``missed`` and ``errors`` (one line each)."""
    rows = list(rows)
    held = [r for r in rows if r.get("met") is not None]
    return {
        "targets": len(held),
        "met": sum(1 for r in held if r["met"]),
        "missed": [f"{r['benchmark']}: {r['case']} ({r['metric']})" for r in held if not r["met"]],
        "errors": [f"{r['benchmark']}: {r['case']}: {_first_line(r.get('error'))}" for r in rows if r.get("error")],
    }


def benchmark_error_row(benchmark: str, error: str, **extra: Any) -> Dict[str, Any]:
    """The row of a benchmark that failed as a whole; ``error`` says why."""
    return row(benchmark, "(benchmark)", "all", None, "", error=error, **extra)


def failure_row(benchmark: str, exc: BaseException, tb: str = "") -> Dict[str, Any]:
    """The row a benchmark that raised leaves behind."""
    return benchmark_error_row(benchmark, f"{type(exc).__name__}: {exc}", traceback=tb)


def error_row(benchmark: str, case: str, metric: str, unit: str, exc: BaseException, **extra: Any) -> Dict[str, Any]:
    """The row of one case that raised ``exc`` (with the traceback being handled); the other
    cases of the benchmark still run."""
    import traceback

    return row(benchmark, case, metric, None, unit, error=f"{type(exc).__name__}: {exc}",
               traceback=traceback.format_exc(), **extra)  # fmt: skip


def bandwidth_row(benchmark: str, case: str, measured: Dict[str, Any], **extra: Any) -> Dict[str, Any]:
    """The row of a copy-bandwidth measurement (``timing.copy_bandwidth``'s result)."""
    return row(benchmark, case, "bandwidth", measured["tb_s"], "TB/s", us=measured["us"], key=True, **extra)
