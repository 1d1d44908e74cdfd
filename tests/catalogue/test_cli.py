"""Catalogue of adversarial cases for the ``attnplug`` command (issue 37, Trust II: the engine
and the command).

A user error ends in exactly one ``attnplug: error:`` line naming the problem, exit code 2, no
traceback, and, where the error is found before the run, no run at all (the function that
would run it is replaced by one that fails the test when called):

* a bad ``--device`` (no torch device, ``meta``, an accelerator this machine lacks, empty) in
  every subcommand that takes a torch device: conformance, bench, soak, generate;
* an output that cannot be written (a path under a regular file, a folder where a file goes, a
  file where a folder goes) for every option that names one: conformance ``--report`` /
  ``--junitxml``, bench ``--json`` / ``--out`` / ``--history``, soak ``--json``, vllm-check and
  sglang-check ``--json`` / ``--work``: found before the run, not after it;
* malformed ``ATTNPLUG_*`` values and unknown or unavailable backends in generate, soak and
  bench; a request longer than the model's positions and malformed ``--tokens`` in generate;
* SIGINT and SIGTERM on ``soak`` and ``bench --isolate`` (real signals, subprocesses): exit
  code 130 / 143, no child process left running, the figures gathered so far written to the
  JSON asked for and marked interrupted; the same for a Ctrl-C inside the run, in-process;
* what a run reports: ``conformance`` says why tests were skipped (not just "skip 10"); ``bench``
  on the host says its graph variant is the eager stand-in (table, JSON rows, summary line,
  plot), and says nothing of the kind for a backend with a real (replaying) graph.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import types

import pytest

from attnplug import cli, env
from attnplug import registry as R
from attnplug.backends.reference import ReferenceBackend
from attnplug.registry import load_registry
from plugin_dists import plugin_source, reg

PREFIX = "attnplug: error: "


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    for name in list(env.FLAGS) + ["ATTNPLUG_KV_STORE", "COLUMNS"]:
        monkeypatch.delenv(name, raising=False)
    R.reset_registry()
    yield
    R.reset_registry()


def _run(argv, capsys):
    """``attnplug ARGV`` in this process: (exit code, stdout, stderr). A KeyboardInterrupt that
    escapes fails the test (it would stop the whole session)."""
    try:
        code = cli.main(argv)
    except SystemExit as exc:  # argparse
        code = exc.code
    except KeyboardInterrupt:
        pytest.fail(f"attnplug {' '.join(argv)}: a KeyboardInterrupt escaped the command")
    out = capsys.readouterr()
    return code, out.out, out.err


def _one_error(err: str, *needles: str) -> str:
    """The one error line of ``err`` (nothing else but argparse's usage lines), holding every
    needle, with no traceback."""
    assert "Traceback" not in err, err
    lines = [line for line in err.strip().splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith(PREFIX)]
    assert len(errors) == 1 and lines[-1] == errors[0], err
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])
    return errors[0]


class RunStarted(AssertionError):
    """A run started although its arguments were refused before it."""


@pytest.fixture
def no_run(monkeypatch):
    """Replace what each subcommand runs by a function that fails the test."""
    import attnplug.bench
    import attnplug.soak
    import attnplug_conformance.runner
    from attnplug.integrations.sglang import check as sglang_check
    from attnplug.integrations.vllm import check as vllm_check

    def started(*args, **kwargs):
        raise RunStarted("the run started although its arguments should have been refused")

    monkeypatch.setattr(attnplug.soak, "run_soak", started)
    monkeypatch.setattr(attnplug.bench, "run_suite", started)
    monkeypatch.setattr(attnplug_conformance.runner, "run_conformance", started)
    monkeypatch.setattr(vllm_check, "run_command", started)
    monkeypatch.setattr(sglang_check, "run_command", started)


# ---------------------------------------------------------------------------- --device
COMMANDS = {
    "conformance": ["conformance", "--backend", "reference", "-k", "check_swa_buffer_contract", "--jobs", "1"],
    "bench": ["bench", "--backend", "reference", "--quick", "--only", "hybrid_step"],
    "soak": ["soak", "--steps", "2", "--progress", "0"],
    "generate": ["generate", "--tiny", "llama", "--tokens", "1,2", "--max-new-tokens", "1"],
}


def _missing_accelerator() -> str:
    import torch

    return "cuda:99" if torch.cuda.is_available() else "cuda"


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize(
    "device, needle",
    [
        ("bogus", "device type at start of device string: bogus"),
        ("meta", "the meta device holds no data"),
        (None, "cuda"),  # an accelerator this machine lacks
        ("", "empty"),
    ],
    ids=["unknown", "meta", "missing", "empty"],
)
def test_a_bad_device_is_one_line_before_the_run(command, device, needle, capsys):
    if command == "generate":
        pytest.importorskip("transformers")
    device = _missing_accelerator() if device is None else device
    start = time.monotonic()
    code, out, err = _run([*COMMANDS[command], "--device", device], capsys)
    assert code == 2, out + err
    _one_error(err, f"{command}: --device {device!r}: ", needle)
    assert out == "" and time.monotonic() - start < 30


# ---------------------------------------------------------------------------- outputs
OUTPUTS = [
    ("conformance", "--report", False),
    ("conformance", "--junitxml", False),
    ("bench", "--json", False),
    ("bench", "--out", True),
    ("bench", "--history", False),
    ("soak", "--json", False),
    ("vllm-check", "--json", False),
    ("vllm-check", "--work", True),
    ("sglang-check", "--json", False),
    ("sglang-check", "--work", True),
]
BASE = {**COMMANDS, "vllm-check": ["vllm-check"], "sglang-check": ["sglang-check"]}


@pytest.mark.parametrize("command, option, folder", OUTPUTS, ids=[f"{c} {o}" for c, o, _ in OUTPUTS])
@pytest.mark.parametrize("kind", ["under-a-file", "wrong-kind"])
def test_an_unwritable_output_is_found_before_the_run(command, option, folder, kind, tmp_path, capsys, no_run):
    blocker = tmp_path / "blocker.txt"
    blocker.write_text("not a folder\n")
    if kind == "under-a-file":
        path, needle = blocker / "sub" / ("out" if folder else "out.json"), "is a file, not a folder"
    elif folder:
        path, needle = blocker, "is a file, not a folder"
    else:
        path, needle = tmp_path, "is a folder, not a file"
    code, out, err = _run([*BASE[command], option, str(path)], capsys)
    assert code == 2, out + err
    _one_error(err, f"{command}: {option} {str(path)!r}: ", needle)
    assert out == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blocker.txt"]  # nothing written
    assert blocker.read_text() == "not a folder\n"


def test_a_writable_output_in_a_new_folder_is_fine(tmp_path, capsys):
    path = tmp_path / "new" / "deeper" / "soak.json"
    code, out, err = _run(["soak", "--steps", "3", "--progress", "0", "--json", str(path)], capsys)
    assert code == 0, out + err
    assert json.loads(path.read_text())["steps"] == 3


# ---------------------------------------------------------------------------- ATTNPLUG_* and backends
def _use_registry(*registrations):
    module = types.ModuleType(f"catalogue_cli_plugin_{abs(hash(registrations))}")
    exec(plugin_source(registrations), module.__dict__)
    R.reset_registry(load_registry(entry_points=[], extra_plugins=[("p", module)]))


REFERENCE = "attnplug.backends.reference:ReferenceBackend"


def _use_offline_registry():
    """``reference`` (available) and ``offline`` (unavailable, higher priority)."""
    offline = reg(
        "offline", target=REFERENCE, priority=100, available=False, reason="the vendor runtime is not installed"
    )
    _use_registry(reg("reference", target=REFERENCE, priority=0), offline)


@pytest.fixture
def offline_registry():
    _use_offline_registry()


ENV_CASES = [
    # (command line, variable, value, what the one line says)
    (COMMANDS["generate"], "ATTNPLUG_BACKEND", "nosuch", ["no backend named 'nosuch'"]),
    (COMMANDS["generate"], "ATTNPLUG_BACKEND", "offline", ["backend 'offline'", "the vendor runtime is not installed"]),
    (COMMANDS["generate"], "ATTNPLUG_PROBE_TIMEOUT", "fast", ["ATTNPLUG_PROBE_TIMEOUT='fast': expected a positive"]),
    (COMMANDS["generate"], "ATTNPLUG_PLUGINS", ",", ["ATTNPLUG_PLUGINS=',': expected comma-separated plugin names"]),
    (["bench", "--quick"], "ATTNPLUG_BACKEND", "nosuch", ["no backend named 'nosuch'"]),
    (["bench", "--quick"], "ATTNPLUG_BACKEND", "offline", ["backend 'offline'", "the vendor runtime is not installed"]),
    (["bench", "--quick"], "ATTNPLUG_PROBE_TIMEOUT", "0", ["ATTNPLUG_PROBE_TIMEOUT='0': expected a positive number"]),
    (COMMANDS["soak"], "ATTNPLUG_PLUGINS", ",", ["ATTNPLUG_PLUGINS=',': expected comma-separated plugin names"]),
    (COMMANDS["soak"], "ATTNPLUG_PROBE_TIMEOUT", "nan", ["ATTNPLUG_PROBE_TIMEOUT='nan': expected a positive number"]),
    (COMMANDS["soak"], "ATTNPLUG_VALIDATE", "ture", ["ATTNPLUG_VALIDATE='ture': expected a switch"]),
]


@pytest.mark.parametrize(
    "argv, variable, value, needles",
    ENV_CASES,
    ids=[f"{argv[0]} {variable}={value}" for argv, variable, value, _ in ENV_CASES],
)
def test_a_malformed_variable_or_unusable_backend_is_one_line(argv, variable, value, needles, monkeypatch, capsys):
    if argv[0] == "generate":
        pytest.importorskip("transformers")
    if variable == "ATTNPLUG_BACKEND":
        _use_registry(
            reg("reference", target=REFERENCE, priority=0),
            reg(
                "offline", target=REFERENCE, priority=100, available=False, reason="the vendor runtime is not installed"
            ),
        )
    monkeypatch.setenv(variable, value)
    code, out, err = _run(argv, capsys)
    assert code == 2, out + err
    _one_error(err, *needles)


@pytest.mark.parametrize("command", ["generate", "soak", "bench", "conformance"])
def test_an_unavailable_backend_by_name_is_one_line_with_the_reason(command, offline_registry, capsys):
    if command == "generate":
        pytest.importorskip("transformers")
    argv = [a if a != "reference" else "offline" for a in COMMANDS[command]]
    if "--backend" not in argv:
        argv += ["--backend", "offline"]
    code, out, err = _run(argv, capsys)
    assert code == 2, out + err
    _one_error(err, "'offline'", "unavailable", "the vendor runtime is not installed")


@pytest.mark.parametrize(
    "extra, needles",
    [
        (["--tokens", "5", "--max-new-tokens", "400"], ["1 prompt tokens + --max-new-tokens 400 = 401", "= 256"]),
        (["--tokens", "1.5"], ["--tokens '1.5': token ids are integers"]),
        (["--tokens", ","], ["--tokens ',' holds no token id"]),
        (["--tokens", "-3"], ["prompts[0] holds token -3, outside the vocabulary [0, 256)"]),
    ],
    ids=["beyond-positions", "float", "empty", "negative"],
)
def test_generate_refuses_requests_it_cannot_run(extra, needles, capsys):
    pytest.importorskip("transformers")
    code, out, err = _run(["generate", "--tiny", "llama", "--backend", "reference", *extra], capsys)
    assert code == 2, out + err
    _one_error(err, "generate: ", *needles)


# ---------------------------------------------------------------------------- interrupted runs, in this process
class InterruptedAtStep(ReferenceBackend):
    """Raises KeyboardInterrupt (what Ctrl-C raises) in its 200th layer call."""

    calls = 0

    def forward(self, *args, **kwargs):
        type(self).calls += 1
        if type(self).calls == 200:
            raise KeyboardInterrupt
        return super().forward(*args, **kwargs)


def test_soak_interrupted_inside_the_run_keeps_its_figures(tmp_path, capsys):
    InterruptedAtStep.calls = 0
    path = tmp_path / "soak.json"
    spec = f"{__name__}:{InterruptedAtStep.__name__}"
    code, out, err = _run(
        ["soak", "--backend", spec, "--steps", "5000", "--progress", "0", "--json", str(path)], capsys
    )
    assert code == 130, out + err
    assert "Traceback" not in err and "INTERRUPTED by SIGINT after" in out
    data = json.loads(path.read_text())
    assert data["interrupted"] == "SIGINT" and data["ok"] is False
    assert 0 < data["steps"] < 5000 and data["failures"] == 0 and data["tokens"] > 0


def _write_package(root, name: str) -> str:
    """A plugin-like package ``name`` in ``root``: backends (the reference one, one with replaying
    graphs) and a bench suite whose benchmarks log rows slowly, raise Ctrl-C, or are never
    reached."""
    pkg = root / name
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        textwrap.dedent(
            """
            from attnplug.backends.reference import ReferenceBackend


            class Backend(ReferenceBackend):
                pass


            class TapeBackend(ReferenceBackend):
                @classmethod
                def new_graph(cls):
                    from fake_graph_device import TapeGraph

                    return TapeGraph()
            """
        )
    )
    (pkg / "bench.py").write_text(
        textwrap.dedent(
            f"""
            import os
            import time

            from attnplug.bench import Benchmark, Suite, row


            def run_slow(ctx):
                for i in range(100000):
                    ctx.rows.append(row("slow", f"case {{i}}", "time", float(i + 1), "us"))
                    ctx.log(f"slow: row {{i}}")  # saves the rows so far (isolated: for the parent)
                    if i == 2:
                        marker = ctx.options["marker"]
                        with open(marker + ".tmp", "w") as f:
                            f.write(str(os.getpid()))
                        os.replace(marker + ".tmp", marker)
                    time.sleep(0.05)
                return ctx.rows


            def run_interrupting(ctx):
                for i in range(3):
                    ctx.rows.append(row("interrupting", f"case {{i}}", "time", float(i + 1), "us"))
                raise KeyboardInterrupt


            def run_tiny_step(ctx):
                from bench_runs import quick_step_benchmark, small_step_shape

                from attnplug.bench.step_case import StepVariant

                cls = ctx.backend_cls
                variants = {{"graph": StepVariant(make=cls, graph=True), "eager": StepVariant(make=cls, graph=False)}}
                return quick_step_benchmark(
                    ctx, name="tiny_step", shape=small_step_shape(), variants=variants, baseline="eager"
                )


            def run_after(ctx):
                ctx.rows.append(row("after", "case", "time", 1.0, "us"))
                return ctx.rows


            SUITE = Suite(
                "slow",
                "{name}.bench",
                [
                    Benchmark("slow", "{name}.bench:run_slow", reserve_s=0),
                    Benchmark("interrupting", "{name}.bench:run_interrupting", reserve_s=0, default=False),
                    Benchmark("after", "{name}.bench:run_after", reserve_s=0),
                    Benchmark("tiny_step", "{name}.bench:run_tiny_step", reserve_s=0, default=False),
                ],
                options={{"marker": ""}},
                isolate=True,
            )
            """
        )
    )
    return name


@pytest.fixture
def package(tmp_path, monkeypatch):
    name = _write_package(tmp_path, f"catalogue_pkg_{os.getpid()}_{int(time.monotonic() * 1e6)}")
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_bench_interrupted_inside_a_benchmark_keeps_its_rows(package, tmp_path, capsys):
    path = tmp_path / "bench.json"
    argv = ["bench", "--backend", f"{package}:Backend", "--no-isolate", "--only", "interrupting", "after"]
    code, out, err = _run([*argv, "--json", str(path), "--budget-s", "none"], capsys)
    assert code == 130, out + err
    assert "Traceback" not in err and "INTERRUPTED by SIGINT" in out.splitlines()[-1]
    data = json.loads(path.read_text())
    assert data["interrupted"] == "SIGINT" and data["not_run"] == ["after"]
    measured = [r for r in data["rows"] if r["value"] is not None]
    assert [r["case"] for r in measured] == ["case 0", "case 1", "case 2"]
    assert data["rows"][-1]["interrupted"] == "SIGINT" and "interrupted by SIGINT" in data["rows"][-1]["error"]


# ---------------------------------------------------------------------------- real signals, subprocesses
def _env(*extra_paths) -> dict:
    paths = [str(p) for p in extra_paths] + [p for p in sys.path if p]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(paths), PYTHONUNBUFFERED="1", COLUMNS="200")


def _wait(predicate, timeout: float, proc, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            pytest.fail(f"the command ended (exit {proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {timeout:.0f} s")
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_a_signal_stops_soak_with_its_figures(signum, code, tmp_path):
    path, log = tmp_path / "soak.json", tmp_path / "out.txt"
    argv = ["soak", "--steps", "10000000", "--progress", "0.1", "--json", str(path)]
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "attnplug.cli", *argv], stdout=out, stderr=subprocess.STDOUT, env=_env()
        )
        try:
            _wait(lambda: "step " in log.read_text(), 120, proc, "progress line")
            proc.send_signal(signum)
            rc = proc.wait(60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = log.read_text()
    name = signal.Signals(signum).name
    assert rc == code, text
    assert "Traceback" not in text and f"INTERRUPTED by {name} after" in text
    data = json.loads(path.read_text())
    assert data["interrupted"] == name and data["steps"] > 0 and data["ok"] is False


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
@pytest.mark.slow
def test_a_signal_stops_bench_isolate_killing_the_child_and_keeping_rows(signum, code, tmp_path):
    name = _write_package(tmp_path, f"catalogue_sig_{signal.Signals(signum).name.lower()}")
    path, log, marker = tmp_path / "bench.json", tmp_path / "out.txt", tmp_path / "child.pid"
    argv = ["bench", "--backend", f"{name}:Backend", "--isolate", "--json", str(path), "--budget-s", "none"]
    argv += ["--set", f"marker={marker}"]
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    child = None
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "attnplug.cli", *argv],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=_env(tmp_path, tests),
        )
        try:
            _wait(marker.exists, 120, proc, "benchmark child")
            child = int(marker.read_text())
            proc.send_signal(signum)
            rc = proc.wait(60)
            deadline = time.monotonic() + 10
            while _alive(child) and time.monotonic() < deadline:
                time.sleep(0.05)
            left_running = _alive(child)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if child is not None and _alive(child):
                os.kill(child, signal.SIGKILL)  # the child this test started, left behind
    text = log.read_text()
    sig = signal.Signals(signum).name
    assert not left_running, f"the benchmark's child process {child} still runs after {sig}"
    assert rc == code, text
    assert "Traceback" not in text and f"INTERRUPTED by {sig}" in text.splitlines()[-1]
    data = json.loads(path.read_text())
    assert data["interrupted"] == sig and data["not_run"] == ["after"]
    measured = [r for r in data["rows"] if r["value"] is not None]
    assert len(measured) >= 3 and [r["case"] for r in measured[:3]] == ["case 0", "case 1", "case 2"]
    assert data["rows"][-1]["interrupted"] == sig


# ---------------------------------------------------------------------------- what a run reports
def test_conformance_says_why_tests_were_skipped(capsys):
    argv = ["conformance", "--backend", "reference", "-k", "check_pdl_on_off_identical", "--jobs", "1"]
    code, out, err = _run(argv, capsys)
    assert code == 0, out + err
    lines = out.splitlines()
    # the check with the model's cache and over float8_e4m3fn (the FP8 axis of the default run)
    heading = lines.index("reference: 2 test(s) skipped, why:")
    assert lines[heading + 1].startswith("  check_pdl_on_off_identical (2): capabilities().pdl is False")


def test_a_matrix_cell_of_passes_and_skips_comes_with_the_reasons():
    """The cell says ``pass 9 · skip 10``; the lines below it say why, per check and reason."""
    import io

    from rich.console import Console

    from attnplug_conformance.runner import print_matrix

    def test(check, outcome, message=""):
        return {"nodeid": f"x::{check}", "check": check, "outcome": outcome, "duration": 0.0, "message": message}

    thorough = "another dtype of an architecture the default run covers: runs with --attnplug-thorough"
    tests = [test("check_matches_transformers", "passed") for _ in range(9)]
    tests += [test("check_matches_transformers", "skipped", thorough) for _ in range(10)]
    tests += [test("check_paged_ops", "skipped", "no paged ops"), test("check_paged_ops", "skipped", "page size 1")]
    tests += [test("check_replay_equals_eager", "xfailed", "known: graphs off on this device")]
    backend = {"name": "fake", "device": "cpu", "exit_code": 0, "error": None, "tests": tests, "collect_errors": []}
    buf = io.StringIO()
    print_matrix(Console(file=buf, width=200), [backend], [])
    lines = buf.getvalue().splitlines()
    row = next(line for line in lines if "check_matches_transformers" in line and "│" in line)
    assert "pass 9 · skip 10" in row
    paged = next(line for line in lines if "check_paged_ops" in line and "│" in line)
    assert "skip 2" in paged and "no paged ops" not in paged  # two reasons: listed below, not one of them
    at = lines.index("fake: 12 test(s) skipped, why:")
    assert lines[at + 1 : at + 4] == [
        f"  check_matches_transformers (10): {thorough}",
        "  check_paged_ops (1): no paged ops",
        "  check_paged_ops (1): page size 1",
    ]
    at = lines.index("fake: 1 test(s) expected to fail (xfail), why:")
    assert lines[at + 1] == "  check_replay_equals_eager (1): known: graphs off on this device"


@pytest.mark.slow
def test_bench_on_the_host_says_its_graph_is_the_eager_stand_in(tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    titles, labels = [], []
    real = Figure.savefig

    def savefig(fig, *args, **kwargs):
        for ax in fig.axes:
            titles.append(ax.get_title())
            legend = ax.get_legend()
            labels.extend(t.get_text() for t in (legend.get_texts() if legend else []))
        return real(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    code, out, err = _run(
        ["bench", "--backend", "reference", "--quick", "--only", "hybrid_step", "--out", str(tmp_path)], capsys
    )
    assert code in (0, 1), out + err
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["graphs"] == "eager stand-in"
    speedups = [r for r in data["rows"] if r["metric"].startswith("speedup")]
    assert speedups and all(r["graphs"] == "eager stand-in" and "eager stand-in" in r["detail"] for r in speedups)
    graph_times = [r for r in data["rows"] if r.get("variant") == "graph"]
    assert graph_times and all(r["graphs"] == "eager stand-in" for r in graph_times)
    assert not any("graphs" in r for r in data["rows"] if r.get("variant") == "eager")
    assert "note: eager stand-in: no device graph on cpu" in out
    assert out.splitlines()[-1].endswith("graphs: eager stand-in") or "graphs: eager stand-in" in out.splitlines()[-1]
    assert any("eager stand-in" in t and "noise" in t for t in titles), titles
    assert "graph (eager stand-in)" in labels and "eager / graph (eager stand-in)" in labels, labels


def test_bench_with_a_replaying_graph_claims_no_stand_in(package, tmp_path, capsys):
    """A backend whose graphs replay like a device graph's (``TapeGraph``): nothing says stand-in."""
    import importlib

    from attnplug.bench import run_suite

    module = importlib.import_module(package)
    suite = importlib.import_module(f"{package}.bench").SUITE
    result = run_suite(suite, module.TapeBackend, "cpu", only=["tiny_step"], json_path=str(tmp_path / "b.json"))
    out = capsys.readouterr().out
    assert result["graphs"] == "device graphs" and not result["summary"]["errors"], result["rows"]
    assert any(r["metric"] == "speedup (eager / graph)" for r in result["rows"])
    assert not any("graphs" in r or "stand-in" in (r.get("detail") or "") for r in result["rows"])
    assert "stand-in" not in out
