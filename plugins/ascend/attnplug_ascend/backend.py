"""The ``ascend`` backend: Ascend NPUs through torch_npu, with NPU graphs.

Attention runs the reference backend's portable PyTorch path on the NPU: device tensors only
(``needs_cpu_seq_lens = False``), one translation per step, every rule of the contract kept.
What this module adds is the NPU's device parts: the graph class (``torch.npu.NPUGraph``,
found by feature detection; without it the backend declares ``GraphSupport.NEVER``) and NPU
synchronisation. ``torch_npu`` is imported when the backend is constructed, never when this
package is imported (importing it without Ascend's CANN breaks ``import torch``).

Not yet run on Ascend hardware by this project: see the README's support matrix.
"""

from __future__ import annotations

import dataclasses
import importlib

import torch

from attnplug.backend import Capabilities, GraphSupport
from attnplug.backends.reference import ReferenceBackend
from attnplug.graphs import StreamGraph

__all__ = ["AscendBackend"]


def _npu_module():
    try:
        importlib.import_module("torch_npu")  # registers torch.npu
    except Exception as exc:  # not installed, or installed without CANN
        raise RuntimeError(f"the ascend backend needs torch_npu with Ascend CANN: {type(exc).__name__}: {exc}") from exc
    return torch.npu


def _npu_graph_class():
    return getattr(_npu_module(), "NPUGraph", None)


class AscendBackend(ReferenceBackend):
    """Portable attention on Ascend NPUs (see module docstring)."""

    name = "ascend"
    needs_cpu_seq_lens = False

    def __init__(self, pool, req_to_token_pool, *, num_heads, sliding_window=None, scaling=None):
        _npu_module()
        if pool.device.type != "npu":
            raise ValueError(f"the ascend backend needs a pool on an NPU device, got {pool.device}")
        super().__init__(pool, req_to_token_pool, num_heads=num_heads, sliding_window=sliding_window, scaling=scaling)

    def capabilities(self) -> Capabilities:
        graphs = GraphSupport.UNIFORM if _npu_graph_class() is not None else GraphSupport.NEVER
        return dataclasses.replace(super().capabilities(), graphs=graphs)

    @classmethod
    def new_graph(cls):
        graph_cls = _npu_graph_class()
        if graph_cls is None:
            raise RuntimeError("this torch_npu has no NPUGraph: the ascend backend declares GraphSupport.NEVER")
        return StreamGraph(_npu_module(), graph_cls)

    @classmethod
    def synchronize(cls, device: torch.device) -> None:
        _npu_module().synchronize(device)
