"""The CUDA plugin's benchmark suite: the new hot path against the "before" path of each step.

==================  ===========================================================================
benchmark           what it measures (each module's docstring has the details and targets)
==================  ===========================================================================
``kv_store``        61 per-layer KV stores in one CUDA graph: Triton / C++ store, PDL on / off,
                    against translate + index_put
``step_metadata``   one graph replay's preparation: device launches, host time, no sync,
                    enqueue-ahead behind a busy GPU
``decode_attention``  SWA decode at 32k context (window 4096): achieved TB/s against the
                    copy bandwidth, SDPA, gather + SDPA and flex_attention peers
``hybrid_step``     whole 48-layer hybrid steps (decode, draft-extend) through the graph
                    runner: cuda backend vs ``BeforeBackend``
==================  ===========================================================================

Entry point: :func:`run_benchmarks` (``benchmarks/run_h200.py`` is its command line). It
needs a CUDA device and raises :class:`NeedsCudaDevice` otherwise. Every benchmark returns
rows (dicts: ``benchmark, case, metric, value, unit, target, met, error, notes`` + extra
numbers); the run prints progress lines as it goes, a compact table LAST, and writes JSON
(after every benchmark, so a run cut short keeps what it measured).

By default each benchmark runs in its own child process (``isolate=True``) with a time
limit taken from the run's budget: a sticky CUDA error, an out-of-memory or a hang in one
benchmark then costs only that benchmark, and its memory is returned to the device.

Nothing here imports Triton, the kernels or CUDA at import time.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Callable, Dict, Iterable, List, Optional

from .common import Ctx, NeedsCudaDevice, row
from .timing import Deadline, environment, free_cuda

__all__ = ["BENCHMARKS", "run_benchmarks", "NeedsCudaDevice", "format_table", "DEFAULT_BUDGET_S"]

#: wall-clock budget of a whole run (the device machine stops a command at 600 s)
DEFAULT_BUDGET_S = 560.0
#: seconds of the budget kept for each benchmark still to come (what it needs at least)
RESERVE_S = {"kv_store": 60.0, "step_metadata": 60.0, "decode_attention": 45.0, "hybrid_step": 150.0}


def _lazy(module: str) -> Callable[[Ctx], List[dict]]:
    def run(ctx: Ctx) -> List[dict]:
        return importlib.import_module(f"{__name__}.{module}").run(ctx)

    run.__name__ = f"run_{module}"
    run.__doc__ = f"Run the ``{module}`` benchmark (see ``{__name__}.{module}``)."
    return run


#: name -> ``fn(ctx) -> rows``, in the order a run executes them
BENCHMARKS: Dict[str, Callable[[Ctx], List[dict]]] = {
    name: _lazy(name) for name in ("kv_store", "step_metadata", "decode_attention", "hybrid_step")
}


def _require_cuda() -> None:
    try:
        import torch
    except Exception as exc:  # pragma: no cover - torch is a dependency
        raise NeedsCudaDevice(f"attnplug bench needs a CUDA device, and torch does not import: {exc}") from exc
    if not torch.cuda.is_available():
        raise NeedsCudaDevice(
            "attnplug bench needs a CUDA device: torch.cuda.is_available() is False "
            f"(torch {torch.__version__}, built with CUDA {torch.version.cuda}). Run it on an NVIDIA GPU "
            "(the targets are for an H200, sm_90)."
        )


# --------------------------------------------------------------------------- output


def _fmt(value) -> str:
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
        if a >= 1:
            return f"{value:.3g}" if a < 10 else f"{value:.2f}"
        if a >= 1e-3:
            return f"{value:.4f}"
        return f"{value:.2e}"
    return str(value)


def format_table(rows: Iterable[dict], *, all_rows: bool = False) -> str:
    """The compact table printed at the end of a run: the rows with a target, an error or
    ``key=True`` (``all_rows``: every row)."""
    header = ("benchmark", "case", "metric", "value", "target", "met", "detail")
    lines = []
    for r in rows:
        if not (all_rows or r.get("target") or r.get("error") or r.get("key")):
            continue
        value = _fmt(r.get("value"))
        if r.get("value") is not None and r.get("unit"):
            value += f" {r['unit']}"
        met = {True: "yes", False: "NO", None: ""}[r.get("met")]
        detail = r.get("detail") or ""
        if r.get("error"):
            met = "ERROR"
            detail = (r["error"].splitlines() or ["error"])[0]
        elif r.get("value") is None and r.get("notes"):
            detail = r["notes"]
        elif r.get("notes") and not detail:
            detail = r["notes"]
        lines.append((r.get("benchmark", ""), str(r.get("case", ""))[:40], str(r.get("metric", ""))[:30], value,
                      r.get("target") or "", met, detail.splitlines()[0][:80] if detail else ""))
    widths = [max([len(h)] + [len(l[i]) for l in lines]) for i, h in enumerate(header)]
    out = ["  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip(), "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(l, widths)).rstrip() for l in lines]
    return "\n".join(out)


def _summary(rows: List[dict]) -> dict:
    held = [r for r in rows if r.get("met") is not None]
    return {
        "targets": len(held),
        "met": sum(1 for r in held if r["met"]),
        "missed": [f"{r['benchmark']}: {r['case']} ({r['metric']})" for r in held if not r["met"]],
        "errors": [f"{r['benchmark']}: {r['case']}: {(r.get('error') or '').splitlines()[0] if r.get('error') else ''}"
                   for r in rows if r.get("error")],
    }


def _write_json(result: dict, path: Optional[str]) -> None:
    if not path:
        return
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1, default=str)
    os.replace(tmp, path)


# --------------------------------------------------------------------------- running


def _run_in_process(name: str, ctx: Ctx) -> List[dict]:
    ctx.rows = []
    try:
        BENCHMARKS[name](ctx)
    except Exception as exc:
        ctx.rows.append(row(name, "(benchmark)", "all", None, "", error=f"{type(exc).__name__}: {exc}",
                            traceback=traceback.format_exc()))
        ctx.log(f"{name}: FAILED {type(exc).__name__}: {exc}")
    finally:
        free_cuda()
    ctx.save_rows()
    return ctx.rows


def run_child_process(cmd: List[str], timeout: float) -> Optional[int]:
    """Run ``cmd`` in its own process session (its output goes to ours); on timeout kill
    that session's process group (the child and anything it started). Returns the exit
    status, or None when it was killed at the time limit."""
    import signal

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    env["PYTHONUNBUFFERED"] = "1"
    sys.stdout.flush()
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            proc.kill()
        proc.wait()
        return None
    except BaseException:  # Ctrl-C: do not leave the child running
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        raise


def _run_in_child(name: str, ctx: Ctx, timeout: float) -> List[dict]:
    fd, rows_path = tempfile.mkstemp(prefix=f"attnplug-bench-{name}-", suffix=".json")
    os.close(fd)
    cmd = [sys.executable, "-m", __name__, "--child", name, "--rows-out", rows_path,
           "--budget-s", f"{max(10.0, timeout - 20):.0f}", "--flex-budget-s", f"{ctx.flex_budget_s:.0f}"]
    if ctx.quick:
        cmd.append("--quick")
    if ctx.skip_cpp:
        cmd.append("--skip-cpp")
    try:
        rc = run_child_process(cmd, timeout)
        rows: List[dict] = []
        try:
            with open(rows_path) as f:
                rows = json.load(f)
        except Exception:
            rows = []
        if rc is None:
            rows.append(row(name, "(benchmark)", "all", None, "", error=f"killed at its {timeout:.0f} s time limit "
                            "(rows before this one were measured before that)"))
        elif rc != 0 and not any(r.get("error") for r in rows):
            rows.append(row(name, "(benchmark)", "all", None, "", error=f"child process exited with status {rc} "
                            "(see its output above)"))
        return rows
    finally:
        for path in (rows_path, rows_path + ".tmp"):
            try:
                os.unlink(path)
            except OSError:
                pass


def run_benchmarks(
    only: Optional[Iterable[str]] = None,
    quick: bool = False,
    json_path: Optional[str] = None,
    *,
    skip_cpp: bool = False,
    budget_s: Optional[float] = DEFAULT_BUDGET_S,
    flex_budget_s: float = 150.0,
    isolate: bool = True,
    argv: Optional[List[str]] = None,
) -> dict:
    """Run the benchmarks named in ``only`` (default: all, in ``BENCHMARKS`` order) on the
    current CUDA device; print progress, then the table; write JSON to ``json_path`` (after
    every benchmark); return the result dict (``environment``, ``rows``, ``summary``, ...).

    ``quick``: a smoke pass (fewer sizes and iterations, no flex_attention compile).
    ``budget_s``: wall-clock budget of the whole run; benchmarks skip cases when it runs low
    (None: unlimited). ``isolate``: one child process per benchmark (see the module
    docstring). Raises :class:`NeedsCudaDevice` without a CUDA device, ``ValueError`` for an
    unknown benchmark name.
    """
    names = list(only) if only else list(BENCHMARKS)
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        raise ValueError(f"unknown benchmark(s) {unknown}; choose from {list(BENCHMARKS)}")
    _require_cuda()
    deadline = Deadline(budget_s)
    ctx = Ctx(quick=quick, deadline=deadline, skip_cpp=skip_cpp, flex_budget_s=flex_budget_s)
    result: dict = {
        "environment": environment(argv),
        "quick": quick,
        "budget_s": budget_s,
        "isolated": isolate,
        "benchmarks": names,
        "rows": [],
        "elapsed_s": {},
    }
    env = result["environment"]
    ctx.log(f"attnplug CUDA benchmarks on {env.get('gpu')} (sm {env.get('compute_capability')}), torch {env.get('torch')} "
            f"(CUDA {env.get('torch_cuda')}), triton {env.get('triton')}, PDL {env.get('pdl')}; "
            f"{'quick' if quick else 'full'} run of {names}")
    for i, name in enumerate(names):
        ctx.log(f"== {name} ==")
        t0 = time.monotonic()
        later = sum(RESERVE_S.get(n, 60.0) * (0.5 if quick else 1.0) for n in names[i + 1:])
        if isolate:
            timeout = 3600.0 if budget_s is None else max(30.0, deadline.left() - later)
            rows = _run_in_child(name, ctx, timeout)
        else:
            ctx.reserve_after_s = 0.0 if budget_s is None else later
            rows = _run_in_process(name, ctx)
        result["rows"].extend(rows)
        result["elapsed_s"][name] = round(time.monotonic() - t0, 1)
        ctx.log(f"== {name}: {len(rows)} rows in {result['elapsed_s'][name]:.1f} s ==")
        result["summary"] = _summary(result["rows"])
        _write_json(result, json_path)
    result["total_s"] = round(deadline.elapsed(), 1)
    result["summary"] = _summary(result["rows"])
    _write_json(result, json_path)
    s = result["summary"]
    print("", flush=True)
    print(format_table(result["rows"]), flush=True)
    print(f"\ntargets met: {s['met']} / {s['targets']}; errors: {len(s['errors'])}; total {result['total_s']:.0f} s"
          + (f"; JSON: {json_path}" if json_path else ""), flush=True)
    return result
