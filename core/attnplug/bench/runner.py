"""Running a suite: budget, isolation, JSON after every benchmark, plots and the table last.

``run_suite`` runs the chosen benchmarks of a ``Suite`` for one backend on one device. With
``isolate`` each benchmark runs in its own child process (``python -m attnplug.bench
--child ...``) with a time limit carved from the run's budget (what the benchmarks still to
come need is kept back): a sticky device error, an out-of-memory or a hang then costs that
benchmark only, and its memory goes back to the device when it ends. A benchmark that raises
leaves an error row; the others still run. Ctrl-C or SIGTERM stops the run with no child
left running and the figures measured so far written, marked ``interrupted``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Dict, List, Optional, Sequence

import torch

from ..cli_errors import interrupts_deferred, output_problem, signal_name
from .context import Ctx, Deadline
from .environment import environment
from .report import STAND_IN, print_report, stand_in_note, write_json
from .rows import benchmark_error_row, failure_row, summarize
from .suite import Benchmark, Suite
from .timing import Timer, free_memory

__all__ = ["run_suite", "run_benchmark", "run_child_process", "class_spec"]

#: the JSON file a run writes into its output folder
JSON_NAME = "bench.json"


def class_spec(cls: type) -> str:
    """``module:QualName`` of a class (how a child process finds the backend again)."""
    return f"{cls.__module__}:{cls.__qualname__}"


def graph_kind(timer: Timer) -> str:
    """``"device graphs"`` when the backend's graph class captures real device graphs, else
    ``STAND_IN`` (``EagerGraph``: a "replay" runs the eager step again)."""
    from ..graphs import EagerGraph

    try:
        graph = timer.new_graph()
    except Exception:  # the benchmarks will say what is wrong with the device
        return "unknown"
    return STAND_IN if isinstance(graph, EagerGraph) else "device graphs"


def run_benchmark(bench: Benchmark, ctx: Ctx) -> List[dict]:
    """Run one benchmark in this process; its exceptions become an error row."""
    ctx.rows = []
    try:
        bench.load()(ctx)
    except Exception as exc:
        ctx.rows.append(failure_row(bench.name, exc, traceback.format_exc()))
        ctx.log(f"{bench.name}: FAILED {type(exc).__name__}: {exc}")
    finally:
        free_memory(ctx.timer)
    ctx.save_rows()
    return ctx.rows


def run_child_process(cmd: List[str], timeout: float) -> Optional[int]:
    """Run ``cmd`` in its own process session (its output goes to ours); on timeout kill that
    session's process group. Returns the exit status, or None when killed at the limit."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    env["PYTHONUNBUFFERED"] = "1"
    sys.stdout.flush()
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        return None
    except BaseException:  # Ctrl-C: do not leave the child running
        _kill_group(proc)
        raise


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        proc.kill()
    proc.wait()


class _Stopped(Exception):
    """A benchmark's child process was stopped by SIGINT / SIGTERM in the parent (the child is
    killed): ``rows`` it had saved, ``signame`` the signal."""

    def __init__(self, rows: List[dict], signame: str) -> None:
        super().__init__(signame)
        self.rows = rows
        self.signame = signame


def _read_rows(path: str) -> List[dict]:
    try:
        with open(path) as f:
            rows = json.load(f)
    except Exception:
        return []
    return rows if isinstance(rows, list) else []


def _interrupted_row(bench: str, signame: str) -> dict:
    return benchmark_error_row(
        bench,
        f"interrupted by {signame} (the rows before this one were measured before that)",
        interrupted=signame,
    )


