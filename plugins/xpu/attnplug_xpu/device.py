"""The Intel XPU's device part: XPU graphs, synchronisation, what ``attnplug info`` shows.

The graph class (``torch.xpu.XPUGraph``, present from torch 2.11) is found by feature
detection (``TorchDevicePart``): without it ``graphs_available()`` is False and the backend
declares ``GraphSupport.NEVER``. Intel Extension for PyTorch is optional and never imported here.
"""

from __future__ import annotations

from attnplug.backends.torch_device import TorchDevicePart

__all__ = ["XpuDevice"]


class XpuDevice(TorchDevicePart):
    """XPU graphs (``StreamGraph`` over ``torch.xpu.XPUGraph``) and XPU synchronisation."""

    device_type = "xpu"
    graph_class_name = "XPUGraph"
    missing_graph = "this torch has no torch.xpu.XPUGraph: the xpu backend declares GraphSupport.NEVER"
