"""The plugin registry: isolated loading, recorded failures, selection rules, allow-list, API
versions, laziness. Plugins are real distributions (``*.dist-info`` + ``entry_points.txt``) in a
temporary directory, found by ``importlib.metadata`` like installed ones."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import tokenize
import types

import pluggy
import pytest
import torch

import attnplug
from attnplug import registry as R
from attnplug.registry import (
    AmbiguousBackend,
    BackendNotFound,
    BackendUnavailable,
    ProbeResult,
    RegistryError,
    load_registry,
)
from plugin_dists import (
    PROJECT_PATHS,
    ROOT,
    DistTree,
    OtherStandIn,
    StandInBackend,
    entry_points_in,
    plugin_source,
    reg,
    write_dist_info,
    write_project_metadata,
)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv("ATTNPLUG_BACKEND", raising=False)
    monkeypatch.delenv("ATTNPLUG_PLUGINS", raising=False)
    yield
    R.reset_registry()


@pytest.fixture
def tree(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    return DistTree(tmp_path / "site")


def _load(tree, **kw):
    return load_registry(entry_points=tree.entry_points(), **kw)


def _error(registry, plugin):
    matches = [e for e in registry.errors if e.plugin == plugin]
    assert len(matches) == 1, registry.errors
    return matches[0]


def _subprocess_env(*extra_paths):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNPLUG_")}
    env["PYTHONPATH"] = os.pathsep.join([str(p) for p in extra_paths] + [str(p) for p in PROJECT_PATHS])
    return env


# ---------------------------------------------------------------------------- the contract
def test_hookspec_is_the_plugin_contract():
    from attnplug.registry import hookspecs

    assert hookspecs.PROJECT_NAME == "attnplug"
    assert attnplug.hookimpl is hookspecs.hookimpl
    assert isinstance(hookspecs.hookimpl, pluggy.HookimplMarker) and hookspecs.hookimpl.project_name == "attnplug"
    specs = [n for n in dir(hookspecs.AttnplugHookspecs) if n.startswith("attnplug_")]
    assert specs == ["attnplug_register_backends"]
    doc = hookspecs.AttnplugHookspecs.attnplug_register_backends.__doc__
    for phrase in (
        "register(name=",
        "backend=",
        "probe=",
        "priority=",
        "ProbeResult",
        "(available: bool, reason: str)",
        "must not initialise a device runtime",
        "PLUGIN_API_VERSION",
        "reference backend is 0",
    ):
        assert phrase in doc, phrase
    assert R.PLUGIN_API_VERSION == attnplug.PLUGIN_API_VERSION == "1.0"


def test_builtin_plugins_load_through_the_project_entry_points(tmp_path, monkeypatch):
    """The reference backend is found through the attnplug distribution's entry point, like any
    external plugin; without that entry point there is no reference backend at all."""
    write_project_metadata(tmp_path)
    for path in PROJECT_PATHS:
        monkeypatch.syspath_prepend(str(path))
    registry = load_registry(entry_points=entry_points_in(tmp_path))
    assert not registry.errors, registry.errors
    records = {r.name: r for r in registry.records}
    assert set(records) == {"reference", "cuda", "ascend", "xpu"}
    ref = records["reference"]
    assert (ref.distribution, ref.plugin, ref.entry_point, ref.priority) == (
        "attnplug",
        "reference",
        "attnplug.backends.reference_plugin",
        0,
    )
    assert ref.target == "attnplug.backends.reference:ReferenceBackend"
    for name in ("cuda", "ascend", "xpu"):
        assert records[name].priority == 100 and records[name].distribution == "attnplug"
    infos = {i.name: i for i in registry.available_backends()}
    assert infos["reference"].available and infos["reference"].reason == "pure PyTorch, any device"
    for name in ("cuda", "ascend", "xpu"):
        assert infos[name].reason  # available or not, the probe says why
    if torch.version.cuda is None:
        assert not infos["cuda"].available and "without CUDA" in infos["cuda"].reason
    pytest.importorskip("attnplug.backends.reference")
    from attnplug.backends.reference import ReferenceBackend

    assert registry.get_backend("reference") is ReferenceBackend
    assert infos["reference"].needs_cpu_seq_lens == ReferenceBackend.needs_cpu_seq_lens
    assert "reference" not in load_registry(entry_points=[]).names()  # no special case


def test_installed_distribution_registers_reference():
    import importlib.metadata as md

    try:
        dist = md.distribution("attnplug")
    except md.PackageNotFoundError:
        pytest.skip("attnplug is not installed (pip install -e .): no installed entry points to check")
    names = {ep.name for ep in dist.entry_points if ep.group == R.ENTRY_POINT_GROUP}
    assert "reference" in names
    registry = load_registry()
    ref = next(r for r in registry.records if r.name == "reference")
    assert ref.distribution == "attnplug"


# ---------------------------------------------------------------------------- isolation
GOOD = plugin_source([reg("good")])

FAILURES = {
    # case: (plugin source or "=target", expected kind, text in reason)
    "import-error": (
        plugin_source(body="raise ImportError('libvendor.so: cannot open shared object file')"),
        "import",
        "libvendor.so",
    ),
    "missing-module": ("=no_such_attnplug_plugin_module", "import", "No module named 'no_such_attnplug_plugin_module'"),
    "runtime-error-at-import": (plugin_source(body="raise RuntimeError('boom at import')"), "import", "boom at import"),
    "system-exit-at-import": (plugin_source(body="raise SystemExit('bye')"), "import", "SystemExit"),
    "hook-raises": (plugin_source([reg("half")], then=["raise ValueError('hook failed')"]), "hook", "hook failed"),
    "bad-register-call": (
        plugin_source(["name='badtarget', backend='no_colon_here', probe=lambda: (True, '')"]),
        "hook",
        "must be a 'module:Class' string",
    ),
    "bad-priority": (
        plugin_source(["name='p', backend='m:C', probe=lambda: (True, ''), priority='high'"]),
        "hook",
        "priority must be an int",
    ),
    "probe-not-callable": (plugin_source(["name='p', backend='m:C', probe=True"]), "hook", "probe must be callable"),
    "api-major-differs": (plugin_source([reg("future")], api="2.0"), "api-version", "built for plugin API 2.0"),
    "api-missing": (plugin_source([reg("old")], api=None), "api-version", "does not declare PLUGIN_API_VERSION"),
    "api-malformed": (plugin_source([reg("odd")], api="one"), "api-version", "is not a 'MAJOR.MINOR' string"),
    "api-not-a-string": (
        "from attnplug.registry import hookimpl\nPLUGIN_API_VERSION = 1.0\n",
        "api-version",
        "is not a 'MAJOR.MINOR' string",
    ),
    "unknown-hook": (
        plugin_source(
            hook=False,
            body="""
        @hookimpl
        def attnplug_register_backend(register):  # typo: not a hook attnplug specifies
            register(name='typo', backend='m:C', probe=lambda: (True, ''))
        """,
        ),
        "invalid",
        "attnplug_register_backend",
    ),
    "bad-hook-signature": (
        plugin_source(
            hook=False,
            body="""
        @hookimpl
        def attnplug_register_backends(register, device):
            pass
        """,
        ),
        "invalid",
        "device",
    ),
    "registers-nothing": (plugin_source([]), "invalid", "registered no backend"),
    "no-hookimpl": (plugin_source(hook=False), "invalid", "registered no backend"),
    "duplicate-name": (
        plugin_source([reg("good", target="plugin_dists:OtherStandIn")]),
        "duplicate",
        "is registered by several plugins",
    ),
}


@pytest.mark.parametrize("case", sorted(FAILURES))
def test_one_broken_plugin_never_hides_the_others(tree, case):
    source, kind, text = FAILURES[case]
    tree.add("good-dist", {"good": GOOD, "other": plugin_source([reg("other", priority=-1)])})
    tree.add("zz-broken-dist", {"broken": source}, version="6.6")  # sorted after good-dist
    registry = _load(tree)
    error = _error(registry, "broken")
    assert error.kind == kind, error
    assert text in error.reason, error.reason
    assert (error.distribution, error.version) == ("zz-broken-dist", "6.6")
    assert error.entry_point.startswith(("plug_broken", "no_such"))
    if kind == "duplicate":
        # neither claimant wins silently: both are reported, naming each other, and the name is unusable
        assert registry.names() == ("other",)
        good = _error(registry, "good")
        assert good.kind == "duplicate" and good.backend == error.backend == "good"
        for reason in (good.reason, error.reason):
            assert "good-dist" in reason and "zz-broken-dist" in reason, reason
        with pytest.raises(BackendUnavailable) as exc:
            registry.get_backend("good")
        assert "good-dist" in str(exc.value) and "zz-broken-dist" in str(exc.value)
        assert registry.get_backend() is StandInBackend  # 'other' is still there
        return
    assert registry.names() == ("good", "other")
    assert registry.get_backend("good") is StandInBackend
    # selecting the broken plugin's backend is an error carrying the recorded reason
    with pytest.raises(BackendUnavailable) as exc:
        registry.get_backend("broken")
    assert text in str(exc.value) and "Available backends: good, other" in str(exc.value)
    assert exc.value.reason == error.reason and exc.value.alternatives == ("good", "other")
    # and automatic selection is not disturbed
    assert registry.get_backend() is StandInBackend


def test_hook_that_raises_keeps_none_of_its_registrations(tree):
    tree.add("d", {"half": plugin_source([reg("first"), "name='second', backend='m:C', probe=1"])})
    registry = _load(tree)
    assert registry.names() == ()
    assert _error(registry, "half").kind == "hook"


def test_newer_minor_api_version_is_compatible(tree):
    tree.add("d", {"minor": plugin_source([reg("minor")], api="1.7")})
    registry = _load(tree)
    assert registry.names() == ("minor",) and not registry.errors


@pytest.mark.parametrize(
    "target, text",
    [
        ("no_such_backend_module:Backend", "cannot import 'no_such_backend_module:Backend': ModuleNotFoundError"),
        ("plugin_dists:Missing", "AttributeError"),
        ("plugin_dists:NotABackend", "not a subclass of attnplug.backend.AttentionBackend"),
        ("plugin_dists:AbstractStandIn", "is abstract (does not implement: "),
        ("plugin_dists:reg", "not a subclass"),
    ],
)
def test_backend_target_checked_when_resolved(tree, target, text):
    tree.add("d", {"p": plugin_source([reg("bad", target=target, priority=5), reg("ok")])})
    registry = _load(tree)
    assert registry.names() == ("bad", "ok") and not registry.errors  # nothing resolved at load
    info = {i.name: i for i in registry.available_backends()}
    assert not info["bad"].available and text in info["bad"].reason
    assert "the probe passed" in info["bad"].reason
    with pytest.raises(BackendUnavailable, match="Available backends: ok") as exc:
        registry.get_backend("bad")
    assert text in exc.value.reason
    with pytest.warns(RuntimeWarning, match="skipping backend 'bad'"):
        assert registry.get_backend() is StandInBackend  # priority 5 is broken: falls back


@pytest.mark.parametrize(
    "probe, text",
    [
        ("lambda: 1 / 0", "probe raised ZeroDivisionError: division by zero"),
        ("lambda: 'yes'", "probe returned 'yes'; expected a ProbeResult or (available: bool, reason: str)"),
        ("lambda: (1, 'x')", "expected a ProbeResult"),
        ("lambda: ProbeResult('yes', 'x')", "probe returned available='yes'; expected a bool"),
        ("lambda: (False, '')", "unavailable (the probe gave no reason)"),
    ],
)
def test_bad_probe_makes_only_its_backend_unavailable(tree, probe, text):
    tree.add("d", {"p": plugin_source([f"name='bad', backend='m:C', probe={probe}, priority=9", reg("ok")])})
    registry = _load(tree)
    info = {i.name: i for i in registry.available_backends()}
    assert not info["bad"].available and text in info["bad"].reason
    assert info["ok"].available
    with pytest.raises(BackendUnavailable, match="Available backends: ok"):
        registry.get_backend("bad")
    assert registry.get_backend() is StandInBackend


def test_probes_run_lazily_once_and_unavailable_targets_are_never_imported(tree):
    target_module = "never_imported_backend_module_xyz"
    tree.add(
        "d",
        {
            "p": plugin_source(
                [
                    "name='a', backend='plugin_dists:StandInBackend', probe=probe, priority=1",
                    f"name='off', backend='{target_module}:Backend', "
                    "probe=lambda: ProbeResult(False, 'no device', None)",
                ],
                body="""
        CALLS = []
        def probe():
            CALLS.append(1)
            return ProbeResult(True, 'found 1 thing', device='thing0')
        """,
            )
        },
    )
    registry = _load(tree)
    module = sys.modules[registry.records[0].entry_point]
    assert module.CALLS == []  # loading runs no probe
    infos = registry.available_backends()
    assert [i.name for i in infos] == ["a", "off"]  # highest priority first
    assert infos[0].device == "thing0" and infos[0].reason == "found 1 thing"
    registry.available_backends()
    registry.get_backend()
    registry.get_backend("a")
    assert module.CALLS == [1]
    assert target_module not in sys.modules
    with pytest.raises(BackendUnavailable, match="no device"):
        registry.get_backend("off")
    assert target_module not in sys.modules


def test_register_after_hook_returned_is_an_error(tree):
    tree.add("d", {"p": plugin_source([reg("a")], body="KEEP = []", then=["KEEP.append(register)"])})
    registry = _load(tree)
    module = sys.modules[registry.records[0].entry_point]
    with pytest.raises(RuntimeError, match="after the attnplug_register_backends hook returned"):
        module.KEEP[0](name="late", backend="m:C", probe=lambda: (True, ""))
    assert registry.names() == ("a",)


def test_same_module_under_two_entry_points_is_reported(tree):
    modules = tree.add("d1", {"one": GOOD})
    tree.add("d2", {"two": "=" + modules["one"]})
    registry = _load(tree)
    assert registry.names() == ("good",)
    assert _error(registry, "two").kind == "invalid"


# ---------------------------------------------------------------------------- containment, time limits, threads
def test_slow_probe_does_not_delay_selection_of_a_known_backend(tree, monkeypatch):
    """The registry lock is not held while a probe runs: another thread selects a backend whose
    probe already ran while the slow probe is still running."""
    import threading
    import time

    monkeypatch.setenv("ATTNPLUG_PROBE_TIMEOUT", "30")
    tree.add(
        "d",
        {
            "p": plugin_source(
                [reg("known"), "name='slow', backend='plugin_dists:OtherStandIn', probe=probe"],
                body="""
        import threading, time
        STARTED, RELEASE = threading.Event(), threading.Event()
        def probe():
            STARTED.set()
            RELEASE.wait(20)
            return True, 'slow but fine'
        """,
            )
        },
    )
    registry = _load(tree)
    module = sys.modules[registry.records[0].entry_point]
    assert registry.get_backend("known") is StandInBackend  # probed once, before the slow one starts
    slow = threading.Thread(target=lambda: registry.get_backend("slow"), daemon=True)
    slow.start()
    assert module.STARTED.wait(10)
    try:
        t0 = time.monotonic()
        assert registry.get_backend("known") is StandInBackend
        assert registry.probe("known").available and registry.select("known") == ("known", StandInBackend)
        assert time.monotonic() - t0 < 1.0
    finally:
        module.RELEASE.set()
    slow.join(10)
    assert registry.get_backend("slow") is OtherStandIn


def test_probe_runs_once_for_concurrent_callers(tree, monkeypatch):
    import threading

    monkeypatch.setenv("ATTNPLUG_PROBE_TIMEOUT", "30")
    tree.add(
        "d",
        {
            "p": plugin_source(
                ["name='once', backend='plugin_dists:StandInBackend', probe=probe"],
                body="""
        import time
        CALLS = []
        def probe():
            CALLS.append(1)
            time.sleep(0.2)
            return True, 'ok'
        """,
            )
        },
    )
    registry = _load(tree)
    module = sys.modules[registry.records[0].entry_point]
    results = []
    threads = [threading.Thread(target=lambda: results.append(registry.probe("once"))) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert module.CALLS == [1] and len(results) == 6 and len({id(r) for r in results}) == 1


def test_probe_time_limit_is_configurable_and_validated(tree, monkeypatch):
    import time

    tree.add(
        "d",
        {
            "p": plugin_source(
                ["name='slow', backend='plugin_dists:StandInBackend', probe=probe", reg("ok")],
                body="import time\ndef probe():\n    time.sleep(0.6)\n    return True, 'late'",
            )
        },
    )
    monkeypatch.setenv("ATTNPLUG_PROBE_TIMEOUT", "0.2")
    registry = _load(tree)
    t0 = time.monotonic()
    result = registry.probe("slow")
    assert time.monotonic() - t0 < 0.55
    assert result == ProbeResult(False, "probe timed out after 0.2 s")
    with pytest.raises(BackendUnavailable, match="probe timed out after 0.2 s"):
        registry.get_backend("slow")
    time.sleep(0.6)
    assert registry.probe("slow") is result  # the late answer does not replace the verdict
    monkeypatch.setenv("ATTNPLUG_PROBE_TIMEOUT", "inf")
    assert _load(tree).probe("slow").available
    for bad in ("0", "-1", "soon", "nan"):
        monkeypatch.setenv("ATTNPLUG_PROBE_TIMEOUT", bad)
        with pytest.raises(RegistryError, match=f"ATTNPLUG_PROBE_TIMEOUT='{bad}': expected a positive number"):
            _load(tree).get_backend("ok")
    monkeypatch.delenv("ATTNPLUG_PROBE_TIMEOUT")
    assert R.containment.probe_timeout() == R.DEFAULT_PROBE_TIMEOUT == 5.0


def test_keyboard_interrupt_in_the_calling_thread_still_stops_loading(tree):
    """Ctrl-C while a plugin's hook runs must reach the user; SystemExit from the same place is
    contained (test_plugin_faults)."""
    tree.add("d", {"p": plugin_source([reg("p")], then=["raise KeyboardInterrupt"])})
    with pytest.raises(KeyboardInterrupt):
        _load(tree)


def test_identical_copies_of_the_attnplug_distribution_are_not_reported(tmp_path, monkeypatch):
    """Two copies with the same version and entry points (an editable install next to its
    source-tree metadata) are one distribution; copies that differ are reported (fault matrix)."""
    for folder in ("one", "two"):
        write_project_metadata(tmp_path / folder)
        monkeypatch.syspath_prepend(str(tmp_path / folder))
    registry = load_registry()
    assert not [e for e in registry.errors if e.kind == "distribution"], registry.errors
    assert {"reference", "cuda", "ascend", "xpu"} <= set(registry.names())
    write_dist_info(tmp_path / "two", "attnplug", "0.0.1", {})
    monkeypatch.syspath_prepend(str(tmp_path / "two"))
    registry = load_registry()
    (error,) = [e for e in registry.errors if e.kind == "distribution"]
    assert "0.0.1 at" in error.reason and "copies of distribution 'attnplug'" in error.reason
    assert registry.get_backend("reference").__name__ == "ReferenceBackend"


# ---------------------------------------------------------------------------- selection
@pytest.fixture
def three(tree):
    tree.add(
        "d",
        {
            "fast": plugin_source([reg("fast", priority=100, available=False, reason="no accelerator visible")]),
            "mid": plugin_source([reg("mid", target="plugin_dists:OtherStandIn", priority=50)]),
            "ref": plugin_source([reg("ref", priority=0)]),
        },
    )
    return tree


def test_priority_explicit_and_env(three, monkeypatch):
    registry = _load(three)
    assert registry.get_backend() is OtherStandIn  # fast is unavailable: mid has the top available priority
    assert registry.select() == ("mid", OtherStandIn)
    assert registry.get_backend("ref") is StandInBackend
    monkeypatch.setenv("ATTNPLUG_BACKEND", "ref")
    assert registry.get_backend() is StandInBackend
    assert registry.get_backend("mid") is OtherStandIn  # explicit beats the environment
    monkeypatch.setenv("ATTNPLUG_BACKEND", "  ")
    assert registry.get_backend() is OtherStandIn  # blank means unset


def test_unavailable_backend_error_carries_reason_and_alternatives(three, monkeypatch):
    registry = _load(three)
    with pytest.raises(BackendUnavailable) as exc:
        registry.get_backend("fast")
    message = str(exc.value)
    assert "'fast'" in message and "no accelerator visible" in message and "Available backends: mid, ref" in message
    assert exc.value.alternatives == ("mid", "ref") and exc.value.reason == "no accelerator visible"
    monkeypatch.setenv("ATTNPLUG_BACKEND", "fast")
    with pytest.raises(BackendUnavailable, match="selected by ATTNPLUG_BACKEND=fast"):
        registry.get_backend()


def test_unknown_backend_error_lists_known_names(three, monkeypatch):
    registry = _load(three)
    with pytest.raises(BackendNotFound) as exc:
        registry.get_backend("nope")
    assert "registered backends: fast, mid, ref" in str(exc.value)
    assert exc.value.known == ("fast", "mid", "ref") and exc.value.name == "nope"
    monkeypatch.setenv("ATTNPLUG_BACKEND", "typo")
    with pytest.raises(BackendNotFound, match="ATTNPLUG_BACKEND=typo"):
        registry.get_backend()
    assert issubclass(BackendNotFound, RegistryError) and issubclass(BackendUnavailable, RegistryError)
    assert issubclass(AmbiguousBackend, RegistryError) and issubclass(RegistryError, LookupError)


def test_tie_at_the_top_is_an_error_naming_the_candidates(tree):
    tree.add(
        "d",
        {
            "p": plugin_source(
                [
                    reg("b", priority=100),
                    reg("a", priority=100),
                    reg("c", priority=100, available=False),
                    reg("low", priority=1),
                ]
            )
        },
    )
    registry = _load(tree)
    with pytest.raises(AmbiguousBackend) as exc:
        registry.get_backend()
    assert exc.value.candidates == ("a", "b") and exc.value.priority == 100
    assert "a, b" in str(exc.value) and "ATTNPLUG_BACKEND" in str(exc.value)
    assert registry.get_backend("a") is StandInBackend  # a name settles it


def test_tie_below_the_top_does_not_matter(tree):
    tree.add("d", {"p": plugin_source([reg("top", priority=2), reg("x", priority=1), reg("y", priority=1)])})
    assert _load(tree).select()[0] == "top"


def test_nothing_available(tree):
    tree.add(
        "d",
        {
            "p": plugin_source([reg("off", available=False, reason="no device")]),
            "broken": plugin_source(body="raise ImportError('nope')"),
        },
    )
    with pytest.raises(BackendUnavailable) as exc:
        _load(tree).get_backend()
    assert "no attention backend is available" in str(exc.value)
    assert "off: no device" in str(exc.value) and "nope" in str(exc.value)
    with pytest.raises(BackendUnavailable, match="no plugin registered one"):
        load_registry(entry_points=[]).get_backend()


# ---------------------------------------------------------------------------- allow-list
def test_allow_list_from_environment(tree, monkeypatch):
    modules = tree.add(
        "d",
        {"a": plugin_source([reg("a")]), "b": plugin_source([reg("b", priority=9)]), "c": plugin_source([reg("c")])},
    )
    monkeypatch.setenv("ATTNPLUG_PLUGINS", " a , c,")
    registry = _load(tree)
    assert registry.names() == ("a", "c")
    assert registry.allow == ("a", "c")
    error = _error(registry, "b")
    assert error.kind == "disabled" and error.reason == "not in ATTNPLUG_PLUGINS=a,c"
    assert modules["b"] not in sys.modules  # not even imported
    with pytest.raises(BackendUnavailable, match="was not loaded: not in ATTNPLUG_PLUGINS=a,c"):
        registry.get_backend("b")
    with pytest.raises(AmbiguousBackend):  # a and c tie once b is gone
        registry.get_backend()


def test_allow_argument_overrides_environment(tree, monkeypatch):
    tree.add("d", {"a": plugin_source([reg("a")]), "b": plugin_source([reg("b")])})
    monkeypatch.setenv("ATTNPLUG_PLUGINS", "a")
    assert _load(tree, allow=["b"]).names() == ("b",)
    monkeypatch.setenv("ATTNPLUG_PLUGINS", "")
    assert _load(tree).names() == ("a", "b")  # empty means no allow-list


# ---------------------------------------------------------------------------- injected plugins
def test_extra_plugins_without_entry_points(tree):
    tree.add("d", {"ep": plugin_source([reg("from-ep")])})
    module = types.ModuleType("injected_plugin")
    exec(plugin_source([reg("injected", priority=3)]), module.__dict__)

    class ObjectPlugin:  # an object plugin: the version comes from its module (this test module)
        @attnplug.hookimpl
        def attnplug_register_backends(self, register):
            register(name="obj", backend="plugin_dists:OtherStandIn", probe=lambda: (True, "ok"), priority=1)

    class Outdated:
        PLUGIN_API_VERSION = "0.9"

        @attnplug.hookimpl
        def attnplug_register_backends(self, register):
            raise AssertionError("never called")

    registry = _load(tree, extra_plugins=[module, ("named", ObjectPlugin()), Outdated()])
    assert registry.names() == ("from-ep", "injected", "obj")
    recs = {r.name: r for r in registry.records}
    assert recs["injected"].plugin == "injected_plugin" and recs["injected"].distribution is None
    assert recs["obj"].plugin == "named"
    assert _error(registry, "Outdated").kind == "api-version"
    assert registry.get_backend() is StandInBackend


PLUGIN_API_VERSION = "1.0"  # for the object plugin defined in this module


# ---------------------------------------------------------------------------- process-wide registry
def test_module_level_functions_use_one_cached_registry(tree, monkeypatch):
    tree.add("d", {"p": plugin_source([reg("only")])})
    calls = []

    def fake_discover():
        calls.append(1)
        return tree.entry_points()

    monkeypatch.setattr(R.registry, "discover_entry_points", fake_discover)
    R.reset_registry()
    assert attnplug.get_backend() is StandInBackend
    assert [i.name for i in attnplug.available_backends()] == ["only"]
    assert attnplug.load_errors() == []
    assert calls == [1]
    R.reset_registry()
    attnplug.get_backend("only")
    assert calls == [1, 1]
    custom = load_registry(entry_points=[], extra_plugins=[("x", _module_with(reg("other")))])
    R.reset_registry(custom)
    assert R.get_registry() is custom and attnplug.get_backend() is StandInBackend
    assert calls == [1, 1]


def _module_with(*registrations):
    module = types.ModuleType(f"m_{id(registrations)}")
    exec(plugin_source(registrations), module.__dict__)
    return module


def test_discovery_uses_the_entry_point_group(tree, monkeypatch):
    """The default discovery reads the ``attnplug.backends`` group from sys.path metadata."""
    tree.add("zz-discovered-dist", {"disc": plugin_source([reg("discovered")])})
    found = [ep for ep in R.discover_entry_points() if ep.name == "disc"]
    assert len(found) == 1 and found[0].dist.name == "zz-discovered-dist"
    assert "discovered" in load_registry(allow=["disc"]).names()


def test_import_attnplug_resolves_no_entry_points():
    code = textwrap.dedent("""
        import importlib.metadata as md, json, sys
        import torch  # torch reads its own entry-point group at import; only attnplug's behaviour is checked
        calls = []
        for fn in ("entry_points", "distributions", "distribution"):
            real = getattr(md, fn)
            def spy(*a, _real=real, _fn=fn, **k):
                calls.append(_fn)
                return _real(*a, **k)
            setattr(md, fn, spy)
        import attnplug
        attnplug.hookimpl, attnplug.get_backend, attnplug.PLUGIN_API_VERSION  # lazy attributes only
        import attnplug.registry.registry as rr
        import attnplug_cuda.plugin, attnplug_ascend.plugin, attnplug_xpu.plugin, attnplug.backends.reference_plugin
        print(json.dumps({"calls": calls, "registry": rr._REGISTRY is not None,
                          "vendor": sorted(m for m in ("triton", "torch_npu", "intel_extension_for_pytorch",
                                                       "attnplug_cuda.backend", "attnplug.backends.reference")
                                           if m in sys.modules)}))
        attnplug.available_backends()
        print(json.dumps({"calls": calls}))
    """)
    out = subprocess.run(
        [sys.executable, "-c", code], env=_subprocess_env(), capture_output=True, text=True, timeout=120, cwd=str(ROOT)
    )
    assert out.returncode == 0, out.stderr
    first, second = (json.loads(line) for line in out.stdout.strip().splitlines()[-2:])
    assert first == {"calls": [], "registry": False, "vendor": []}
    assert "distributions" in second["calls"]  # the first real use does discover


# ---------------------------------------------------------------------------- built-in probes
def test_reference_probe():
    from attnplug.backends import reference_plugin

    assert reference_plugin.PLUGIN_API_VERSION == R.PLUGIN_API_VERSION
    assert reference_plugin.probe() == ProbeResult(True, "pure PyTorch, any device", device="any")


@pytest.fixture
def vendor_paths(monkeypatch):
    for path in PROJECT_PATHS[1:]:
        monkeypatch.syspath_prepend(str(path))


def test_cuda_probe(vendor_paths, monkeypatch):
    from attnplug_cuda import plugin

    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.setattr(torch.version, "cuda", None)
    assert plugin.probe().reason.endswith("was built without CUDA") and not plugin.probe().available
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    result = plugin.probe()
    assert not result.available and "no NVIDIA GPU visible" in result.reason
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    fake_triton = types.ModuleType("triton")
    fake_triton.__version__ = "3.4.1"
    monkeypatch.setitem(sys.modules, "triton", fake_triton)
    result = plugin.probe()
    assert not result.available and "triton 3.4.1 is too old; need >= 3.5" in result.reason
    fake_triton.__version__ = "3.5.0+git1234"
    result = plugin.probe()
    assert result.available and "2 NVIDIA GPU(s)" in result.reason and result.device == "cuda (2 visible)"
    monkeypatch.setitem(sys.modules, "triton", None)  # import fails
    result = plugin.probe()
    assert not result.available and "triton >= 3.5 is required" in result.reason
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert "ROCm" in plugin.probe().reason


def test_ascend_probe_never_imports_a_missing_or_broken_torch_npu(vendor_paths, monkeypatch, tmp_path):
    from attnplug_ascend import plugin

    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    if plugin.importlib.util.find_spec("torch_npu") is None:
        result = plugin.probe()
        assert not result.available and "torch_npu is not installed" in result.reason
        assert "torch_npu" not in sys.modules
    # an installed torch_npu without its native libraries: importing it fails in odd ways
    for failure in ("raise OSError('libascendcl.so: cannot open shared object file')", "raise SystemExit(1)"):
        fake = tmp_path / f"f{abs(hash(failure))}"
        fake.mkdir()
        (fake / "torch_npu.py").write_text(failure + "\n")
        monkeypatch.syspath_prepend(str(fake))
        monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
        result = plugin.probe()
        assert not result.available and result.reason.startswith("importing torch_npu failed")
        sys.path.remove(str(fake))
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)


def test_xpu_probe(vendor_paths, monkeypatch):
    from attnplug_xpu import plugin

    if hasattr(torch, "xpu"):
        monkeypatch.setattr(torch.xpu, "is_available", lambda: False)
        result = plugin.probe()
        assert not result.available and "no Intel XPU visible" in result.reason
        monkeypatch.setattr(torch.xpu, "is_available", lambda: True)
        monkeypatch.setattr(torch.xpu, "device_count", lambda: 1)
        result = plugin.probe()
        assert result.available and result.device == "xpu (1 visible)"
    monkeypatch.delattr(torch, "xpu", raising=False)
    assert "has no torch.xpu" in plugin.probe().reason


def test_vendor_plugins_declare_the_api_version(vendor_paths):
    import attnplug_ascend.plugin
    import attnplug_cuda.plugin
    import attnplug_xpu.plugin

    for module in (attnplug_cuda.plugin, attnplug_ascend.plugin, attnplug_xpu.plugin):
        assert module.PLUGIN_API_VERSION == R.PLUGIN_API_VERSION


# ---------------------------------------------------------------------------- small pieces
VENDOR_WORDS = ("cuda", "npu", "xpu", "torch_npu", "ipex")


@pytest.mark.parametrize(
    "relpath",
    [
        "registry/__init__.py",
        "registry/hookspecs.py",
        "registry/records.py",
        "registry/registry.py",
        "registry/containment.py",
        "registry/discovery.py",
        "cli.py",
        "env.py",
        "versions.py",
        "backends/__init__.py",
        "backends/reference_plugin.py",
    ],
)
def test_registry_code_names_no_vendor(relpath):
    """Core is device-neutral: vendor names may appear in comments only."""
    import re

    path = ROOT / "core" / "attnplug" / relpath
    with open(path, "rb") as f:
        tokens = [t for t in tokenize.tokenize(f.readline) if t.type in (tokenize.NAME, tokenize.STRING)]
    pattern = re.compile(r"(?<![a-z])(" + "|".join(VENDOR_WORDS) + r")(?![a-z])", re.I)
    offending = [t.string for t in tokens if pattern.search(t.string.replace("cuda_graph_swa_out_cache_loc", ""))]
    assert offending == []
