"""The ``ascend`` backend: Ascend NPUs through torch_npu, with NPU graphs.

Attention runs the portable PyTorch path (``attnplug.backends.portable.PortableBackend``) on
the NPU: device tensors only (``needs_cpu_seq_lens = False``), one translation per step, every
rule of the contract kept. The NPU's own parts (graph class, synchronisation) are in
``device.py``. ``torch_npu`` is imported when the backend is constructed, never when this
package is imported.

Not yet run on Ascend hardware by this project: see the README's support matrix.
"""

from __future__ import annotations

from attnplug.backends.torch_device import TorchDeviceBackend

from .device import AscendDevice

__all__ = ["AscendBackend"]


class AscendBackend(TorchDeviceBackend):
    """Portable attention on Ascend NPUs (see module docstring)."""

    name = "ascend"
    device_part = AscendDevice()
    device_label = "an NPU device"
