"""``attnplug conformance``: run the suite once per backend, print the matrix, write a report.

``run_conformance(backends=None, report=None, keyword=None, junitxml=None) -> int``

* ``backends``: registry names (or ``module:Class``) to test; default: every AVAILABLE
  registered backend (the others are listed as not run, with the reason). A requested name
  that is unknown or unavailable is an error naming the alternatives (exit code 2).
* For each backend, pytest runs over the suite's check modules with ``--attnplug-backend
  NAME`` (its own quiet progress line is the progress display), in this process or, with
  ``jobs`` > 1, spread over that many pytest-xdist worker processes (:func:`worker_count`); a
  collector plugin in this process records every test's outcome.
* Then a rich matrix check x backend (pass / FAIL / skip / xfail), why tests were skipped,
  expected to fail or not run (per check and reason, with counts), and the failures'
  messages are printed, and ``report`` (a path) receives the JSON report:
  versions (attnplug, torch, python, pytest, triton when installed), platform, and per
  backend its device, ``capabilities().to_json()`` and every test's nodeid, check, outcome,
  duration and message.
* Exit code: 0 when every backend ran with no failure, 1 when a check failed (or an
  unexpected pass of a strict xfail), 2 for a usage error, 130 / 143 when Ctrl-C / SIGTERM
  stopped the run (no further backend runs; the matrix and report hold what ran, the report
  with ``interrupted``).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import pytest

from attnplug.cli_errors import device_problem, fail, output_problem, signal_exit_code, signal_name

from .plugin import CHECKS_DIR, check_name_of, check_names
from .pytest_args import pytest_plugin_args, worker_count

__all__ = ["run_conformance", "ResultCollector", "REPORT_VERSION"]

REPORT_VERSION = 1


# ---------------------------------------------------------------------------- collecting results
@dataclass
class TestResult:
    __test__ = False

    nodeid: str
    check: str
    outcome: str = "passed"  # passed / failed / error / skipped / xfailed / xpassed
    duration: float = 0.0
    message: str = ""

    def to_json(self) -> Dict[str, Any]:
        return {
            "nodeid": self.nodeid,
            "check": self.check,
            "outcome": self.outcome,
            "duration": round(self.duration, 4),
            "message": self.message,
        }


def _message(report) -> str:
    longrepr = report.longrepr
    if longrepr is None:
        return ""
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # skip: (path, line, reason)
        reason = str(longrepr[2])
        return reason[len("Skipped: ") :] if reason.startswith("Skipped: ") else reason
    crash = getattr(getattr(longrepr, "reprcrash", None), "message", None)
    if crash:
        text = str(crash)
        for prefix in ("Failed: ", "AssertionError: "):
            if text.startswith(prefix):
                text = text[len(prefix) :]
        return text.strip()
    lines = str(getattr(report, "longreprtext", "") or longrepr).strip().splitlines()
    return lines[-1] if lines else ""


def _check_of_nodeid(nodeid: str) -> str:
    """The check of a test known by its id only (a suite check's function is named after its
    module)."""
    return nodeid.split("::")[-1].split("[")[0]


class ResultCollector:
    """A pytest plugin object that records every test's outcome (``results``, by nodeid) and
    collection errors (``collect_errors``)."""

    def __init__(self) -> None:
        self.results: Dict[str, TestResult] = {}
        self.collect_errors: List[str] = []
        self.total = 0
        self.interrupted: Optional[str] = None  # the signal that stopped the run (pytest swallows it)

    def pytest_keyboard_interrupt(self, excinfo) -> None:
        if type(excinfo.value).__module__.startswith("xdist"):
            return  # -x / --maxfail stopping the workers (xdist's Interrupted), not a signal
        self.interrupted = signal_name(excinfo.value)

    def pytest_collection_finish(self, session) -> None:
        self.total = len(session.items)
        for item in session.items:
            self.results[item.nodeid] = TestResult(item.nodeid, check_name_of(item), outcome="not run")

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node, ids) -> None:
        """With workers, what this process learns of the collection: each worker's test ids
        (the same list from every worker), in the run order."""
        if not self.results:
            self.total = len(ids)
            for nodeid in ids:
                self.results[nodeid] = TestResult(nodeid, _check_of_nodeid(nodeid), outcome="not run")

    def pytest_collectreport(self, report) -> None:
        if report.failed:
            self.collect_errors.append(f"{report.nodeid or '<session>'}: {_message(report) or report.longreprtext}")

    def pytest_runtest_logreport(self, report) -> None:
        result = self.results.get(report.nodeid)
        if result is None:
            result = self.results[report.nodeid] = TestResult(report.nodeid, _check_of_nodeid(report.nodeid))
        result.duration += getattr(report, "duration", 0.0) or 0.0
        if report.when == "setup":
            result.outcome = "passed"
        xfail = hasattr(report, "wasxfail")
        if report.when == "call":
            if xfail:
                result.outcome = "xfailed" if report.skipped else "xpassed"
                result.message = report.wasxfail if report.skipped else f"unexpected pass: {report.wasxfail}"
            elif report.failed:
                result.outcome = "failed"
                result.message = _message(report)
                if "[XPASS(strict)]" in str(report.longrepr):
                    result.message = f"unexpected pass of a strict xfail: {result.message}"
            elif report.skipped:
                result.outcome = "skipped"
                result.message = _message(report)
        elif report.failed:  # setup or teardown error
            result.outcome = "error"
            result.message = f"{report.when}: {_message(report)}"
        elif report.skipped:  # skipped in setup (a fixture), or an xfail decided in setup
            result.outcome = "xfailed" if xfail else "skipped"
            result.message = report.wasxfail if xfail else _message(report)


# ---------------------------------------------------------------------------- selection
@dataclass
class _Plan:
    run: List[Tuple[str, Any]] = field(default_factory=list)  # (name, BackendInfo or None)
    not_run: List[Tuple[str, str]] = field(default_factory=list)  # (name, reason)
    error: Optional[str] = None
    selected_by_env: Optional[str] = None  # ATTNPLUG_BACKEND chose the backend


def _plan(backends: Optional[Sequence[str]]) -> _Plan:
    """Which backends to run. No ``backends`` given: the one ``ATTNPLUG_BACKEND`` names when
    it is set (as ``get_backend()`` would pick it), else every available backend."""
    from attnplug import env, registry

    reg = registry.get_registry()
    infos = {info.name: info for info in reg.available_backends()}
    available = [n for n, i in infos.items() if i.available]
    plan = _Plan()
    if not backends and env.backend_name():
        plan.selected_by_env = env.backend_name()
        backends = [plan.selected_by_env]
    if not backends:
        for name, info in infos.items():
            if info.available:
                plan.run.append((name, info))
            else:
                plan.not_run.append((name, f"unavailable: {info.reason}"))
        for error in reg.load_errors():
            plan.not_run.append((error.backend or error.plugin, f"plugin did not load ({error.kind}): {error.reason}"))
        if not plan.run:
            plan.error = "no backend is available to test"
        return plan
    problems = []
    for name in backends:
        if ":" in name:
            plan.run.append((name, None))
        elif name not in infos:
            known = ", ".join(sorted(infos)) or "none"
            problems.append(
                f"unknown backend {name!r}; registered backends: {known}; available: {', '.join(available) or 'none'}"
            )
        elif not infos[name].available:
            others = [n for n in available if n != name]
            problems.append(
                f"backend {name!r} is unavailable: {infos[name].reason}; "
                f"available backends: {', '.join(others) or 'none'}"
            )
        else:
            plan.run.append((name, infos[name]))
    for name, info in infos.items():
        if name not in backends:
            plan.not_run.append((name, "not requested" if info.available else f"unavailable: {info.reason}"))
    if problems:
        plan.error = "\n".join(problems)
    return plan


# ---------------------------------------------------------------------------- report data
def environment() -> Dict[str, Any]:
    """Versions and platform recorded in the report."""
    import torch

    import attnplug
    from attnplug.versions import installed_version

    triton = installed_version("triton")
    if triton is None:
        try:  # an unpackaged install
            import triton as _triton  # noqa: F401

            triton = getattr(_triton, "__version__", "unknown")
        except Exception:
            triton = None
    return {
        "attnplug_version": attnplug.__version__,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "pytest_version": pytest.__version__,
        "triton_version": triton,
        "platform": {
            "system": platform.system(),
            "release": platform.release(),
            "machine": platform.machine(),
            "platform": platform.platform(),
            "python_implementation": platform.python_implementation(),
        },
    }


def _capabilities(name: str, device: Optional[str]) -> Tuple[Optional[str], Optional[dict], Optional[str], dict]:
    """``(device, capabilities json, error, source)`` of a backend, without running tests."""
    from .selection import SelectionError, resolve_backend
    from .support import probe_capabilities

    try:
        resolved = resolve_backend(name, device)
    except SelectionError as exc:
        return None, None, str(exc), {}
    source = {
        "backend": resolved.target,
        "source": resolved.source,
        "distribution": resolved.distribution,
        "version": resolved.version,
    }
    try:
        caps = probe_capabilities(resolved.cls, resolved.device).to_json()
        return str(resolved.device), caps, None, source
    except Exception as exc:
        return str(resolved.device), None, f"{type(exc).__name__}: {exc}", source


# ---------------------------------------------------------------------------- matrix
_ORDER = ("failed", "error", "xpassed", "passed", "xfailed", "skipped", "not run")


def _cell(results: List[TestResult]):
    from rich.text import Text

    if not results:
        return Text("-", style="dim")
    counts = {o: sum(1 for r in results if r.outcome == o) for o in _ORDER}
    bad = counts["failed"] + counts["error"] + counts["xpassed"]
    n = len(results)
    if bad:
        return Text(f"FAIL {bad}/{n}", style="bold red")
    if counts["skipped"] == n and len({r.message for r in results}) == 1:
        return Text(f"skip: {results[0].message}", style="yellow")  # the reason fits in the cell
    parts = []
    if counts["passed"]:
        parts.append(f"pass {counts['passed']}")
    if counts["xfailed"]:
        parts.append(f"xfail {counts['xfailed']}")
    if counts["skipped"]:
        parts.append(f"skip {counts['skipped']}")
    if counts["not run"]:
        parts.append(f"not run {counts['not run']}")
    style = "green" if counts["passed"] and not counts["xfailed"] else "cyan"
    return Text(" · ".join(parts), style=style)


#: outcomes whose reasons the matrix lists below the table: (outcome, how the list is headed)
_EXPLAINED = (("skipped", "skipped"), ("xfailed", "expected to fail (xfail)"), ("not run", "not run"))


def _reasons(tests: List[Dict[str, Any]], outcome: str) -> List[Tuple[str, str, int]]:
    """``(check, reason, count)`` of the tests with ``outcome``, grouped, in the order met."""
    counts: Dict[Tuple[str, str], int] = {}
    for t in tests:
        if t["outcome"] == outcome:
            default = "not reached: the run stopped before it" if outcome == "not run" else "(no reason given)"
            key = (t["check"], t["message"] or default)
            counts[key] = counts.get(key, 0) + 1
    return [(check, reason, n) for (check, reason), n in counts.items()]


def print_reasons(console, backends: List[Dict[str, Any]]) -> None:
    """Why tests were skipped, expected to fail or not run, per backend: one line per check
    and reason with its count (a matrix cell says ``skip 10``; this says why)."""
    from rich.text import Text

    for b in backends:
        for outcome, heading in _EXPLAINED:
            reasons = _reasons(b["tests"], outcome)
            if not reasons:
                continue
            total = sum(n for _c, _r, n in reasons)
            console.print(Text(f"{b['name']}: {total} test(s) {heading}, why:", style="bold"))
            for check, reason, n in reasons:
                console.print(Text(f"  {check} ({n}): {reason}"), soft_wrap=True)


def _console():
    from rich.console import Console

    if not sys.stdout.isatty() and "COLUMNS" not in os.environ:
        return Console(width=160)
    return Console()


def print_matrix(console, backends: List[Dict[str, Any]], not_run: List[Tuple[str, str]]) -> None:
    from rich.table import Table
    from rich.text import Text

    table = Table(title="attnplug conformance: check x backend", title_justify="left")
    table.add_column("check", overflow="fold")
    for b in backends:
        table.add_column(f"{b['name']} ({b['device'] or '?'})", overflow="fold")
    checks = list(check_names())
    for b in backends:
        for t in b["tests"]:
            if t["check"] not in checks:
                checks.append(t["check"])
    for check in checks:
        row = [Text(check)]
        for b in backends:
            results = [TestResult(**{**t, "duration": t["duration"]}) for t in b["tests"] if t["check"] == check]
            row.append(_cell(results))
        table.add_row(*row)
    status = [Text("run")]
    for b in backends:
        ok = b["exit_code"] in (0, 5) and not b.get("error")
        status.append(
            Text(
                "ok" if ok else f"exit {b['exit_code']}" + (f": {b['error']}" if b.get("error") else ""),
                style="green" if ok else "bold red",
            )
        )
    table.add_row(*status)
    console.print(table)
    print_reasons(console, backends)
    for b in backends:
        failures = [t for t in b["tests"] if t["outcome"] in ("failed", "error", "xpassed")]
        if failures:
            console.print(Text(f"{b['name']}: {len(failures)} failing test(s)", style="bold red"))
            for t in failures:
                console.print(Text(f"  {t['nodeid'].split('::')[-1]}: {t['message']}"))
        if b.get("collect_errors"):
            for e in b["collect_errors"]:
                console.print(Text(f"{b['name']}: collection error: {e}", style="bold red"))
    if not_run:
        console.print(Text("backends not run:", style="bold"))
        for name, reason in not_run:
            console.print(Text(f"  {name}: {reason}"))


# ---------------------------------------------------------------------------- entry point
def _junit_path(junitxml: str, name: str, many: bool) -> str:
    if not many:
        return junitxml
    p = Path(junitxml)
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    return str(p.with_name(f"{p.stem}-{safe}{p.suffix or '.xml'}"))


def run_conformance(
    backends: Optional[Sequence[str]] = None,
    report: Optional[str] = None,
    keyword: Optional[str] = None,
    junitxml: Optional[str] = None,
    *,
    device: Optional[str] = None,
    pytest_args: Sequence[str] = (),
    console=None,
    thorough: bool = False,
    jobs: Union[int, str] = 1,
) -> int:
    """Run the suite against ``backends`` (default: every available one); see the module
    docstring. ``device`` overrides every backend's device; ``pytest_args`` are passed on;
    ``thorough`` adds every combination of the declared dtypes, head dims and page sizes;
    ``jobs`` (a number or ``"auto"``, :func:`worker_count`) spreads each backend's tests over
    worker processes. With several backends, ``junitxml`` gets one file per backend
    (``PATH-<backend>.xml``)."""
    from rich.text import Text

    console = console or _console()
    try:
        workers = worker_count(jobs)
    except ValueError as exc:
        return fail(f"conformance: {exc}")
    if device is not None:
        problem = device_problem(device)
        if problem:
            return fail(f"conformance: --device {device!r}: {problem}")
    for option, path in (("--report", report), ("--junitxml", junitxml)):
        problem = output_problem(path) if path is not None else None
        if problem:  # found now, not after the suite ran
            return fail(f"conformance: {option} {path!r}: {problem}")
    plan = _plan(backends)
    if plan.error:
        return fail(f"conformance: {plan.error}")
    if plan.selected_by_env:
        console.print(
            Text(
                f"ATTNPLUG_BACKEND={plan.selected_by_env} selects the backend to test (give --backend to choose others)"
            )
        )
    started = datetime.datetime.now(datetime.timezone.utc)
    results: List[Dict[str, Any]] = []
    exit_code = 0
    interrupted: Optional[str] = None
    for name, info in plan.run:
        dev, caps, caps_error, source = _capabilities(name, device)
        console.rule(Text(f"attnplug conformance: {name} on {dev or '?'}"))
        collector = ResultCollector()
        args = [
            str(CHECKS_DIR),
            "--attnplug-backend",
            name,
            *pytest_plugin_args(workers),
            "-q",
            "-p",
            "no:cacheprovider",
            "--tb=short",
            "-r",
            "fE",
            "--no-header",
            "-W",
            "ignore::pytest.PytestAssertRewriteWarning",
        ]
        if device:
            args += ["--attnplug-device", device]
        if thorough:
            args += ["--attnplug-thorough"]
        if keyword:
            args += ["-k", keyword]
        if junitxml:
            args += ["--junitxml", _junit_path(junitxml, name, len(plan.run) > 1)]
        args += list(pytest_args)
        code = int(pytest.main(args, plugins=[collector]))
        tests = [r.to_json() for r in collector.results.values()]
        summary = {o: sum(1 for t in tests if t["outcome"] == o) for o in _ORDER}
        failed = summary["failed"] + summary["error"] + summary["xpassed"]
        error = None
        if code not in (0, 1, 5):  # 5: nothing selected (e.g. by -k), not a failure
            try:
                error = f"pytest exited with {code} ({pytest.ExitCode(code).name})"
            except ValueError:
                error = f"pytest exited with {code}"
        if failed or collector.collect_errors or error or code == 1:
            exit_code = 1
        results.append(
            {
                "name": name,
                "device": dev,
                **source,
                "probe_device": getattr(info, "device", None),
                "capabilities": caps,
                "capabilities_error": caps_error,
                "exit_code": code,
                "error": error,
                "summary": summary,
                "collect_errors": collector.collect_errors,
                "tests": tests,
            }
        )
        if collector.interrupted:  # Ctrl-C / SIGTERM: no further backend; what ran is shown and written
            interrupted = collector.interrupted
            done = {r["name"] for r in results}
            plan.not_run += [(n, f"not run: interrupted by {interrupted}") for n, _ in plan.run if n not in done]
            break
    if keyword and not interrupted and not any(r["tests"] or r["collect_errors"] for r in results):
        return fail(f"conformance: -k {keyword!r} matched no check (checks: {', '.join(check_names())})")
    print_matrix(console, results, plan.not_run)
    if report:
        data = {
            "report_version": REPORT_VERSION,
            "created": started.isoformat(),
            "duration": round((datetime.datetime.now(datetime.timezone.utc) - started).total_seconds(), 3),
            **environment(),
            "requested": list(backends) if backends else None,
            "keyword": keyword,
            "exit_code": exit_code,
            "interrupted": interrupted,
            "backends": results,
            "not_run": [{"name": n, "reason": r} for n, r in plan.not_run],
        }
        path = Path(report)
        try:
            if path.parent and not path.parent.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(data, indent=2) + "\n")
        except OSError as exc:
            return fail(f"conformance: --report {report!r}: {exc.strerror or exc}")
        console.print(Text(f"report written to {path}"))
    label = "conformance (quick profile)" if "--attnplug-quick" in pytest_args else "conformance"
    if interrupted:
        console.print(Text(f"{label}: INTERRUPTED by {interrupted} (the results above are partial)", style="bold red"))
        return signal_exit_code(signum=getattr(signal, interrupted))
    console.print(
        Text(
            f"{label}: PASSED" if exit_code == 0 else f"{label}: FAILED",
            style="bold green" if exit_code == 0 else "bold red",
        )
    )
    return exit_code