def _run_in_child(suite: Suite, bench: Benchmark, ctx: Ctx, timeout: float) -> List[dict]:
    fd, rows_path = tempfile.mkstemp(prefix=f"attnplug-bench-{bench.name}-", suffix=".json")
    os.close(fd)
    cmd = [
        sys.executable,
        "-m",
        "attnplug.bench",
        "--child",
        bench.name,
        "--suite",
        suite.module,
        "--backend",
        class_spec(ctx.backend_cls) if ctx.backend_cls else "",
        "--device",
        str(ctx.device),
        "--rows-out",
        rows_path,
        "--budget-s",
        f"{max(5.0, timeout - 20):.0f}",
        "--options",
        json.dumps(ctx.options),
    ]
    if ctx.quick:
        cmd.append("--quick")
    try:
        try:
            rc = run_child_process(cmd, timeout)  # kills the child's process group on Ctrl-C / SIGTERM
        except KeyboardInterrupt as exc:
            raise _Stopped(_read_rows(rows_path), signal_name(exc)) from None
        rows = _read_rows(rows_path)
        if rc is None:
            rows.append(
                benchmark_error_row(
                    bench.name,
                    f"killed at its {timeout:.0f} s time limit (rows before this one were measured before that)",
                )
            )
        elif rc != 0 and not any(r.get("error") for r in rows):
            rows.append(
                benchmark_error_row(bench.name, f"child process exited with status {rc} (see its output above)")
            )
        return rows
    finally:
        for path in (rows_path, rows_path + ".tmp"):
            try:
                os.unlink(path)
            except OSError:
                pass


def _with_index(device: torch.device) -> torch.device:
    """``device`` with its index (the current one of its device module) where it names none."""
    module = getattr(torch, device.type, None)
    if device.index is not None or device.type == "cpu" or not callable(getattr(module, "current_device", None)):
        return device
    try:
        return torch.device(device.type, module.current_device())
    except Exception:  # the device runtime is unusable: the benchmarks will say so
        return device


