"""The plugin-fault matrix: one misbehaving plugin distribution per scenario, installed next to the
project's own entry points. After each scenario

* ``attnplug info --json`` works (exit code 0, JSON on stdout),
* ``get_backend("reference")`` returns the genuine ``ReferenceBackend``,
* the fault is listed (a plugin load error, or the reason of an unavailable backend) with its
  reason.

Scenarios that could hang or end the process on a regression (re-entrant registry calls, hung
probes, hung ``describe()``) run in one subprocess with a time limit, so a regression fails instead
of hanging the test run. The others run in this process through ``attnplug.cli.main``. A last test
installs every fault at once and runs the ``attnplug info`` command itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import pytest

from attnplug import cli
from attnplug import registry as R
from attnplug.backends.reference import ReferenceBackend
from plugin_dists import PROJECT_PATHS, DistTree, OtherStandIn, plugin_source, write_dist_info, write_project_metadata

HERE = Path(__file__).resolve().parents[1]  # tests/: the helper modules
REFERENCE_TARGET = "attnplug.backends.reference:ReferenceBackend"
#: time limit the scenarios give probes and describe() (ATTNPLUG_PROBE_TIMEOUT)
LIMIT = "1"


def register(
    name: str, probe: str = "lambda: (True, 'fine')", backend: str = "'plugin_dists:StandInBackend'", priority: int = -5
) -> str:
    """A ``register(...)`` argument string; ``probe`` and ``backend`` are Python expressions."""
    return f"name={name!r}, backend={backend}, probe={probe}, priority={priority}"


def src(*registrations: str, body: str = "", then: Tuple[str, ...] = ()) -> str:
    return plugin_source(registrations, body=body, then=then)


@dataclass
class Fault:
    """One scenario. ``dists``: (distribution, {entry-point name: module source or "=target"},
    version) installed in the scenario's site folder; ``first``: the same, installed in a folder
    placed before it on ``sys.path`` (stale copies); ``expect``: text that must appear in a load
    error or in a backend's reason; ``hangs``: could hang or end the process on a regression."""

    dists: List[Tuple[str, Dict[str, str], str]]
    expect: str
    env: Dict[str, str] = field(default_factory=dict)
    first: List[Tuple[str, Dict[str, str], str]] = field(default_factory=list)
    hangs: bool = False
    #: the scenario disables the reference plugin itself (ATTNPLUG_PLUGINS without it)
    reference_disabled: bool = False
    check: Optional[Callable[[dict], None]] = None


def _errors(data, kind=None):
    return [e for e in data["errors"] if kind is None or e["kind"] == kind]


def _intruder_refused(dist: str, kind: str = "reserved"):
    def check(data):
        (error,) = [e for e in data["errors"] if e["distribution"] == dist]
        assert error["kind"] == kind, error
        assert dist in error["reason"] and "attnplug" in error["reason"], error["reason"]
        rows = {row["name"]: row for row in data["backends"]}
        for name in ("reference", "cuda"):
            if name in rows:
                assert rows[name]["distribution"] == "attnplug", rows[name]

    return check


def _both_named(data):
    errors = [e for e in data["errors"] if e.get("backend") == "shared"]
    assert {e["distribution"] for e in errors} == {"dist-a", "dist-b"}, data["errors"]
    for error in errors:
        assert "dist-a" in error["reason"] and "dist-b" in error["reason"], error["reason"]
    assert "shared" not in {row["name"] for row in data["backends"]}
    with pytest.raises(R.BackendUnavailable) as exc:
        R.get_backend("shared")
    assert "dist-a" in str(exc.value) and "dist-b" in str(exc.value)


def _default_is_reference(data):
    assert data["default_backend"] == "reference"
    assert R.get_backend() is ReferenceBackend


def _cuda_is_genuine(data):
    try:
        cls = R.get_backend("cuda")
    except R.BackendUnavailable as exc:
        assert "belongs to attnplug" not in exc.reason  # the genuine probe's reason, not the intruder's
    else:
        assert cls is not OtherStandIn and cls.__module__.startswith("attnplug_")


def _row(name, text):
    def check(data):
        rows = {row["name"]: row for row in data["backends"]}
        assert rows[name]["available"] is False and text in rows[name]["reason"], rows[name]

    return check


