"""The ``xpu`` backend: Intel GPUs through native ``torch.xpu`` (IPEX not required).

Attention runs the portable PyTorch path (``attnplug.backends.portable.PortableBackend``) on
the XPU: device tensors only (``needs_cpu_seq_lens = False``), one translation per step, every
rule of the contract kept. The XPU's own parts (graph class, synchronisation) are in
``device.py``.

Not yet run on Intel GPUs by this project: see the README's support matrix.
"""

from __future__ import annotations

from attnplug.backends.torch_device import TorchDeviceBackend

from .device import XpuDevice

__all__ = ["XpuBackend"]


class XpuBackend(TorchDeviceBackend):
    """Portable attention on Intel XPUs (see module docstring)."""

    name = "xpu"
    device_part = XpuDevice()
    device_label = "an XPU device"
