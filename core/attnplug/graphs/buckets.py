"""Which captured graph serves a step.

The modes a ``GraphRunner`` captures per batch-size bucket (one q_len per request:
``captured_modes``) and whether it can capture EXTEND steps per token-count bucket
(``captures_extend``: a backend at ``GraphSupport.ALWAYS``), the bucket sizes it captures by
default (``default_bucket_sizes``, ``default_extend_tokens``), why it never captures a mode
(``why_not_captured``), and the per-mode table from batch size (EXTEND: token count) to the
smallest captured bucket that holds it (``build_routes``), so that a step finds its graph with
one index (``route``).
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
    "captures_extend",
    "default_bucket_sizes",
    "default_extend_tokens",
    "key_name",
    "route",
    "why_not_captured",
]

#: a captured graph's key: (mode, bucket size); an EXTEND bucket is a token count
GraphKey = Tuple[ForwardMode, int]

#: mode -> (num_draft_tokens the graphs need or None, [bs] -> graph or None (EXTEND: [tokens] ->
#: graph or None), the most requests a graph of the mode holds); a graph is the runner's
#: ``capture.Captured``
Routes = Dict[ForwardMode, Tuple[Optional[int], List[Any], int]]

#: the modes a runner can capture: one graph per bucket fixes the tokens per request
_RUNNER_MODES = GraphSupport.UNIFORM.modes


def captured_modes(support: GraphSupport) -> Tuple[ForwardMode, ...]:
    """The modes a ``GraphRunner`` captures for a backend of this level: those of
    ``support.modes`` (core's ``GRAPH_MODES`` table) with one q_len per request."""
    return tuple(m for m in support.modes if m in _RUNNER_MODES)


def captures_extend(support: GraphSupport) -> bool:
    """Whether a ``GraphRunner`` can capture EXTEND steps of a backend of this level (one graph
    per token-count bucket: the backend takes every length from device tensors)."""
    return ForwardMode.EXTEND in support.modes


def default_extend_tokens(max_tokens: int) -> Tuple[int, ...]:
    """Token-count buckets of EXTEND graphs up to ``max_tokens``: powers of two from 256 (or
    from ``max_tokens`` when smaller), ending at ``max_tokens``. A step pads to the next bucket,
    so its padding stays under half of it."""
    sizes = []
    b = 256
    while b < max_tokens:
        sizes.append(b)
        b *= 2
    sizes.append(max_tokens)
    return tuple(sizes)


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
    """``"MODE/bs=N"`` (EXTEND: ``"EXTEND/tokens=N"``)."""
    return f"{key[0].name}/{'tokens' if key[0] is ForwardMode.EXTEND else 'bs'}={key[1]}"


def why_not_captured(
    mode: ForwardMode,
    backend: AttentionBackend,
    supported: Tuple[ForwardMode, ...],
    wanted: Tuple[ForwardMode, ...],
    extend_tokens: Optional[Sequence[int]] = None,
) -> str:
    """Why a runner over ``backend`` (built with ``extend_tokens``) never captures ``mode`` (one
    sentence)."""
    graphs = backend.capabilities().graphs.name
    if not supported:
        return f"backend {backend.name!r} declares graphs=NEVER"
    if mode is ForwardMode.EXTEND and captures_extend(backend.capabilities().graphs):
        if extend_tokens:
            return f"not in the runner's modes {[m.name for m in wanted]}"
        return "the runner was built without extend_tokens (the token counts of its EXTEND graphs)"
    if mode is ForwardMode.EXTEND:
        return (
            f"backend {backend.name!r} declares graphs={graphs}: EXTEND steps are captured only by a backend "
            "at ALWAYS (lengths read from device tensors inside a graph)"
        )
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
    graphs: Mapping[GraphKey, Any],
    modes: Sequence[ForwardMode],
    max_bs: int,
    num_draft_tokens: Optional[int],
    max_extend_tokens: int = 0,
) -> Routes:
    """Per mode of ``modes``, a table from batch size (EXTEND: token count, up to
    ``max_extend_tokens``) to the graph of the smallest captured bucket that holds it (None: no
    graph)."""
    routes = {}
    for mode in modes:
        sizes = sorted(b for (m, b) in graphs if m is mode)
        top = max_extend_tokens if mode is ForwardMode.EXTEND else max_bs
        table: List[Any] = [None] * (top + 1)
        for n in range(1, top + 1):
            bucket = next((b for b in sizes if b >= n), None)
            table[n] = None if bucket is None else graphs[(mode, bucket)]
        routes[mode] = (num_draft_tokens if mode.is_speculative else None, table, max_bs)
    return routes


def route(routes: Routes, batch: ForwardBatch) -> Any:
    """The graph that replays ``batch`` (host values only), or None (eager)."""
    found = routes.get(batch.forward_mode)
    if found is None:
        return None
    ndt, table, max_bs = found
    bs = batch.batch_size
    n = batch.num_tokens if batch.forward_mode is ForwardMode.EXTEND else bs
    if bs > max_bs or n >= len(table) or (ndt is not None and batch.num_draft_tokens != ndt):
        return None
    return table[n]
