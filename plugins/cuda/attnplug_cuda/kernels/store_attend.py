"""One launch a layer for small steps: store the step's K/V, attend, merge the KV splits.

For small decode and draft steps (``planner.one_launch_serves``) a layer is ONE kernel,
``_store_attend_kernel``, instead of a KV store, an attention kernel and a split combine. At
small batch a layer's time is a chain of dependent memory round trips and launches, not
bandwidth; this kernel shortens the chain:

* split 0 of each (request, kv head) group stores the step's K/V rows of its kv head, and
  every program reads the keys of the step's own tokens from ``k`` / ``v`` (the rows it would
  otherwise read back from the cache right after the store), so no program waits for another;
* the KV range of a request is cut into ``NUM_SPLITS`` chunks of whole 16-key steps
  (flash-decoding); each program writes a partial ``(m, l, acc / l)`` (the normalised part in
  the output's dtype), and the LAST program of the group to finish (an atomic ticket per
  group) merges the partials in split order and writes the output: no second launch. The
  merge takes ``MERGE_CHUNK`` splits a trip, each thread over its own (row, head-dim)
  elements, so a trip's loads are in flight together. The tickets return to zero in the same
  launch, so a graph replays the kernel any number of times;
* K and V of a key block are requested together before any arithmetic. The first block's
  table entries and cached K/V do not depend on the previous layer: under a ``prologue``
  PDL schedule they are read before the wait, the step's own rows loaded over them after it
  (a masked load whose other value is the cached tile), so the block is held once;
* with ``OWN_BLOCK`` (decode steps of up to one group an SM) the first block holds cached keys
  only, and two products with zero matrices, taken before the wait, move its K and V into
  the products' layouts there (exact: their results start the real products' accumulators).
  The step's own keys come after the others: a decode step's one own key as a vector (its
  logits as row sums of ``q * k`` in float32, ``p * v`` added to the accumulator), in the one
  split that holds it; a draft step's in a block of their own;
* an FP8 cache (``common``): the store quantises the rows (``quantize_kv``) and every program
  folds the step's own keys in after the cached ones, as above, from the rows it read from
  ``k`` / ``v`` quantised the same way (a few rows, not a whole key block): attention sees
  the values the cache holds. The tiles are converted to q's dtype (float16 products for a
  bfloat16 q, as ``paged_attention`` takes, push the draft tiles past 255 registers on sm_90).

Shapes (``T`` new tokens, ``bs`` requests, ``H`` q heads, ``Hkv`` kv heads, ``G = H / Hkv``,
``D`` head dim, ``S`` cache slots):

=============  =========================  ===============================================
tensor         shape / dtype              meaning
=============  =========================  ===============================================
q, out         [T, H, D] fp16/bf16/fp32   last dim contiguous, other strides free
k, v           [T, Hkv, D], q's dtype     the step's new K/V rows (last dim contiguous,
                                          heads dense); stored at ``loc``
loc            [>= T] int32/int64         cache slot of each new token (``[1, S)`` is
                                          stored, anything else skipped) or None: nothing
                                          stored, every key read from the cache
k_cache,       [S, Hkv, D], q's dtype     contiguous; an FP8 cache with
v_cache        or an FP8 dtype            ``inputs.kv_scales``
cu_q_lens      [bs + 1] int32             exclusive prefix sum of new tokens per request
seq_lens       [bs] int32/int64           KV length of each request INCLUDING new tokens
keys           ``common.KeyTable``        where each request's keys are
workspace      fp32, contiguous           split partials (``one_launch_workspace_numel``)
tickets        [>= bs * Hkv] int32        one counter per (request, kv head) group,
                                          ZERO-filled once; every launch leaves it zero
=============  =========================  ===============================================

Semantics are those of ``paged_attention`` after ``kv_store`` (the same logits and masks;
results differ only by rounding, the KV range being split elsewhere). For a position of the
step's own tokens the K/V come from ``k`` / ``v`` (quantised for an FP8 cache): what the store
writes, since the engine's table points at ``loc`` for those positions (the contract's
``out_cache_loc``).

PDL (``pdl.Schedule``): the tickets and the workspace are touched only after the wait, and a
kernel completes only after its own wait returns, so each wait still covers every launch
before it. The merge order of the splits is fixed (split 0 first), so the output does not
depend on which program merges: every schedule, and PDL off, give the same bits.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..planner import OneLaunchPlan
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
    product_tile,
    quantize_kv,
    scaled_logits,
    softmax_block,
    table_entry,
    table_row,
    tanh,
)
from .interpret import ensure_interpreter_compat, interpreting
from .pdl import Schedule, launch_options

__all__ = ["store_attend"]

ensure_interpreter_compat()


@triton.jit
def _online_block(q, k, v, has_key, offs_n, in_range, pos, lo, m_i, l_i, acc, qk_scale, softcap_log2, window, qk0=None):
    """One key block folded into the running ``(m_i, l_i, acc)``. ``qk0``: the products'
    accumulator (zeros: a product laid out before the wait)."""
    PRECISION: tl.constexpr = "ieee" if q.dtype == tl.float32 else "tf32"
    qk = tl.dot(q, tl.trans(k), acc=qk0, input_precision=PRECISION)
    qk = scaled_logits(qk, tl.where(has_key, 0.0, float("-inf")), qk_scale, softcap_log2)
    qk = causal_window(qk, offs_n, in_range, pos, lo, window)
    p, alpha, m_i, l_i = softmax_block(qk, m_i, l_i)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_i, l_i, acc


@triton.jit
def _online_key(q, k, v, row_valid, m_i, l_i, acc, qk_scale, softcap_log2):
    """One key (``k``, ``v``: ``[BLOCK_D]``) folded into every valid row's running ``(m_i, l_i,
    acc)``: its logits as row sums of ``q * k`` in float32 and ``p * v`` added to ``acc``, with
    no product tile and no layout change through shared memory."""
    qk = tl.sum(q.to(tl.float32) * k.to(tl.float32)[None, :], 1)
    if softcap_log2 is not None:
        qk = tanh(qk * qk_scale) * softcap_log2
    else:
        qk = qk * qk_scale
    qk = tl.where(row_valid, qk, float("-inf"))
    m_new = tl.maximum(m_i, qk)
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(qk - m_new)
    l_i = l_i * alpha + p
    acc = acc * alpha[:, None] + p[:, None] * v.to(tl.float32)[None, :]
    return m_new, l_i, acc


@triton.jit
def _merge_splits(Out, Work, WorkL, WorkAcc, Sinks, gbase, q_start, hk, n_rows, stride_ot, stride_oh, offs_d, d_valid,
                  G: tl.constexpr, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
                  NUM_SPLITS: tl.constexpr, MERGE_CHUNK: tl.constexpr):  # fmt: skip
    """The group's splits merged in order into its output rows. Each thread keeps its own
    (row, head-dim) elements of every split in registers: the splits' loads are independent
    of each other and of the arithmetic, so a trip's are all in flight at once."""
    offs_r = tl.arange(0, ROWS)
    r_valid = offs_r < n_rows
    r_head = (hk * G + offs_r % G).to(tl.int64)
    m_run = tl.full([ROWS], -1.0e30, dtype=tl.float32)
    total = tl.zeros([ROWS], dtype=tl.float32)
    merged = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    for c in range(NUM_SPLITS // MERGE_CHUNK):
        for s in tl.static_range(MERGE_CHUNK):
            srow = gbase + (c * MERGE_CHUNK + s) * ROWS + offs_r
            m_s = tl.load(Work + srow, cache_modifier=".cg")
            l_s = tl.load(WorkL + srow, cache_modifier=".cg")
            a_s = tl.load(
                WorkAcc + srow[:, None] * HEAD_DIM + offs_d[None, :], mask=d_valid[None, :], cache_modifier=".cg"
            )
            m_new = tl.maximum(m_run, m_s)
            alpha = tl.math.exp2(m_run - m_new)
            w = tl.math.exp2(m_s - m_new)
            total = total * alpha + w * l_s
            merged = merged * alpha[:, None] + a_s.to(tl.float32) * (w * l_s)[:, None]
            m_run = m_new
    if Sinks is not None:
        r_sink = tl.load(Sinks + r_head, mask=r_valid, other=0.0) * 1.4426950408889634
        m_fin = tl.maximum(m_run, r_sink)
        alpha = tl.math.exp2(m_run - m_fin)
        total = total * alpha + tl.math.exp2(r_sink - m_fin)
        merged = merged * alpha[:, None]
    out = merged / tl.where(total > 0.0, total, 1.0)[:, None]
    r_rows = (q_start + offs_r // G).to(tl.int64)
    r_ptrs = Out + r_rows[:, None] * stride_ot + r_head[:, None] * stride_oh + offs_d[None, :]
    tl.store(r_ptrs, out.to(Out.dtype.element_ty), mask=r_valid[:, None] & d_valid[None, :])


@triton.jit(do_not_specialize=VALUES_ONLY)
def _store_attend_kernel(
    Q,
    Out,
    New,  # NewRows: the step's K/V rows stored at New.loc, or None
    K,
    V,
    Work,
    Tickets,
    Sinks,  # [H] float32 sink logits (natural log), or None
    Scales,  # common.KVScales of an FP8 cache, or None
    CuQ,
    SeqLens,
    keys,  # KeyTable
    qk_scale,  # sm_scale * log2(e); with a soft cap: sm_scale / c
    softcap_log2,  # c * log2(e), or None: no soft cap
    window,  # int, or None: no window
    num_kv_heads,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    num_slots,  # S: rows of the cache
    num_groups,  # bs * Hkv: program groups (sizes the workspace sections)
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PLAN: tl.constexpr,  # planner.OneLaunchPlan
    PDL: tl.constexpr,  # pdl.Schedule, or None
    PTX: tl.constexpr,  # PLAN.FP8_PTX where the kernel is compiled (the interpreter runs no PTX)
):
    ROWS: tl.constexpr = PLAN.ROWS
    BLOCK_M: tl.constexpr = 16 if ROWS < 16 else ROWS
    BLOCK_T: tl.constexpr = PLAN.TOKENS
    BLOCK_O: tl.constexpr = 16 if BLOCK_T < 16 else BLOCK_T  # positions of a draft step's own keys' block
    BLOCK_N: tl.constexpr = PLAN.BLOCK_N
    NUM_SPLITS: tl.constexpr = PLAN.NUM_SPLITS
    STORE: tl.constexpr = New is not None
    PRECISION: tl.constexpr = "ieee" if Q.dtype.element_ty == tl.float32 else "tf32"
    KV_FP8: tl.constexpr = K.dtype.element_ty.is_fp8()  # the cache stores FP8 (common)
    # the products' dtype: q's, or float16 for a half q over an FP8 cache with ``FP8_PTX`` (an
    # FP8 tile converts to it exactly: ``common.product_tile``; q once, below 65504 in magnitude)
    QTY: tl.constexpr = (
        tl.float16 if KV_FP8 and PLAN.FP8_PTX and Q.dtype.element_ty != tl.float32 else Q.dtype.element_ty
    )
    # The step's own keys come after the cached ones, from a small tile of their own: with
    # OWN_BLOCK, and wherever an FP8 step stores (its own rows, read from k / v, are quantised
    # there: a few rows, never a whole key block).
    OWN_APART: tl.constexpr = PLAN.OWN_BLOCK or (KV_FP8 and STORE)
    pid_g = tl.program_id(0)  # (request, kv head) group
    pdl_release(PDL, "entry")
    pid_s = tl.program_id(1)  # split
    b = pid_g // num_kv_heads
    hk = pid_g % num_kv_heads
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM
    tok = offs_m // G
    head = hk * G + offs_m % G
    kv_stride = num_kv_heads * HEAD_DIM
    kv_col = hk * HEAD_DIM + offs_d
    pdl_wait(PDL, "entry")

    q_start = tl.load(CuQ + b)
    q_len = tl.load(CuQ + b + 1) - q_start
    seq_len = tl.load(SeqLens + b).to(tl.int32)
    t_idx, t_start = table_entry(keys, b)
    new0 = seq_len - q_len  # position of the step's first token

    n_rows = q_len * G
    row_valid = offs_m < n_rows
    rd_mask = row_valid[:, None] & d_valid[None, :]
    pos = new0 + tok
    q_rows = (q_start + tok).to(tl.int64)

    # the group's key range: the first token's window start .. the last token's position
    kv_hi = seq_len
    if window is not None:
        lo = tl.maximum(pos - window + 1, 0)
        kv_lo = tl.maximum(new0 - window + 1, 0)
    else:
        lo = 0
        kv_lo = seq_len * 0
    kv_hi = tl.where(q_len > 0, kv_hi, kv_lo)
    kv_hi = tl.maximum(kv_hi, kv_lo)
    if NUM_SPLITS > 1:
        # splits of whole 16-key steps (not whole blocks): every split gets keys even when the
        # host bound that sized BLOCK_N is far above the request's length
        chunk = tl.cdiv(tl.cdiv(kv_hi - kv_lo, NUM_SPLITS), 16) * 16
        s_lo = tl.minimum(kv_lo + pid_s * chunk, kv_hi)
        s_hi = tl.minimum(s_lo + chunk, kv_hi)
    else:
        s_lo = kv_lo
        s_hi = kv_hi

    t_row = table_row(keys, t_idx)

    # The first key block: its table entries and the K/V of positions before the step's own
    # tokens were written before this step began, so a prologue reads them before the wait.
    offs_n, slot, has_key = key_slots(t_row, s_lo, s_hi, t_start, keys.width, num_slots, BLOCK_N, True)
    in_range = offs_n < s_hi
    is_new = offs_n >= new0
    kv_off = slot.to(tl.int64)[:, None] * kv_stride + kv_col[None, :]
    old_mask = (has_key & ~is_new)[:, None] & d_valid[None, :]
    k_old = tl.load(K + kv_off, mask=old_mask, other=0.0)
    v_old = tl.load(V + kv_off, mask=old_mask, other=0.0)
    if PLAN.OWN_BLOCK:
        # the first block holds cached keys only: its operands go into the products' layouts
        # now (products with zeros, exact), and the step's own keys come after the others
        # (an FP8 cache's tiles converted first, exactly)
        k_old = product_tile(k_old, QTY, PTX)
        v_old = product_tile(v_old, QTY, PTX)
        s_pre = tl.dot(tl.zeros([BLOCK_M, BLOCK_D], dtype=k_old.dtype), tl.trans(k_old), input_precision=PRECISION)
        o_pre = tl.dot(tl.zeros([BLOCK_M, BLOCK_N], dtype=v_old.dtype), v_old, input_precision=PRECISION)
    if OWN_APART:
        # (not ``key_slots``: its table read is not bounded below by the split)
        if BLOCK_T == 1:  # decode: one own key, folded as a vector by the split that holds it
            o_here = (new0 >= s_lo) & (new0 < s_hi)
            o_col1 = new0 - t_start
            o_slot1 = tl.load(t_row + o_col1, mask=o_here & (o_col1 >= 0) & (o_col1 < keys.width), other=0)
            o_here = o_here & (o_slot1 >= 1) & (o_slot1 < num_slots)
        else:
            offs_o = new0 + tl.arange(0, BLOCK_O)
            o_range = (offs_o >= s_lo) & (offs_o < s_hi)
            o_col = offs_o - t_start
            o_slot = tl.load(t_row + o_col, mask=o_range & (o_col >= 0) & (o_col < keys.width), other=0)
            o_key = o_range & (o_slot >= 1) & (o_slot < num_slots)
    pdl_wait(PDL, "prologue")
    pdl_release(PDL, "wait")
    if KV_FP8:  # kv head hk's scales: k_scale joins the logit scale, v_scale the output
        k_scale = tl.load(Scales.k + hk * Scales.stride_k)
        v_scale = tl.load(Scales.v + hk * Scales.stride_v)
        qk_scale = qk_scale * k_scale

    if STORE:
        if pid_s == 0:  # one program per group stores the group's head of the new rows
            offs_t = tl.arange(0, BLOCK_T)
            t_rows = (q_start + offs_t).to(tl.int64)
            loc = tl.load(New.loc + t_rows, mask=offs_t < q_len, other=0).to(tl.int64)
            ok = (offs_t < q_len) & (loc >= 1) & (loc < num_slots)
            st_mask = ok[:, None] & d_valid[None, :]
            kn = tl.load(New.k + t_rows[:, None] * New.stride_k + kv_col[None, :], mask=st_mask)
            vn = tl.load(New.v + t_rows[:, None] * New.stride_v + kv_col[None, :], mask=st_mask)
            if KV_FP8:
                kn = quantize_kv(kn, k_scale, K.dtype.element_ty)
                vn = quantize_kv(vn, v_scale, V.dtype.element_ty)
            dst = loc[:, None] * kv_stride + kv_col[None, :]
            tl.store(K + dst, kn, mask=st_mask)
            tl.store(V + dst, vn, mask=st_mask)

    # (heads in 64 bits: q and out may be head-major views of more than 2**31 elements)
    head64 = head.to(tl.int64)
    q_off = q_rows[:, None] * stride_qt + head64[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(Q + q_off, mask=rd_mask, other=0.0).to(QTY)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if OWN_APART:  # the first block: cached keys only
        first_key = has_key & ~is_new
        if PLAN.OWN_BLOCK:  # as laid out before the wait
            k, v, acc, qk0 = k_old, v_old, o_pre, s_pre
        else:
            k, v, acc, qk0 = (
                product_tile(k_old, QTY, PTX),
                product_tile(v_old, QTY, PTX),
                tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32),
                None,
            )
        if BLOCK_T == 1:  # decode: the own key's row, loaded with q (nothing where no split holds it)
            o_mask1 = offs_d < tl.where(o_here, HEAD_DIM, 0)  # (not ``d_valid & o_here``: a scalar mask
            # broadcast that Triton's interpreter turns into integers)
            if STORE:
                k_own = tl.load(New.k + q_start.to(tl.int64) * New.stride_k + kv_col, mask=o_mask1, other=0.0)
                v_own = tl.load(New.v + q_start.to(tl.int64) * New.stride_v + kv_col, mask=o_mask1, other=0.0)
            else:
                o_off1 = o_slot1.to(tl.int64) * kv_stride + kv_col
                k_own = tl.load(K + o_off1, mask=o_mask1, other=0.0)
                v_own = tl.load(V + o_off1, mask=o_mask1, other=0.0)
        else:
            o_mask = o_key[:, None] & d_valid[None, :]
            if STORE:  # the rows being stored, read from k / v
                o_row = (q_start + offs_o - new0).to(tl.int64)
                k_own = tl.load(New.k + o_row[:, None] * New.stride_k + kv_col[None, :], mask=o_mask, other=0.0)
                v_own = tl.load(New.v + o_row[:, None] * New.stride_v + kv_col[None, :], mask=o_mask, other=0.0)
            else:
                o_off = o_slot.to(tl.int64)[:, None] * kv_stride + kv_col[None, :]
                k_own = tl.load(K + o_off, mask=o_mask, other=0.0)
                v_own = tl.load(V + o_off, mask=o_mask, other=0.0)
        if KV_FP8:
            if STORE:  # what the store writes: attention sees what the cache holds
                k_own = quantize_kv(k_own, k_scale, K.dtype.element_ty)
                v_own = quantize_kv(v_own, v_scale, V.dtype.element_ty)
            k_own = k_own.to(QTY)
            v_own = v_own.to(QTY)
    else:
        first_key, acc, qk0 = has_key, tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32), None
        new_mask = (has_key & is_new)[:, None] & d_valid[None, :]
        if STORE:  # keys of the step's own tokens: the rows being stored, read from k / v (not FP8)
            n_row = (q_start + offs_n - new0).to(tl.int64)
            k = tl.load(New.k + n_row[:, None] * New.stride_k + kv_col[None, :], mask=new_mask, other=k_old)
            v = tl.load(New.v + n_row[:, None] * New.stride_v + kv_col[None, :], mask=new_mask, other=v_old)
        else:
            k = product_tile(tl.load(K + kv_off, mask=new_mask, other=k_old), QTY, PTX)
            v = product_tile(tl.load(V + kv_off, mask=new_mask, other=v_old), QTY, PTX)
    # fmt: off
    m_i, l_i, acc = _online_block(
        q, k, v, first_key, offs_n, in_range, pos, lo, m_i, l_i, acc, qk_scale, softcap_log2, window, qk0
    )
    # fmt: on
    for start in range(s_lo + BLOCK_N, s_hi, BLOCK_N):
        offs_n, slot, has_key = key_slots(t_row, start, s_hi, t_start, keys.width, num_slots, BLOCK_N, True)
        in_range = offs_n < s_hi
        kv_off = slot.to(tl.int64)[:, None] * kv_stride + kv_col[None, :]
        if OWN_APART:  # cached keys only: the step's own come after them
            has_key = has_key & (offs_n < new0)
        kv_mask = has_key[:, None] & d_valid[None, :]
        if STORE and not OWN_APART:
            # keys of the step's own tokens: the rows being stored, read from k / v (not FP8)
            is_new = offs_n >= new0
            n_row = (q_start + offs_n - new0).to(tl.int64)
            k_ptr = tl.where(is_new[:, None], New.k + n_row[:, None] * New.stride_k + kv_col[None, :], K + kv_off)
            v_ptr = tl.where(is_new[:, None], New.v + n_row[:, None] * New.stride_v + kv_col[None, :], V + kv_off)
        else:
            k_ptr = K + kv_off
            v_ptr = V + kv_off
        k = product_tile(tl.load(k_ptr, mask=kv_mask, other=0.0), QTY, PTX)
        v = product_tile(tl.load(v_ptr, mask=kv_mask, other=0.0), QTY, PTX)
        # fmt: off
        m_i, l_i, acc = _online_block(
            q, k, v, has_key, offs_n, in_range, pos, lo, m_i, l_i, acc, qk_scale, softcap_log2, window
        )
        # fmt: on
    if OWN_APART:
        if BLOCK_T == 1:
            if o_here:  # one key at the row's own position: inside the window, never masked
                m_i, l_i, acc = _online_key(q, k_own, v_own, row_valid, m_i, l_i, acc, qk_scale, softcap_log2)
        else:
            # fmt: off
            m_i, l_i, acc = _online_block(
                q, k_own, v_own, o_key, offs_o, o_range, pos, lo, m_i, l_i, acc, qk_scale, softcap_log2, window
            )
            # fmt: on
    if KV_FP8:  # the values' scale, once per row (a split's partial too: the merge is unchanged)
        acc = acc * v_scale

    o_ptrs = Out + q_rows[:, None] * stride_ot + head64[:, None] * stride_oh + offs_d[None, :]
    if NUM_SPLITS == 1:
        if Sinks is not None:  # joins the denominator only, once (in the merge when the range is split)
            l_i, acc = fold_sink(m_i, l_i, acc, Sinks, head, row_valid)
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=rd_mask)
    else:
        # workspace: m [groups, splits, ROWS], then l (same), then the split's normalised output
        # acc / l [groups, splits, ROWS, D] in Out's dtype (what the merge reads most of: half the
        # bytes for 16-bit outputs); only the first ROWS rows of the tile are real (ROWS >= q_len * G)
        n_ml = num_groups * NUM_SPLITS * ROWS
        WorkL = Work + n_ml
        WorkAcc = (Work + 2 * n_ml).to(tl.pointer_type(Out.dtype.element_ty))
        gbase = pid_g.to(tl.int64) * NUM_SPLITS * ROWS
        prow = gbase + pid_s * ROWS + offs_m
        keep_row = offs_m < ROWS
        part = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(Work + prow, m_i, mask=keep_row)
        tl.store(WorkL + prow, l_i, mask=keep_row)
        tl.store(
            WorkAcc + prow[:, None] * HEAD_DIM + offs_d[None, :],
            part.to(Out.dtype.element_ty),
            mask=keep_row[:, None] & d_valid[None, :],
        )
        tl.debug_barrier()  # every thread's partial is written before the ticket is taken
        ticket = tl.atomic_add(Tickets + pid_g, 1, sem="acq_rel")
        if ticket == NUM_SPLITS - 1:  # the last program of the group merges the splits, in order
            # fmt: off
            _merge_splits(
                Out, Work, WorkL, WorkAcc, Sinks, gbase, q_start, hk, n_rows, stride_ot, stride_oh, offs_d, d_valid,
                G, HEAD_DIM, ROWS, BLOCK_D, NUM_SPLITS, PLAN.MERGE_CHUNK
            )
            # fmt: on
            tl.atomic_xchg(Tickets + pid_g, 0, sem="relaxed")  # ready for the next launch
    pdl_release(PDL, "end")


