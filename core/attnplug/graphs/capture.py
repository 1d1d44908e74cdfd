"""Capturing one (mode, bucket) graph of a ``GraphRunner``, and what a failed capture leaves.

``capture_bucket`` runs the backend's capture metadata and captures ``step`` on the padded
static batch through ``backend.new_graph()``; the captured callable holds the step, the batch
and the input views, never the runner (no reference cycle). A capture that raises is described
by ``describe_failure`` (the runner keeps the reason and leaves the bucket out);
``GraphCaptureError`` carries every failure of ``capture(strict=True)``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Dict, Mapping, Optional

import torch

from ..backend import AttentionBackend
from ..batch import ForwardBatch
from .buckets import GraphKey, key_name
from .device_graph import DeviceGraph

__all__ = ["Captured", "GraphCaptureError", "capture_bucket", "describe_failure"]


class GraphCaptureError(RuntimeError):
    """``GraphRunner.capture(strict=True)`` found buckets it could not capture.
    ``failures`` maps each ``(mode, bucket)`` to the reason."""

    def __init__(self, failures: Mapping[GraphKey, str]) -> None:
        self.failures = dict(failures)
        lines = "; ".join(f"{key_name(k)}: {r}" for k, r in self.failures.items())
        super().__init__(f"{len(self.failures)} graph capture(s) failed: {lines}")


def describe_failure(exc: BaseException) -> str:
    """``Type: first line of the message`` of ``exc`` and of the exceptions it was raised while
    handling (the runner logs the full traceback at DEBUG)."""
    parts, seen = [], set()
    while exc is not None and id(exc) not in seen and len(parts) < 3:
        seen.add(id(exc))
        first_line = (str(exc).strip().splitlines() or [""])[0]
        parts.append(f"{type(exc).__name__}: {first_line}")
        exc = exc.__cause__ or exc.__context__
    return " <- raised while handling ".join(parts)


@dataclass
class Captured:
    """One captured graph: ``batch`` the padded static batch (views of the runner's buffers),
    ``output`` the static output the graph rewrites on replay."""

    graph: DeviceGraph
    batch: ForwardBatch
    output: torch.Tensor
    rows: Dict[int, torch.Tensor] = field(default_factory=dict)  # n -> output[:n] (cached views)

    def output_rows(self, n: int) -> torch.Tensor:
        view = self.rows.get(n)
        if view is None:
            view = self.rows[n] = self.output[:n]
        return view


def capture_bucket(
    backend: AttentionBackend,
    step: Callable[[ForwardBatch, Dict[str, torch.Tensor]], torch.Tensor],
    batch: ForwardBatch,
    views: Dict[str, torch.Tensor],
    rows: Optional[int] = None,
) -> Captured:
    """Capture ``step(batch, views)`` through a new device graph of ``backend``; raises when
    the capture does, or when the step returns fewer than ``rows`` rows (default: the batch's
    tokens)."""
    backend.init_forward_metadata_capture_cuda_graph(batch)
    graph = backend.new_graph()
    # The callable holds the step, the batch and the views, never the runner (no cycle).
    output = graph.capture(functools.partial(step, batch, views))
    rows = batch.num_tokens if rows is None else rows
    if not isinstance(output, torch.Tensor) or output.dim() == 0 or output.shape[0] < rows:
        got = tuple(output.shape) if isinstance(output, torch.Tensor) else type(output).__name__
        raise ValueError(f"the step must return a tensor of >= {rows} rows, got {got}")
    return Captured(graph, batch, output)
