"""The Ascend NPU's device part: NPU graphs, synchronisation, what ``attnplug info`` shows.

``torch_npu`` is imported on first use, never when this module is imported (importing it
without Ascend's CANN toolkit breaks ``import torch``). The graph class
(``torch.npu.NPUGraph``) is found by feature detection: without it ``graphs_available()`` is
False and the backend declares ``GraphSupport.NEVER``.
"""

from __future__ import annotations

import importlib
from typing import Any, Dict

import torch

from attnplug.device_part import DevicePart
from attnplug.graphs import StreamGraph

__all__ = ["AscendDevice", "npu_module"]


def npu_module():
    """``torch.npu`` after importing torch_npu; ``RuntimeError`` naming torch_npu when it
    cannot be imported."""
    try:
        importlib.import_module("torch_npu")  # registers torch.npu
    except Exception as exc:  # not installed, or installed without CANN
        raise RuntimeError(f"the ascend backend needs torch_npu with Ascend CANN: {type(exc).__name__}: {exc}") from exc
    return torch.npu


def _npu_graph_class():
    return getattr(npu_module(), "NPUGraph", None)


class AscendDevice(DevicePart):
    """NPU graphs (``StreamGraph`` over ``torch.npu.NPUGraph``) and NPU synchronisation."""

    device_type = "npu"

    def new_graph(self) -> StreamGraph:
        graph_cls = _npu_graph_class()
        if graph_cls is None:
            raise RuntimeError("this torch_npu has no NPUGraph: the ascend backend declares GraphSupport.NEVER")
        return StreamGraph(npu_module(), graph_cls)

    def graphs_available(self) -> bool:
        try:
            return _npu_graph_class() is not None
        except RuntimeError:  # torch_npu missing: no graphs (the probe says why)
            return False

    def synchronize(self, device: torch.device) -> None:
        npu_module().synchronize(device)

    def describe(self) -> Dict[str, Any]:
        return {"graph_class": "torch.npu.NPUGraph" if self.graphs_available() else "none (GraphSupport.NEVER)"}