def store_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    loc: Optional[torch.Tensor],
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    inputs: AttentionInputs,
    plan: OneLaunchPlan,
    *,
    workspace: torch.Tensor,
    tickets: torch.Tensor,
    pdl: Optional[Schedule] = None,
) -> torch.Tensor:
    """Store ``k``/``v`` at ``loc`` (None: store nothing), attend ``q`` over the paged cache as
    ``inputs`` describe it into ``out`` and return ``out``, in one launch of ``plan``
    (``planner.plan_one_launch``; module docstring). The plan's tiles must hold
    ``inputs.max_q_len`` tokens a request.

    ``workspace``: fp32, >= ``planner.one_launch_workspace_numel`` elements; ``tickets``:
    int32, >= ``bs * Hkv`` elements, zero-filled once when allocated and reused by every call
    (each launch leaves it zero). Both are static buffers in graph mode. ``pdl``: the launch's
    PDL schedule (None: launched without PDL); a ``prologue`` schedule only for a launch whose
    previous kernel did not write the step's metadata or its first key block's cached K/V.
    """
    T, H, D, hkv, G, bs = check_attention_args(q, k_cache, v_cache, out, inputs)
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "k_cache and v_cache must be contiguous"
    max_q_len = inputs.max_q_len
    device = q.device
    rows = max(1, max_q_len) * G
    assert rows <= plan.ROWS and max(1, max_q_len) <= plan.TOKENS, f"{max_q_len} tokens x {G} heads exceed {plan}"
    if loc is not None:
        check_new_rows(k, v, loc, q, hkv)
    for name, t, dtype in (("workspace", workspace, torch.float32), ("tickets", tickets, torch.int32)):
        assert t.dtype == dtype and t.is_contiguous() and t.device == device, (
            f"{name} must be contiguous {dtype} on {device}, got {t.dtype} on {t.device}"
        )
    if pdl is not None:
        pdl.check()
    if T == 0 or bs == 0:
        return out
    splits, groups = plan.NUM_SPLITS, bs * hkv
    if splits > 1:
        assert splits & (splits - 1) == 0, f"NUM_SPLITS must be a power of two, got {splits}"
        assert 1 <= plan.MERGE_CHUNK <= splits and splits % plan.MERGE_CHUNK == 0, f"MERGE_CHUNK must divide: {plan}"
        need = groups * splits * plan.ROWS * (D + 2)
        assert workspace.numel() >= need, f"workspace needs >= {need} fp32 elements, has {workspace.numel()}"
        assert tickets.numel() >= groups, f"tickets needs >= {groups} int32 elements, has {tickets.numel()}"
    qk_scale, softcap_log2 = log2_scales(inputs.sm_scale, inputs.softcap, D)
    _store_attend_kernel[(groups, splits)](
        q,
        out,
        NewRows.of(k, v, loc) if loc is not None else None,
        k_cache,
        v_cache,
        workspace,
        tickets,
        inputs.sinks,
        inputs.kv_scales,
        inputs.cu_q_lens,
        inputs.seq_lens,
        inputs.keys,
        qk_scale,
        softcap_log2,
        inputs.window,
        hkv,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.shape[0],
        groups,
        G=G,
        HEAD_DIM=D,
        BLOCK_D=triton.next_power_of_2(D),
        PLAN=plan,
        PDL=pdl,
        PTX=plan.FP8_PTX and not interpreting(),
        num_warps=plan.num_warps,
        num_stages=plan.num_stages,
        **launch_options(pdl),
    )
    return out
