"""One launch per forward step that builds every per-step table the layers read.

This is where the hoisted SWA work happens (DESIGN rule 1): the new tokens' full-pool slots
are translated to SWA slots, and the sliding window's SWA page table is gathered, ONCE per
step, from device tensors only (DESIGN rule 2: no host read anywhere).

Outputs (``bs`` requests, ``T`` new tokens, ``q_len_b`` new tokens of request ``b``):

=====================  ===================  ===============================================
output                 shape / dtype        value
=====================  ===================  ===============================================
swa_out_cache_loc      [L >= T] int32       ``[:T] = full_to_swa_index_mapping[out_cache_loc]``
                                            where ``0 <= out_cache_loc < M``, else -1 ("no
                                            slot": -1 itself and any garbage; nothing wraps);
                                            ``[T:] = 0`` (graph buffers are longer)
cu_q_lens              [bs + 1] int32       exclusive prefix sum of ``q_len_b``
window_start           [bs] int32           ``max(0, seq_len - q_len_b - W + 1)``; 0 when
                                            there is no window
token_pos              [>= T] int32         ``[cu_q_lens[b] + i] = seq_len_b - q_len_b + i``
                                            (its causal KV length is ``token_pos + 1``)
tiles (optional)       [P, 2] int32         the attention grid as a tile map (EXTEND steps
                                            whose grid must not depend on their lengths):
                                            request ``b``'s ``n_b = cdiv(q_len_b * G, R)``
                                            row blocks of ``R`` (token, q head) rows take
                                            entries ``[sum_{i<b} n_i, + n_b)``, its last
                                            row block first (``(b, n_b - 1), ..., (b, 0)``);
                                            the entries past every request's are ``(bs - 1,
                                            P)``: a row block past any request's rows
swa_window_table       [>= bs, width] int32 ``[b, c] = mapping[req_to_token[req_pool_indices[b],
                                            window_start[b] + c]]`` where
                                            ``window_start[b] + c < seq_len_b``, else 0
                                            (a row outside ``req_to_token`` reads row 0, a
                                            full slot outside the mapping gives 0);
                                            ``width >= max q_len + W - 1`` (caller's bound)
=====================  ===================  ===============================================

Inputs: ``req_pool_indices`` [bs] int32/int64, ``seq_lens`` [bs] int32/int64 (KV length
INCLUDING the new tokens), ``extend_lens``: a host int (uniform modes: 1 for decode,
``num_draft_tokens`` for TARGET_VERIFY / DRAFT_EXTEND) or the [bs] int32/int64
``extend_seq_lens`` tensor (EXTEND), ``out_cache_loc`` [T] int64, ``full_to_swa_index_mapping``
[M] int32, ``req_to_token`` [R, C] int32.

Padded copy (graph replay of a step in a larger captured bucket, ``padded=PaddedCopy(...)``):
the launch reads the engine's own step tensors and also writes them, padded, into the graph's
static ``req_pool_indices`` / ``seq_lens`` [bs_padded] and ``out_cache_loc`` / ``positions``
[T_padded]: padded requests get row 0 and ``fill_value``, padded tokens slot 0 and position 0.
Every output above is then computed for the padded step, exactly as a launch over the filled
static tensors would. This folds the graph runner's copies into the one launch. The step's
tensors, sizes and strides are the kernel's per-step arguments (``_PER_STEP``, never
specialised), so ``Relaunch`` repeats the launch for each new step with only those replaced.

Grid: ONE launch, 1-D, programs split by role; no program depends on another's output:

* programs ``[0, NB_LOC)``: ``BLOCK_T`` entries each of ``swa_out_cache_loc`` (translation
  and tail zeroing) and of the padded ``out_cache_loc`` / ``positions``; program 0 also
  writes ``cu_q_lens[0] = 0``;
* programs ``[NB_LOC, NB_LOC + bs * NCHUNK)``: request ``b``, window-table chunk ``c`` of
  ``BLOCK_W`` columns. Chunk 0 also writes ``cu_q_lens[b + 1]``, ``window_start[b]``, the
  request's ``token_pos``, its tiles and its padded ``req_pool_indices`` / ``seq_lens``,
  computing its own prefix sums of the extend lens (and of their row blocks) with masked
  loads; the last request's also writes the tile map's tail.

PDL: ``gdc_wait`` first (``seq_lens`` and friends may have just been written by a copy),
``gdc_launch_dependents`` after the last store.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Tuple, Union

import torch
import triton
import triton.language as tl

from .common import pdl_release, pdl_wait
from .interpret import ensure_interpreter_compat
from .pdl import PLAIN, launch_options
from .relaunch import Relaunch

__all__ = ["step_metadata", "per_step_args", "PaddedCopy"]

_BLOCK_T = 1024  # swa_out_cache_loc entries / token positions per program iteration
_BLOCK_W = 1024  # window-table columns per program
_MAX_BLOCK_BS = 1024  # extend lens summed per iteration of the prefix sum

ensure_interpreter_compat()


#: arguments that change from one replay to the next (the engine's tensors and sizes): never
#: specialised, so one compiled kernel serves every step (``Relaunch`` replaces them per call)
_PER_STEP = (
    "ReqPoolIdx",
    "SeqLens",
    "OutCacheLoc",
    "Positions",
    "num_reqs",
    "num_tokens",
    "stride_req",
    "stride_seq",
    "stride_loc",
    "stride_pos",
)


class WindowTable(NamedTuple):
    """The SWA window table's inputs and output, a kernel argument as it is: ``req_to_token``
    [R, C] int32 (contiguous rows), ``table`` [>= bs, width] int32 (contiguous rows)."""

    req_to_token: torch.Tensor
    r2t_stride: int
    r2t_rows: int
    r2t_cols: int
    table: torch.Tensor
    table_stride: int
    width: int


#: arguments only compared or stored, never part of an address: not specialised either, so
#: steps of other sizes share the compiled kernel
_VALUES = ("mapping_len", "loc_len", "window", "padded_tokens", "fill_value", "NB_LOC", "num_tiles")


@triton.jit(do_not_specialize=_PER_STEP + _VALUES)
def _step_metadata_kernel(
    ReqPoolIdx,
    SeqLens,
    OutCacheLoc,
    Positions,
    num_reqs,  # real requests (< the grid's bs: the rest are padding)
    num_tokens,  # T: real tokens
    stride_req,
    stride_seq,
    stride_loc,
    stride_pos,
    ExtLens,  # [bs] new tokens of each request, or None: q_len_uniform each
    q_len_uniform,
    Padded,  # PaddedCopy: the static tensors the step is copied into, padded; or None
    Mapping,  # full_to_swa_index_mapping [M], or None (no SWA outputs)
    mapping_len,  # M
    SwaLoc,  # swa_out_cache_loc [L], or None
    loc_len,  # L
    Window,  # WindowTable, or None
    window,  # int, or None: window_start is 0
    CuQ,
    WinStart,
    TokenPos,
    Tiles,  # [num_tiles, 2] int32 tile map, or None
    num_tiles,
    tile_rows,  # R: (token, q head) rows of a row block
    group,  # G: q heads of a kv head
    padded_tokens,  # tokens of the padded step (== num_tokens without padding)
    fill_value,  # seq_lens of a padded request
    NB_LOC,
    NCHUNK,
    BLOCK_T: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_BS: tl.constexpr,
    PDL: tl.constexpr,  # pdl.Schedule, or None
):
    pid = tl.program_id(0)
    pdl_wait(PDL, "entry")
    if pid < NB_LOC:
        # ---- role 1: token block: the padded copy, translate out_cache_loc, zero the tail
        if pid == 0:
            tl.store(CuQ, 0)
        offs = pid * BLOCK_T + tl.arange(0, BLOCK_T)
        real = offs < num_tokens
        padded = offs < padded_tokens
        full = tl.load(OutCacheLoc + offs * stride_loc, mask=real, other=0)  # padded tokens: slot 0
        if Padded is not None:
            tl.store(Padded.out_cache_loc + offs, full, mask=padded)
            if Padded.positions is not None:
                new_pos = tl.load(Positions + offs * stride_pos, mask=real, other=0)
                tl.store(Padded.positions + offs, new_pos, mask=padded)
        if SwaLoc is not None:
            in_map = (full >= 0) & (full < mapping_len)  # -1 and garbage: no slot, never a wrap
            swa = tl.load(Mapping + full, mask=padded & in_map, other=-1)
            swa = tl.where(padded, swa, 0)
            tl.store(SwaLoc + offs, swa.to(tl.int32), mask=offs < loc_len)
    else:
        # ---- role 2: one request (real or padded), one chunk of its window table
        r = pid - NB_LOC
        b = r // NCHUNK
        c = r % NCHUNK
        real_req = b < num_reqs
        seq_in = tl.load(SeqLens + b * stride_seq, mask=real_req, other=fill_value)
        seq = seq_in.to(tl.int32)
        if ExtLens is None:
            q_len = q_len_uniform
        else:
            q_len = tl.load(ExtLens + b).to(tl.int32)
        if window is not None:
            ws = tl.maximum(seq - q_len - window + 1, 0)
        else:
            ws = seq * 0
        row_in = tl.load(ReqPoolIdx + b * stride_req, mask=real_req, other=0)  # padded requests: row 0
        if c == 0:
            if ExtLens is None:
                start = b * q_len_uniform
            else:
                start = b * 0
                tile0 = b * 0
                for i in range(0, b, BLOCK_BS):
                    offs_b = i + tl.arange(0, BLOCK_BS)
                    e = tl.load(ExtLens + offs_b, mask=offs_b < b, other=0).to(tl.int32)
                    start += tl.sum(e, axis=0)
                    if Tiles is not None:
                        tile0 += tl.sum((e * group + tile_rows - 1) // tile_rows, axis=0)
                if Tiles is not None:
                    # this request's row blocks, its last (most keys) first; the last request
                    # also marks the entries past every request's as no work
                    n_t = (q_len * group + tile_rows - 1) // tile_rows
                    for i in range(0, n_t, BLOCK_T):
                        j = i + tl.arange(0, BLOCK_T)
                        dst = Tiles + (tile0 + j).to(tl.int64) * 2
                        inside = (j < n_t) & (tile0 + j < num_tiles)  # lengths past the bucket: nothing past the map
                        tl.store(dst, b + j * 0, mask=inside)
                        tl.store(dst + 1, n_t - 1 - j, mask=inside)
                    if b == (tl.num_programs(0) - NB_LOC) // NCHUNK - 1:
                        for i in range(tile0 + n_t, num_tiles, BLOCK_T):
                            j = i + tl.arange(0, BLOCK_T)
                            dst = Tiles + j.to(tl.int64) * 2
                            tl.store(dst, b + j * 0, mask=j < num_tiles)
                            tl.store(dst + 1, num_tiles + j * 0, mask=j < num_tiles)
            tl.store(CuQ + b + 1, start + q_len)
            tl.store(WinStart + b, ws)
            for i in range(0, q_len, BLOCK_T):
                offs_q = i + tl.arange(0, BLOCK_T)
                tl.store(TokenPos + start + offs_q, seq - q_len + offs_q, mask=offs_q < q_len)
            if Padded is not None:
                tl.store(Padded.seq_lens + b, seq_in)
                tl.store(Padded.req_pool_indices + b, row_in)
        if Window is not None:
            row = row_in.to(tl.int64)
            row = tl.where((row >= 0) & (row < Window.r2t_rows), row, 0)  # outside the table: row 0
            cols = c * BLOCK_W + tl.arange(0, BLOCK_W)
            pos = ws + cols
            valid = (pos >= 0) & (pos < seq) & (pos < Window.r2t_cols) & (cols < Window.width)
            f_slot = tl.load(Window.req_to_token + row * Window.r2t_stride + pos, mask=valid, other=0)
            f_in_map = (f_slot >= 0) & (f_slot < mapping_len)
            s_slot = tl.load(Mapping + f_slot, mask=valid & f_in_map, other=0)
            s_slot = tl.where(valid, s_slot, 0)
            dst = Window.table + b.to(tl.int64) * Window.table_stride + cols
            tl.store(dst, s_slot.to(tl.int32), mask=cols < Window.width)
    pdl_release(PDL, "end")


def _check_1d(name: str, t: torch.Tensor, min_len: int, dtypes, device: torch.device, *, strided: bool = False) -> None:
    assert isinstance(t, torch.Tensor), f"{name} must be a tensor, got {type(t).__name__}"
    assert t.dim() == 1 and t.shape[0] >= min_len, f"{name} must be 1-D with >= {min_len} entries, got {tuple(t.shape)}"
    assert t.dtype in dtypes, f"{name} must be one of {dtypes}, got {t.dtype}"
    assert strided or t.stride(0) == 1 or t.shape[0] <= 1, f"{name} must be contiguous, got stride {t.stride()}"
    assert t.device == device, f"{name} is on {t.device}, expected {device}"


class PaddedCopy(NamedTuple):
    """Static tensors a launch also fills with the step, padded (graph replay): requests
    ``[bs_padded]`` (``req_pool_indices``, ``seq_lens``, int32/int64), tokens
    ``[T_padded]`` (``out_cache_loc``, ``positions`` int64; ``positions`` None: not written)."""

    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    positions: Optional[torch.Tensor]


def per_step_args(
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,
    positions: Optional[torch.Tensor] = None,
) -> Tuple[Any, ...]:
    """The kernel's per-step arguments (``_PER_STEP``) for these step tensors: what
    ``Relaunch.__call__`` takes to repeat a launch over another step's tensors of the same
    dtypes (host values only: shapes and strides)."""
    pos = positions if positions is not None else out_cache_loc
    return (
        req_pool_indices,
        seq_lens,
        out_cache_loc,
        pos,
        req_pool_indices.shape[0],
        out_cache_loc.shape[0],
        req_pool_indices.stride(0),
        seq_lens.stride(0),
        out_cache_loc.stride(0),
        pos.stride(0),
    )


def step_metadata(
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_lens: Union[int, torch.Tensor],
    out_cache_loc: torch.Tensor,
    *,
    cu_q_lens: torch.Tensor,
    window_start: torch.Tensor,
    token_pos: torch.Tensor,
    full_to_swa_index_mapping: Optional[torch.Tensor] = None,
    swa_out_cache_loc: Optional[torch.Tensor] = None,
    req_to_token: Optional[torch.Tensor] = None,
    swa_window_table: Optional[torch.Tensor] = None,
    window: Optional[int] = None,
    pdl: bool = False,
    positions: Optional[torch.Tensor] = None,
    padded: Optional[PaddedCopy] = None,
    fill_value: int = 1,
    tiles: Optional[torch.Tensor] = None,
    tile_rows: int = 16,
    group: int = 1,
) -> Relaunch:
    """Fill the step's metadata buffers in ONE launch (see the module docstring) and return
    a ``Relaunch`` that repeats exactly this launch cheaply (graph replay: same buffers), or,
    called with ``per_step_args(...)`` of another step (same dtypes, same ``positions``
    presence, at most as many requests), the same launch over that step.

    ``bs = req_pool_indices.shape[0]`` and ``T = out_cache_loc.shape[0]`` are host ints taken
    from shapes; no device value is read on the host. The step tensors may be strided.
    ``swa_out_cache_loc`` (with the mapping) is optional for pools without SWA layers;
    ``swa_window_table`` (with the mapping and ``req_to_token``) only when ``window`` is given.

    ``padded`` (uniform modes only): the launch also writes the step into those static
    tensors, padded to their length (requests: row 0 and ``fill_value``; tokens: slot 0 and
    position 0; ``positions`` copied only when both it and ``padded.positions`` are given),
    and computes every output for the padded step (``bs_padded`` requests, ``T_padded``
    tokens), exactly as if it had been called on the padded static tensors. Rows of the table
    past the (padded) bs and entries of ``token_pos`` past the (padded) T are left untouched.

    ``tiles`` (EXTEND only: a tensor ``extend_lens``): also write the attention grid's tile map,
    ``[P, 2]`` int32, of row blocks of ``tile_rows`` (token, q head) rows, ``group`` q heads a
    kv head (module docstring); ``P`` must hold every request's row blocks
    (``paged_attention``'s ``tiles``).
    """
    idx = (torch.int32, torch.int64)
    device = seq_lens.device
    bs = req_pool_indices.shape[0]
    _check_1d("req_pool_indices", req_pool_indices, bs, idx, device, strided=True)
    _check_1d("seq_lens", seq_lens, bs, idx, device, strided=True)
    assert seq_lens.shape[0] == bs, f"seq_lens has {seq_lens.shape[0]} entries, req_pool_indices {bs}"
    _check_1d("out_cache_loc", out_cache_loc, 0, (torch.int64,), device, strided=True)
    T = out_cache_loc.shape[0]
    if positions is not None:
        _check_1d("positions", positions, T, (torch.int64,), device, strided=True)
        assert positions.shape[0] == T, f"positions has {positions.shape[0]} entries, out_cache_loc {T}"
    uniform = not isinstance(extend_lens, torch.Tensor)
    if uniform:
        assert isinstance(extend_lens, int) and extend_lens >= 1, (
            f"extend_lens must be an int >= 1, got {extend_lens!r}"
        )
        assert T == bs * extend_lens, f"{bs} requests x q_len {extend_lens} != {T} tokens"
        q_uniform = int(extend_lens)
    else:
        assert padded is None, "padded needs a uniform q_len (an int extend_lens)"
        _check_1d("extend_lens", extend_lens, bs, idx, device)
        assert extend_lens.shape[0] == bs, f"extend_lens has {extend_lens.shape[0]} entries, expected {bs}"
        q_uniform = 1
    grid_bs, grid_T = bs, T
    copy_pos = False
    if padded is not None:
        grid_bs, grid_T = padded.req_pool_indices.shape[0], padded.out_cache_loc.shape[0]
        assert bs <= grid_bs, f"the step has {bs} requests, the padded batch {grid_bs}"
        assert grid_T == grid_bs * q_uniform, f"padded: {grid_bs} requests x q_len {q_uniform} != {grid_T} tokens"
        _check_1d("padded.req_pool_indices", padded.req_pool_indices, grid_bs, idx, device)
        _check_1d("padded.seq_lens", padded.seq_lens, grid_bs, idx, device)
        _check_1d("padded.out_cache_loc", padded.out_cache_loc, grid_T, (torch.int64,), device)
        copy_pos = positions is not None and padded.positions is not None
        if copy_pos:
            _check_1d("padded.positions", padded.positions, grid_T, (torch.int64,), device)
        assert isinstance(fill_value, int) and fill_value >= 1, f"fill_value must be an int >= 1, got {fill_value!r}"
    _check_1d("cu_q_lens", cu_q_lens, grid_bs + 1, (torch.int32,), device)
    _check_1d("window_start", window_start, grid_bs, (torch.int32,), device)
    _check_1d("token_pos", token_pos, grid_T, (torch.int32,), device)
    if window is not None:
        assert isinstance(window, int) and window >= 1, f"window must be None or an int >= 1, got {window!r}"
    if tiles is not None:
        assert not uniform, "tiles need the extend lens as a tensor (an EXTEND step)"
        assert tiles.dim() == 2 and tiles.shape[1] == 2 and tiles.dtype == torch.int32 and tiles.is_contiguous(), (
            f"tiles must be a contiguous [P, 2] int32 tensor, got {tuple(tiles.shape)} {tiles.dtype}"
        )
        assert tiles.device == device, f"tiles is on {tiles.device}, expected {device}"
        assert isinstance(tile_rows, int) and tile_rows >= 1 and isinstance(group, int) and group >= 1, (
            f"tile_rows and group must be ints >= 1, got {tile_rows!r}, {group!r}"
        )

    has_swa = swa_out_cache_loc is not None
    has_table = swa_window_table is not None
    if has_swa or has_table:
        assert full_to_swa_index_mapping is not None, "the SWA outputs need full_to_swa_index_mapping"
        _check_1d("full_to_swa_index_mapping", full_to_swa_index_mapping, 1, (torch.int32,), device)
    if has_swa:
        _check_1d("swa_out_cache_loc", swa_out_cache_loc, grid_T, (torch.int32,), device)
    if has_table:
        assert window is not None, "swa_window_table needs a window"
        assert req_to_token is not None, "swa_window_table needs req_to_token"
        assert req_to_token.dim() == 2 and req_to_token.stride(1) == 1 and req_to_token.dtype == torch.int32, (
            "req_to_token must be [R, C] int32 with contiguous rows, "
            f"got {tuple(req_to_token.shape)} {req_to_token.dtype}"
        )
        assert req_to_token.device == device, f"req_to_token is on {req_to_token.device}, expected {device}"
        t = swa_window_table
        assert (
            t.dim() == 2 and t.shape[0] >= grid_bs and t.dtype == torch.int32 and (t.stride(1) == 1 or t.shape[1] <= 1)
        ), f"swa_window_table must be [>= {grid_bs}, width] int32 with contiguous rows, got {tuple(t.shape)} {t.dtype}"
        assert t.device == device, f"swa_window_table is on {t.device}, expected {device}"

    loc_len = swa_out_cache_loc.shape[0] if has_swa else 0
    nb_loc = max(1, triton.cdiv(max(loc_len, grid_T if padded is not None else 0), _BLOCK_T))
    nchunk = max(1, triton.cdiv(swa_window_table.shape[1], _BLOCK_W)) if has_table else 1
    grid = (nb_loc + grid_bs * nchunk,)
    schedule = PLAIN if pdl else None
    args = (
        *per_step_args(req_pool_indices, seq_lens, out_cache_loc, positions),
        None if uniform else extend_lens,
        q_uniform,
        padded._replace(positions=padded.positions if copy_pos else None) if padded is not None else None,
        full_to_swa_index_mapping,
        full_to_swa_index_mapping.shape[0] if full_to_swa_index_mapping is not None else 0,
        swa_out_cache_loc,
        loc_len,
        WindowTable(
            req_to_token,
            req_to_token.stride(0),
            req_to_token.shape[0],
            req_to_token.shape[1],
            swa_window_table,
            swa_window_table.stride(0),
            swa_window_table.shape[1],
        )
        if has_table
        else None,
        window,
        cu_q_lens,
        window_start,
        token_pos,
        tiles,
        tiles.shape[0] if tiles is not None else 0,
        tile_rows,
        group,
        grid_T,
        fill_value,
        nb_loc,
        nchunk,
    )
    meta = dict(
        BLOCK_T=_BLOCK_T,
        BLOCK_W=_BLOCK_W,
        # the prefix sum's block (uniform steps have none: one value, one compiled kernel)
        BLOCK_BS=1 if uniform else min(triton.next_power_of_2(max(grid_bs, 1)), _MAX_BLOCK_BS),
        PDL=schedule,
        num_warps=4,
        **launch_options(schedule),
    )
    return Relaunch(_step_metadata_kernel, grid, args, meta, per_step=len(_PER_STEP))
