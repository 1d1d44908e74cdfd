"""The ``attnplug`` command's errors all start with ``attnplug: error:`` (argument errors
included), and ``attnplug info`` reads at 100 columns."""

from __future__ import annotations

import types

import pytest

from attnplug import cli, env
from attnplug import registry as R
from attnplug.registry import load_registry
from plugin_dists import plugin_source, reg


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    for name in env.FLAGS:
        monkeypatch.delenv(name, raising=False)
    yield
    R.reset_registry()


def _use_registry(*registrations):
    module = types.ModuleType(f"cli_errors_plugin_{id(registrations)}")
    exec(plugin_source(registrations), module.__dict__)
    R.reset_registry(load_registry(entry_points=[], extra_plugins=[("p", module)]))


def _error_of(argv, capsys) -> str:
    try:
        code = cli.main(argv)
    except SystemExit as exc:  # argparse
        code = exc.code
    assert code == 2, argv
    err = capsys.readouterr().err.strip().splitlines()
    return err[-1]


@pytest.mark.parametrize(
    "argv, env_vars, text",
    [
        (["nosuch"], {}, "argument COMMAND: invalid choice: 'nosuch'"),
        (["info", "--bogus"], {}, "unrecognized arguments: --bogus"),
        (["bench", "--budget-s", "soon"], {}, "bench: argument --budget-s: invalid _budget value: 'soon'"),
        (["soak", "--steps", "many"], {}, "soak: argument --steps"),
        (["info"], {"ATTNPLUG_PROBE_TIMEOUT": "fast"}, "ATTNPLUG_PROBE_TIMEOUT='fast': expected a positive number"),
        (["info", "--json"], {"ATTNPLUG_PLUGINS": ","}, "ATTNPLUG_PLUGINS=',': expected comma-separated plugin names"),
        (["bench", "--backend", "nosuch"], {}, "nosuch"),
        (["soak", "--backend", "nosuch", "--steps", "1"], {}, "nosuch"),
    ],
)
def test_every_error_starts_with_the_one_prefix(argv, env_vars, text, capsys, monkeypatch):
    _use_registry(reg("solo"))
    for name, value in env_vars.items():
        monkeypatch.setenv(name, value)
    if "ATTNPLUG_PLUGINS" in env_vars:
        R.reset_registry()  # the allow-list is read when the registry is built
    line = _error_of(argv, capsys)
    assert line.startswith(cli.ERROR_PREFIX) and text in line, line


def test_a_malformed_variable_read_anywhere_is_one_error_line(capsys, monkeypatch):
    monkeypatch.setenv("ATTNPLUG_VALIDATE", "ture")

    def run(args):
        return int(env.validation_enabled())

    monkeypatch.setattr(cli, "_run_info", run)
    line = _error_of(["info"], capsys)
    assert line == "attnplug: error: ATTNPLUG_VALIDATE='ture': expected a switch: 1, true, yes, on or 0, false, no, off"


def test_info_reads_at_100_columns(capsys, monkeypatch):
    long_reason = "the vendor runtime is not installed (pip install 'attnplug[thing]'; needs the vendor toolkit 9.1)"
    _use_registry(
        reg("reference-like", priority=0), reg("offline-device", priority=100, available=False, reason=long_reason)
    )
    monkeypatch.setenv("COLUMNS", "100")
    assert cli.main(["info"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line.rstrip()) for line in lines) <= 100
    header = next(line for line in lines if "backend" in line and "graphs" in line)
    for column in ("available", "priority", "device", "needs_cpu_seq_lens", "PDL"):
        assert column in header  # one header line: no column folded
    rows = [line for line in lines if line.startswith((" reference-like", " offline-device"))]
    assert len(rows) == 2  # one table line per backend
    reason_lines = [line for line in lines if line.startswith("offline-device")]
    assert reason_lines and reason_lines[0].startswith("offline-device: the vendor runtime is not installed")
