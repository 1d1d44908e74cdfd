"""The plugin-fault matrix (tests/registry/test_plugin_faults*.py): one misbehaving plugin
distribution per scenario, installed next to the project's own entry points. After each scenario

* ``attnplug info --json`` works (exit code 0, JSON on stdout),
* ``get_backend("reference")`` returns the genuine ``ReferenceBackend``,
* the fault is listed (a plugin load error, or the reason of an unavailable backend) with its
  reason.

``FAULTS`` names the scenarios; ``install`` writes one, ``assert_outcome`` checks what every
scenario must leave.
"""

from __future__ import annotations

import os
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import pytest

from attnplug import registry as R
from attnplug.backends.reference import ReferenceBackend
from plugin_dists import PROJECT_PATHS, DistTree, OtherStandIn, plugin_source, write_dist_info, write_project_metadata

HERE = Path(__file__).resolve().parent  # tests/: the helper modules
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


def _intruder(
    expect="belongs to attnplug", *, dist="aaa-intruder", ep="evil", name="reference", priority=0, version="1.0", **kw
) -> Fault:
    """A distribution claiming a built-in backend name (or naming its entry point after one); by
    default checked to be refused naming itself."""
    plugin = src(register(name, backend="'plugin_dists:OtherStandIn'", priority=priority))
    kw.setdefault("check", _intruder_refused(dist))
    return Fault([(dist, {ep: plugin}, version)], expect, **kw)


def _plugin(source: str, expect: str, **kw) -> Fault:
    """One distribution ``d`` with one plugin ``p`` (its module source or ``"=target"``)."""
    return Fault([("d", {"p": source}, "1.0")], expect, **kw)


def _probe(body: str, expect: str, **kw) -> Fault:
    """Plugin ``p`` whose backend's probe is the function ``probe`` that ``body`` defines."""
    return _plugin(src(register("p", probe="probe"), body=body), expect, **kw)


def _target(cls: str, expect: str, **kw) -> Fault:
    """Plugin ``p`` whose backend target is class ``cls`` of ``_EXIT_CLASS`` (in the plugin's module)."""
    return _plugin(src(register("p", backend=f"__name__ + ':{cls}'"), body=_EXIT_CLASS), expect, **kw)


_REENTRANT = "cannot be called from plugin code"