def run_suite(
    suite: Suite,
    backend_cls: Optional[type],
    device: Any = "cpu",
    *,
    only: Optional[Sequence[str]] = None,
    quick: bool = False,
    out_dir: Optional[str] = None,
    json_path: Optional[str] = None,
    budget_s: Optional[float] = -1.0,
    isolate: Optional[bool] = None,
    options: Optional[Dict[str, Any]] = None,
    argv: Optional[List[str]] = None,
) -> Dict[str, Any]:
    """Run ``suite``'s benchmarks named in ``only`` (default: its default ones) for
    ``backend_cls`` on ``device``; print progress lines, then the table and a summary line
    last; return the result (``environment``, ``rows``, ``summary``, ``plots``, ...).

    ``out_dir``: write ``bench.json`` and the PNG plots there. ``json_path``: (also) write
    the JSON there; the JSON is rewritten after every benchmark, so a run cut short keeps
    what it measured. ``budget_s``: the run's wall-clock budget (-1: the suite's default;
    None: unlimited). ``isolate``: one child process per benchmark (None: the suite's
    default). ``options``: the suite's options (``Suite.parse_options``).
    Raises ``ValueError`` for an unknown benchmark name or an output that cannot be written
    (``out_dir`` / ``json_path``) and ``SuiteUnavailable`` when the suite cannot run here; all
    before anything is measured or written.

    A ``KeyboardInterrupt`` (Ctrl-C, or SIGTERM under ``cli_errors.interrupts_raise``) stops
    the run without being raised: an isolated benchmark's child process is killed, the rows
    measured so far (the child's saved ones included) are kept with an error row saying so, the
    JSON, plots and table are written as usual, and ``result["interrupted"]`` names the signal
    (``"SIGINT"`` / ``"SIGTERM"``; ``result["not_run"]``: the benchmarks that did not start).
    Every row of a graph variant that had no device graph carries ``graphs="eager stand-in"``
    (``result["graphs"]`` says which the backend has).
    """
    benchmarks = suite.select(only)
    for option, path, folder in (("--out", out_dir, True), ("--json", json_path, False)):
        problem = output_problem(path, folder=folder) if path else None
        if problem:  # found now: a run is never lost to an output that cannot be written
            raise ValueError(f"{option} {path!r}: {problem}")
    suite.check()
    device = _with_index(torch.device(device))
    budget = suite.budget_s if budget_s == -1.0 else budget_s
    isolate = suite.isolate if isolate is None else isolate
    paths = [p for p in (os.path.join(out_dir, JSON_NAME) if out_dir else None, json_path) if p]
    deadline = Deadline(budget)
    ctx = Ctx(
        backend_cls=backend_cls,
        device=device,
        quick=quick,
        deadline=deadline,
        options=dict(suite.options if options is None else options),
        timer=Timer(device, backend_cls),
    )
    env = environment(device, argv)
    if suite.environment is not None:
        env.update(suite.environment())
    env["timing"] = ctx.timer.method
    graphs = graph_kind(ctx.timer)
    result: Dict[str, Any] = {
        "suite": suite.name,
        "backend": getattr(backend_cls, "name", None) or "-",
        "device": str(device),
        "environment": env,
        "quick": quick,
        "budget_s": budget,
        "isolated": isolate,
        # "device graphs", or "eager stand-in": no device graph here, graph variants replay eager steps
        "graphs": graphs,
        "options": ctx.options,
        "benchmarks": [b.name for b in benchmarks],
        "rows": [],
        "elapsed_s": {},
        "json": paths[-1] if paths else None,
    }
    ctx.log(
        f"attnplug bench: {suite.name} suite, backend {result['backend']} on {device} "
        f"({env.get('device_name')}), torch {env['torch']}, triton {env['triton']}, timing: {env['timing']}; "
        f"{'quick' if quick else 'full'} run of {result['benchmarks']}"
    )
    if graphs == STAND_IN:
        ctx.log(f"graphs: {stand_in_note(device)}")
    for i, bench in enumerate(benchmarks):
        t0 = time.monotonic()
        ctx.rows = []
        try:
            ctx.log(f"== {bench.name} ==")
            later = sum(b.reserve_s * (0.5 if quick else 1.0) for b in benchmarks[i + 1 :])
            if isolate:
                timeout = 3600.0 if budget is None else max(30.0, deadline.left() - later)
                rows = _run_in_child(suite, bench, ctx, timeout)
            else:
                ctx.reserve_after_s = 0.0 if budget is None else later
                rows = run_benchmark(bench, ctx)
        except _Stopped as stop:  # the child is gone; the rows it saved are kept
            result["interrupted"] = stop.signame
            rows = stop.rows + [_interrupted_row(bench.name, stop.signame)]
        except KeyboardInterrupt as exc:  # in this process: the rows appended so far are kept
            result["interrupted"] = signal_name(exc)
            rows = list(ctx.rows if not isolate else []) + [_interrupted_row(bench.name, result["interrupted"])]
        with interrupts_deferred() as arrived:  # each JSON is written whole
            result["rows"].extend(rows)
            result["elapsed_s"][bench.name] = round(time.monotonic() - t0, 1)
            result["summary"] = summarize(result["rows"])
            for path in paths:
                write_json(result, path)
        if arrived and "interrupted" not in result:
            result["interrupted"] = signal_name(signum=arrived[0])
        if "interrupted" in result:
            result["not_run"] = [b.name for b in benchmarks[i + 1 :]]
            break
        ctx.log(f"== {bench.name}: {len(rows)} rows in {result['elapsed_s'][bench.name]:.1f} s ==")
    with interrupts_deferred() as arrived:  # the figures gathered are written and shown, whatever arrives
        result["total_s"] = round(deadline.elapsed(), 1)
        result["summary"] = summarize(result["rows"])
        result["plots"] = []
        if out_dir:
            try:
                from .plots import write_plots

                result["plots"] = write_plots(result["rows"], out_dir, suite.baseline)
            except ImportError as exc:
                result["plots_note"] = (
                    f"no PNG plots: matplotlib is not installed ({exc}); pip install 'attnplug[bench]'"
                )
        for path in paths:
            write_json(result, path)
        print_report(result)
    if arrived and "interrupted" not in result:
        result["interrupted"] = signal_name(signum=arrived[0])
    return result
