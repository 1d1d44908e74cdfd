"""The plugin registry isolates plugins: a plugin that fails to import, whose hook raises or
registers badly, that declares another API version, or whose backend target or probe is broken
makes only its own backends unusable, with the recorded reason; probes run lazily."""

from __future__ import annotations

import sys

import pytest

from attnplug.registry import BackendUnavailable
from plugin_dists import StandInBackend, one_error, plugin_source, reg

pytestmark = pytest.mark.usefixtures("clean_registry")


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
    registry = tree.load()
    error = one_error(registry, "broken")
    assert error.kind == kind, error
    assert text in error.reason, error.reason
    assert (error.distribution, error.version) == ("zz-broken-dist", "6.6")
    assert error.entry_point.startswith(("plug_broken", "no_such"))
    if kind == "duplicate":
        # neither claimant wins silently: both are reported, naming each other, and the name is unusable
        assert registry.names() == ("other",)
        good = one_error(registry, "good")
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
    registry = tree.load()
    assert registry.names() == ()
    assert one_error(registry, "half").kind == "hook"


def test_newer_minor_api_version_is_compatible(tree):
    tree.add("d", {"minor": plugin_source([reg("minor")], api="1.7")})
    registry = tree.load()
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
    registry = tree.load()
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
    registry = tree.load()
    info = {i.name: i for i in registry.available_backends()}
    assert not info["bad"].available and text in info["bad"].reason
    assert info["ok"].available
    with pytest.raises(BackendUnavailable, match="Available backends: ok"):
        registry.get_backend("bad")
    assert registry.get_backend() is StandInBackend


def test_probes_run_lazily_once_and_unavailable_targets_are_never_imported(tree, tmp_path):
    target_module = "never_imported_backend_module_xyz"
    calls = tmp_path / "calls"
    calls.write_text("")
    tree.add(
        "d",
        {
            "p": plugin_source(
                [
                    "name='a', backend='plugin_dists:StandInBackend', probe=probe, priority=1",
                    f"name='off', backend='{target_module}:Backend', "
                    "probe=lambda: ProbeResult(False, 'no device', None)",
                ],
                body=f"""
        def probe():
            with open({str(calls)!r}, 'a') as f:
                f.write('call\\n')
            return ProbeResult(True, 'found 1 thing', device='thing0')
        """,
            )
        },
    )
    registry = tree.load()
    assert calls.read_text() == ""  # loading runs no probe
    infos = registry.available_backends()
    assert [i.name for i in infos] == ["a", "off"]  # highest priority first
    assert infos[0].device == "thing0" and infos[0].reason == "found 1 thing"
    registry.available_backends()
    registry.get_backend()
    registry.get_backend("a")
    assert calls.read_text().splitlines() == ["call"]  # once, in the probe process
    assert target_module not in sys.modules
    with pytest.raises(BackendUnavailable, match="no device"):
        registry.get_backend("off")
    assert target_module not in sys.modules


def test_register_after_hook_returned_is_an_error(tree):
    tree.add("d", {"p": plugin_source([reg("a")], body="KEEP = []", then=["KEEP.append(register)"])})
    registry = tree.load()
    module = sys.modules[registry.records[0].entry_point]
    with pytest.raises(RuntimeError, match="after the attnplug_register_backends hook returned"):
        module.KEEP[0](name="late", backend="m:C", probe=lambda: (True, ""))
    assert registry.names() == ("a",)


def test_same_module_under_two_entry_points_is_reported(tree):
    modules = tree.add("d1", {"one": GOOD})
    tree.add("d2", {"two": "=" + modules["one"]})
    registry = tree.load()
    assert registry.names() == ("good",)
    assert one_error(registry, "two").kind == "invalid"
