"""The graph-capture soak script (benchmarks/graph_capture_soak.py) on the CPU: a few runners
of random configurations over the reference backend, one deliberate capture failure."""

import json

import pytest

from attnplug.graphs import EagerGraph
from scripts import load_script


@pytest.fixture(scope="module")
def soak():
    return load_script("graph_capture_soak")


def test_cpu_smoke_passes_and_records_the_deliberate_failure(soak, tmp_path, capsys):
    path = tmp_path / "soak.json"
    rc = soak.main(["--cpu", "--runners", "4", "--steps", "2", "--fail-at", "1", "--quiet", "--json", str(path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert out.rstrip().splitlines()[-2].split()[-1] == "PASS"  # the table comes last, then the JSON path
    summary = json.loads(path.read_text())["summary"]
    assert summary["runners"] == 4 and summary["captures_failed"] == 1 and summary["unexpected_failures"] == []
    assert [d["runner"] for d in summary["deliberate"]] == [1]
    assert "deliberate failure inside capture" in next(iter(summary["deliberate"][0]["recorded"].values()))
    assert summary["steps"] == 8 and summary["bad_steps"] == 0 and all(summary["checks"].values())


def test_a_wrong_replay_fails_the_soak(soak, tmp_path, monkeypatch, capsys):
    original = EagerGraph.replay

    def corrupted(self):
        original(self)
        self._out.add_(1.0)

    monkeypatch.setattr(EagerGraph, "replay", corrupted)
    rc = soak.main(
        ["--cpu", "--runners", "1", "--steps", "1", "--fail-at", "5", "--quiet", "--json", str(tmp_path / "soak.json")]
    )
    assert rc == 1
    rows = {
        line.rsplit(None, 1)[0].strip(): line.split()[-1]
        for line in capsys.readouterr().out.splitlines()
        if line.strip()
    }
    assert rows["every step within tolerance"] == "FAILED" and rows["RESULT"] == "FAIL"
