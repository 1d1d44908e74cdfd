"""Registers the ``xpu`` backend (entry point ``xpu`` in the ``attnplug.backends`` group): the
Triton kernels on ``torch.xpu`` (``triton_backend.XpuTritonBackend``); the portable fallback
(``backend.XpuPortableBackend``) is selected by ``module:Class`` (docs/xpu.md)."""

from __future__ import annotations

import importlib.util

from attnplug.registry import ProbeResult, hookimpl

PLUGIN_API_VERSION = "1.0"


def probe() -> ProbeResult:
    """Available when this torch has ``torch.xpu`` and it reports a device
    (``torch.xpu.is_available()`` counts devices; it does not initialise the runtime)."""
    import torch

    if not hasattr(torch, "xpu"):
        return ProbeResult(False, f"torch {torch.__version__} has no torch.xpu (needs torch >= 2.4 with XPU support)")
    try:
        available = torch.xpu.is_available()
    except Exception as exc:
        return ProbeResult(False, f"torch.xpu.is_available() failed: {type(exc).__name__}: {exc}")
    if not available:
        return ProbeResult(
            False, f"no Intel XPU visible (torch {torch.__version__}: torch.xpu.is_available() is False)"
        )
    count = torch.xpu.device_count()
    ipex = "with" if importlib.util.find_spec("intel_extension_for_pytorch") is not None else "without"
    from .device import FALLBACK, triton_xpu_status

    found, why = triton_xpu_status()
    kernels = "Triton kernels" if found else f"no Triton for XPU ({why}): use the portable fallback {FALLBACK}"
    return ProbeResult(
        True,
        f"{count} Intel XPU(s) visible, torch {torch.__version__} {ipex} IPEX; {kernels}",
        device=f"xpu ({count} visible)",
    )


@hookimpl
def attnplug_register_backends(register):
    register(name="xpu", backend="attnplug_xpu.triton_backend:XpuTritonBackend", probe=probe, priority=100)