_EXIT_CLASS = """
from plugin_dists import StandInBackend
class Exits(StandInBackend):
    @classmethod
    def describe(cls):
        raise SystemExit('describe exits')
class Hangs(StandInBackend):
    @classmethod
    def describe(cls):
        import time
        time.sleep(3600)
class Unprintable:
    def __str__(self):
        raise SystemExit('str exits')
    __repr__ = __str__
class Odd(StandInBackend):
    @classmethod
    def describe(cls):
        return {'weird': Unprintable()}
class Meta(type(StandInBackend)):
    @property
    def needs_cpu_seq_lens(cls):
        raise SystemExit('attribute exits')
class BadAttr(StandInBackend, metaclass=Meta):
    pass
class Slow:
    pass
"""
_TUPLE_EXITS = """
class Weird(tuple):
    def __len__(self):
        raise SystemExit('len exits')
"""
_NAME = "__name__ + ':{}'"  # a class of the plugin module itself

FAULTS: Dict[str, Fault] = {
    # -------------------------------------------------------------- builtin names are owned
    "intruder-registers-reference-sorting-first": Fault(
        [
            (
                "aaa-intruder",
                {"evil": src(register("reference", backend="'plugin_dists:OtherStandIn'", priority=0))},
                "6.6",
            )
        ],
        "belongs to attnplug",
        check=_intruder_refused("aaa-intruder"),
    ),
    "intruder-registers-reference-sorting-last": Fault(
        [
            (
                "zzz-intruder",
                {"evil": src(register("reference", backend="'plugin_dists:OtherStandIn'", priority=0))},
                "1.0",
            )
        ],
        "belongs to attnplug",
        check=_intruder_refused("zzz-intruder"),
    ),
    "intruder-with-ATTNPLUG_BACKEND=reference": Fault(
        [
            (
                "aaa-intruder",
                {"evil": src(register("reference", backend="'plugin_dists:OtherStandIn'", priority=0))},
                "1.0",
            )
        ],
        "belongs to attnplug",
        env={"ATTNPLUG_BACKEND": "reference"},
        check=_default_is_reference,
    ),
    "intruder-entry-point-named-reference": Fault(
        [
            (
                "aaa-intruder",
                {"reference": src(register("reference", backend="'plugin_dists:OtherStandIn'", priority=0))},
                "1.0",
            )
        ],
        "reserved",
        check=_intruder_refused("aaa-intruder"),
    ),
    "intruder-entry-point-with-ATTNPLUG_PLUGINS=reference": Fault(
        [
            (
                "aaa-intruder",
                {"reference": src(register("reference", backend="'plugin_dists:OtherStandIn'", priority=0))},
                "1.0",
            )
        ],
        "reserved",
        env={"ATTNPLUG_PLUGINS": "reference"},
        check=_intruder_refused("aaa-intruder"),
    ),
    "intruder-registers-cuda": Fault(
        [
            (
                "aaa-intruder",
                {"evil": src(register("cuda", backend="'plugin_dists:OtherStandIn'", priority=1000))},
                "1.0",
            )
        ],
        "belongs to attnplug",
        check=lambda data: (_intruder_refused("aaa-intruder")(data), _cuda_is_genuine(data)),
    ),
    "intruder-with-the-builtin-plugin-disabled": Fault(
        [
            (
                "aaa-intruder",
                {"evil": src(register("reference", backend="'plugin_dists:OtherStandIn'", priority=0))},
                "1.0",
            )
        ],
        "belongs to attnplug",
        env={"ATTNPLUG_PLUGINS": "evil"},
        reference_disabled=True,
        check=_intruder_refused("aaa-intruder"),
    ),
    "duplicate-third-party-name": Fault(
        [
            ("dist-a", {"a": src(register("shared"))}, "1.0"),
            ("dist-b", {"b": src(register("shared", backend="'plugin_dists:OtherStandIn'"))}, "2.0"),
        ],
        "registered by several plugins",
        check=_both_named,
    ),
    "stale-attnplug-dist-info-without-entry-points": Fault(
        [],
        "copies of distribution 'attnplug'",
        first=[("attnplug", {}, "0.0.1")],
        check=lambda data: _errors(data, "distribution"),
    ),
    "stale-attnplug-dist-info-with-old-entry-points": Fault(
        [],
        "copies of distribution 'attnplug'",
        first=[
            ("attnplug", {"reference": "=attnplug.old_reference_plugin", "legacy": "=attnplug_legacy.plugin"}, "0.0.9")
        ],
        check=lambda data: (
            {row["name"]: row for row in data["backends"]}["reference"]["entry_point"]
            == "attnplug.backends.reference_plugin"
        ),
    ),
    "third-party-distribution-twice": Fault(
        [("dup-dist", {"dup": src(register("dup"))}, "2.0")],
        "copies of distribution 'dup-dist'",
        first=[("dup-dist", {"dup": src(register("dup"))}, "1.0")],
    ),
    # -------------------------------------------------------------- importing the plugin
    "import-raises": Fault(
        [("d", {"p": src(body="raise ImportError('libvendor.so missing')")}, "1.0")], "libvendor.so"
    ),
    "import-system-exit": Fault(
        [("d", {"p": src(body="raise SystemExit('bye from import')")}, "1.0")], "SystemExit: bye from import"
    ),
    "import-base-exception": Fault(
        [("d", {"p": src(body="class PluginAbort(BaseException):\n    pass\nraise PluginAbort('abort')")}, "1.0")],
        "PluginAbort: abort",
    ),
    "import-calls-get_backend": Fault(
        [("d", {"p": src(register("p"), body="import attnplug\nattnplug.get_backend('reference')")}, "1.0")],
        "cannot be called from plugin code",
        hangs=True,
    ),
    "import-calls-available_backends": Fault(
        [("d", {"p": src(register("p"), body="import attnplug\nattnplug.available_backends()")}, "1.0")],
        "cannot be called from plugin code",
        hangs=True,
    ),
    "import-calls-load_errors": Fault(
        [("d", {"p": src(register("p"), body="import attnplug\nattnplug.load_errors()")}, "1.0")],
        "cannot be called from plugin code",
        hangs=True,
    ),
    "malformed-entry-point-value": Fault([("d", {"p": "=not a module!"}, "1.0")], "p = 'not a module!' is malformed"),
    "empty-entry-point-value": Fault([("d", {"p": "="}, "1.0")], "p = '' is malformed"),
    "entry-point-attribute-missing": Fault(
        [("d", {"p": "=plugin_dists:no_such_plugin_object"}, "1.0")], "no_such_plugin_object"
    ),
    "module-getattr-exits": Fault(
        [
            (
                "d",
                {
                    "p": plugin_source(
                        [register("p")],
                        api=None,  # PLUGIN_API_VERSION is read through __getattr__
                        body="def __getattr__(name):\n    raise SystemExit('getattr ' + name)",
                    )
                },
                "1.0",
            )
        ],
        "SystemExit: getattr",
    ),
    # -------------------------------------------------------------- the hook
    "hook-raises": Fault(
        [("d", {"p": src(register("p"), then=("raise RuntimeError('hook broke')",))}, "1.0")], "hook broke"
    ),
    "hook-system-exit": Fault(
        [("d", {"p": src(register("p"), then=("raise SystemExit('hook exits')",))}, "1.0")], "SystemExit: hook exits"
    ),
    "hook-base-exception": Fault(
        [
            (
                "d",
                {"p": src(register("p"), body="class Abort(BaseException):\n    pass", then=("raise Abort('x')",))},
                "1.0",
            )
        ],
        "Abort: x",
    ),
    "hook-calls-get_backend": Fault(
        [("d", {"p": src(register("p"), then=("__import__('attnplug').get_backend('reference')",))}, "1.0")],
        "cannot be called from plugin code that the registry is running "
        "(the attnplug_register_backends hook of plugin 'p'",
        hangs=True,
    ),
    "hook-registers-a-name-twice": Fault(
        [("d", {"p": src(register("twice"), register("twice"))}, "1.0")], "register(name='twice') was called twice"
    ),
    "hook-registers-a-non-string-name": Fault(
        [("d", {"p": src("name=7, backend='m:C', probe=lambda: (True, '')")}, "1.0")], "register(name=7)"
    ),
    # -------------------------------------------------------------- probes
    "probe-system-exit": Fault(
        [
            (
                "d",
                {"p": src(register("p", probe="probe"), body="def probe():\n    raise SystemExit('probe exits')")},
                "1.0",
            )
        ],
        "probe raised SystemExit: probe exits",
        check=_row("p", "probe exits"),
    ),
    "probe-keyboard-interrupt": Fault(
        [
            (
                "d",
                {
                    "p": src(
                        register("p", probe="probe"),
                        body="def probe():\n    raise KeyboardInterrupt('from the plugin')",
                    )
                },
                "1.0",
            )
        ],
        "probe raised KeyboardInterrupt: from the plugin",
        hangs=True,
    ),  # on a regression it stops pytest
    "probe-base-exception": Fault(
        [
            (
                "d",
                {
                    "p": src(
                        register("p", probe="probe"),
                        body="class Abort(BaseException):\n    pass\ndef probe():\n    raise Abort('probe abort')",
                    )
                },
                "1.0",
            )
        ],
        "probe raised Abort: probe abort",
    ),
    "probe-hangs": Fault(
        [
            (
                "d",
                {"p": src(register("p", probe="probe"), body="import time\ndef probe():\n    time.sleep(3600)")},
                "1.0",
            )
        ],
        f"probe timed out after {LIMIT} s",
        hangs=True,
        check=_row("p", "timed out"),
    ),
    "probe-slow-beyond-the-limit": Fault(
        [
            (
                "d",
                {
                    "p": src(
                        register("p", probe="probe"),
                        body="import time\ndef probe():\n    time.sleep(4)\n    return True, 'late'",
                    )
                },
                "1.0",
            )
        ],
        "probe timed out after 0.3 s",
        env={"ATTNPLUG_PROBE_TIMEOUT": "0.3"},
    ),
    "probe-calls-get_backend": Fault(
        [
            (
                "d",
                {
                    "p": src(
                        register("p", probe="probe"), body="import attnplug\ndef probe():\n    attnplug.get_backend()"
                    )
                },
                "1.0",
            )
        ],
        "cannot be called from plugin code",
        hangs=True,
        check=_row("p", "probe raised RegistryError"),
    ),
    "probe-result-whose-len-exits": Fault(
        [("d", {"p": src(register("p", probe="lambda: Weird((True, 'x'))"), body=_TUPLE_EXITS)}, "1.0")], "len exits"
    ),
    "probe-reason-not-a-string": Fault(
        [("d", {"p": src(register("p", probe="lambda: ProbeResult(True, 42)"))}, "1.0")], "reason=42"
    ),
    # -------------------------------------------------------------- the backend class
    "backend-class-missing": Fault(
        [("d", {"p": src(register("p", backend=_NAME.format("Missing")))}, "1.0")], "AttributeError"
    ),
    "backend-import-system-exit": Fault(
        [("d", {"p": src(register("p", backend="'attnplug_fault_exits_at_import:Backend'"))}, "1.0")],
        "SystemExit: backend module exits",
    ),
    "backend-module-calls-get_backend": Fault(
        [("d", {"p": src(register("p", backend="'attnplug_fault_reentrant_backend:Backend'"))}, "1.0")],
        "cannot be called from plugin code",
    ),
    "describe-system-exit": Fault(
        [("d", {"p": src(register("p", backend=_NAME.format("Exits")), body=_EXIT_CLASS)}, "1.0")],
        "describe() raised SystemExit: describe exits",
    ),
    "describe-hangs": Fault(
        [("d", {"p": src(register("p", backend=_NAME.format("Hangs")), body=_EXIT_CLASS)}, "1.0")],
        f"describe() timed out after {LIMIT} s",
        hangs=True,
    ),
    "describe-returns-unprintable": Fault(
        [("d", {"p": src(register("p", backend=_NAME.format("Odd")), body=_EXIT_CLASS)}, "1.0")],
        "str exits",
        hangs=True,
    ),  # on a regression its SystemExit escapes even pytest's reporting
    "class-attribute-exits": Fault(
        [("d", {"p": src(register("p", backend=_NAME.format("BadAttr")), body=_EXIT_CLASS)}, "1.0")], "attribute exits"
    ),
    "target-is-not-a-backend": Fault(
        [("d", {"p": src(register("p", backend=_NAME.format("Slow")), body=_EXIT_CLASS)}, "1.0")],
        "not a subclass of attnplug.backend.AttentionBackend",
    ),
}

