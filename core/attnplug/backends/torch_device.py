"""The portable backend on one of torch's device modules, for a plugin without its own kernels.

A plugin whose device has a torch module (``torch.<device_type>``) with stream-capture graphs
declares, in a few lines, a ``TorchDevicePart`` (the device type, the name of the module's
graph class, the message when this install lacks it) and a ``TorchDeviceBackend`` naming that
part. The graph class is found by feature detection: without it ``graphs_available()`` is
False and the backend declares ``GraphSupport.NEVER``. A device whose module appears only
after importing a runtime package overrides ``TorchDevicePart.module`` to import it (raising
``RuntimeError`` that names the package when it cannot).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, ClassVar, Dict, Optional

import torch

from ..device_part import DevicePart
from ..graphs import StreamGraph
from .portable import PortableBackend

__all__ = ["TorchDevicePart", "TorchDeviceBackend"]


class TorchDevicePart(DevicePart):
    """Graphs (``StreamGraph`` over ``torch.<device_type>.<graph_class_name>``) and
    synchronisation through the device's torch module."""

    #: the name of the module's graph class
    graph_class_name: ClassVar[str] = ""
    #: the ``RuntimeError`` of ``new_graph()`` when this install has no graph class
    missing_graph: ClassVar[str] = ""

    def module(self) -> Optional[ModuleType]:
        """``torch.<device_type>`` (None when this torch has none)."""
        return getattr(torch, self.device_type, None)

    def graph_class(self) -> Optional[type]:
        return getattr(self.module(), self.graph_class_name, None)

    def new_graph(self) -> StreamGraph:
        graph_cls = self.graph_class()
        if graph_cls is None:
            raise RuntimeError(self.missing_graph)
        return StreamGraph(self.module(), graph_cls)

    def graphs_available(self) -> bool:
        try:
            return self.graph_class() is not None
        except RuntimeError:  # the runtime is missing: no graphs (the probe says why)
            return False

    def synchronize(self, device: torch.device) -> None:
        self.module().synchronize(device)

    def describe(self) -> Dict[str, Any]:
        name = f"torch.{self.device_type}.{self.graph_class_name}"
        return {"graph_class": name if self.graphs_available() else "none (GraphSupport.NEVER)"}


class TorchDeviceBackend(PortableBackend):
    """``PortableBackend`` on the device of its ``TorchDevicePart``: construction loads the
    device module and refuses a pool on another device."""

    device_part: ClassVar[TorchDevicePart]
    #: the device as the refusal names it, e.g. "an XYZ device"
    device_label: ClassVar[str] = ""

    def __init__(self, pool, req_to_token_pool, **kwargs) -> None:
        self.device_part.module()
        if pool.device.type != self.device_part.device_type:
            raise ValueError(f"the {self.name} backend needs a pool on {self.device_label}, got {pool.device}")
        super().__init__(pool, req_to_token_pool, **kwargs)
