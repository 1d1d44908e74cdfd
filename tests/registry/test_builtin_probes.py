"""The built-in plugins' probes (reference, cuda, ascend, xpu) decide availability without a
device runtime; the registry's own code names no vendor."""

from __future__ import annotations

import sys
import tokenize
import types

import pytest
import torch

from attnplug import registry as R
from attnplug.registry import ProbeResult
from plugin_dists import PROJECT_PATHS, ROOT

pytestmark = pytest.mark.usefixtures("clean_registry")


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
        "registry/loading.py",
        "registry/probing.py",
        "registry/sandbox.py",
        "registry/worker.py",
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