FAULTS: Dict[str, Fault] = {
    # -------------------------------------------------------------- builtin names are owned
    "intruder-registers-reference-sorting-first": _intruder(version="6.6"),
    "intruder-registers-reference-sorting-last": _intruder(dist="zzz-intruder"),
    "intruder-with-ATTNPLUG_BACKEND=reference": _intruder(
        env={"ATTNPLUG_BACKEND": "reference"}, check=_default_is_reference
    ),
    "intruder-entry-point-named-reference": _intruder("reserved", ep="reference"),
    "intruder-entry-point-with-ATTNPLUG_PLUGINS=reference": _intruder(
        "reserved", ep="reference", env={"ATTNPLUG_PLUGINS": "reference"}
    ),
    "intruder-registers-cuda": _intruder(
        name="cuda",
        priority=1000,
        check=lambda data: (_intruder_refused("aaa-intruder")(data), _cuda_is_genuine(data)),
    ),
    "intruder-with-the-builtin-plugin-disabled": _intruder(env={"ATTNPLUG_PLUGINS": "evil"}, reference_disabled=True),
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
    "import-raises": _plugin(src(body="raise ImportError('libvendor.so missing')"), "libvendor.so"),
    "import-system-exit": _plugin(src(body="raise SystemExit('bye from import')"), "SystemExit: bye from import"),
    "import-base-exception": _plugin(
        src(body="class PluginAbort(BaseException):\n    pass\nraise PluginAbort('abort')"), "PluginAbort: abort"
    ),
    "import-calls-get_backend": _plugin(
        src(register("p"), body="import attnplug\nattnplug.get_backend('reference')"), _REENTRANT, hangs=True
    ),
    "import-calls-available_backends": _plugin(
        src(register("p"), body="import attnplug\nattnplug.available_backends()"), _REENTRANT, hangs=True
    ),
    "import-calls-load_errors": _plugin(
        src(register("p"), body="import attnplug\nattnplug.load_errors()"), _REENTRANT, hangs=True
    ),
    "malformed-entry-point-value": _plugin("=not a module!", "p = 'not a module!' is malformed"),
    "empty-entry-point-value": _plugin("=", "p = '' is malformed"),
    "entry-point-attribute-missing": _plugin("=plugin_dists:no_such_plugin_object", "no_such_plugin_object"),
    "module-getattr-exits": _plugin(
        plugin_source(
            [register("p")],
            api=None,  # PLUGIN_API_VERSION is read through __getattr__
            body="def __getattr__(name):\n    raise SystemExit('getattr ' + name)",
        ),
        "SystemExit: getattr",
    ),
    # -------------------------------------------------------------- the hook
    "hook-raises": _plugin(src(register("p"), then=("raise RuntimeError('hook broke')",)), "hook broke"),
    "hook-system-exit": _plugin(src(register("p"), then=("raise SystemExit('hook exits')",)), "SystemExit: hook exits"),
    "hook-base-exception": _plugin(
        src(register("p"), body="class Abort(BaseException):\n    pass", then=("raise Abort('x')",)), "Abort: x"
    ),
    "hook-calls-get_backend": _plugin(
        src(register("p"), then=("__import__('attnplug').get_backend('reference')",)),
        "cannot be called from plugin code that the registry is running "
        "(the attnplug_register_backends hook of plugin 'p'",
        hangs=True,
    ),
    "hook-registers-a-name-twice": _plugin(
        src(register("twice"), register("twice")), "register(name='twice') was called twice"
    ),
    "hook-registers-a-non-string-name": _plugin(
        src("name=7, backend='m:C', probe=lambda: (True, '')"), "register(name=7)"
    ),
    # -------------------------------------------------------------- probes
    "probe-system-exit": _probe(
        "def probe():\n    raise SystemExit('probe exits')",
        "probe raised SystemExit: probe exits",
        check=_row("p", "probe exits"),
    ),
    "probe-keyboard-interrupt": _probe(
        "def probe():\n    raise KeyboardInterrupt('from the plugin')",
        "probe raised KeyboardInterrupt: from the plugin",
        hangs=True,
    ),  # on a regression it stops pytest
    "probe-base-exception": _probe(
        "class Abort(BaseException):\n    pass\ndef probe():\n    raise Abort('probe abort')",
        "probe raised Abort: probe abort",
    ),
    "probe-hangs": _probe(
        "import time\ndef probe():\n    time.sleep(3600)",
        f"probe timed out after {LIMIT} s",
        hangs=True,
        check=_row("p", "timed out"),
    ),
    "probe-slow-beyond-the-limit": _probe(
        "import time\ndef probe():\n    time.sleep(4)\n    return True, 'late'",
        "probe timed out after 0.3 s",
        env={"ATTNPLUG_PROBE_TIMEOUT": "0.3"},
    ),
    "probe-calls-get_backend": _probe(
        "import attnplug\ndef probe():\n    attnplug.get_backend()",
        _REENTRANT,
        hangs=True,
        check=_row("p", "probe raised RegistryError"),
    ),
    "probe-result-whose-len-exits": _plugin(
        src(register("p", probe="lambda: Weird((True, 'x'))"), body=_TUPLE_EXITS), "len exits"
    ),
    "probe-reason-not-a-string": _plugin(src(register("p", probe="lambda: ProbeResult(True, 42)")), "reason=42"),
    # -------------------------------------------------------------- the backend class
    "backend-class-missing": _plugin(src(register("p", backend="__name__ + ':Missing'")), "AttributeError"),
    "backend-import-system-exit": _plugin(
        src(register("p", backend="'attnplug_fault_exits_at_import:Backend'")), "SystemExit: backend module exits"
    ),
    "backend-module-calls-get_backend": _plugin(
        src(register("p", backend="'attnplug_fault_reentrant_backend:Backend'")), _REENTRANT
    ),
    "describe-system-exit": _target("Exits", "describe() raised SystemExit: describe exits"),
    "describe-hangs": _target("Hangs", f"describe() timed out after {LIMIT} s", hangs=True),
    # on a regression its SystemExit escapes even pytest's reporting
    "describe-returns-unprintable": _target("Odd", "str exits", hangs=True),
    "class-attribute-exits": _target("BadAttr", "attribute exits"),
    "target-is-not-a-backend": _target("Slow", "not a subclass of attnplug.backend.AttentionBackend"),
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


def project_site(site: Path) -> DistTree:
    """``site`` with the built-in plugins' metadata, exactly as an install declares them, and the
    modules the scenarios name as backend targets; returns it as a tree to add plugins to."""
    write_project_metadata(site)
    tree = DistTree(site)
    for name, text in _SUPPORT_MODULES.items():
        (site / f"{name}.py").write_text(text)
    return tree


def install(fault: Fault, root: Path) -> List[str]:
    """Write the scenario's distributions; returns the folders to put first on sys.path, in order."""
    site, stale = root / "site", root / "stale"
    tree = project_site(site)
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


def env_for(fault: Fault) -> Dict[str, str]:
    return {"ATTNPLUG_PROBE_TIMEOUT": LIMIT, **fault.env}


def inherited_path() -> List[str]:
    """This run's PYTHONPATH, kept first, so the subprocesses test the same attnplug as this process."""
    return [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
