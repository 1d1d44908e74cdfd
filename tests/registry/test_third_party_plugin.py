"""A plugin shipped as its own distribution (examples/third_party_plugin), installed with pip into
an isolated directory, is found through its entry point; a broken one (examples/broken_plugin) is
reported with its error while every other backend keeps working."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap

import pytest

from child import HANG_LIMIT_S
from plugin_dists import ROOT, install_plugins

pytestmark = pytest.mark.slow  # installs plugin distributions and runs the command


EXAMPLES = ROOT / "examples"


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("third_party")
    sources = []
    for name in ("third_party_plugin", "broken_plugin"):
        # build from a copy: an in-tree build would leave build/ and *.egg-info in examples/
        dst = tmp / "src" / name
        shutil.copytree(EXAMPLES / name, dst, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
        sources.append(str(dst))
    env = install_plugins(sources, tmp)
    assert (tmp / "site" / "attnplug_example" / "plugin.py").exists()
    return env, tmp


def _run(env, *args, code=None, extra_env=None):
    cmd = [sys.executable] + (["-c", code] if code else ["-m", "attnplug.cli", *args])
    out = subprocess.run(cmd, env={**env, **(extra_env or {})}, capture_output=True, text=True, timeout=HANG_LIMIT_S)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_info_lists_the_installed_plugin_and_the_broken_one(installed):
    env, tmp = installed
    data = json.loads(_run(env, "info", "--json"))
    rows = {row["name"]: row for row in data["backends"]}
    example = rows["example"]
    assert example["available"] is True, example
    assert (example["distribution"], example["version"]) == ("attnplug-example", "0.1.0")
    assert example["plugin"] == "example" and example["entry_point"] == "attnplug_example.plugin"
    assert example["backend"] == "attnplug_example.backend:ExampleBackend" and example["priority"] == -1
    caps = example["capabilities"]
    assert (caps["pdl"], caps["graphs"], caps["needs_cpu_seq_lens"]) == (False, "ALWAYS", False)
    assert (example["pdl"], example["graphs"]) == (False, "ALWAYS")
    assert caps["graph_class"].startswith("eager stand-in")  # what its device part adds
    assert rows["reference"]["available"] is True and rows["reference"]["distribution"] == "attnplug"
    broken = [e for e in data["errors"] if e["plugin"] == "broken"]
    assert len(broken) == 1, data["errors"]
    assert broken[0]["kind"] == "import" and broken[0]["distribution"] == "attnplug-broken-example"
    assert "ImportError: attnplug_broken needs libbroken.so" in broken[0]["reason"]
    table = _run(env, "info")
    assert "example" in table and "attnplug-example 0.1.0" in table and "libbroken.so" in table


def test_installed_backend_is_selectable_and_broken_one_errors(installed):
    env, _ = installed
    code = textwrap.dedent("""
        import json, torch, attnplug
        from attnplug import ReqToTokenPool, SWAKVPool
        from attnplug.backends.portable import PortableBackend
        from attnplug.backends.reference import ReferenceBackend
        Example = attnplug.get_backend("example")
        out = {"subclass": issubclass(Example, PortableBackend) and not issubclass(Example, ReferenceBackend),
               "module": Example.__module__,
               "name": Example.name, "reference": attnplug.get_backend("reference") is ReferenceBackend,
               "default": attnplug.get_backend().name}
        try:
            attnplug.get_backend("broken")
        except attnplug.BackendUnavailable as exc:
            out["broken"] = str(exc)
        pool = SWAKVPool(64, 32, 2, [0], 2, 64, torch.float16, torch.device("cpu"))
        rows = ReqToTokenPool(4, 32, torch.device("cpu"))
        caps = Example(pool, rows, num_heads=4, sliding_window=8).capabilities()
        out["device_type"] = caps.device_type
        out["agrees"] = all(Example.describe()[k] == v for k, v in caps.to_json().items() if k != "device_type")
        print(json.dumps(out))
    """)
    out = json.loads(_run(env, code=code).strip().splitlines()[-1])
    assert out["subclass"] and out["module"] == "attnplug_example.backend" and out["name"] == "example"
    assert out["reference"] is True
    assert out["default"] != "example"  # priority -1: installing the example never changes the default
    assert "libbroken.so" in out["broken"] and "Available backends:" in out["broken"] and "example" in out["broken"]
    assert out["device_type"] == "cpu" and out["agrees"] is True  # describe() never disagrees
    out = json.loads(_run(env, code=code, extra_env={"ATTNPLUG_BACKEND": "example"}).strip().splitlines()[-1])
    assert out["default"] == "example"


def test_allow_list_skips_the_broken_plugin(installed):
    env, _ = installed
    data = json.loads(_run(env, "info", "--json", extra_env={"ATTNPLUG_PLUGINS": "reference,example"}))
    assert {row["name"] for row in data["backends"]} == {"reference", "example"}
    assert data["errors"] == []  # a plugin left out by ATTNPLUG_PLUGINS is not an error
    disabled = {e["plugin"] for e in data["disabled"]}
    assert {"broken", "cuda"} <= disabled and all(e["kind"] == "disabled" for e in data["disabled"])
    assert data["plugin_allow_list"] == ["reference", "example"]


def test_conformance_runs_against_the_installed_plugin(installed):
    """`attnplug conformance --backend example` and the plugin's own one-line test file."""
    env, tmp = installed
    out = _run(env, "conformance", "--backend", "example", "-k", "check_swa_buffer_contract or capabilities")
    assert "example" in out and "conformance: PASSED" in out
    plugin_dir = tmp / "src" / "third_party_plugin"
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-k", "check_swa_buffer_contract"],
        cwd=plugin_dir,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_LIMIT_S,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "check_swa_buffer_contract[example" in res.stdout and " passed" in res.stdout
