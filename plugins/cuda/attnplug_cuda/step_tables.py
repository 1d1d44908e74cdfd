"""``StepTables``: what one step's metadata launch writes and what its layers read.

Eager steps get fresh tensors (``StepTables.allocate``); graph mode gets views of the static
buffers that ``init_cuda_graph_state`` allocates once (``graph_buffers`` / ``StepTables.view``),
one ``StepTables`` per captured ``(bs, q_len)`` bucket, whose addresses never change. A captured
EXTEND step of up to ``T`` tokens (``StepTables.view_extend``) also reads a tile map and a
window table as wide as ``T`` tokens of one request allow: buffers of the graph state sized
for its largest EXTEND bucket (``extend_buffers``), allocated when that bucket is captured.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional

import torch

from attnplug.graph_buffers import GraphBuffers

from .planner import AttentionShape, StepPlan

__all__ = ["StepTables", "extend_buffers", "graph_buffers"]


@dataclass
class StepTables:
    """Per-step tables (device tensors; graph mode: views of the static buffers) and the
    step's plan."""

    plan: StepPlan
    max_q_len: int  # host bound: most new tokens of one request
    cu_q_lens: torch.Tensor  # [bs + 1] int32
    window_start: torch.Tensor  # [bs] int32: position of column 0 of swa_window_table
    token_pos: torch.Tensor  # [T] int32: position of each new token
    swa_out_cache_loc: Optional[torch.Tensor]  # [T] int32 (graphs: the whole buffer): hoisted SWA slots
    swa_window_table: Optional[torch.Tensor]  # [bs, width] int32: SWA slots of the window
    workspace: Optional[torch.Tensor]  # fp32 split-KV scratch of paged_attention (graph mode: static)
    tiles: Optional[torch.Tensor] = None  # [P, 2] int32: paged_attention's tile map (captured EXTEND)
    relaunch: Optional[object] = None  # graph mode: repeats the metadata launch (same buffers)
    relaunch_key: tuple = ()  # the batch tensors relaunch was built for
    # graph mode, copies from the engine's step: (step dtypes, positions given) ->
    # (the static tensors it writes, the Relaunch that takes each step's tensors)
    padded_launches: Dict[tuple, tuple] = field(default_factory=dict)

    @classmethod
    def allocate(cls, plan: StepPlan, shape: AttentionShape, bs: int, T: int, max_q_len: int, device) -> "StepTables":
        """Fresh tables of an eager step of ``bs`` requests and ``T`` tokens."""
        i32 = dict(dtype=torch.int32, device=device)
        swa = shape.window is not None
        return cls(
            plan=plan,
            max_q_len=max_q_len,
            cu_q_lens=torch.empty(bs + 1, **i32),
            window_start=torch.empty(bs, **i32),
            token_pos=torch.empty(T, **i32),
            swa_out_cache_loc=torch.empty(T, **i32) if swa else None,
            swa_window_table=torch.empty(bs, shape.table_width(max_q_len), **i32) if swa else None,
            workspace=None,
        )

    @classmethod
    def view(cls, plan: StepPlan, shape: AttentionShape, buffers: GraphBuffers, bs: int, q_len: int) -> "StepTables":
        """The tables of a captured bucket: views of ``buffers`` (``graph_buffers``)."""
        n = bs * q_len
        buffers.check_fits(bs, n)
        table = None
        if shape.window is not None:
            width = shape.table_width(q_len)
            table = buffers["swa_window_table"][: bs * width].view(bs, width)
        return cls(
            plan=plan,
            max_q_len=q_len,
            cu_q_lens=buffers["cu_q_lens"][: bs + 1],
            window_start=buffers["window_start"][:bs],
            token_pos=buffers["token_pos"][:n],
            # the whole buffer: the launch translates [:n] and zeroes the tail
            swa_out_cache_loc=buffers.swa_out_cache_loc if shape.window is not None else None,
            swa_window_table=table,
            workspace=buffers["workspace"],
        )

    @classmethod
    def view_extend(
        cls, plan: StepPlan, shape: AttentionShape, buffers: GraphBuffers, bs: int, num_tokens: int
    ) -> "StepTables":
        """The tables of a captured EXTEND step of ``bs`` requests (padded ones have no tokens)
        and up to ``num_tokens`` tokens, any request up to all of them: views of ``buffers``
        and of its ``extend_buffers``."""
        buffers.check_fits(bs, num_tokens)
        rows = plan.full.kernel.BLOCK_M
        tiles, table = extend_buffers(shape, buffers, bs, num_tokens, rows)
        return cls(
            plan=plan,
            max_q_len=num_tokens,
            cu_q_lens=buffers["cu_q_lens"][: bs + 1],
            window_start=buffers["window_start"][:bs],
            token_pos=buffers["token_pos"][:num_tokens],
            swa_out_cache_loc=buffers.swa_out_cache_loc if shape.window is not None else None,
            swa_window_table=table,
            workspace=buffers["workspace"],
            tiles=tiles,
        )


def extend_buffers(shape: AttentionShape, buffers: GraphBuffers, bs: int, num_tokens: int, rows: int):
    """``(tiles [P, 2], window table [bs, width] or None)`` of a captured EXTEND step: views of
    the graph state's ``extend_tiles`` / ``extend_window_table`` (``buffers.shared``), allocated
    (or grown) here, before the capture that first needs them. ``P`` holds every request's row
    blocks of ``rows`` rows: ``cdiv(num_tokens * G, rows) + bs``; ``width`` covers one request
    holding all ``num_tokens`` tokens."""
    count = -(-num_tokens * shape.group // rows) + bs
    width = shape.table_width(num_tokens) if shape.window is not None else 0
    need = {"extend_tiles": count * 2, "extend_window_table": bs * width}
    for name, numel in need.items():
        held = buffers.shared.get(name)
        if numel and (held is None or held.numel() < numel):
            buffers.shared[name] = torch.zeros(numel, dtype=torch.int32, device=buffers.device)
    tiles = buffers.shared["extend_tiles"][: count * 2].view(count, 2)
    table = buffers.shared["extend_window_table"][: bs * width].view(bs, width) if width else None
    return tiles, table


def graph_buffers(
    shape: AttentionShape, device, max_bs: int, max_num_tokens: int, workspace_numel: int
) -> GraphBuffers:
    """The static buffers of every captured bucket up to ``max_bs`` requests and
    ``max_num_tokens`` tokens. The step_metadata launch writes the whole of
    ``swa_out_cache_loc``: ``[:n]`` translated, ``[n:]`` zeroed, exactly
    ``GraphBuffers.expected_swa_out_cache_loc`` (tested)."""
    i32 = dict(dtype=torch.int32)
    buffers = GraphBuffers(device, max_bs, max_num_tokens)
    buffers.add("cu_q_lens", max_bs + 1, **i32)
    buffers.add("window_start", "requests", **i32)
    buffers.add("token_pos", "tokens", **i32)
    buffers.add("workspace", workspace_numel, dtype=torch.float32)
    if shape.window is not None:
        # Rows of any captured (bs, q_len) fit: bs * (W + q_len - 1) <= max_bs * W + max_num_tokens.
        buffers.add("swa_window_table", max_bs * shape.window + max_num_tokens, **i32)
    return buffers
