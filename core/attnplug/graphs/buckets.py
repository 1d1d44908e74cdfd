"""Which captured graph serves a step.

The modes a ``GraphRunner`` can capture (one q_len per request: ``captured_modes``), the bucket
sizes it captures by default (``default_bucket_sizes``), why it never captures a mode
(``why_not_captured``), and the per-mode table from batch size to the smallest captured bucket
that holds it (``build_routes``), so that a step finds its graph with one index (``route``).
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from ..backend import AttentionBackend, GraphSupport
from ..batch import ForwardBatch, ForwardMode

__all__ = [
    "GraphKey",
    "Routes",
    "build_routes",
    "captured_modes",
    "default_bucket_sizes",
    "key_name",
    "route",
    "why_not_captured",
]

#: a captured graph's key: (mode, bucket size)
GraphKey = Tuple[ForwardMode, int]

#: mode -> (num_draft_tokens the graphs need or None, [bs] -> graph or None); a graph is the
#: runner's ``capture.Captured``
Routes = Dict[ForwardMode, Tuple[Optional[int], List[Any]]]

#: the modes a runner can capture: one graph per bucket fixes the tokens per request
_RUNNER_MODES = GraphSupport.UNIFORM.modes


def captured_modes(support: GraphSupport) -> Tuple[ForwardMode, ...]:
    """The modes a ``GraphRunner`` captures for a backend of this level: those of
    ``support.modes`` (core's ``GRAPH_MODES`` table) with one q_len per request."""
    return tuple(m for m in support.modes if m in _RUNNER_MODES)


def default_bucket_sizes(max_bs: int) -> Tuple[int, ...]:
    """1, 2, 4, 8, then every 8 up to 64, then every 16, ending at ``max_bs``."""
    sizes = [b for b in (1, 2, 4) if b < max_bs]
    b = 8
    while b < max_bs:
        sizes.append(b)
        b += 8 if b < 64 else 16
    sizes.append(max_bs)
    return tuple(sizes)


def key_name(key: GraphKey) -> str:
    """``"MODE/bs=N"``."""
    return f"{key[0].name}/bs={key[1]}"


def why_not_captured(
    mode: ForwardMode, backend: AttentionBackend, supported: Tuple[ForwardMode, ...], wanted: Tuple[ForwardMode, ...]
) -> str:
    """Why a runner over ``backend`` never captures ``mode`` (one sentence)."""
    graphs = backend.capabilities().graphs.name
    if not supported:
        return f"backend {backend.name!r} declares graphs=NEVER"
    if mode not in _RUNNER_MODES:
        return (
            "GraphRunner captures only modes with the same number of new tokens per request "
            "(DECODE, TARGET_VERIFY, DRAFT_EXTEND)"
        )
    if mode not in supported:
        return f"backend {backend.name!r} declares graphs={graphs} ({', '.join(m.name for m in supported)})"
    if mode not in wanted:
        return f"not in the runner's modes {[m.name for m in wanted]}"
    return "the runner was built without num_draft_tokens (the q_len these modes need)"


def build_routes(
    graphs: Mapping[GraphKey, Any], modes: Sequence[ForwardMode], max_bs: int, num_draft_tokens: Optional[int]
) -> Routes:
    """Per mode of ``modes``, a table from batch size to the graph of the smallest captured
    bucket that holds it (None: no graph)."""
    routes = {}
    for mode in modes:
        sizes = sorted(b for (m, b) in graphs if m is mode)
        table: List[Any] = [None] * (max_bs + 1)
        for bs in range(1, max_bs + 1):
            bucket = next((b for b in sizes if b >= bs), None)
            table[bs] = None if bucket is None else graphs[(mode, bucket)]
        routes[mode] = (num_draft_tokens if mode.is_speculative else None, table)
    return routes


def route(routes: Routes, batch: ForwardBatch) -> Any:
    """The graph that replays ``batch`` (host values only), or None (eager)."""
    found = routes.get(batch.forward_mode)
    if found is None:
        return None
    ndt, table = found
    bs = batch.batch_size
    if bs >= len(table) or (ndt is not None and batch.num_draft_tokens != ndt):
        return None
    return table[bs]
