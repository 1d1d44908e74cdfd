"""The Ascend NPU's device part: NPU graphs, synchronisation, what ``attnplug info`` shows.

``torch_npu`` is imported on first use, never when this module is imported (importing it
without Ascend's CANN toolkit breaks ``import torch``). The graph class
(``torch.npu.NPUGraph``) is found by feature detection (``TorchDevicePart``), and so are the
task-update calls captured attention needs at replay (``graph_task_update_begin`` and its
companions): without either, ``graphs_available()`` is False and the backend declares
``GraphSupport.NEVER``.
"""

from __future__ import annotations

import importlib

import torch

from attnplug.backends.torch_device import TorchDevicePart

__all__ = ["AscendDevice", "npu_module", "TASK_UPDATE_NAMES"]

#: the runtime calls that re-issue a captured fused-attention task with a step's host lengths
TASK_UPDATE_NAMES = (
    "graph_task_group_begin",
    "graph_task_group_end",
    "graph_task_update_begin",
    "graph_task_update_end",
)


def npu_module():
    """``torch.npu`` after importing torch_npu; ``RuntimeError`` naming torch_npu when it
    cannot be imported."""
    try:
        importlib.import_module("torch_npu")  # registers torch.npu
    except Exception as exc:  # not installed, or installed without CANN
        raise RuntimeError(f"the ascend backend needs torch_npu with Ascend CANN: {type(exc).__name__}: {exc}") from exc
    return torch.npu


class AscendDevice(TorchDevicePart):
    """NPU graphs (``StreamGraph`` over ``torch.npu.NPUGraph``) and NPU synchronisation."""

    device_type = "npu"
    graph_class_name = "NPUGraph"
    missing_graph = "this torch_npu has no NPUGraph: the ascend backend declares GraphSupport.NEVER"

    def module(self):
        return npu_module()

    def graphs_available(self) -> bool:
        """NPUGraph and the task-update calls (the fused attention reads host lengths: a
        replay re-issues it with the step's, ``graph_task_update_begin``/``end``)."""
        if not super().graphs_available():
            return False
        try:
            mod = self.module()
        except RuntimeError:
            return False
        return all(hasattr(mod, name) for name in TASK_UPDATE_NAMES)
