"""The ascend and xpu plugins import on any machine and refuse, with a clear reason, to run
where their device is absent; their graph class is found by feature detection."""

import pytest
import torch

from attnplug import ReqToTokenPool, SWAKVPool
from attnplug.backend import GraphSupport


def _cpu_pool():
    pool = SWAKVPool(64, 32, 2, [0], 2, 64, torch.float16, torch.device("cpu"))
    return pool, ReqToTokenPool(4, 32, torch.device("cpu"))


def test_packages_import_without_vendor_runtime():
    import attnplug_ascend.backend
    import attnplug_xpu.backend

    # the fused attention takes host length lists (docs/ascend.md)
    assert attnplug_ascend.backend.AscendBackend.needs_cpu_seq_lens is True
    assert attnplug_xpu.backend.XpuBackend.needs_cpu_seq_lens is False


def test_ascend_backend_names_missing_torch_npu(monkeypatch):
    import importlib

    from attnplug_ascend import backend, device

    real = importlib.import_module

    def fake_import(name, *a, **k):
        if name == "torch_npu":
            raise ImportError("No module named 'torch_npu'")
        return real(name, *a, **k)

    monkeypatch.setattr(device.importlib, "import_module", fake_import)
    pool, rows = _cpu_pool()
    with pytest.raises(RuntimeError, match="torch_npu"):
        backend.AscendBackend(pool, rows, num_heads=4, sliding_window=8)


def test_xpu_backend_refuses_a_cpu_pool():
    from attnplug_xpu.backend import XpuBackend

    pool, rows = _cpu_pool()
    with pytest.raises(ValueError, match="XPU device"):
        XpuBackend(pool, rows, num_heads=4, sliding_window=8)


def test_xpu_graph_support_follows_feature_detection(monkeypatch):
    from attnplug_xpu import backend

    inst = backend.XpuBackend.__new__(backend.XpuBackend)  # capabilities() is pure data
    inst.device = torch.device("xpu")
    monkeypatch.delattr(torch.xpu, "XPUGraph", raising=False)
    with pytest.raises(RuntimeError, match="XPUGraph"):
        backend.XpuBackend.new_graph()
    assert inst.capabilities().graphs is GraphSupport.NEVER
    assert backend.XpuBackend.describe()["graphs"] == "NEVER"
    monkeypatch.setattr(torch.xpu, "XPUGraph", object, raising=False)
    assert inst.capabilities().graphs is GraphSupport.ALWAYS
    assert backend.XpuBackend.describe()["graphs"] == "ALWAYS"
    assert inst.capabilities().device_type == "xpu"


@pytest.mark.parametrize("module", ["attnplug_xpu"])  # ascend calls torch_npu's fused operators
def test_device_plugins_use_the_portable_base_not_the_oracle(module):
    import importlib

    from attnplug.backends.portable import PortableBackend
    from attnplug.backends.reference import ReferenceBackend

    cls = next(
        v
        for k, v in vars(importlib.import_module(f"{module}.backend")).items()
        if k.endswith("Backend") and isinstance(v, type) and v.__module__ == f"{module}.backend"
    )
    assert issubclass(cls, PortableBackend) and not issubclass(cls, ReferenceBackend)
    assert type(cls.device_part).__module__ == f"{module}.device"


def test_ascend_declares_never_without_torch_npu(monkeypatch):
    from attnplug_ascend import backend, device

    def missing():
        raise RuntimeError("the ascend backend needs torch_npu with Ascend CANN: ImportError")

    monkeypatch.setattr(device, "npu_module", missing)
    facts = backend.AscendBackend.describe()
    assert facts["graphs"] == "NEVER" and facts["device_type"] == "npu"
    assert backend.AscendBackend.declared_capabilities().graphs is GraphSupport.UNIFORM  # the install-free claim
