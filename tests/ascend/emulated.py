"""The ascend backend on the host, its torch_npu operators EMULATED by tests/ascend/npu_standin.py.

``EmulatedAscendBackend`` is ``AscendBackend`` on the ``cpu`` device with the stand-in injected
(``AscendBackend.ops_module``) and the stand-in's NPU graph runtime behind ``StreamGraph`` (the
path real NPU graphs take): every call the backend makes — the KV store, the fused attention with
its host lengths, the task groups captured and re-issued at replay — runs against the operators'
documented semantics. It is a test target, never a backend anyone serves with; its name and
``describe()`` say "emulated".

``EmulatedAscendBackendSmallPages`` also declares page sizes 1 and 4 (the conformance suite's
base configurations) with the stand-in's block-size rule relaxed: the whole suite then reaches
every check through the fused-operator path. The real operator refuses those block sizes.

Conformance targets: ``emulated:EmulatedAscendBackend``, ``emulated:EmulatedAscendBackendSmallPages``
(tests/ascend on ``sys.path``).
"""

from __future__ import annotations

from typing import Any, Dict

import npu_standin

from attnplug.device_part import DevicePart
from attnplug.graphs import StreamGraph
from attnplug_ascend.backend import AscendBackend

__all__ = ["EmulatedNpuDevice", "EmulatedAscendBackend", "EmulatedAscendBackendSmallPages"]


class EmulatedNpuDevice(DevicePart):
    """The host standing in for an NPU: ``StreamGraph`` over the stand-in's ``NPUGraph``."""

    device_type = "cpu"

    def __init__(self, standin: npu_standin.StandIn) -> None:
        self.standin = standin

    def new_graph(self) -> StreamGraph:
        npu = self.standin.npu
        return StreamGraph(npu, npu.NPUGraph, pool_ops=None)

    def synchronize(self, device) -> None:
        pass

    def describe(self) -> Dict[str, Any]:
        return {"graph_class": "emulated NPUGraph (tests/ascend/npu_standin.py)", "operators": self.standin.SOURCE}


class EmulatedAscendBackend(AscendBackend):
    """``AscendBackend`` with its operators emulated on the host (see module docstring)."""

    name = "ascend-emulated"
    device_part = EmulatedNpuDevice(npu_standin.STANDIN)
    device_label = "the host (the emulated NPU)"
    ops_module = staticmethod(lambda: npu_standin.STANDIN)


class EmulatedAscendBackendSmallPages(EmulatedAscendBackend):
    """The same, also declaring page sizes 1 and 4, the stand-in's block-size rule relaxed."""

    name = "ascend-emulated-small-pages"
    page_sizes = (1, 4, 128)
    device_part = EmulatedNpuDevice(npu_standin.RELAXED)
    ops_module = staticmethod(lambda: npu_standin.RELAXED)
