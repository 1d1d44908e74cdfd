"""`attnplug bench`: runs the selected backend's own benchmarks, or says it ships none."""

from attnplug import cli, registry
from attnplug.backends.reference import ReferenceBackend


def test_bench_reference_ships_none(capsys):
    assert cli.main(["bench", "--backend", "reference"]) == 2
    assert "ships no benchmarks" in capsys.readouterr().err


def test_bench_unknown_backend_names_alternatives(capsys):
    assert cli.main(["bench", "--backend", "nope"]) == 2
    assert "reference" in capsys.readouterr().err


def test_bench_forwards_options(monkeypatch):
    calls = []

    class Benchmarked(ReferenceBackend):
        @classmethod
        def run_benchmarks(cls, *, only=None, quick=False, json_path=None):
            calls.append((only, quick, json_path))
            return {}

    monkeypatch.setattr(registry, "get_backend", lambda name=None: Benchmarked)
    assert cli.main(["bench", "--only", "kv_store", "--quick", "--json", "x.json"]) == 0
    assert calls == [(["kv_store"], True, "x.json")]
