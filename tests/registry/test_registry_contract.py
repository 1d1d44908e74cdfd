"""The plugin registry: the plugin contract, the built-in plugins loaded through the project's
entry points, plugins given as objects, the process-wide registry and its laziness. Plugins are
real distributions (``*.dist-info`` + ``entry_points.txt``) in a temporary directory, found by
``importlib.metadata`` like installed ones (tests/plugin_dists.py). The other registry topics:
test_registry_isolation.py, test_registry_containment.py, test_registry_selection.py,
test_builtin_probes.py."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import types

import pluggy
import pytest
import torch

import attnplug
from attnplug import registry as R
from attnplug.registry import load_registry
from child import HANG_LIMIT_S
from plugin_dists import (
    PROJECT_PATHS,
    ROOT,
    StandInBackend,
    entry_points_in,
    one_error,
    plugin_module,
    plugin_source,
    reg,
    subprocess_env,
    write_project_metadata,
)

pytestmark = pytest.mark.usefixtures("clean_registry")


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

    registry = tree.load(extra_plugins=[module, ("named", ObjectPlugin()), Outdated()])
    assert registry.names() == ("from-ep", "injected", "obj")
    recs = {r.name: r for r in registry.records}
    assert recs["injected"].plugin == "injected_plugin" and recs["injected"].distribution is None
    assert recs["obj"].plugin == "named"
    assert one_error(registry, "Outdated").kind == "api-version"
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
    custom = load_registry(entry_points=[], extra_plugins=[("x", plugin_module(reg("other")))])
    R.reset_registry(custom)
    assert R.get_registry() is custom and attnplug.get_backend() is StandInBackend
    assert calls == [1, 1]


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
        [sys.executable, "-c", code],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=HANG_LIMIT_S,
        cwd=str(ROOT),
    )
    assert out.returncode == 0, out.stderr
    first, second = (json.loads(line) for line in out.stdout.strip().splitlines()[-2:])
    assert first == {"calls": [], "registry": False, "vendor": []}
    assert "distributions" in second["calls"]  # the first real use does discover
