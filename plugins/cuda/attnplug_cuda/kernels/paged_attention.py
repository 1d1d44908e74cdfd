"""Attention over the paged KV cache, for every forward mode (decode, extend, verify).

Shapes (``T`` new tokens, ``bs`` requests, ``H`` q heads, ``Hkv`` kv heads, ``G = H / Hkv``,
``D`` head dim, ``S`` cache slots):

============  =========================  ==================================================
tensor        shape / dtype              meaning
============  =========================  ==================================================
q, out        [T, H, D] fp16/bf16/fp32   rows ``cu_q_lens[b] .. cu_q_lens[b+1]`` belong to
                                         request ``b`` (every row belongs to a request);
                                         last dim contiguous, other strides free
k_cache,      [S, Hkv, D], q's dtype     last dim contiguous; slot and head strides
v_cache       or an FP8 dtype            free, the same for both (an engine's K/V
                                         halves of one interleaved cache are fine); an
                                         FP8 cache with ``inputs.kv_scales``
cu_q_lens     [bs + 1] int32             exclusive prefix sum of the new tokens per request
seq_lens      [bs] int32/int64           KV length of each request INCLUDING its new tokens
keys          ``common.KeyTable``        where each request's keys are
============  =========================  ==================================================

Semantics: new token ``i`` of request ``b`` sits at position ``p = seq_len - q_len_b + i`` and
attends to keys ``lo <= j <= p`` with ``lo = max(0, p - W + 1)`` under a window ``W``, else
0; q head ``h`` uses kv head ``h // G``. Logits, the soft cap, sinks, what is no key and an
FP8 cache's scales as ``common`` says; accumulation is fp32, the output has q's dtype. Over an
FP8 cache a half-precision q and the converted K/V tiles meet in float16 products (q beyond
float16's range, 65504, is not served there). A query with no valid key (a padded request)
outputs zeros.

Design (one program = one request x one kv head x ``BLOCK_M`` rows x one KV split):

* rows are (token, q head of the kv head's group) pairs flattened, so the ``G`` query heads
  sharing a kv head are one tile: every K/V row is read once per kv head, and decode
  (``q_len * G <= 16`` rows) is a single ``[16, D] x [D, BLOCK_N]`` ``tl.dot`` per key block;
  long extends use ``BLOCK_M`` = 64/128 rows (flash-attention tiling);
* the program's key range is ``[lo of its first token, p of its last token]``, clipped;
  with ``NUM_SPLITS > 1`` (flash-decoding) that range is cut into ``NUM_SPLITS`` chunks,
  each program writes a partial ``(m, l, acc)`` and ``_split_combine_kernel`` merges them in a
  second launch (the sinks join there, once). Programs past a request's real lengths do no
  work;
* decode tiles whose requests have one new token (``ONE_TOKEN``) mask no key by position:
  the program's range starts at the token's window start and ends at its position, and the
  positions past a split's end read no slot (``key_slots``);
* large tiles (``PHASES``) run the key blocks every row sees whole in an unmasked loop
  between the masked edge blocks (diagonal, window start, split end); with ``SLOTS_AHEAD``
  each loop reads its blocks' slots one block ahead (``_attend_range``: the K/V tiles then
  pipeline to ``num_stages``), and with ``SETTLE`` waits for a block's products in its
  iteration (``common.settle``: in flight across the loop's back edge, they made ptxas
  serialise every ``wgmma`` of the kernel).

The plan (``planner.plan_paged``) comes from host bounds only; with splits, the partials take
``T * H * splits * (D + 2)`` fp32 elements of ``workspace`` (``planner.paged_workspace_numel``
serves every plan; allocated per call when None).

PDL (``pdl.Schedule``): both kernels wait before their first load of what the previous
kernel wrote. Under a ``prologue`` schedule the attention kernel reads the step's metadata
before its wait, and a program sends its first ``PREFETCH`` key blocks' cached K/V lines to L2
(``prefetch.global.L2``: a hint that holds no register and changes no result; columns
without a key prefetch the kv head's first line, inside the cache).

Storing the step (``loc``, decode and draft steps whose rows fit one tile): every program
first stores kv head ``hk`` of its request's new K/V rows from a tile of its tokens, as many
as the host bound ``max_q_len`` (not of its (token, q head) rows, nor of every token its row
block could hold: an FP8 cache quantises each new value once, a decode step one token's),
the programs of one group's KV splits writing the same bytes, then a CTA barrier orders
those stores before its reads of the cache, so the layer needs no KV store launch; the cache
and the output are those of ``kv_store`` followed by this kernel (an FP8 cache: the rows
stored quantised, and read back as every other key).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from ..planner import PagedPlan, store_tokens
from .common import (
    VALUES_ONLY,
    AttentionInputs,
    NewRows,
    causal_window,
    check_attention_args,
    check_new_rows,
    fold_sink,
    key_slots,
    log2_scales,
    pdl_release,
    pdl_wait,
    quantize_kv,
    scaled_logits,
    settle,
    slot_is_key,
    softmax_block,
    table_entry,
    table_row,
)
from .interpret import ensure_interpreter_compat, interpreting
from .pdl import PLAIN, Schedule, launch_options

__all__ = ["paged_attention"]

ensure_interpreter_compat()


class Partials(NamedTuple):
    """Split partials in the workspace, laid out ``[T, H, NUM_SPLITS]`` (``m``, ``l``) and
    ``[T, H, NUM_SPLITS, D]`` (``acc``), fp32."""

    m: torch.Tensor
    l: torch.Tensor
    acc: torch.Tensor


@triton.jit
def _prefetch_l2(ptrs):
    """``prefetch.global.L2`` of every address in ``ptrs`` (a hint: no register holds the
    data, nothing waits for it). CUDA only: the interpreter cannot run inline PTX."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def _attend_block(acc, l_i, m_i, q, qk_scale, softcap_log2, start, s_hi, pos, lo, slot, num_slots,
                  K, V, kv_stride, kv_col, d_valid, window, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                  EVEN_D: tl.constexpr):  # fmt: skip
    """One block of ``BLOCK_N`` keys from ``start``, at the cache's rows ``slot`` (``[BLOCK_N]``
    from ``common.key_slots``), folded into ``(acc, l_i, m_i)``.
    ``MASKED=False`` only for blocks every row sees whole (no causal / window / range mask);
    a column with no key is no key in both kinds of block. With ``EVEN_D`` (head dim ==
    BLOCK_D) the load mask is constant along the head dim, so K/V rows load as full-width
    vectors. An FP8 cache's stored values are used as they are (``qk_scale`` holds the kv
    head's ``k_scale``; the caller multiplies the result by its ``v_scale``)."""
    PRECISION: tl.constexpr = "ieee" if q.dtype == tl.float32 else "tf32"
    offs_n = start + tl.arange(0, BLOCK_N)
    has_key = slot_is_key(slot, num_slots)
    if EVEN_D:
        kv_mask = has_key[:, None]
    else:
        kv_mask = has_key[:, None] & d_valid[None, :]
    no_key = tl.where(has_key, 0.0, float("-inf"))
    kv_off = slot.to(tl.int64)[:, None] * kv_stride + kv_col[None, :]
    # (an FP8 cache's tiles are converted to q's dtype in registers, exactly; others are q's)
    k = tl.load(K + kv_off, mask=kv_mask, other=0.0).to(q.dtype)
    qk = scaled_logits(tl.dot(q, tl.trans(k), input_precision=PRECISION), no_key, qk_scale, softcap_log2)
    if MASKED:
        qk = causal_window(qk, offs_n, offs_n < s_hi, pos, lo, window)
    p, alpha, m_i, l_i = softmax_block(qk, m_i, l_i)
    v = tl.load(V + kv_off, mask=kv_mask, other=0.0).to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, l_i, m_i


