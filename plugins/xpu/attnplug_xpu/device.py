"""The Intel XPU's device part: XPU graphs, synchronisation, what ``attnplug info`` shows.

The graph class (``torch.xpu.XPUGraph``, present from torch 2.11) is found by feature
detection: without it ``graphs_available()`` is False and the backend declares
``GraphSupport.NEVER``. Intel Extension for PyTorch is optional and never imported here.
"""

from __future__ import annotations

from typing import Any, Dict

import torch

from attnplug.device_part import DevicePart
from attnplug.graphs import StreamGraph

__all__ = ["XpuDevice"]


def _xpu_graph_class():
    xpu = getattr(torch, "xpu", None)
    return getattr(xpu, "XPUGraph", None) if xpu is not None else None


class XpuDevice(DevicePart):
    """XPU graphs (``StreamGraph`` over ``torch.xpu.XPUGraph``) and XPU synchronisation."""

    device_type = "xpu"

    def new_graph(self) -> StreamGraph:
        graph_cls = _xpu_graph_class()
        if graph_cls is None:
            raise RuntimeError("this torch has no torch.xpu.XPUGraph: the xpu backend declares GraphSupport.NEVER")
        return StreamGraph(torch.xpu, graph_cls)

    def graphs_available(self) -> bool:
        return _xpu_graph_class() is not None

    def synchronize(self, device: torch.device) -> None:
        torch.xpu.synchronize(device)

    def describe(self) -> Dict[str, Any]:
        return {"graph_class": "torch.xpu.XPUGraph" if self.graphs_available() else "none (GraphSupport.NEVER)"}
