"""The ``attnplug`` command.

Subcommands are registered by small ``_add_<name>(subparsers)`` functions listed in
``SUBCOMMANDS``; each sets ``func`` (``args -> exit code``) on its parser. To add one, write
``_add_<name>`` and append it to ``SUBCOMMANDS``.

* ``attnplug info [--json]``: every registered backend (availability and reason, device,
  ``needs_cpu_seq_lens``, PDL, graph support) and every plugin load error.
* ``attnplug conformance [--backend NAME ...] [--report PATH] [-k EXPR] [--junitxml PATH]``: the
  conformance suite (``attnplug_conformance.runner``), a check x backend matrix, a JSON report.
* ``attnplug bench [--backend NAME] [--device D] [--only NAME ...] [--quick] [--out DIR] [--json PATH]
  [--budget-s S] [--isolate/--no-isolate] [--set NAME=VALUE]``: the benchmarks the backend's plugin
  ships, or the portable suite (``attnplug.bench``).
* ``attnplug soak [--backend NAME] [--steps N] [--seed S] [--page-size P] [--graphs/--no-graphs] [--json PATH]``:
  a random serving simulation checked every step (``attnplug.soak``).
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
    except Exception as exc:  # a RegistryError, or anything else: info still lists what it found
        default_error = str(exc) if isinstance(exc, reg.RegistryError) else f"{type(exc).__name__}: {exc}"
    return {
        "attnplug_version": attnplug.__version__,
        "plugin_api_version": reg.PLUGIN_API_VERSION,
        "entry_point_group": reg.ENTRY_POINT_GROUP,
        "environment": {name: os.environ.get(name) for name in (reg.ENV_BACKEND, reg.ENV_PLUGINS,
                                                                 reg.ENV_PROBE_TIMEOUT)},
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
    from attnplug.registry import RegistryError

    try:
        data = info_data()
    except RegistryError as exc:  # e.g. a malformed ATTNPLUG_PROBE_TIMEOUT
        print(f"error: {exc}", file=sys.stderr)
        return 2
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
                           junitxml=args.junitxml, device=args.device, thorough=args.thorough)


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
    parser.add_argument("--thorough", action="store_true",
                        help="also run every combination of the declared dtypes, head dims and page sizes "
                             "(slower; the default runs each declared value)")
    parser.set_defaults(func=_run_conformance)


# ---------------------------------------------------------------------------- bench
def _bench_error(message: str) -> int:
    print(f"attnplug: error: {message}", file=sys.stderr)
    return 2


def _run_bench(args: argparse.Namespace) -> int:
    # The harness (and the suite a plugin ships) is imported only when this subcommand runs.
    from attnplug import registry
    from attnplug.bench import SuiteUnavailable, run_suite, suite_for
    from attnplug.soak.selection import SoakSelectionError, resolve_backend

    try:
        spec = args.backend or registry.get_registry().select()[0]
        cls, device = resolve_backend(spec, args.device)
    except (registry.RegistryError, SoakSelectionError) as exc:
        return _bench_error(str(exc))
    except (RuntimeError, ValueError) as exc:  # torch.device() of a malformed --device
        return _bench_error(f"--device {args.device!r}: {exc}")
    try:
        suite = suite_for(cls)
        options = suite.parse_options(args.set or [])
        result = run_suite(suite, cls, device, only=args.only, quick=args.quick, out_dir=args.out,
                           json_path=args.json, budget_s=args.budget_s, isolate=args.isolate, options=options)
    except (SuiteUnavailable, ValueError) as exc:
        return _bench_error(str(exc))
    return 1 if result["summary"]["errors"] else 0


def _budget(text: str) -> Optional[float]:
    return None if text.strip().lower() in ("none", "inf", "0") else float(text)


def _add_bench(subparsers) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="run the benchmarks a backend ships (any backend: the portable whole-step benchmark)",
        description="Run the benchmarks a backend's plugin ships (default backend: get_backend()); a backend "
                    "whose plugin ships none runs the portable suite (whole hybrid steps through GraphRunner vs "
                    "eager steps, small sizes, any device). Prints progress, a table and a summary line last; "
                    "--out DIR writes bench.json and PNG plots (time vs batch size per variant, ratio vs the "
                    "baseline). Exit code 1 when a benchmark failed with an error, 2 when the run cannot start. "
                    "Methods and recorded results: docs/benchmarks.md.",
    )
    parser.add_argument("--backend", metavar="NAME",
                        help="registry name, or module:Class (default: the backend get_backend() selects)")
    parser.add_argument("--device", metavar="DEVICE",
                        help="torch device (default: from the backend's registry probe; the host for module:Class)")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these benchmarks of the suite")
    parser.add_argument("--quick", action="store_true", help="a fast smoke pass: fewer sizes and iterations")
    parser.add_argument("--out", metavar="DIR", help="write bench.json and the PNG plots into DIR")
    parser.add_argument("--json", metavar="PATH", help="(also) write the JSON results to PATH")
    parser.add_argument("--budget-s", type=_budget, default=-1.0, metavar="S",
                        help="wall-clock budget of the run in seconds; benchmarks skip cases rather than overrun "
                             "it (default: the suite's; 'none': unlimited)")
    parser.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                        help="run each benchmark in its own child process (default: the suite's choice)")
    parser.add_argument("--set", action="append", metavar="NAME=VALUE",
                        help="a suite option, e.g. --set flex_budget_s=60 (repeatable)")
    parser.set_defaults(func=_run_bench)


# ---------------------------------------------------------------------------- soak
def _run_soak(args: argparse.Namespace) -> int:
    from attnplug.soak.command import run_command

    return run_command(args)


def _add_soak(subparsers) -> None:
    from attnplug.soak.command import add_arguments

    parser = subparsers.add_parser(
        "soak",
        help="run a random serving simulation checked every step against a float64 oracle",
        description="Run a random serving simulation (arrivals, chunked prefill, decode, verify with rollback, "
                    "draft-extend, pool pressure, graph replay and eager fallback, NaN in free slots and the sink) "
                    "and check every step against a float64 oracle, the allocator's invariants and the live KV "
                    "values (docs/reliability.md). Exit code 1 on any failure (the first failing step is printed), "
                    "2 when the run cannot start.",
    )
    add_arguments(parser)
    parser.set_defaults(func=_run_soak)


# ---------------------------------------------------------------------------- entry point
#: functions that add one subcommand each to the ``attnplug`` parser
SUBCOMMANDS: List[Callable[[Any], None]] = [_add_info, _add_conformance, _add_bench, _add_soak]


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
