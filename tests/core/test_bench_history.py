"""The benchmark history (attnplug.bench.history): one JSON line per measured row of a run,
appended to a .jsonl file by `attnplug bench --history PATH` or from written reports."""

import contextlib
import io
import json

import pytest

from attnplug import cli
from attnplug.bench.history import append_history, history_lines, main
from attnplug.bench.rows import row

ENV = {
    "date_utc": "2026-12-04T23:30:00-02:00",  # 2026-12-05 in UTC
    "command": "python3 attnplug bench --backend cuda --only hybrid_step",
    "python": "3.12.3",
    "torch": "2.11.0+cu130",
    "torch_cuda": "13.0",
    "git_commit": "287be8a20e86d3bfafaf813d0655e4e8ab303623",
    "device": "cuda:0",
    "device_name": "NVIDIA H200",
    "triton": "3.6.0",
    "gpu": "NVIDIA H200",
    "sm_count": 132,
    "driver": "580.159.04",
}


def _report(**env):
    rows = [
        row("hybrid_step", "decode bs=1 new", "time per step", 120.5, "us", variant="new", bs=1, series="decode"),
        row("hybrid_step", "decode bs=1 before", "time per step", None, "us", notes="skipped: time budget"),
        row("hybrid_step", "decode bs=8 new", "time per step", 3.0, "us", error="RuntimeError: boom"),
        row("hybrid_step", "(benchmark)", "all", None, "", error="killed at its limit"),
        row("hybrid_step", "decode bs=1", "speedup (before / new)", float("nan"), "x"),
        {"benchmark": "hybrid_step", "case": "agreement", "metric": "bit-identical", "value": True, "unit": ""},
        {"benchmark": "kv_store", "case": "triton pdl", "metric": "time per layer", "value": 1, "unit": "us"},
    ]
    return {"suite": "cuda", "backend": "cuda", "device": "cuda:0", "environment": {**ENV, **env}, "rows": rows}


def test_lines_of_a_report_keep_measured_rows_with_what_they_ran_on():
    ran_on = {
        "date": "2026-12-05",
        "device": "NVIDIA H200",
        "sm_count": 132,
        "versions": {"torch": "2.11.0+cu130", "triton": "3.6.0", "driver": "580.159.04", "torch_cuda": "13.0"},
        "commit": "287be8a20e86",
        "command": ENV["command"],
        "suite": "cuda",
    }
    lines = history_lines(_report())  # rows with an error, no value, NaN or a boolean are left out
    assert lines == [
        {
            **ran_on,
            "benchmark": "hybrid_step",
            "case": "decode bs=1 new",
            "metric": "time per step",
            "value": 120.5,
            "unit": "us",
            "variant": "new",
            "bs": 1,
            "series": "decode",
        },
        {
            **ran_on,
            "benchmark": "kv_store",
            "case": "triton pdl",
            "metric": "time per layer",
            "value": 1.0,
            "unit": "us",
        },
    ]
    assert isinstance(lines[1]["value"], float)


def test_lines_on_the_host_name_the_device_and_leave_unknowns_null():
    report = _report(gpu=None, sm_count=None, driver=None, torch_cuda=None, git_commit=None, device="cpu")
    report.update(device="cpu", suite="portable")
    report["environment"].update(device_name="x86_64", triton="unavailable (ModuleNotFoundError: triton)")
    line = history_lines(report)[0]
    assert line["device"] == "cpu" and line["suite"] == "portable"
    assert [line[k] for k in ("sm_count", "commit")] == [None] * 2
    assert set(line["versions"]) == {"torch"}  # what is not recorded (or no version) is left out
    report = _report(gpu=None)
    report.update(device="xpu:0")
    report["environment"]["device_name"] = "Intel(R) Data Center GPU Max 1550"
    assert history_lines(report)[0]["device"] == "Intel(R) Data Center GPU Max 1550"


def test_append_creates_the_file_and_keeps_earlier_lines(tmp_path):
    path = tmp_path / "sub" / "history.jsonl"
    assert append_history(str(path), _report()) == 2
    first = path.read_text()
    assert first.count("\n") == 2 and first.endswith("\n")
    assert append_history(str(path), _report(date_utc="2026-12-06T01:00:00+00:00")) == 2
    text = path.read_text()
    assert text.startswith(first)
    lines = text.splitlines()
    assert [json.loads(line)["date"] for line in lines] == ["2026-12-05"] * 2 + ["2026-12-06"] * 2
    # one compact line per row, keys in a stable (sorted) order
    assert all(": " not in line and list(json.loads(line)) == sorted(json.loads(line)) for line in lines)
    with open(path, "a") as f:  # a last line without its newline is ended before appending
        f.write(lines[0])
    append_history(str(path), _report())
    assert [json.loads(line) for line in path.read_text().splitlines()][-3:] == [
        json.loads(line) for line in lines[:1] + lines[:2]
    ]


def test_module_appends_written_reports_and_refuses_other_files(tmp_path, capsys):
    a, b, other = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "conformance.json"
    a.write_text(json.dumps(_report()))
    b.write_text(json.dumps(_report(date_utc="2026-12-06T01:00:00+00:00")))
    other.write_text(json.dumps({"report_version": 1, "tests": []}))
    out = tmp_path / "history.jsonl"
    assert main([str(a), str(other), "--out", str(out)]) == 2
    assert "not a report of attnplug bench" in capsys.readouterr().err and not out.exists()
    assert main([str(a), str(b), "--out", str(out)]) == 0
    assert [json.loads(line)["date"] for line in out.read_text().splitlines()] == ["2026-12-05"] * 2 + [
        "2026-12-06"
    ] * 2


@pytest.mark.slow
def test_bench_history_option_appends_the_runs_rows(tmp_path):
    path = tmp_path / "history.jsonl"
    path.write_text('{"earlier": 1}\n')
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = cli.main(
            ["bench", "--backend", "reference", "--quick", "--json", str(tmp_path / "b.json")]
            + [
                "--history",
                str(path),
            ]
        )
    assert rc == 0, buf.getvalue()
    assert buf.getvalue().rstrip().splitlines()[-1].startswith("targets met:")  # the summary line stays last
    result = json.loads((tmp_path / "b.json").read_text())
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0] == {"earlier": 1}
    measured = [r for r in result["rows"] if r["value"] is not None and not r["error"]]
    assert len(lines) == 1 + len(measured) and lines[1:] == history_lines(result)
    steps = [line for line in lines[1:] if line["metric"] == "time per step"]
    assert len(steps) == 8 and all(line["suite"] == "portable" and line["device"] == "cpu" for line in steps)
    assert {(line["series"], line["bs"], line["variant"]) for line in steps} == {
        (m, bs, v) for m in ("decode", "draft_extend") for bs in (1, 4) for v in ("graph", "eager")
    }
    assert lines[1]["date"] == result["environment"]["date_utc"][:10]


def test_a_peers_configuration_is_kept_with_its_figure():
    config = {"page_size": 16, "layout": "HND", "tensor_cores": True, "use_cuda_graph": False}
    rows = [
        row("hybrid_step", "decode bs=1 flashinfer", "time per step", 470.0, "us", variant="flashinfer", bs=1,
            config=config, configs=[{**config, "us": 470.0}]),
        row("hybrid_step", "decode bs=1 new", "time per step", 190.0, "us", variant="new", bs=1),
    ]  # fmt: skip
    lines = history_lines({"suite": "cuda", "environment": ENV, "rows": rows})
    assert lines[0]["config"] == config and "configs" not in lines[0]  # the chosen one, not the search
    assert "config" not in lines[1]