#: modules some scenarios name as backend targets (written next to the plugins)
_SUPPORT_MODULES = {
    "attnplug_fault_exits_at_import": "raise SystemExit('backend module exits')\n",
    "attnplug_fault_reentrant_backend": textwrap.dedent("""
        import attnplug
        from plugin_dists import StandInBackend
        attnplug.get_backend('reference')
        class Backend(StandInBackend):
            pass
    """),
}


def install(fault: Fault, root: Path) -> List[str]:
    """Write the scenario's distributions; returns the folders to put first on sys.path, in order."""
    site, stale = root / "site", root / "stale"
    write_project_metadata(site)  # the built-in plugins, exactly as an install declares them
    tree = DistTree(site)
    for name, text in _SUPPORT_MODULES.items():
        (site / f"{name}.py").write_text(text)
    for dist, plugins, version in fault.dists:
        tree.add(dist, plugins, version=version)
    paths = [str(site)]
    if fault.first:
        stale_tree = DistTree(stale)
        for dist, plugins, version in fault.first:
            if dist == "attnplug":
                write_dist_info(stale, dist, version, {k: v[1:] for k, v in plugins.items()})
            else:
                stale_tree.add(dist, plugins, version=version)
        paths.insert(0, str(stale))
    return paths + [str(HERE)] + [str(p) for p in PROJECT_PATHS]


