"""The ascend and xpu plugins import on any machine and refuse, with a clear reason, to run
where their device is absent; their graph class is found by feature detection."""

import pytest
import torch

from attnplug import ReqToTokenPool, SWAKVPool
from attnplug.backend import Capabilities, GraphSupport


def _cpu_pool():
    pool = SWAKVPool(64, 32, 2, [0], 2, 64, torch.float16, torch.device("cpu"))
    return pool, ReqToTokenPool(4, 32, torch.device("cpu"))


def test_packages_import_without_vendor_runtime():
    import attnplug_ascend.backend
    import attnplug_xpu.backend

    assert attnplug_ascend.backend.AscendBackend.needs_cpu_seq_lens is False
    assert attnplug_xpu.backend.XpuBackend.needs_cpu_seq_lens is False


def test_ascend_backend_names_missing_torch_npu(monkeypatch):
    import importlib

    from attnplug_ascend import backend

    real = importlib.import_module

    def fake_import(name, *a, **k):
        if name == "torch_npu":
            raise ImportError("No module named 'torch_npu'")
        return real(name, *a, **k)

    monkeypatch.setattr(backend.importlib, "import_module", fake_import)
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
    monkeypatch.setattr(backend, "_xpu_graph_class", lambda: None)
    with pytest.raises(RuntimeError, match="XPUGraph"):
        backend.XpuBackend.new_graph()
    monkeypatch.setattr(backend, "_xpu_graph_class", lambda: object)
    base = Capabilities("xpu", False, False, GraphSupport.UNIFORM, (torch.float16,), (64,), (1,), True)
    monkeypatch.setattr(backend.ReferenceBackend, "capabilities", lambda self: base)
    assert backend.XpuBackend.capabilities(inst).graphs is GraphSupport.UNIFORM
    monkeypatch.setattr(backend, "_xpu_graph_class", lambda: None)
    assert backend.XpuBackend.capabilities(inst).graphs is GraphSupport.NEVER
