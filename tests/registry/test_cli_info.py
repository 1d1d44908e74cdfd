"""``attnplug info [--json]`` and ``attnplug --version``."""

from __future__ import annotations

import json

import pytest
import torch

import attnplug
from attnplug import cli
from attnplug import registry as R
from attnplug.registry import load_registry
from child import HANG_LIMIT_S
from plugin_dists import (
    ROOT,
    DistTree,
    plugin_module,
    plugin_source,
    reg,
    run_cli,
    subprocess_env,
    write_project_metadata,
)

pytestmark = pytest.mark.usefixtures("clean_registry")


@pytest.fixture
def fake_registry():
    good = plugin_module(
        reg("described", target="plugin_dists:DescribedStandIn", priority=10),
        reg("plain", target="plugin_dists:OtherStandIn", priority=5),
        reg("broken-describe", target="plugin_dists:BrokenDescribeStandIn", priority=1),
        reg("offline", priority=50, available=False, reason="no widget attached"),
    )
    outdated = plugin_module(reg("old"))
    outdated.PLUGIN_API_VERSION = "0.3"
    registry = load_registry(entry_points=[], extra_plugins=[("good", good), ("outdated", outdated)])
    R.reset_registry(registry)
    return registry


def test_info_json(fake_registry, capsys):
    assert cli.main(["info", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["attnplug_version"] == attnplug.__version__
    assert data["plugin_api_version"] == R.PLUGIN_API_VERSION
    assert data["entry_point_group"] == "attnplug.backends"
    assert data["default_backend"] == "described" and data["default_error"] is None
    rows = {row["name"]: row for row in data["backends"]}
    assert [row["name"] for row in data["backends"]] == ["offline", "described", "plain", "broken-describe"]
    described = rows["described"]
    assert described["available"] is True and described["needs_cpu_seq_lens"] is False
    assert described["pdl"] is True and described["graphs"] == "UNIFORM"
    assert described["capabilities"] == {"pdl": True, "graphs": "UNIFORM", "dtypes": ["float16"]}
    assert described["backend"] == "plugin_dists:DescribedStandIn" and described["plugin"] == "good"
    assert rows["plain"]["pdl"] is None and rows["plain"]["graphs"] is None  # no describe(): unknown
    assert rows["plain"]["needs_cpu_seq_lens"] is True
    assert rows["broken-describe"]["available"] is True
    assert "describe() raised RuntimeError: describe exploded" in rows["broken-describe"]["reason"]
    offline = rows["offline"]
    assert offline["available"] is False and offline["reason"] == "no widget attached"
    assert offline["needs_cpu_seq_lens"] is None and offline["pdl"] is None
    (error,) = data["errors"]
    assert error["plugin"] == "outdated" and error["kind"] == "api-version" and "0.3" in error["reason"]
    assert set(error) >= {"plugin", "distribution", "version", "entry_point", "kind", "reason", "backend"}


def test_info_json_reports_selection_problems(capsys, monkeypatch):
    R.reset_registry(
        load_registry(entry_points=[], extra_plugins=[("p", plugin_module(reg("a", priority=3), reg("b", priority=3)))])
    )
    cli.main(["info", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert data["default_backend"] is None and "a, b" in data["default_error"]
    monkeypatch.setenv("ATTNPLUG_BACKEND", "b")
    cli.main(["info", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert data["default_backend"] == "b" and data["environment"]["ATTNPLUG_BACKEND"] == "b"


def test_info_table(fake_registry, capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    for text in (
        "described *",
        "plain",
        "offline",
        "no widget attached",
        "UNIFORM",
        "plugin load errors",
        "outdated",
        "api-version",
        "default: get_backend() returns 'described'",
        "needs_cpu_seq_lens",
    ):
        assert text in out, text
    plain_line = next(line for line in out.splitlines() if line.startswith(" plain "))
    assert "?" in plain_line  # PDL / graphs unknown without describe()
    assert "\noffline: no widget attached\n" in out  # one line per backend: its reason


def test_info_table_without_errors(capsys):
    R.reset_registry(load_registry(entry_points=[], extra_plugins=[("p", plugin_module(reg("solo")))]))
    cli.main(["info"])
    out = capsys.readouterr().out
    assert "solo *" in out and "no plugin load errors" in out


def test_version_and_help(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"attnplug {attnplug.__version__} (plugin API {R.PLUGIN_API_VERSION})"
    assert cli.main([]) == 2
    assert "info" in capsys.readouterr().out


def test_subcommands_are_registered_by_small_functions():
    assert cli._add_info in cli.SUBCOMMANDS
    parser = cli.build_parser()
    args = parser.parse_args(["info", "--json"])
    assert args.json is True and args.func is cli._run_info


def test_console_script_is_declared():
    text = (ROOT / "pyproject.toml").read_text()
    assert 'attnplug = "attnplug.cli:main"' in text


def test_info_json_subprocess_with_the_project_entry_points(tmp_path):
    """The command as a user runs it: the project's entry points (written from pyproject.toml) plus
    a plugin distribution whose import fails; every backend is listed, the failure reported."""
    site = tmp_path / "site"
    write_project_metadata(site)
    DistTree(site).add(
        "attnplug-flaky", {"flaky": plugin_source(body="raise ImportError('libflaky.so missing')")}, version="0.0.1"
    )
    out = run_cli(subprocess_env(site), "info", "--json", cwd=tmp_path, timeout=HANG_LIMIT_S)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    rows = {row["name"]: row for row in data["backends"]}
    assert {"reference", "cuda", "ascend", "xpu"} <= set(rows)
    ref = rows["reference"]
    assert ref["available"] is True and ref["distribution"] == "attnplug" and ref["priority"] == 0
    assert ref["entry_point"] == "attnplug.backends.reference_plugin" and ref["device"] == "any"
    assert ref["needs_cpu_seq_lens"] is False
    for name in ("cuda", "ascend", "xpu"):
        assert rows[name]["priority"] == 100 and rows[name]["reason"]
    if torch.version.cuda is None:
        assert rows["cuda"]["available"] is False
    assert data["default_backend"] in {name for name, row in rows.items() if row["available"]}
    flaky = [e for e in data["errors"] if e["plugin"] == "flaky"]
    assert len(flaky) == 1 and flaky[0]["kind"] == "import" and "libflaky.so missing" in flaky[0]["reason"]
    assert flaky[0]["distribution"] == "attnplug-flaky" and flaky[0]["version"] == "0.0.1"


def test_info_shows_what_describe_adds_beyond_the_columns(capsys):
    """e.g. why the cuda backend stores KV with Triton rather than the C++ kernel."""
    from attnplug import cli

    row = {
        "name": "dev",
        "distribution": "d",
        "version": "1",
        "priority": 1,
        "available": True,
        "device": "x",
        "needs_cpu_seq_lens": False,
        "pdl": True,
        "graphs": "UNIFORM",
        "reason": "ok",
        "capabilities": {"pdl": True, "graphs": "UNIFORM", "kv_store_reason": "C++ store unavailable: no nvcc"},
    }
    cli._print_info(
        {
            "attnplug_version": "0",
            "plugin_api_version": "1.0",
            "default_backend": "dev",
            "default_error": None,
            "environment": {},
            "errors": [],
            "backends": [row],
        }
    )
    out = capsys.readouterr().out
    assert "dev (d 1): ok\n  kv_store_reason: C++ store unavailable: no nvcc\n" in out


def test_info_with_a_malformed_probe_time_limit_names_the_variable(fake_registry, capsys, monkeypatch):
    monkeypatch.setenv("ATTNPLUG_PROBE_TIMEOUT", "fast")
    assert cli.main(["info", "--json"]) == 2
    err = capsys.readouterr().err
    assert "ATTNPLUG_PROBE_TIMEOUT='fast': expected a positive number of seconds" in err
    monkeypatch.setenv("ATTNPLUG_PROBE_TIMEOUT", "7")
    assert cli.main(["info", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["environment"]["ATTNPLUG_PROBE_TIMEOUT"] == "7"


def test_info_survives_a_selection_that_raises_something_unexpected(fake_registry, capsys, monkeypatch):
    def broken_select(name=None):
        raise ValueError("not a registry error")

    monkeypatch.setattr(fake_registry, "select", broken_select)
    assert cli.main(["info", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["default_backend"] is None and data["default_error"] == "ValueError: not a registry error"
