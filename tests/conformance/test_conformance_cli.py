"""``attnplug conformance``: exit codes, the printed matrix, the JSON report."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from attnplug.cli import main
from child import HANG_LIMIT_S
from suite_runs import LARGE_BUFFERS_CASE

CONFORMANCE = [sys.executable, "-m", "attnplug.cli", "conformance"]

CHECKS = [
    "check_accepts_seq_lens_cpu_none",
    "check_attention_matches_reference",
    "check_capabilities_honest",
    "check_kv_written_only_at_step_slots",
    "check_large_kv_buffers",
    "check_matches_transformers",
    "check_paged_ops",
    "check_pdl_on_off_identical",
    "check_replay_equals_eager",
    "check_replay_metadata_sync_free",
    "check_sampled_worlds",
    "check_softcap_and_sinks",
    "check_swa_buffer_contract",
    "check_translates_once_per_step",
]


@pytest.mark.slow
def test_reference_passes_writes_report_and_prints_matrix(tmp_path):
    report = tmp_path / "out" / "report.json"
    env = dict(os.environ, COLUMNS="200", PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.run(
        # without the 8.7 GB world of check_large_kv_buffers (tests/conformance/test_scale_mutant.py runs it)
        [*CONFORMANCE, "--backend", "reference", "-k", f"not {LARGE_BUFFERS_CASE}", "--report", str(report)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=HANG_LIMIT_S,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "attnplug conformance: check x backend" in out and "reference (cpu)" in out
    for check in CHECKS:
        assert check in out
    assert "skip: capabilities().pdl is False" in out
    assert "conformance: PASSED" in out

    data = json.loads(report.read_text())
    for key in ("attnplug_version", "torch_version", "python_version", "pytest_version", "triton_version", "platform"):
        assert key in data
    assert data["exit_code"] == 0 and data["requested"] == ["reference"]
    (backend,) = data["backends"]
    assert backend["name"] == "reference" and backend["device"] == "cpu"
    assert backend["backend"] == "attnplug.backends.reference:ReferenceBackend"
    assert backend["capabilities"]["device_type"] == "cpu" and backend["capabilities"]["graphs"] == "ALWAYS"
    tests = backend["tests"]
    assert {t["check"] for t in tests} == set(CHECKS)
    for t in tests:
        assert set(t) == {"nodeid", "check", "outcome", "duration", "message"}
        assert t["outcome"] in ("passed", "skipped") and t["duration"] >= 0
    skips = [t for t in tests if t["outcome"] == "skipped"]
    skipped = {t["check"]: t["message"] for t in skips}
    model_skips = [t for t in tests if t["check"] == "check_matches_transformers" and t["outcome"] == "skipped"]
    # the model check: every architecture in float32 by default, the other dtypes when thorough
    assert len(model_skips) == 10 and all("--attnplug-thorough" in t["message"] for t in model_skips)
    skipped.pop("check_matches_transformers")
    assert "capabilities().pdl is False" in skipped.pop("check_pdl_on_off_identical")
    assert "--attnplug-thorough" in skipped.pop("check_attention_matches_reference")  # the thorough profile only
    # a backend that declares both features has no refusal to check
    assert "nothing to refuse" in skipped.pop("check_softcap_and_sinks")
    assert "large_kv_buffers is True: nothing to refuse" in skipped.pop("check_large_kv_buffers")
    assert not skipped
    # each with the model's cache and over float8_e4m3fn (the FP8 axis of the default run),
    # every_combination once
    per_check = {c: sum(t["check"] == c for t in skips) for c in {t["check"] for t in skips}}
    assert per_check == {
        "check_matches_transformers": len(model_skips),
        "check_pdl_on_off_identical": 2,
        "check_attention_matches_reference": 1,
        "check_softcap_and_sinks": 2,
        "check_large_kv_buffers": 2,
    }
    assert backend["summary"]["passed"] == len(tests) - len(skips)
    # the registered backends that were not requested are listed with their reason
    assert {n["name"] for n in data["not_run"]} >= {"cuda"}
    assert all(n["reason"] for n in data["not_run"])


def test_unknown_backend_exits_non_zero_naming_alternatives(capsys):
    code = main(["conformance", "--backend", "no-such-backend"])
    out = capsys.readouterr().err
    assert code == 2 and out.startswith("attnplug: error: conformance: ")
    assert "unknown backend 'no-such-backend'" in out and "available: reference" in out


def test_unavailable_backend_exits_non_zero_with_reason(capsys):
    from attnplug import available_backends

    unavailable = [b for b in available_backends() if not b.available]
    if not unavailable:  # every backend is available on this machine
        return
    code = main(["conformance", "--backend", unavailable[0].name])
    out = capsys.readouterr().err
    assert code == 2 and "is unavailable" in out and "reference" in out


def test_broken_backend_fails_with_the_rule_in_matrix_report_and_junit(tmp_path, capsys):
    report, junit = tmp_path / "r.json", tmp_path / "junit.xml"
    code = main(
        [
            "conformance",
            "--backend",
            "broken_backends:DirtyTail",
            "-k",
            "check_swa_buffer",
            "--report",
            str(report),
            "--junitxml",
            str(junit),
        ]
    )
    out = capsys.readouterr().out
    assert code == 1
    # DECODE and TARGET_VERIFY, each with the model's cache and over float8_e4m3fn (the FP8 axis;
    # float8_e5m2 runs in this check's cases with --thorough)
    assert "FAIL 4/4" in out and "tail of cuda_graph_swa_out_cache_loc is not zero" in out
    assert "conformance: FAILED" in out
    data = json.loads(report.read_text())
    assert data["exit_code"] == 1
    failed = [t for t in data["backends"][0]["tests"] if t["outcome"] == "failed"]
    assert len(failed) == 4 and all(t["message"].startswith("rule 1 (hoisted SWA writes)") for t in failed)
    assert junit.exists() and "rule 1 (hoisted SWA writes)" in junit.read_text()


def test_keyword_matching_no_check_exits_non_zero_naming_the_checks(capsys):
    assert main(["conformance", "--backend", "reference", "-k", "no_such_check_anywhere"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("attnplug: error: conformance: -k 'no_such_check_anywhere' matched no check")
    assert all(check in err for check in CHECKS)


def test_bad_device_is_one_clear_line(capsys):
    assert main(["conformance", "--backend", "reference", "--device", "no-such-device"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("attnplug: error: conformance: --device 'no-such-device':"), err


def test_attnplug_backend_selects_the_backend_to_test(monkeypatch, capsys):
    monkeypatch.setenv("ATTNPLUG_BACKEND", "reference")
    assert main(["conformance", "-k", "check_swa_buffer_contract"]) == 0
    out = capsys.readouterr().out
    assert "ATTNPLUG_BACKEND=reference selects the backend to test" in out
    monkeypatch.setenv("ATTNPLUG_BACKEND", "no_such_backend")
    assert main(["conformance", "-k", "check_swa_buffer_contract"]) == 2
    assert "unknown backend 'no_such_backend'" in capsys.readouterr().err


def test_quick_profile_says_so(capsys):
    assert main(["conformance", "--backend", "reference", "--quick", "-k", "check_swa_buffer_contract"]) == 0
    out = capsys.readouterr().out
    assert "conformance (quick profile): PASSED" in out
