"""The ``xpu`` backend: attnplug's Triton kernels on Intel GPUs (``torch.xpu``).

``XpuTritonBackend`` is the device-neutral ``attnplug_cuda.backend.TritonBackend`` (the one
home of the Triton kernels, their planner and launchers) built with the XPU's part
(``device.XpuTritonDevice``): PDL compiled out (every plan's ``PDL`` constexpr is None), the
XPU plan defaults (``device.xpu_tuning``), Xe-cores as compute units, the Triton KV store,
XPU graphs where this torch has ``torch.xpu.XPUGraph``. Intel's Triton backend lowers the
kernels' ``tl.dot`` to the XPU's matrix units (DPAS). FP8 KV caches: both dtypes
(``TritonBackend.fp8_kv_dtypes``), Intel's Triton having the ``fp8e4nv`` / ``fp8e5`` types and
their conversions the kernels use (the stores quantise in integers, no FP8 rounding).

Without Triton for XPU the constructor refuses, naming the portable fallback
(``attnplug_xpu.backend:XpuPortableBackend``); ``attnplug info`` says which one runs here.
On the host, the kernels run with the XPU plans on CPU tensors under the Triton interpreter
(``TRITON_INTERPRET=1``), as the cuda backend's do.

Not yet run on Intel GPUs by this project: docs/xpu.md says what to run and send back.
"""

from __future__ import annotations

from attnplug.backend import BackendConfigError
from attnplug_cuda.backend import TritonBackend

from .device import FALLBACK, XpuTritonDevice, triton_xpu_status

__all__ = ["XpuTritonBackend"]


class XpuTritonBackend(TritonBackend):
    """Paged hybrid full + SWA attention through the Triton kernels on Intel XPUs."""

    name = "xpu"
    device_part = XpuTritonDevice()
    device_label = "an XPU device"

    def _check_runtime(self) -> None:
        if self.device.type != "xpu":  # the host, under the Triton interpreter
            return
        self.device_part.module()
        found, reason = triton_xpu_status()
        if not found:
            raise BackendConfigError(
                f"the xpu backend runs Triton kernels: {reason}; install torch's XPU wheels "
                f"(they ship pytorch-triton-xpu) or select the portable fallback {FALLBACK}"
            )
