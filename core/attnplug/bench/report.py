"""The run's outputs: the printed table (rich), the JSON file and the closing summary line.

``python -m attnplug.bench.report BENCH_JSON [--only NAME ...]`` prints the table of a
written run again (only the rows of the named benchmarks with ``--only``).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Dict, Iterable, List, Optional

__all__ = ["results_table", "print_report", "write_json", "format_value", "main", "STAND_IN", "stand_in_note"]

#: ``result["graphs"]`` (and a row's ``graphs``) where the backend has no device graph: its
#: ``EagerGraph`` stand-in "replays" by running the eager step again
STAND_IN = "eager stand-in"


def stand_in_note(device: Any) -> str:
    """What a run through the eager stand-in means, in one line."""
    return (
        f"{STAND_IN}: no device graph on {device}; the graph variants replay the eager step again, so "
        "their speedups over eager steps are noise, not a graph's gain"
    )


def format_value(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        a = abs(value)
        if a == 0:
            return "0"
        if a >= 1000:
            return f"{value:,.0f}"
        if a >= 100:
            return f"{value:.1f}"
        if a >= 10:
            return f"{value:.2f}"
        if a >= 1:
            return f"{value:.3g}"
        if a >= 1e-3:
            return f"{value:.4f}"
        return f"{value:.2e}"
    return str(value)


def _first_line(text: Optional[str]) -> str:
    lines = [line for line in (text or "").splitlines() if line.strip()]
    return lines[0] if lines else ""


def results_table(rows: Iterable[Dict[str, Any]], *, all_rows: bool = False, title: Optional[str] = None):
    """A ``rich.table.Table`` of the rows with a target, an error or ``key=True`` (``all_rows``:
    every row). A ``% of floor`` column appears when a shown row carries ``floor``."""
    from rich.table import Table
    from rich.text import Text

    shown = [r for r in rows if all_rows or r.get("target") or r.get("error") or r.get("key")]
    floors = any(r.get("floor") is not None for r in shown)
    table = Table(title=title, title_justify="left")
    for column in ("benchmark", "case", "metric", "value", "target", "met"):
        table.add_column(column, overflow="fold", no_wrap=column in ("value", "met"))
    if floors:
        table.add_column("% of floor", no_wrap=True)
    table.add_column("detail", overflow="fold")
    for r in shown:
        value = format_value(r.get("value"))
        if r.get("value") is not None and r.get("unit"):
            value += f" {r['unit']}"
        met = {True: Text("yes", style="green"), False: Text("NO", style="bold red"), None: Text("")}[r.get("met")]
        detail = r.get("detail") or r.get("notes") or ""
        if r.get("error"):
            met, detail = Text("ERROR", style="bold red"), _first_line(r["error"])
        cells = [
            Text(str(r.get("benchmark", ""))),
            Text(str(r.get("case", ""))),
            Text(str(r.get("metric", ""))),
            Text(value),
            Text(r.get("target") or ""),
            met,
        ]
        if floors:
            pct = r.get("pct_of_floor")
            cells.append(Text("" if pct is None else f"{pct:.0f}%"))
        cells.append(Text(_first_line(detail)[:100]))
        table.add_row(*cells)
    return table


def _console(file=None):
    from rich.console import Console

    if file is None and not sys.stdout.isatty() and "COLUMNS" not in os.environ:
        return Console(width=160)  # pipes and logs: keep details on one line
    return Console(file=file)


def print_report(result: Dict[str, Any], file=None) -> None:
    """The table, then (last) one summary line: targets met, errors, time, where outputs went."""
    console = _console(file)
    console.print()
    stand_in = result.get("graphs") == STAND_IN
    title = f"attnplug bench: {result['suite']} suite, backend {result['backend']} on {result['device']}"
    if stand_in:
        title += f" (graphs: {STAND_IN}, no device graph)"
    if result.get("interrupted"):
        title += f" (INTERRUPTED by {result['interrupted']})"
    console.print(results_table(result["rows"], title=title))
    if stand_in:
        console.print(f"note: {stand_in_note(result['device'])}", soft_wrap=True)
    if result.get("interrupted"):
        not_run = result.get("not_run") or []
        console.print(
            f"INTERRUPTED by {result['interrupted']}: the rows above are what was measured before"
            + (f"; not run: {', '.join(not_run)}" if not_run else ""),
            soft_wrap=True,
        )
    s = result["summary"]
    where = []
    if result.get("json"):
        where.append(f"JSON: {result['json']}")
    if result.get("plots"):
        where.append(f"plots: {len(result['plots'])} PNG in {os.path.dirname(result['plots'][0]) or '.'}")
    elif result.get("plots_note"):
        where.append(result["plots_note"])
    if stand_in:
        where.append(f"graphs: {STAND_IN}")
    if result.get("interrupted"):
        where.insert(0, f"INTERRUPTED by {result['interrupted']}")
    line = (
        f"targets met: {s['met']} / {s['targets']}; errors: {len(s['errors'])}; total {result['total_s']:.0f} s"
        + "".join(f"; {w}" for w in where)
    )
    console.file.flush()
    print(line, file=console.file, flush=True)


def write_json(result: Dict[str, Any], path: Optional[str]) -> None:
    """Write ``result`` to ``path`` atomically (creating the folder); nothing when path is None."""
    if not path:
        return
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1, default=str)
    os.replace(tmp, path)


def main(argv: Optional[List[str]] = None) -> int:
    """Print the table of a ``bench.json`` (see the module docstring); 2 when it cannot be read."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m attnplug.bench.report", description="print a bench.json's table")
    p.add_argument("json", help="a bench.json written by attnplug bench")
    p.add_argument("--only", nargs="+", metavar="NAME", help="only the rows of these benchmarks")
    args = p.parse_args(argv)
    try:
        with open(args.json) as f:
            result = json.load(f)
        rows = result["rows"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"attnplug.bench.report: cannot read {args.json!r}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    if args.only:
        rows = [r for r in rows if r.get("benchmark") in args.only]
    names = ", ".join(args.only) if args.only else "every benchmark"
    title = f"{names}: backend {result.get('backend', '-')} on {result.get('device', '-')}"
    if result.get("graphs") == STAND_IN:
        title += f" (graphs: {STAND_IN}, no device graph)"
    if result.get("interrupted"):
        title += f" (INTERRUPTED by {result['interrupted']})"
    _console().print(results_table(rows, title=title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
