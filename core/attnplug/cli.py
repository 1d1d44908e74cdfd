"""The ``attnplug`` command.

Subcommands are registered by small ``_add_<name>(subparsers)`` functions listed in
``SUBCOMMANDS``; each sets ``func`` (``args -> exit code``) on its parser. To add one, write
``_add_<name>`` and append it to ``SUBCOMMANDS``.

* ``attnplug info [--json]``: every registered backend (availability and reason, device,
  ``needs_cpu_seq_lens``, PDL, graph support) and every plugin load error.
* ``attnplug conformance [--backend NAME ...] [--report PATH] [-k EXPR] [--junitxml PATH]``: the
  conformance suite (``attnplug_conformance.runner``), a check x backend matrix, a JSON report.
* ``attnplug bench [--backend NAME] [--only NAME ...] [--quick] [--json PATH]``: the
  benchmarks the backend's plugin ships (``AttentionBackend.run_benchmarks``).
* ``attnplug --version``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence

__all__ = ["main", "build_parser", "SUBCOMMANDS", "info_data"]


# ---------------------------------------------------------------------------- info
def info_data(registry=None) -> Dict[str, Any]:
    """What ``attnplug info`` shows, as JSON-able data (``--json`` prints exactly this)."""
    import attnplug
    from attnplug import registry as reg

    registry = registry if registry is not None else reg.get_registry()
    backends: List[Dict[str, Any]] = []
    for info in registry.available_backends():
        row = info.to_json()
        caps = info.capabilities or {}
        # PDL and graph support are instance data; shown only when the class describes them
        row["pdl"] = caps.get("pdl") if info.available else None
        row["graphs"] = caps.get("graphs") if info.available else None
        backends.append(row)
    default = default_error = None
    try:
        default = registry.select()[0]
    except reg.RegistryError as exc:
        default_error = str(exc)
    return {
        "attnplug_version": attnplug.__version__,
        "plugin_api_version": reg.PLUGIN_API_VERSION,
        "entry_point_group": reg.ENTRY_POINT_GROUP,
        "environment": {name: os.environ.get(name) for name in (reg.ENV_BACKEND, reg.ENV_PLUGINS)},
        "default_backend": default,
        "default_error": default_error,
        "backends": backends,
        "errors": [error.to_json() for error in registry.load_errors()],
    }


def _cell(value: Any, available: bool) -> str:
    if not available:
        return "-"
    if value is None:
        return "?"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def _dist(distribution: Optional[str], version: Optional[str]) -> str:
    if not distribution:
        return "-"
    return f"{distribution} {version}" if version else distribution


def _console():
    from rich.console import Console

    if not sys.stdout.isatty() and "COLUMNS" not in os.environ:
        return Console(width=160)  # pipes and logs: do not squeeze reasons into 80 columns
    return Console()


def _print_info(data: Dict[str, Any]) -> None:
    from rich.table import Table
    from rich.text import Text

    console = _console()
    table = Table(title=f"attnplug {data['attnplug_version']} backends (plugin API {data['plugin_api_version']})",
                  title_justify="left")
    for column in ("backend", "distribution", "priority", "available", "device",
                   "needs_cpu_seq_lens", "PDL", "graphs", "reason"):
        table.add_column(column, overflow="fold")
    for row in data["backends"]:
        ok = row["available"]
        name = row["name"] + (" *" if row["name"] == data["default_backend"] else "")
        table.add_row(
            Text(name),
            Text(_dist(row["distribution"], row["version"])),
            str(row["priority"]),
            Text("yes", style="green") if ok else Text("no", style="red"),
            Text(row["device"] or "-"),
            _cell(row["needs_cpu_seq_lens"], ok),
            _cell(row["pdl"], ok),
            _cell(row["graphs"], ok),
            Text(row["reason"]),
        )
    console.print(table)
    for row in data["backends"]:  # what a backend's describe() says beyond the table's columns
        extra = {k: v for k, v in (row.get("capabilities") or {}).items()
                 if k not in ("pdl", "graphs", "needs_cpu_seq_lens")} if row["available"] else {}
        for key, value in extra.items():
            console.print(Text(f"{row['name']}: {key}: {value}"))
    if data["default_backend"]:
        console.print(Text(f"* default: get_backend() returns {data['default_backend']!r}"))
    else:
        console.print(Text(f"no default backend: {data['default_error']}", style="red"))
    env = ", ".join(f"{k}={v}" for k, v in data["environment"].items() if v)
    if env:
        console.print(Text(f"environment: {env}"))
    if data["errors"]:
        errors = Table(title="plugin load errors", title_justify="left")
        for column in ("plugin", "distribution", "entry point", "kind", "reason"):
            errors.add_column(column, overflow="fold")
        for error in data["errors"]:
            plugin = error["plugin"] + (f" (backend {error['backend']})" if error.get("backend") else "")
            errors.add_row(Text(plugin), Text(_dist(error["distribution"], error["version"])),
                           Text(error["entry_point"]), error["kind"], Text(error["reason"]))
        console.print(errors)
    else:
        console.print(Text("no plugin load errors"))


def _run_info(args: argparse.Namespace) -> int:
    data = info_data()
    if args.json:
        json.dump(data, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        _print_info(data)
    return 0


def _add_info(subparsers) -> None:
    parser = subparsers.add_parser(
        "info",
        help="list registered backends, their availability and plugin load errors",
        description="List every registered attention backend (available or not, with the reason) "
                    "and every plugin that failed to load. Runs the probes; creates no device context.",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.set_defaults(func=_run_info)


# ---------------------------------------------------------------------------- conformance
def _run_conformance(args: argparse.Namespace) -> int:
    # The suite (pytest, the checks) is imported only when this subcommand runs.
    from attnplug_conformance.runner import run_conformance

    return run_conformance(backends=args.backends or None, report=args.report, keyword=args.keyword,
                           junitxml=args.junitxml, device=args.device)


def _add_conformance(subparsers) -> None:
    parser = subparsers.add_parser(
        "conformance",
        help="run the conformance suite against the available backends",
        description="Run the shared conformance suite (docs/conformance.md) once per backend, print a "
                    "check x backend matrix and optionally write a JSON report. Default: every available "
                    "backend. Exit code 1 when a check fails, 2 for an unknown or unavailable backend.",
    )
    parser.add_argument("--backend", action="append", dest="backends", metavar="NAME",
                        help="backend to test (registry name, or module:Class); repeatable")
    parser.add_argument("--report", metavar="PATH", help="write the JSON report to PATH")
    parser.add_argument("-k", dest="keyword", metavar="EXPR", help="only run checks matching EXPR (pytest -k)")
    parser.add_argument("--junitxml", metavar="PATH",
                        help="write JUnit XML to PATH (PATH-<backend>.xml per backend when several run)")
    parser.add_argument("--device", metavar="DEVICE",
                        help="torch device for every backend under test (default: from its registry probe)")
    parser.set_defaults(func=_run_conformance)


# ---------------------------------------------------------------------------- bench
def _run_bench(args: argparse.Namespace) -> int:
    from attnplug.registry import RegistryError, get_backend

    try:
        cls = get_backend(args.backend)
    except RegistryError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        cls.run_benchmarks(only=args.only, quick=args.quick, json_path=args.json)
    except (NotImplementedError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def _add_bench(subparsers) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="run the benchmarks a backend ships",
        description="Run the benchmarks shipped by a backend's plugin (default: the selected backend) and "
                    "print a table; results and methods are recorded in docs/benchmarks.md.",
    )
    parser.add_argument("--backend", metavar="NAME", help="backend whose benchmarks to run (default: get_backend())")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these benchmarks")
    parser.add_argument("--quick", action="store_true", help="a fast smoke pass: fewer sizes and iterations")
    parser.add_argument("--json", metavar="PATH", help="write the results to PATH")
    parser.set_defaults(func=_run_bench)


# ---------------------------------------------------------------------------- entry point
#: functions that add one subcommand each to the ``attnplug`` parser
SUBCOMMANDS: List[Callable[[Any], None]] = [_add_info, _add_conformance, _add_bench]


def _version_text() -> str:
    import attnplug
    from attnplug.registry import PLUGIN_API_VERSION

    return f"attnplug {attnplug.__version__} (plugin API {PLUGIN_API_VERSION})"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attnplug",
        description="Attention backends for hybrid full + sliding-window KV caches, one plugin per device family.",
    )
    parser.add_argument("--version", action="version", version=_version_text())
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(subparsers)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    return int(func(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
