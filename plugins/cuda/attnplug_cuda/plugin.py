"""Registers the ``cuda`` backend (entry point ``cuda`` in the ``attnplug.backends`` group).

ROCm's home is this backend: on a ROCm build of torch (``torch.version.hip``) it runs the same
Triton kernels on AMD GPUs, PDL compiled out and the Triton KV store (``device.CudaDevice``).

Importable on any machine: torch and triton are looked at only inside the probe, and the
backend module (``attnplug_cuda.backend``) is imported by the registry only when the probe
passes and the backend is listed or selected.
"""

from __future__ import annotations

from attnplug.registry import ProbeResult, hookimpl
from attnplug.versions import at_least, dotted

from . import env as _env  # noqa: F401  (declares the plugin's ATTNPLUG_* variables, so info checks them)

PLUGIN_API_VERSION = "1.0"


def probe() -> ProbeResult:
    """Available when torch is a CUDA build with an NVIDIA GPU visible, or a ROCm build with
    an AMD GPU visible (the same Triton kernels, PDL compiled out), and Triton >= 3.5
    imports. Creates no device context (``torch.cuda.device_count`` does not)."""
    import torch

    from .kernels.pdl import MIN_TRITON_VERSION as MIN_TRITON

    hip = getattr(torch.version, "hip", None)
    if hip:
        platform, vendor = f"ROCm {hip}, PDL compiled out", "AMD"
    elif not torch.version.cuda:
        return ProbeResult(False, f"torch {torch.__version__} was built without CUDA")
    else:
        platform, vendor = f"CUDA {torch.version.cuda}", "NVIDIA"
    count = torch.cuda.device_count()
    if count == 0:
        return ProbeResult(
            False,
            f"no {vendor} GPU visible (torch {torch.__version__}, {platform}, "
            "torch.cuda.device_count() == 0; check the driver and "
            f"{'HIP_VISIBLE_DEVICES' if hip else 'CUDA_VISIBLE_DEVICES'})",
        )
    try:
        import triton
    except Exception as exc:  # not installed, or broken
        return ProbeResult(
            False,
            f"triton >= {dotted(MIN_TRITON)} is required: import failed: "
            f"{type(exc).__name__}: {exc} (pip install 'attnplug[cuda]'; {platform})",
            device=f"{count} GPU(s)",
        )
    version = getattr(triton, "__version__", "0")
    if not at_least(version, MIN_TRITON):
        return ProbeResult(
            False, f"triton {version} is too old; need >= {dotted(MIN_TRITON)} ({platform})", device=f"{count} GPU(s)"
        )
    return ProbeResult(
        True,
        f"{count} {vendor} GPU(s) visible, {platform}, triton {version}",
        device=f"cuda ({count} visible)",
    )


@hookimpl
def attnplug_register_backends(register):
    register(name="cuda", backend="attnplug_cuda.backend:CudaBackend", probe=probe, priority=100)