@triton.jit
def _attend_range(acc, l_i, m_i, q, qk_scale, softcap_log2, s_lo, i_begin, i_end, s_hi, pos, lo, t_row, t_start, width,
                  num_slots, K, V, kv_stride, kv_col, d_valid, window, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                  EVEN_D: tl.constexpr, AHEAD: tl.constexpr, SETTLE: tl.constexpr):  # fmt: skip
    """Key blocks ``i_begin <= i < i_end`` (block ``i`` starts at ``s_lo + i * BLOCK_N``), all
    of one kind (``MASKED``), folded into ``(acc, l_i, m_i)``.

    ``AHEAD`` (``PagedPlan.SLOTS_AHEAD``): each block's slots are read from the key table one
    block ahead and carried into the next iteration, so no K/V address waits for a table load
    of its own iteration and Triton's pipeliner issues the K/V tiles ``num_stages - 1`` blocks
    ahead (with the table read in the iteration that uses it, the tiles stay one block ahead
    whatever the stages). With ``SETTLE`` the accumulator is settled at the end of each
    block (``common.settle``). Only the slots are carried: carrying their validity too made Triton
    3.9's pipeliner fail to compile the loop. The read past the last block stays inside the
    table's row (``key_slots``) and is not used. (The two loops are written apart: as one
    loop with ``AHEAD`` branches inside, the read-ahead tiles compile to other code.)"""
    if AHEAD:
        _, slot, _ = key_slots(t_row, s_lo + i_begin * BLOCK_N, s_hi, t_start, width, num_slots, BLOCK_N, MASKED)
        for i in range(i_begin, i_end):
            _, slot_next, _ = key_slots(
                t_row, s_lo + (i + 1) * BLOCK_N, s_hi, t_start, width, num_slots, BLOCK_N, MASKED
            )
            acc, l_i, m_i = _attend_block(
                acc, l_i, m_i, q, qk_scale, softcap_log2, s_lo + i * BLOCK_N, s_hi, pos, lo, slot, num_slots,
                K, V, kv_stride, kv_col, d_valid, window, BLOCK_N, MASKED, EVEN_D
            )  # fmt: skip
            if SETTLE:
                acc = settle(acc)
            slot = slot_next
    else:
        for i in range(i_begin, i_end):
            _, slot, _ = key_slots(t_row, s_lo + i * BLOCK_N, s_hi, t_start, width, num_slots, BLOCK_N, MASKED)
            acc, l_i, m_i = _attend_block(
                acc, l_i, m_i, q, qk_scale, softcap_log2, s_lo + i * BLOCK_N, s_hi, pos, lo, slot, num_slots,
                K, V, kv_stride, kv_col, d_valid, window, BLOCK_N, MASKED, EVEN_D
            )  # fmt: skip
    return acc, l_i, m_i


