"""The portable fallback of the xpu plugin: Intel GPUs through native ``torch.xpu`` with the
portable PyTorch path (``attnplug.backends.portable.PortableBackend``).

The ``xpu`` backend is the Triton one (``triton_backend.XpuTritonBackend``). This class is the
documented fallback for an install without Triton for XPU (``pytorch-triton-xpu``): select it
by ``module:Class``, ``--backend attnplug_xpu.backend:XpuPortableBackend`` (docs/xpu.md).
Device tensors only (``needs_cpu_seq_lens = False``), one translation per step, every rule of
the contract kept. ``XpuBackend`` is its earlier name.

Not yet run on Intel GPUs by this project: see the README's support matrix.
"""

from __future__ import annotations

from attnplug.backends.torch_device import TorchDeviceBackend

from .device import XpuDevice

__all__ = ["XpuPortableBackend", "XpuBackend"]


class XpuPortableBackend(TorchDeviceBackend):
    """Portable attention on Intel XPUs (see module docstring)."""

    name = "xpu"
    device_part = XpuDevice()
    device_label = "an XPU device"


#: the earlier name of the portable fallback
XpuBackend = XpuPortableBackend