def assert_outcome(name: str, fault: Fault, data: dict) -> None:
    """What every scenario must leave: info worked, the genuine reference, the fault listed."""
    rows = {row["name"]: row for row in data["backends"]}
    if not fault.reference_disabled:
        ref = rows["reference"]
        assert ref["distribution"] == "attnplug" and ref["backend"] == REFERENCE_TARGET and ref["available"], ref
    reasons = [e["reason"] for e in data["errors"]] + [row["reason"] for row in data["backends"]]
    assert any(fault.expect in reason for reason in reasons), (name, fault.expect, reasons)


def _env_for(fault: Fault) -> Dict[str, str]:
    return {"ATTNPLUG_PROBE_TIMEOUT": LIMIT, **fault.env}


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    for name in ("ATTNPLUG_BACKEND", "ATTNPLUG_PLUGINS", "ATTNPLUG_PROBE_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    yield
    R.reset_registry()


def test_the_matrix_is_large_enough():
    assert len(FAULTS) >= 30
    assert sum(f.hangs for f in FAULTS.values()) >= 5


@pytest.mark.parametrize("name", sorted(n for n, f in FAULTS.items() if not f.hangs))
def test_fault_in_process(name, tmp_path, monkeypatch, capsys):
    fault = FAULTS[name]
    for path in reversed(install(fault, tmp_path)):
        monkeypatch.syspath_prepend(path)
    for key, value in _env_for(fault).items():
        monkeypatch.setenv(key, value)
    R.reset_registry()
    assert cli.main(["info", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert_outcome(name, fault, data)
    if fault.reference_disabled:
        with pytest.raises(R.BackendUnavailable, match="not in ATTNPLUG_PLUGINS"):
            R.get_backend("reference")
    else:
        assert R.get_backend("reference") is ReferenceBackend
    if fault.check is not None:
        fault.check(data)


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


def _inherited_path() -> List[str]:
    """This run's PYTHONPATH, kept first, so the subprocesses test the same attnplug as this process."""
    return [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]


@pytest.fixture(scope="module")
def hang_results(tmp_path_factory):
    scenarios = []
    for name, fault in sorted(FAULTS.items()):
        if fault.hangs:
            root = tmp_path_factory.mktemp(name.replace("_", "-"))
            scenarios.append({"name": name, "paths": install(fault, root), "env": _env_for(fault)})
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNPLUG_")}
    env["PYTHONPATH"] = os.pathsep.join(_inherited_path() + [str(HERE)] + [str(p) for p in PROJECT_PATHS])
    try:
        out = subprocess.run(
            [sys.executable, "-c", _DRIVER, json.dumps(scenarios)], env=env, capture_output=True, text=True, timeout=120
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
    write_project_metadata(site)
    tree = DistTree(site)
    for name, text in _SUPPORT_MODULES.items():
        (site / f"{name}.py").write_text(text)
    used = 0
    for i, (_name, fault) in enumerate(sorted(FAULTS.items())):
        if fault.env or fault.first or fault.reference_disabled:
            continue
        for dist, plugins, version in fault.dists:  # backend names of their own, so no scenario hides another
            plugins = {ep: text.replace("name='p',", f"name='p{i}',") for ep, text in plugins.items()}
            tree.add(f"{dist}-{i}", plugins, version=version)
        used += 1
    assert used >= 25
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNPLUG_")}
    env["ATTNPLUG_PROBE_TIMEOUT"] = LIMIT
    env["PYTHONPATH"] = os.pathsep.join([str(site)] + _inherited_path() + [str(HERE)] + [str(p) for p in PROJECT_PATHS])
    out = subprocess.run(
        [sys.executable, "-m", "attnplug.cli", "info", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(tmp_path),
    )
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