@triton.jit(do_not_specialize=VALUES_ONLY)
def _paged_attention_kernel(
    Q,
    K,
    V,
    Out,
    New,  # NewRows: the step's K/V rows stored at New.loc first, or None
    Part,  # Partials (with NUM_SPLITS > 1), or None
    Tiles,  # [programs, 2] int32 (request, row block) of each program along axis 0, or None
    CuQ,
    SeqLens,
    keys,  # KeyTable
    Sinks,  # [H] float32 sink logits (natural log), or None
    Scales,  # common.KVScales of an FP8 cache, or None
    qk_scale,  # sm_scale * log2(e); with a soft cap: sm_scale / c
    softcap_log2,  # c * log2(e), or None: no soft cap
    window,  # int, or None: no window
    num_kv_heads,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    kv_stride,  # elements between two slots of the cache
    kv_head_stride,  # elements between two kv heads of a slot
    num_slots,  # S: rows of the cache
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PLAN: tl.constexpr,  # planner.PagedPlan
    PDL: tl.constexpr,  # pdl.Schedule, or None
    PF_LINES: tl.constexpr,  # 128-byte lines of one K/V row of a kv head (power of 2)
    LINE_ELEMS: tl.constexpr,  # elements of a 128-byte line
    NEW_TOKENS: tl.constexpr,  # tokens of the store's tile (planner.store_tokens), 1 without New
    SETTLE: tl.constexpr,  # PLAN.SETTLE where the kernel is compiled (the interpreter runs no asm)
):
    BLOCK_M: tl.constexpr = PLAN.BLOCK_M
    BLOCK_N: tl.constexpr = PLAN.BLOCK_N
    NUM_SPLITS: tl.constexpr = PLAN.NUM_SPLITS
    KV_FP8: tl.constexpr = K.dtype.element_ty.is_fp8()  # the cache stores FP8 (common)
    pid_s = tl.program_id(2)
    pdl_wait(PDL, "entry")
    if Tiles is None:
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = pid_bh // num_kv_heads
        hk = pid_bh % num_kv_heads
    else:  # the tile map (step_metadata's): axis 0 names the request and its row block
        tile = tl.program_id(0).to(tl.int64) * 2
        b = tl.load(Tiles + tile)
        pid_m = tl.load(Tiles + tile + 1)
        hk = tl.program_id(1)

    q_start = tl.load(CuQ + b)
    q_len = tl.load(CuQ + b + 1) - q_start
    seq_len = tl.load(SeqLens + b).to(tl.int32)
    t_idx, t_start = table_entry(keys, b)
    n_rows = q_len * G

    # rows of this program: (token, head of the group) pairs
    row0 = pid_m * BLOCK_M
    offs_m = row0 + tl.arange(0, BLOCK_M)
    tok = offs_m // G
    head = hk * G + offs_m % G
    row_valid = offs_m < n_rows
    pos = seq_len - q_len + tok  # position of each row's token
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM
    rd_mask = row_valid[:, None] & d_valid[None, :]

    # key range of the program: from the first token's lower bound to the last token's position
    t_last = tl.minimum((row0 + BLOCK_M - 1) // G, q_len - 1)
    kv_hi = seq_len - q_len + t_last + 1
    pos_first = seq_len - q_len + row0 // G
    if window is not None:
        lo = tl.maximum(pos - window + 1, 0)
        kv_lo = tl.maximum(pos_first - window + 1, 0)
    else:
        lo = 0
        kv_lo = seq_len * 0
    kv_hi = tl.where(row0 < n_rows, kv_hi, kv_lo)  # rows past the request: no work
    kv_hi = tl.maximum(kv_hi, kv_lo)
    if NUM_SPLITS > 1:
        chunk = tl.cdiv(tl.cdiv(kv_hi - kv_lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
        s_lo = tl.minimum(kv_lo + pid_s * chunk, kv_hi)
        s_hi = tl.minimum(s_lo + chunk, kv_hi)
    else:
        s_lo = kv_lo
        s_hi = kv_hi

    t_row = table_row(keys, t_idx)
    # kv head hk of the cache, its offset in 64 bits: a head index times the head stride
    # passes 2**31 in a head-major buffer of more than 2**31 elements
    K += hk.to(tl.int64) * kv_head_stride
    V += hk.to(tl.int64) * kv_head_stride
    if PDL is not None:
        if PDL.wait == "prologue" and PLAN.PREFETCH > 0:
            # The cached K/V rows of the first PREFETCH key blocks do not depend on the
            # previous kernel: send their lines to L2 now, so the loads after the wait find them
            # there or on their way. Columns without a key prefetch the kv head's first line.
            offs_line = tl.arange(0, PF_LINES) * LINE_ELEMS
            line_ok = offs_line < HEAD_DIM
            for i in range(PLAN.PREFETCH):
                _, pf_slot, pf_key = key_slots(
                    t_row, s_lo + i * BLOCK_N, s_hi, t_start, keys.width, num_slots, BLOCK_N, True
                )
                pf_ok = pf_key[:, None] & line_ok[None, :]
                pf_row = pf_slot.to(tl.int64)[:, None] * kv_stride + offs_line[None, :]
                pf_off = tl.where(pf_ok, pf_row, 0)
                _prefetch_l2(K + pf_off)
                _prefetch_l2(V + pf_off)
    pdl_wait(PDL, "prologue")
    pdl_release(PDL, "wait")

    q_rows = (q_start + tok).to(tl.int64)
    # (heads in 64 bits too: q and out may be head-major views of more than 2**31 elements)
    head64 = head.to(tl.int64)
    q_off = q_rows[:, None] * stride_qt + head64[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(Q + q_off, mask=rd_mask, other=0.0)
    if KV_FP8:  # kv head hk's scales: k_scale joins the logit scale, v_scale the output
        k_scale = tl.load(Scales.k + hk * Scales.stride_k)
        v_scale = tl.load(Scales.v + hk * Scales.stride_v)
        qk_scale = qk_scale * k_scale
        if q.dtype != tl.float32:
            # products in float16 over an FP8 cache: sm_90 converts a pair of FP8 values to
            # float16 in one instruction, to bfloat16 only through float32; float16 holds every
            # FP8 value and P exactly enough, and a half q's values below 65504 in magnitude
            q = q.to(tl.float16)

    kv_col = offs_d  # in kv head hk's rows of the cache
    if New is not None:
        # Every program of the group stores kv head hk of the request's new rows (the tile
        # holds all of them: at most NEW_TOKENS tokens, the host bound), then waits for the
        # CTA's stores before reading the cache. Programs of one group (its KV splits) write
        # the same bytes, so each reads the new rows whoever wrote last (module docstring).
        offs_t = tl.arange(0, NEW_TOKENS)
        t_valid = offs_t < q_len
        t_rows = (q_start + offs_t).to(tl.int64)
        slot_new = tl.load(New.loc + t_rows, mask=t_valid, other=0).to(tl.int64)
        # the new rows' loads do not wait for their slots: both round trips overlap
        ld_mask = t_valid[:, None] & d_valid[None, :]
        st_mask = ld_mask & ((slot_new >= 1) & (slot_new < num_slots))[:, None]
        new_col = hk * HEAD_DIM + offs_d  # in the new rows (dense heads)
        kn = tl.load(New.k + t_rows[:, None] * New.stride_k + new_col[None, :], mask=ld_mask)
        vn = tl.load(New.v + t_rows[:, None] * New.stride_v + new_col[None, :], mask=ld_mask)
        if KV_FP8:
            kn = quantize_kv(kn, k_scale, K.dtype.element_ty)
            vn = quantize_kv(vn, v_scale, V.dtype.element_ty)
        dst = slot_new[:, None] * kv_stride + kv_col[None, :]
        tl.store(K + dst, kn, mask=st_mask)
        tl.store(V + dst, vn, mask=st_mask)
        tl.debug_barrier()

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    width = keys.width
    if PLAN.PHASES:
        # Key blocks every row of the program may see whole (below the first token's position,
        # at or past the last token's window start, inside the split) need no mask: run them
        # in a loop of their own between the masked edge blocks.
        n_blocks = tl.cdiv(s_hi - s_lo, BLOCK_N)
        if window is not None:
            i0 = tl.minimum(tl.cdiv(tl.maximum(tl.maximum(kv_hi - window, 0) - s_lo, 0), BLOCK_N), n_blocks)
        else:
            i0 = n_blocks * 0
        i1 = tl.maximum(tl.minimum(pos_first + 1, s_hi) - s_lo, 0) // BLOCK_N
        i1 = tl.minimum(tl.maximum(i1, i0), n_blocks)
        # the three phases differ only in their block range and MASKED: one compact call each
        # fmt: off
        acc, l_i, m_i = _attend_range(
            acc, l_i, m_i, q, qk_scale, softcap_log2, s_lo, 0, i0, s_hi, pos, lo, t_row, t_start, width,
            num_slots, K, V, kv_stride, kv_col, d_valid, window, BLOCK_N, True, EVEN_D, PLAN.SLOTS_AHEAD, SETTLE
        )
        acc, l_i, m_i = _attend_range(
            acc, l_i, m_i, q, qk_scale, softcap_log2, s_lo, i0, i1, s_hi, pos, lo, t_row, t_start, width,
            num_slots, K, V, kv_stride, kv_col, d_valid, window, BLOCK_N, False, EVEN_D, PLAN.SLOTS_AHEAD, SETTLE
        )
        acc, l_i, m_i = _attend_range(
            acc, l_i, m_i, q, qk_scale, softcap_log2, s_lo, i1, n_blocks, s_hi, pos, lo, t_row, t_start, width,
            num_slots, K, V, kv_stride, kv_col, d_valid, window, BLOCK_N, True, EVEN_D, PLAN.SLOTS_AHEAD, SETTLE
        )
        # fmt: on
    else:
        # (the decode tiles' own loop: written as an ``_attend_range`` it compiles to other code;
        # ``ONE_TOKEN``: the module docstring)
        MASKED: tl.constexpr = not PLAN.ONE_TOKEN
        # fmt: off
        for start in range(s_lo, s_hi, BLOCK_N):
            _, slot, _ = key_slots(t_row, start, s_hi, t_start, width, num_slots, BLOCK_N, True)
            acc, l_i, m_i = _attend_block(
                acc, l_i, m_i, q, qk_scale, softcap_log2, start, s_hi, pos, lo, slot, num_slots,
                K, V, kv_stride, kv_col, d_valid, window, BLOCK_N, MASKED, EVEN_D
            )
        # fmt: on
    if KV_FP8:  # the values' scale, once per row (a split's partial too: the merge is unchanged)
        acc = acc * v_scale

    if NUM_SPLITS == 1:
        if Sinks is not None:  # the sink joins the denominator only (with splits: in the combine kernel, once)
            l_i, acc = fold_sink(m_i, l_i, acc, Sinks, head, row_valid)
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        o_ptrs = Out + q_rows[:, None] * stride_ot + head64[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=rd_mask)
    else:
        # partials laid out [T, H, NUM_SPLITS, (HEAD_DIM)]
        prow = (q_rows * (num_kv_heads * G) + head) * NUM_SPLITS + pid_s
        tl.store(Part.m + prow, m_i, mask=row_valid)
        tl.store(Part.l + prow, l_i, mask=row_valid)
        tl.store(Part.acc + prow[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=rd_mask)
    pdl_release(PDL, "end")


@triton.jit
def _split_combine_kernel(
    Part,  # Partials
    Out,
    Sinks,  # [H] float32 sink logits (natural log), or None
    num_heads,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PDL: tl.constexpr,  # pdl.Schedule, or None
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    pdl_wait(PDL, "entry")
    base = (t * num_heads + h) * NUM_SPLITS
    offs_s = tl.arange(0, BLOCK_S)
    s_valid = offs_s < NUM_SPLITS
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM
    m = tl.load(Part.m + base + offs_s, mask=s_valid, other=float("-inf"))
    l = tl.load(Part.l + base + offs_s, mask=s_valid, other=0.0)
    m_max = tl.max(m, 0)
    if Sinks is not None:  # the head's sink joins the denominator once, here (never per split)
        sink = tl.load(Sinks + h) * 1.4426950408889634
        m_max = tl.maximum(m_max, sink)
    w = tl.math.exp2(m - m_max)
    total = tl.sum(w * l, 0)
    if Sinks is not None:
        total += tl.math.exp2(sink - m_max)
    acc = tl.load(
        Part.acc + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
        mask=s_valid[:, None] & d_valid[None, :],
        other=0.0,
    )
    out = tl.sum(acc * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(Out + t * stride_ot + h * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=d_valid)
    pdl_release(PDL, "end")


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    inputs: AttentionInputs,
    plan: PagedPlan,
    *,
    new: Optional[NewRows] = None,
    workspace: Optional[torch.Tensor] = None,
    pdl: Optional[Schedule] = None,
    tiles: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Write attention of ``q`` over the paged cache, as ``inputs`` describe it, into ``out`` by
    ``plan`` (``planner.plan_paged``) and return ``out``.

    ``new``: first store the step's new rows in the same launch, ``k_cache[loc[t]] = k[t]``
    and ``v_cache[loc[t]] = v[t]`` for every ``loc[t]`` in ``[1, S)`` (``kv_store``'s rule, an
    FP8 cache's quantisation included: ``inputs.kv_scales``);
    only for steps whose rows fit one tile (``max_q_len * G <= BLOCK_M``, decode and short
    drafts). The grid is sized from the host bound ``inputs.max_q_len``; the kernels read the
    real lengths on the device. ``workspace``: fp32, used when the plan splits the KV range;
    allocated here when None (pass one for graph capture). ``pdl``: the launch's PDL schedule
    (None: without PDL); the combine kernel, when there is one, runs ``PLAIN``.

    ``tiles``: the grid as a tile map instead (``step_metadata``'s, for steps whose grid must
    not depend on their lengths: a captured EXTEND step): ``[programs, 2]`` int32, program
    ``i`` of axis 0 takes request ``tiles[i, 0]``'s row block ``tiles[i, 1]`` (a row block
    past the request's rows: no work), axis 1 the kv heads; one KV split only.
    """
    T, H, D, hkv, G, bs = check_attention_args(q, k_cache, v_cache, out, inputs)
    max_q_len, window = inputs.max_q_len, inputs.window

    if new is not None:
        check_new_rows(new.k, new.v, new.loc, q, hkv)
        assert max(1, max_q_len) * G <= plan.BLOCK_M, f"storing the new rows needs one row block: {max_q_len} x {G}"
    if pdl is not None:
        pdl.check()
    if T == 0 or bs == 0:
        return out
    device = q.device
    qk_scale, softcap_log2 = log2_scales(inputs.sm_scale, inputs.softcap, D)
    splits = plan.NUM_SPLITS
    block_d = triton.next_power_of_2(D)
    part = None
    if splits > 1:
        need = T * H * splits * (D + 2)
        if workspace is None:
            workspace = torch.empty(need, dtype=torch.float32, device=device)
        assert workspace.dtype == torch.float32 and workspace.is_contiguous() and workspace.numel() >= need, (
            f"workspace must be contiguous float32 with >= {need} elements"
        )
        assert workspace.device == device, f"workspace is on {workspace.device}, q on {device}"
        n_ml = T * H * splits
        part = Partials(workspace[:n_ml], workspace[n_ml : 2 * n_ml], workspace[2 * n_ml : need])
    if tiles is None:
        grid = (triton.cdiv(max(1, max_q_len) * G, plan.BLOCK_M), bs * hkv, splits)
    else:
        assert splits == 1 and new is None, "a tile map runs one KV split and stores nothing"
        assert tiles.dim() == 2 and tiles.shape[1] == 2 and tiles.dtype == torch.int32 and tiles.is_contiguous(), (
            f"tiles must be a contiguous [programs, 2] int32 tensor, got {tuple(tiles.shape)} {tiles.dtype}"
        )
        assert tiles.device == device, f"tiles is on {tiles.device}, q on {device}"
        grid = (tiles.shape[0], hkv, 1)
    _paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        new,
        part,
        tiles,
        inputs.cu_q_lens,
        inputs.seq_lens,
        inputs.keys,
        inputs.sinks,
        inputs.kv_scales,
        qk_scale,
        softcap_log2,
        window,
        hkv,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.shape[0],
        G=G,
        HEAD_DIM=D,
        BLOCK_D=block_d,
        PLAN=plan,
        PDL=pdl,
        PF_LINES=triton.next_power_of_2(triton.cdiv(D * k_cache.element_size(), 128)),
        LINE_ELEMS=128 // k_cache.element_size(),
        NEW_TOKENS=1 if new is None else store_tokens(max_q_len),
        SETTLE=plan.SETTLE and not interpreting(),
        num_warps=plan.num_warps,
        num_stages=plan.num_stages,
        **launch_options(pdl),
        **({} if plan.max_registers is None else {"maxnreg": plan.max_registers}),
    )
    if splits > 1:
        block_s = triton.next_power_of_2(splits)
        combine_pdl = PLAIN if pdl is not None else None
        _split_combine_kernel[(T, H)](
            part,
            out,
            inputs.sinks,
            H,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=D,
            BLOCK_D=block_d,
            NUM_SPLITS=splits,
            BLOCK_S=block_s,
            PDL=combine_pdl,
            num_warps=1 if block_s * block_d <= 1024 else 4,
            **launch_options(combine_pdl),
        )
    return out
