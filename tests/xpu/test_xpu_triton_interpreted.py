"""The xpu backend (``XpuTritonBackend``: the Triton kernels with the XPU's part) on the host,
its kernels under TRITON_INTERPRET=1 exactly as the cuda backend's are tested: every mode
eager and replayed equals the reference backend, the XPU plans are chosen, no PDL is compiled
or launched; and the cuda backend on a ROCm torch (``torch.version.hip``) compiles PDL out."""

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs the Triton interpreter (set by conftest without a GPU)", allow_module_level=True)
pytest.importorskip("triton")

from attnplug.backend import BackendConfigError  # noqa: E402
from attnplug.backends.reference import ReferenceBackend  # noqa: E402
from attnplug_conformance.harness import World  # noqa: E402
from attnplug_cuda.backend import CudaBackend, TritonBackend  # noqa: E402
from attnplug_cuda.device import CudaDevice  # noqa: E402
from attnplug_cuda.kernels import pdl_supported  # noqa: E402
from attnplug_cuda.planner import Path, plan_step  # noqa: E402
from attnplug_xpu import device as xpu_device  # noqa: E402
from attnplug_xpu import triton_backend  # noqa: E402
from attnplug_xpu.triton_backend import XpuTritonBackend  # noqa: E402
from child import HANG_LIMIT_S  # noqa: E402
from worlds import drive_every_mode, kernel_spec  # noqa: E402

SPEC = kernel_spec()


def _drive(cls, use_graphs, world_hook=None):
    return drive_every_mode(cls, "cpu", use_graphs=use_graphs, world_hook=world_hook)


@pytest.mark.parametrize("use_graphs", [False, True], ids=["eager", "replay"])
def test_xpu_backend_matches_reference(use_graphs):
    ref_outs, ref_caches, _ = _drive(ReferenceBackend, use_graphs)
    outs, caches, world = _drive(XpuTritonBackend, use_graphs)
    assert isinstance(world.backend, TritonBackend) and world.backend.name == "xpu"
    for i, (a, b) in enumerate(zip(outs, ref_outs)):
        err = (a.double() - b.double()).norm() / b.double().norm()
        assert err < 2e-3, f"step {i}: relative error {err:.2e}"
    for a, b in zip(caches, ref_caches):
        assert torch.equal(a, b), "KV caches differ"


def test_the_xpu_plans_are_chosen():
    world = World(SPEC, XpuTritonBackend, "cpu", seed=1)
    b = world.backend
    assert (b.tuning.max_block_n, b.tuning.min_flash_warps, b.tuning.pdl) == (64, 8, False)
    assert b.pdl is False and "compiled out" in b.pdl_reason and b.capabilities().pdl is False
    assert b.kv_store_impl == "triton"
    # an XPU-sized device (Xe-cores stand in for SMs) and a prefill, a verify and a decode shape
    shape = b.shape.__class__(**{**b.shape.__dict__, "num_sms": 64, "head_dim": 128})
    cuda_shape = shape
    cuda_tuning = CudaDevice().default_tuning()
    seen = set()
    for bs, tokens, q in ((2, 600, 300), (4, 16, 4), (8, 8, 1), (1, 1, 1)):
        plan = plan_step(shape, bs, tokens, q, b.tuning, b.pdl)
        cuda_plan = plan_step(cuda_shape, bs, tokens, q, cuda_tuning, False)
        seen.add(plan.path)
        for layer in (plan.full, plan.swa):
            if layer is None:
                continue
            assert layer.first is None and layer.later is None  # PDL compiled out
            k = layer.kernel
            assert k.BLOCK_N <= 64, k
            big = getattr(k, "BLOCK_M", 16) > 16 or k.BLOCK_N * 128 >= 128 * 128
            if big:
                assert k.num_warps >= 8, k
        if q == 300:  # a prefill: CUDA's 128-key tiles, the XPU's 64-key ones, 8 warps
            assert cuda_plan.full.kernel.BLOCK_N == 128 and plan.full.kernel.BLOCK_N == 64
            assert plan.full.kernel.num_warps == 8 and plan.full.kernel.BLOCK_M == cuda_plan.full.kernel.BLOCK_M
    assert Path.TWO_LAUNCH in seen and Path.ONE_LAUNCH in seen


def test_no_pdl_is_compiled_or_launched(monkeypatch):
    """Every launch of the xpu backend gets PDL None / False, and no gdc instruction runs."""
    import triton.language as tl

    calls = []
    for name in ("gdc_wait", "gdc_launch_dependents"):
        monkeypatch.setattr(tl.extra.cuda, name, lambda *a, _n=name, **k: calls.append(_n), raising=False)
    schedules = []

    def hook(world):
        b = world.backend
        for attr in ("_paged_attention", "_store_attend", "_kv_store", "_step_metadata"):
            real = getattr(b, attr)

            def wrapped(*a, _real=real, _attr=attr, **k):
                schedules.append((_attr, k.get("pdl")))
                return _real(*a, **k)

            monkeypatch.setattr(b, attr, wrapped)

    _drive(XpuTritonBackend, False, hook)
    kinds = {a for a, _ in schedules}
    assert {"_step_metadata", "_store_attend", "_paged_attention"} <= kinds, kinds
    assert all(p in (None, False) for _, p in schedules), schedules
    assert not calls


