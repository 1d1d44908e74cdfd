"""Registers the ``xpu`` backend (entry point ``xpu`` in the ``attnplug.backends`` group)."""

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
    return ProbeResult(
        True, f"{count} Intel XPU(s) visible, torch {torch.__version__} {ipex} IPEX", device=f"xpu ({count} visible)"
    )


@hookimpl
def attnplug_register_backends(register):
    register(name="xpu", backend="attnplug_xpu.backend:XpuBackend", probe=probe, priority=100)
