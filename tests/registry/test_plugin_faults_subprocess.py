"""The plugin-fault matrix (tests/fault_matrix.py) in subprocesses: the scenarios that could hang
or end the process on a regression (re-entrant registry calls, hung probes, hung ``describe()``)
run in one subprocess with a time limit, so a regression fails instead of hanging the test run;
a last test installs every fault at once and runs the ``attnplug info`` command itself."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from child import HANG_LIMIT_S
from fault_matrix import (
    FAULTS,
    HERE,
    LIMIT,
    REFERENCE_TARGET,
    assert_outcome,
    env_for,
    inherited_path,
    install,
    project_site,
)
from plugin_dists import run_cli, subprocess_env

pytestmark = [pytest.mark.usefixtures("clean_registry"), pytest.mark.slow]  # slow: faulty plugins in child processes


# ---------------------------------------------------------------------------- hang / exit scenarios
_DRIVER = textwrap.dedent("""
    import contextlib, faulthandler, importlib, io, json, os, sys
    scenarios = json.loads(sys.argv[1])
    from attnplug import cli, registry as R
    from attnplug.backends.reference import ReferenceBackend
    base_path, base_env = list(sys.path), dict(os.environ)
    for item in scenarios:
        print("START " + item["name"], flush=True)
        faulthandler.dump_traceback_later(30, exit=True)  # a hung scenario: its stack on stderr, then exit
        sys.path[:] = item["paths"] + base_path
        os.environ.clear(); os.environ.update(base_env); os.environ.update(item["env"])
        importlib.invalidate_caches()
        R.reset_registry()
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = cli.main(["info", "--json"])
        genuine = R.get_backend("reference") is ReferenceBackend
        print("RESULT " + json.dumps({"name": item["name"], "code": code, "genuine": genuine,
                                      "data": json.loads(out.getvalue())}), flush=True)
        faulthandler.cancel_dump_traceback_later()
    print("DONE", flush=True)
""")


@pytest.fixture(scope="module")
def hang_results(tmp_path_factory):
    scenarios = []
    for name, fault in sorted(FAULTS.items()):
        if fault.hangs:
            root = tmp_path_factory.mktemp(name.replace("_", "-"))
            scenarios.append({"name": name, "paths": install(fault, root), "env": env_for(fault)})
    env = subprocess_env(*inherited_path(), HERE)
    try:
        out = subprocess.run(
            [sys.executable, "-c", _DRIVER, json.dumps(scenarios)],
            env=env,
            capture_output=True,
            text=True,
            timeout=HANG_LIMIT_S,
        )
        stdout, stderr, code = out.stdout, out.stderr, out.returncode
    except subprocess.TimeoutExpired as exc:
        stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        stderr, code = "timed out after 120 s", None
    results = {}
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            item = json.loads(line[len("RESULT ") :])
            results[item["name"]] = item
    started = [line[len("START ") :] for line in stdout.splitlines() if line.startswith("START ")]
    return results, f"exit code {code}; last scenario started: {started[-1:] or None}; stderr: {stderr[-2000:]}"


@pytest.mark.parametrize("name", sorted(n for n, f in FAULTS.items() if f.hangs))
def test_fault_in_a_subprocess(name, hang_results):
    results, diagnosis = hang_results
    assert name in results, diagnosis
    result = results[name]
    assert result["code"] == 0 and result["genuine"] is True, result
    assert_outcome(name, FAULTS[name], result["data"])
    if FAULTS[name].check is not None:
        FAULTS[name].check(result["data"])


def test_every_fault_at_once_through_the_command(tmp_path):
    """``attnplug info`` as a user runs it, with every scenario's distribution installed together
    (scenarios that need their own environment are left out)."""
    site = tmp_path / "site"
    tree = project_site(site)
    used = 0
    for i, (_name, fault) in enumerate(sorted(FAULTS.items())):
        if fault.env or fault.first or fault.reference_disabled:
            continue
        for dist, plugins, version in fault.dists:  # backend names of their own, so no scenario hides another
            plugins = {ep: text.replace("name='p',", f"name='p{i}',") for ep, text in plugins.items()}
            tree.add(f"{dist}-{i}", plugins, version=version)
        used += 1
    assert used >= 25
    env = subprocess_env(site, *inherited_path(), HERE)
    env["ATTNPLUG_PROBE_TIMEOUT"] = LIMIT
    out = run_cli(env, "info", "--json", cwd=tmp_path, timeout=HANG_LIMIT_S)
    assert out.returncode == 0, out.stderr[-3000:]
    data = json.loads(out.stdout)
    rows = {row["name"]: row for row in data["backends"]}
    assert rows["reference"]["available"] and rows["reference"]["backend"] == REFERENCE_TARGET
    assert rows["reference"]["distribution"] == "attnplug"
    assert data["default_backend"] == "reference", data["default_error"]
    reasons = [e["reason"] for e in data["errors"]] + [row["reason"] for row in data["backends"]]
    for name, fault in FAULTS.items():
        if not (fault.env or fault.first or fault.reference_disabled):
            assert any(fault.expect in reason for reason in reasons), (name, fault.expect)