def test_xpu_backend_refuses_without_triton_for_xpu(monkeypatch):
    inst = XpuTritonBackend.__new__(XpuTritonBackend)
    inst.device = torch.device("xpu")
    monkeypatch.setattr(xpu_device.XpuTritonDevice, "module", lambda self: torch.xpu)
    monkeypatch.setattr(triton_backend, "triton_xpu_status", lambda: (False, "no intel backend"))
    with pytest.raises(BackendConfigError, match="XpuPortableBackend"):
        inst._check_runtime()
    monkeypatch.setattr(triton_backend, "triton_xpu_status", lambda: (True, "found"))
    inst._check_runtime()


def test_integrations_take_the_triton_backends_for_a_host_model_under_the_interpreter(monkeypatch):
    """A model on the host runs through the xpu and cuda backends while the interpreter runs
    their kernels (the conformance suite's model check does): the integrations' choice asks
    the device part, which serves the host then, and no other device."""
    from attnplug.integrations.choice import BackendChoiceError, backend_class

    cpu = torch.device("cpu")
    for cls in (XpuTritonBackend, CudaBackend):
        assert backend_class(cls, cpu) is cls
        assert cls.device_part.serves(torch.device(cls.device_part.device_type))
        with pytest.raises(BackendChoiceError, match="move the model"):
            backend_class(cls, torch.device("meta"))
    monkeypatch.setattr("attnplug_cuda.kernels.interpret.interpreting", lambda: False)
    with pytest.raises(BackendChoiceError, match="the model is on cpu"):
        backend_class(XpuTritonBackend, cpu)


def test_xpu_describe_says_which_path_runs(monkeypatch):
    facts = XpuTritonBackend.describe()
    assert facts["pdl"] is False and facts["device_type"] == "xpu"
    assert "max_block_n=64" in facts["plan_defaults"]
    monkeypatch.setattr(xpu_device, "triton_xpu_status", lambda: (False, "missing"))
    assert xpu_device.FALLBACK in XpuTritonBackend.describe()["kernels"]
    monkeypatch.setattr(xpu_device, "triton_xpu_status", lambda: (True, "found"))
    assert XpuTritonBackend.describe()["kernels"].startswith("triton: ")


def test_rocm_torch_compiles_pdl_out(monkeypatch):
    """On a ROCm torch the cuda backend is ROCm's home: its capability has pdl False, its
    plans carry no PDL, the C++ store is not chosen, and info says so."""
    monkeypatch.setattr(torch.version, "hip", "6.2", raising=False)
    ok, reason = pdl_supported("cuda")
    assert not ok and "ROCm" in reason
    ok, reason = CudaDevice().pdl_support(torch.device("cuda"))
    assert not ok and "ROCm" in reason
    assert CudaDevice().kv_store_choice("cpp", build=False)[0] == "triton"
    facts = CudaBackend.describe()
    assert "ROCm 6.2" in facts["pdl_rule"] and "ROCm" in facts["platform"]
    world = World(SPEC, CudaBackend, "cpu", seed=2)
    b = world.backend
    assert b.pdl is False and b.capabilities().pdl is False
    for bs, tokens, q in ((2, 20, 10), (3, 3, 1), (3, 12, 4)):
        plan = plan_step(b.shape, bs, tokens, q, b.tuning, b.pdl)
        for layer in (plan.full, plan.swa):
            assert layer is None or (layer.first is None and layer.later is None)


def test_the_cuda_probe_takes_a_rocm_torch(monkeypatch):
    import sys
    import types

    from attnplug_cuda import plugin

    monkeypatch.setattr(torch.version, "hip", "6.2", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    fake = types.ModuleType("triton")
    fake.__version__ = "3.5.0"
    monkeypatch.setitem(sys.modules, "triton", fake)
    result = plugin.probe()
    assert result.available and "2 AMD GPU(s)" in result.reason and "ROCm 6.2, PDL compiled out" in result.reason


@pytest.mark.slow
def test_conformance_quick_profile_passes_on_the_xpu_backend():
    """The shared suite's quick profile (``--attnplug-quick``) against the xpu backend, its
    kernels through the interpreter with the XPU plans, in a child process (inside this one
    the interpreter's calls sit deeper on the stack, where on CPython 3.11 they straddled one
    of its 16 KiB frame chunks, which it then maps and unmaps on every call)."""
    import subprocess
    import sys

    from attnplug_conformance.plugin import CHECKS_DIR
    from attnplug_conformance.pytest_args import pytest_plugin_args

    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            str(CHECKS_DIR),
            *pytest_plugin_args(),
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:unraisableexception",
            "--tb=short",
            "--attnplug-backend",
            "attnplug_xpu.triton_backend:XpuTritonBackend",
            "--attnplug-device",
            "cpu",
            "--attnplug-quick",
        ],
        capture_output=True,
        text=True,
        timeout=HANG_LIMIT_S,
        env=dict(os.environ, TRITON_INTERPRET="1"),
    )
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert " passed" in res.stdout and " failed" not in res.stdout and " error" not in res.stdout
