"""The benchmark history: one JSON line per measured row of a run, appended to a ``.jsonl`` file.

``attnplug bench ... --history PATH`` appends the run's lines to PATH (created when missing);
``python -m attnplug.bench.history BENCH_JSON ... --out PATH`` appends the lines of written
reports (``bench.json`` and the like), in the order given, which is how a history is back-filled.

A line is one measured row (a numeric, finite ``value`` and no ``error``) with what it was
measured on: ``date`` (UTC, ``YYYY-MM-DD``), ``device`` (the accelerator's name, else the
device string), ``sm_count``, ``versions`` (the recorded versions: ``torch``, ``triton``,
``driver`` and the ``torch_*`` build versions a suite's environment adds), ``commit`` (12 hex),
the ``command`` as recorded, then ``suite``, ``benchmark``, ``case``, ``metric``, ``value``,
``unit`` and, where the row has them, ``variant``, ``bs``, ``series``, ``graphs`` (``"eager
stand-in"``: a graph variant measured without a device graph) and ``config`` (the
configuration a peer ran in, e.g. FlashInfer's page size, layout and kernels). Unknown fields
are null (a version not recorded is left out). Keys are sorted; one compact line per row.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import sys
from typing import Any, Dict, List, Optional

__all__ = ["history_lines", "append_history", "main"]

#: the row keys a line keeps when the row has them (what the plots draw a row by)
PLOT_KEYS = ("variant", "bs", "series")
#: what a line keeps about how a row was measured, when the row has it (``graphs``: "eager
#: stand-in" for a graph variant that had no device graph, so its figures are not a graph's;
#: ``config``: the configuration a peer was measured in, its best)
MARK_KEYS = ("graphs", "config")
#: the environment's versions a line keeps, besides every ``torch_*`` key (the build's)
VERSION_KEYS = ("torch", "triton", "driver")


def _date(text: Any) -> Optional[str]:
    if not isinstance(text, str) or not text:
        return None
    try:
        when = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return text[:10]
    if when.tzinfo is not None:
        when = when.astimezone(datetime.timezone.utc)
    return when.date().isoformat()


def _version(text: Any) -> Optional[str]:
    """A version string, or None for what the environment records when there is none
    (``"unavailable (...)"``, ``"?"``)."""
    text = None if text is None else str(text)
    return text if text and text[0].isdigit() else None


def _versions(env: Dict[str, Any]) -> Dict[str, str]:
    names = [k for k in VERSION_KEYS if k in env] + sorted(k for k in env if k.startswith("torch_"))
    versions = {k: _version(env.get(k)) for k in names}
    return {k: v for k, v in versions.items() if v is not None}


def _device(report: Dict[str, Any], env: Dict[str, Any]) -> Optional[str]:
    device = report.get("device") or env.get("device")
    name = env.get("gpu")
    if not name and device and not str(device).startswith("cpu"):
        name = env.get("device_name")  # an accelerator's name (on the host: the processor, not shown)
    return str(name or device) if (name or device) else None


def history_lines(report: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The history lines (dicts) of a run's report (``run_suite``'s result or a bench.json):
    one per row with a numeric, finite value and no error, in the report's row order."""
    env = report.get("environment") or {}
    commit = env.get("git_commit")
    sm_count = env.get("sm_count")
    common = {
        "date": _date(env.get("date_utc")),
        "device": _device(report, env),
        "sm_count": int(sm_count) if isinstance(sm_count, (int, float)) and not isinstance(sm_count, bool) else None,
        "versions": _versions(env),
        "commit": str(commit)[:12] if commit else None,
        "command": env.get("command"),
        "suite": report.get("suite"),
    }
    lines = []
    for r in report.get("rows") or []:
        value = r.get("value")
        if r.get("error") or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if not math.isfinite(value):
            continue
        line = dict(common)
        line.update(
            benchmark=r.get("benchmark"),
            case=r.get("case"),
            metric=r.get("metric"),
            value=float(value),
            unit=r.get("unit"),
        )
        line.update({k: r[k] for k in PLOT_KEYS + MARK_KEYS if r.get(k) is not None})
        lines.append(line)
    return lines


def _dumps(line: Dict[str, Any]) -> str:
    return json.dumps(line, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def append_history(path: str, report: Dict[str, Any]) -> int:
    """Append ``report``'s history lines to ``path`` (creating it and its folder when
    missing); return how many lines were written."""
    lines = history_lines(report)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path, "a+b") as f:
        f.seek(0, os.SEEK_END)
        if f.tell():  # an earlier line without its newline: end it first
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")
        f.write("".join(_dumps(line) + "\n" for line in lines).encode("utf-8"))
    return len(lines)


def main(argv: Optional[List[str]] = None) -> int:
    """Append the lines of written reports to ``--out``; 2 (nothing written) when one of them
    cannot be read or is not a harness report."""
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m attnplug.bench.history",
        description="append the history lines of bench.json reports to a .jsonl history",
    )
    p.add_argument("json", nargs="+", help="reports written by attnplug bench (bench.json, --json PATH)")
    p.add_argument("--out", required=True, metavar="PATH", help="the history to append to (created when missing)")
    args = p.parse_args(argv)
    reports = []
    for path in args.json:
        try:
            with open(path) as f:
                report = json.load(f)
            if not isinstance(report, dict) or not isinstance(report.get("rows"), list):
                raise ValueError("no 'rows' list: not a report of attnplug bench")
            if not isinstance(report.get("environment"), dict):
                raise ValueError("no 'environment': not a report of attnplug bench")
        except (OSError, ValueError) as exc:
            print(f"attnplug.bench.history: cannot read {path!r}: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 2
        reports.append((path, report))
    try:
        for path, report in reports:
            n = append_history(args.out, report)
            print(f"{path}: {n} lines -> {args.out}")
    except OSError as exc:
        print(f"attnplug.bench.history: cannot write {args.out!r}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
