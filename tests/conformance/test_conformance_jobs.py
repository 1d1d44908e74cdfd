"""``attnplug conformance --jobs``: the suite spread over pytest-xdist workers reports what the
run in one process reports (the same tests, order, outcomes and messages); bad values are one
clear line."""

from __future__ import annotations

import json
import sys

import pytest

from attnplug.cli import main
from attnplug_conformance import pytest_args
from attnplug_conformance.pytest_args import AUTO_JOBS_MAX, worker_count

pytestmark = pytest.mark.slow  # runs the suite in worker processes

#: cheap checks of three kinds (flags, the SWA buffer, translation counts): 12 tests
SOME_CHECKS = "check_capabilities_honest or check_swa_buffer_contract or check_translates_once_per_step"


def _report(tmp_path, name, *argv):
    path = tmp_path / f"{name}.json"
    code = main(["conformance", *argv, "--report", str(path)])
    data = json.loads(path.read_text())
    (backend,) = data["backends"]
    return code, [(t["nodeid"], t["check"], t["outcome"], t["message"]) for t in backend["tests"]], backend


@pytest.mark.parametrize(
    "backend, expected_code",
    [("reference", 0), ("broken_backends:DirtyTail", 1)],
)
def test_workers_report_what_one_process_reports(tmp_path, capsys, backend, expected_code):
    argv = ["--backend", backend, "-k", SOME_CHECKS]
    code_one, one, _ = _report(tmp_path, "one", *argv, "--jobs", "1")
    code_two, two, data = _report(tmp_path, "two", *argv, "--jobs", "2")
    assert code_one == code_two == expected_code
    assert two == one and len(one) >= 12
    assert data["summary"]["not run"] == 0
    if expected_code:
        failed = [t for t in two if t[2] == "failed"]
        assert failed and all(t[3].startswith("rule 1 (hoisted SWA writes)") for t in failed)
        assert "tail of cuda_graph_swa_out_cache_loc is not zero" in capsys.readouterr().out


def test_workers_stopped_early_list_the_tests_not_run(tmp_path):
    """``-x`` on a broken backend: the workers stop at the first failure and the report still
    names every collected test (those never run as ``not run``), as the run in one process
    does."""
    from attnplug_conformance.runner import run_conformance

    path = tmp_path / "r.json"
    code = run_conformance(
        ["broken_backends:DirtyTail"], report=str(path), keyword=SOME_CHECKS, pytest_args=["-x"], jobs=2
    )
    tests = json.loads(path.read_text())["backends"][0]["tests"]
    assert code == 1 and len(tests) >= 12
    outcomes = [t["outcome"] for t in tests]
    assert "failed" in outcomes and "not run" in outcomes


@pytest.mark.parametrize("cores, expected", [(None, 1), (1, 1), (3, 1), (4, 2), (6, 3), (64, AUTO_JOBS_MAX)])
def test_auto_is_half_the_cores_at_most_the_ceiling(monkeypatch, cores, expected):
    monkeypatch.setattr(pytest_args.os, "cpu_count", lambda: cores)
    assert worker_count("auto") == expected
    assert worker_count(3) == worker_count("3") == 3


def test_without_xdist_auto_is_this_process_and_a_number_is_refused(monkeypatch):
    monkeypatch.setitem(sys.modules, "xdist", None)  # import xdist raises ImportError
    monkeypatch.setattr(pytest_args.os, "cpu_count", lambda: 64)
    assert worker_count("auto") == worker_count(1) == 1
    with pytest.raises(ValueError, match=r"--jobs 2: worker processes need pytest-xdist"):
        worker_count(2)


@pytest.mark.parametrize("jobs", ["0", "-2", "many", "1.5"])
def test_bad_jobs_is_one_clear_line(capsys, jobs):
    assert main(["conformance", "--backend", "reference", "--jobs", jobs]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"attnplug: error: conformance: --jobs {jobs!r}: expected a positive number or 'auto'"]
