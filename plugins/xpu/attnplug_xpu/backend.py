"""The ``xpu`` backend: Intel GPUs through native ``torch.xpu`` (IPEX not required).

Attention runs the reference backend's portable PyTorch path on the XPU: device tensors only
(``needs_cpu_seq_lens = False``), one translation per step, every rule of the contract kept.
What this module adds is the XPU's device parts: the graph class (``torch.xpu.XPUGraph``,
present from torch 2.11, found by feature detection; without it the backend declares
``GraphSupport.NEVER``) and XPU synchronisation. Intel Extension for PyTorch is optional and
never imported here (it was discontinued upstream).

Not yet run on Intel GPUs by this project: see the README's support matrix.
"""

from __future__ import annotations

import dataclasses

import torch

from attnplug.backend import Capabilities, GraphSupport
from attnplug.backends.reference import ReferenceBackend
from attnplug.graphs import StreamGraph

__all__ = ["XpuBackend"]


def _xpu_graph_class():
    xpu = getattr(torch, "xpu", None)
    return getattr(xpu, "XPUGraph", None) if xpu is not None else None


class XpuBackend(ReferenceBackend):
    """Portable attention on Intel XPUs (see module docstring)."""

    name = "xpu"
    needs_cpu_seq_lens = False

    def __init__(self, pool, req_to_token_pool, *, num_heads, sliding_window=None, scaling=None):
        if pool.device.type != "xpu":
            raise ValueError(f"the xpu backend needs a pool on an XPU device, got {pool.device}")
        super().__init__(pool, req_to_token_pool, num_heads=num_heads, sliding_window=sliding_window, scaling=scaling)

    def capabilities(self) -> Capabilities:
        graphs = GraphSupport.UNIFORM if _xpu_graph_class() is not None else GraphSupport.NEVER
        return dataclasses.replace(super().capabilities(), graphs=graphs)

    @classmethod
    def new_graph(cls):
        graph_cls = _xpu_graph_class()
        if graph_cls is None:
            raise RuntimeError("this torch has no torch.xpu.XPUGraph: the xpu backend declares GraphSupport.NEVER")
        return StreamGraph(torch.xpu, graph_cls)

    @classmethod
    def synchronize(cls, device: torch.device) -> None:
        torch.xpu.synchronize(device)
