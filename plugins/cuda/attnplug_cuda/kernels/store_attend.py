"""One launch per layer for small steps: store the step's K/V, attend, merge the KV splits.

For small decode and draft steps (``max_q_len * G <= MAX_ROWS`` and few enough requests that
every (request, kv head) group gets at least two KV splits: ``eligible``) a layer is ONE
kernel, ``_store_attend_kernel``, instead of a KV store, an attention kernel and a split
combine. At small batch a layer's time is a chain of dependent memory round trips and
launches, not bandwidth; this kernel shortens the chain:

* the store of the step's K/V rows is done by split 0 of each (request, kv head) program
  group, and every program reads the keys of the step's own tokens from ``k`` / ``v`` (the
  rows it would otherwise read back from the cache right after the store), so no program
  waits for another;
* the KV range of a request is cut into ``NUM_SPLITS`` chunks (their count sized from host
  bounds so the grid fills the GPU even at batch 1, up to two 4-warp programs an SM
  (``_plan``); their length from the request's real range, in whole 16-key steps: flash-decoding);
  each program writes a partial ``(m, l, acc / l)`` (the normalised part in the output's
  dtype: half the bytes the merge reads for 16-bit outputs), and the LAST program of the
  group to finish (an atomic ticket per group) merges the partials and writes the output: no
  second launch. The merge folds the splits in order, ``MERGE_ROWS`` (split, row) pairs a
  trip, each thread over its own (row, head-dim) elements, so a trip's loads are in flight
  together and no thread waits for another. The ticket counters return to zero in the same
  launch, so the kernel can be replayed from a graph any number of times;
* K and V of a key block are requested together before any arithmetic. In the first block,
  read before the wait, the step's own rows are loaded over the cached ones in place (a
  masked load whose other value is the prologue's tile), so the block is held once, not
  twice (registers and shared memory: ``benchmarks/store_attend_resources.py``);
* with ``own_block`` (the plan's, for decode steps of up to one group an SM) the first block
  holds cached keys only, and two products with zero matrices, taken before the wait, move its
  K and V into the products' layouts there (exact: their results start the real products'
  accumulators);
  the step's own keys then come in a block of their own after the others, read from
  ``k`` / ``v``. A decode step's one own key is no block: the split that holds it folds it
  in as a vector (its logits as row sums of ``q * k`` in float32, ``p * v`` added to the
  accumulator), with no product tile and no layout change after the wait, and every other
  split skips it.

Shapes (``T`` new tokens, ``bs`` requests, ``H`` q heads, ``Hkv`` kv heads, ``G = H / Hkv``,
``D`` head dim, ``S`` cache slots, ``R`` table rows):

=============  =========================  ===============================================
tensor         shape / dtype              meaning
=============  =========================  ===============================================
q, out         [T, H, D] fp16/bf16/fp32   last dim contiguous, other strides free
k, v           [T, Hkv, D], q's dtype     the step's new K/V rows (last dim contiguous,
                                          heads dense); stored at ``loc``
loc            [T] int32/int64            cache slot of each new token (``[1, S)`` is
                                          stored, anything else skipped) or None: nothing
                                          stored, every key read from the cache
k_cache,       [S, Hkv, D], q's dtype     contiguous
v_cache
cu_q_lens      [bs + 1] int32             exclusive prefix sum of new tokens per request
seq_lens       [bs] int32/int64           KV length of each request INCLUDING new tokens
table,         as ``paged_attention``     slot of key position ``j`` of request ``b`` is
table_rows,                               ``table[table_rows[b], j - table_start[b]]``
table_start
workspace      fp32, contiguous           split partials (``store_attend_workspace_numel``)
tickets        [>= bs * Hkv] int32        one counter per (request, kv head) group,
                                          ZERO-filled once; every launch leaves it zero
=============  =========================  ===============================================

Semantics are those of ``paged_attention`` after ``kv_store`` (the same logits and masks;
results differ only by rounding, since the KV range is split elsewhere). A key position is a key only when its
table entry is a slot in ``[1, S)``; for a position of the step's own tokens the K/V values
come from ``k`` / ``v`` — equal to what the store writes, since the engine's table points
at ``loc`` for those positions (the contract's ``out_cache_loc``). With ``loc=None`` (the
layer does not save its KV) every key is read from the cache.

PDL: the kernel ``gdc_wait``s before its first load and releases its dependents after its
last store, or with ``release_early`` right after ``gdc_wait`` (every layer after the first
then starts its prologue while the previous one computes), or with the plan's
``release_entry`` (only with ``prologue``) at entry. With ``prologue`` it first reads
what no recent kernel wrote — the step's metadata (``cu_q_lens``,
``seq_lens``, table rows and starts), the first key block's table entries and the cached K/V
of its positions before the step's own tokens — and only then waits: the previous layer's
tail overlaps those loads. Where each kernel of a PDL chain waits before it releases the
next, every kernel two or more launches back has completed when a launch starts, and the data
read early must come from those. A launch released at entry may start while earlier ones still
run, so the data read before the wait must come from before the step's first attention
launch (which never releases at entry): earlier steps' K/V, the step's metadata. That is
what the prologue reads; the tickets and the workspace are touched only after the wait, and a
kernel completes only after its own wait returns, so each wait still covers every launch
before it. The step's own K/V (from ``k`` / ``v``, or the cache when
``loc`` is None) and ``q`` are read after the wait.
The merge order of the splits is fixed (split 0 first), so the output does not depend on
which program merges: PDL on and off give identical bits.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from .interpret import ensure_interpreter_compat
from .paged_attention import _num_sms, _tanh, check_attention_args, check_new_rows, log2_scales

__all__ = ["store_attend", "plan_store_attend", "store_attend_workspace_numel", "max_split_programs", "MAX_ROWS"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: most (token, q head) rows of one request this kernel serves: decode and short draft steps
#: (an H200 ran 48-layer 4-draft steps with 4 q heads per kv head, 16 rows, in 374 / 575 us at
#: bs 1 / 8 against 487 / 691 us for store + attention)
MAX_ROWS = 16
#: most KV splits of one (request, kv head) group
MAX_SPLITS = 32
#: a split covers at least this many keys
MIN_KEYS_PER_SPLIT = 32
#: split until the grid has about this many programs per SM
PROGRAMS_PER_SM = 1
#: paired plans (decode steps' full layers; steps of several tokens a request once their
#: groups cover a quarter of the SMs) split until the grid has about this many 4-warp
#: programs per SM, two sharing each SM (``_plan``)
PAIRED_PROGRAMS_PER_SM = 2
#: a split of those steps covers at least this many keys
PAIRED_MIN_KEYS_PER_SPLIT = 64
#: most (split, row) pairs the merge holds at once (each thread keeps its share of that many
#: partial rows in registers; more splits are merged in several trips)
MERGE_ROWS = 64
#: most (split, row) pairs one merge reads: the split count stops there
MERGE_READS = 256
#: most (request, kv head) groups per SM of a step this kernel serves. An H200, the 48-layer
#: hybrid step (8 kv heads, W 256, 1,024 keys), one launch a layer against the KV store +
#: paged attention: decode bs 16 641.0 against 776.8 us, bs 32 938.9 against 1053.1 us;
#: 4-draft steps bs 16 795.9 against 892.1 us, bs 32 1071.4 against 1331.9 us; at bs 64
#: (3.9 groups per SM) slower, 2080.7 against 1752.7 us (4 drafts)
GROUPS_PER_SM = 2

ensure_interpreter_compat()


@triton.jit
def _key_block(t_row, start, s_hi, t_start, table_width, num_slots, BLOCK_N: tl.constexpr):
    """Key positions ``start .. start + BLOCK_N`` of a split ending at ``s_hi``: ``(offs_n,
    in_range, slot, has_key)`` (the table read)."""
    offs_n = start + tl.arange(0, BLOCK_N)
    col = offs_n - t_start
    in_range = offs_n < s_hi
    slot = tl.load(t_row + col, mask=in_range & (col >= 0) & (col < table_width), other=0)
    has_key = (slot >= 1) & (slot < num_slots)
    return offs_n, in_range, slot, has_key


@triton.jit
def _online_block(
    q,
    k,
    v,
    has_key,
    offs_n,
    in_range,
    pos,
    lo,
    m_i,
    l_i,
    acc,
    qk_scale,
    softcap_log2,
    HAS_WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    PRECISION: tl.constexpr,
    qk0=None,
):
    """One key block folded into the running ``(m_i, l_i, acc)`` (base-2 online softmax).
    ``qk0``: the products' accumulator (zeros: a product laid out before the wait)."""
    qk = tl.dot(q, tl.trans(k), acc=qk0, input_precision=PRECISION)
    if SOFTCAP:
        qk = _tanh(qk * qk_scale) * softcap_log2 + tl.where(has_key, 0.0, float("-inf"))[None, :]
    else:
        qk = qk * qk_scale + tl.where(has_key, 0.0, float("-inf"))[None, :]
    keep = (offs_n[None, :] <= pos[:, None]) & in_range[None, :]
    if HAS_WINDOW:
        keep = keep & (offs_n[None, :] >= lo[:, None])
    qk = tl.where(keep, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _online_key(q, k, v, row_valid, m_i, l_i, acc, qk_scale, softcap_log2, SOFTCAP: tl.constexpr):
    """One key (``k``, ``v``: ``[BLOCK_D]``) folded into every valid row's running ``(m_i, l_i,
    acc)``: its logits as row sums of ``q * k`` in float32 and ``p * v`` added to ``acc``, with
    no product tile and no layout change through shared memory."""
    qk = tl.sum(q.to(tl.float32) * k.to(tl.float32)[None, :], 1)
    if SOFTCAP:
        qk = _tanh(qk * qk_scale) * softcap_log2
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
def _store_attend_kernel(
    Q,
    KNew,
    VNew,
    Loc,
    K,
    V,
    Out,
    Work,
    Tickets,
    CuQ,
    SeqLens,
    Table,
    TableRows,
    TableStart,
    Sinks,  # [H] float32 sink logits (natural log); read only with HAS_SINKS
    qk_scale,  # sm_scale * log2(e); with SOFTCAP: sm_scale / c
    softcap_log2,  # with SOFTCAP: c * log2(e)
    window,
    num_kv_heads,
    stride_qt,
    stride_qh,
    stride_knt,
    stride_vnt,
    stride_ot,
    stride_oh,
    stride_table,
    table_width,
    table_rows_len,  # R: rows of the table
    num_slots,  # S: rows of the cache
    num_groups,  # bs * Hkv: program groups (sizes the workspace sections)
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_O: tl.constexpr,  # with OWN_BLOCK: positions of the step's own keys' block (>= 16)
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    MERGE_CHUNK: tl.constexpr,  # splits merged per trip of the merge loop (divides NUM_SPLITS)
    HAS_WINDOW: tl.constexpr,
    HAS_TABLE_START: tl.constexpr,
    STORE: tl.constexpr,
    PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    PDL: tl.constexpr,
    PROLOGUE: tl.constexpr,  # with PDL: read the step's metadata and the first key block's cached K/V before gdc_wait
    RELEASE_EARLY: tl.constexpr,  # with PDL: release the dependents right after gdc_wait
    OWN_BLOCK: tl.constexpr,  # the step's own keys in a block of their own; the first block laid out before the wait
    RELEASE_ENTRY: tl.constexpr,  # with PDL and PROLOGUE: release the dependents at entry
):
    pid_g = tl.program_id(0)  # (request, kv head) group
    if PDL and RELEASE_ENTRY:
        tl.extra.cuda.gdc_launch_dependents()
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
    if PDL and not PROLOGUE:
        tl.extra.cuda.gdc_wait()

    q_start = tl.load(CuQ + b)
    q_len = tl.load(CuQ + b + 1) - q_start
    seq_len = tl.load(SeqLens + b).to(tl.int32)
    t_idx = tl.load(TableRows + b).to(tl.int64)
    if HAS_TABLE_START:
        t_start = tl.load(TableStart + b).to(tl.int32)
    else:
        t_start = 0
    new0 = seq_len - q_len  # position of the step's first token

    n_rows = q_len * G
    row_valid = offs_m < n_rows
    rd_mask = row_valid[:, None] & d_valid[None, :]
    pos = new0 + tok
    q_rows = (q_start + tok).to(tl.int64)

    # the group's key range: the first token's window start .. the last token's position
    kv_hi = seq_len
    if HAS_WINDOW:
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

    t_idx = tl.where((t_idx >= 0) & (t_idx < table_rows_len), t_idx, 0)  # outside the table: row 0
    t_row = Table + t_idx * stride_table

    # The first key block: its table entries and the K/V of positions before the step's own
    # tokens were written before this step began (by earlier steps, the engine, the step's
    # metadata), so with PROLOGUE they are read before gdc_wait, overlapping the previous
    # kernel; only the step's own tokens (written by the previous kernels) wait.
    offs_n, in_range, slot, has_key = _key_block(t_row, s_lo, s_hi, t_start, table_width, num_slots, BLOCK_N)
    is_new = offs_n >= new0
    kv_off = slot.to(tl.int64)[:, None] * kv_stride + kv_col[None, :]
    old_mask = (has_key & ~is_new)[:, None] & d_valid[None, :]
    k_old = tl.load(K + kv_off, mask=old_mask, other=0.0)
    v_old = tl.load(V + kv_off, mask=old_mask, other=0.0)
    if OWN_BLOCK:
        # the first block holds cached keys only: its operands go into the products' layouts
        # now (products with zeros, exact), and the step's own keys get a block of their own
        s_pre = tl.dot(tl.zeros([BLOCK_M, BLOCK_D], dtype=k_old.dtype), tl.trans(k_old), input_precision=PRECISION)
        o_pre = tl.dot(tl.zeros([BLOCK_M, BLOCK_N], dtype=v_old.dtype), v_old, input_precision=PRECISION)
        # (not ``_key_block``: its table read is not bounded below by the split, and the kernel
        # compiled through it took 4 more registers on the bs 8 SWA plan, offline for sm_90)
        if BLOCK_T == 1:  # decode: one own key, folded as a vector by the split that holds it
            o_here = (new0 >= s_lo) & (new0 < s_hi)
            o_col1 = new0 - t_start
            o_slot1 = tl.load(t_row + o_col1, mask=o_here & (o_col1 >= 0) & (o_col1 < table_width), other=0)
            o_here = o_here & (o_slot1 >= 1) & (o_slot1 < num_slots)
        else:
            offs_o = new0 + tl.arange(0, BLOCK_O)
            o_range = (offs_o >= s_lo) & (offs_o < s_hi)
            o_col = offs_o - t_start
            o_slot = tl.load(t_row + o_col, mask=o_range & (o_col >= 0) & (o_col < table_width), other=0)
            o_key = o_range & (o_slot >= 1) & (o_slot < num_slots)
    if PDL and PROLOGUE:
        tl.extra.cuda.gdc_wait()
    if PDL and RELEASE_EARLY:
        tl.extra.cuda.gdc_launch_dependents()

    if STORE:
        if pid_s == 0:  # one program per group stores the group's head of the new rows
            offs_t = tl.arange(0, BLOCK_T)
            t_rows = (q_start + offs_t).to(tl.int64)
            loc = tl.load(Loc + t_rows, mask=offs_t < q_len, other=0).to(tl.int64)
            ok = (offs_t < q_len) & (loc >= 1) & (loc < num_slots)
            st_mask = ok[:, None] & d_valid[None, :]
            kn = tl.load(KNew + t_rows[:, None] * stride_knt + kv_col[None, :], mask=st_mask)
            vn = tl.load(VNew + t_rows[:, None] * stride_vnt + kv_col[None, :], mask=st_mask)
            dst = loc[:, None] * kv_stride + kv_col[None, :]
            tl.store(K + dst, kn, mask=st_mask)
            tl.store(V + dst, vn, mask=st_mask)

    q = tl.load(Q + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :], mask=rd_mask, other=0.0)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if OWN_BLOCK:  # the first block as laid out before the wait: cached keys only
        k, v, first_key, acc, qk0 = k_old, v_old, has_key & ~is_new, o_pre, s_pre
        if BLOCK_T == 1:  # decode: the own key's row, loaded with q (nothing where no split holds it)
            o_mask1 = offs_d < tl.where(o_here, HEAD_DIM, 0)  # (not ``d_valid & o_here``: a scalar mask
            # broadcast that Triton's interpreter turns into integers)
            if STORE:
                k_own = tl.load(KNew + q_start.to(tl.int64) * stride_knt + kv_col, mask=o_mask1, other=0.0)
                v_own = tl.load(VNew + q_start.to(tl.int64) * stride_vnt + kv_col, mask=o_mask1, other=0.0)
            else:
                o_off1 = o_slot1.to(tl.int64) * kv_stride + kv_col
                k_own = tl.load(K + o_off1, mask=o_mask1, other=0.0)
                v_own = tl.load(V + o_off1, mask=o_mask1, other=0.0)
        else:
            o_mask = o_key[:, None] & d_valid[None, :]
            if STORE:  # the rows being stored, read from k / v
                o_row = (q_start + offs_o - new0).to(tl.int64)
                k_own = tl.load(KNew + o_row[:, None] * stride_knt + kv_col[None, :], mask=o_mask, other=0.0)
                v_own = tl.load(VNew + o_row[:, None] * stride_vnt + kv_col[None, :], mask=o_mask, other=0.0)
            else:
                o_off = o_slot.to(tl.int64)[:, None] * kv_stride + kv_col[None, :]
                k_own = tl.load(K + o_off, mask=o_mask, other=0.0)
                v_own = tl.load(V + o_off, mask=o_mask, other=0.0)
    else:
        first_key, acc, qk0 = has_key, tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32), None
        new_mask = (has_key & is_new)[:, None] & d_valid[None, :]
        if STORE:  # keys of the step's own tokens: the rows being stored, read from k / v
            n_row = (q_start + offs_n - new0).to(tl.int64)
            k = tl.load(KNew + n_row[:, None] * stride_knt + kv_col[None, :], mask=new_mask, other=k_old)
            v = tl.load(VNew + n_row[:, None] * stride_vnt + kv_col[None, :], mask=new_mask, other=v_old)
        else:
            k = tl.load(K + kv_off, mask=new_mask, other=k_old)
            v = tl.load(V + kv_off, mask=new_mask, other=v_old)
    # the key blocks and the own keys' block differ only in their keys: one compact call each
    # fmt: off
    m_i, l_i, acc = _online_block(
        q, k, v, first_key, offs_n, in_range, pos, lo, m_i, l_i, acc, qk_scale, softcap_log2, HAS_WINDOW, SOFTCAP,
        PRECISION, qk0
    )
    # fmt: on
    for start in range(s_lo + BLOCK_N, s_hi, BLOCK_N):
        offs_n, in_range, slot, has_key = _key_block(t_row, start, s_hi, t_start, table_width, num_slots, BLOCK_N)
        kv_off = slot.to(tl.int64)[:, None] * kv_stride + kv_col[None, :]
        if OWN_BLOCK:  # cached keys only: the step's own come in their own block
            has_key = has_key & (offs_n < new0)
        kv_mask = has_key[:, None] & d_valid[None, :]
        if STORE and not OWN_BLOCK:
            # keys of the step's own tokens: the rows being stored, read from k / v
            is_new = offs_n >= new0
            n_row = (q_start + offs_n - new0).to(tl.int64)
            k_ptr = tl.where(is_new[:, None], KNew + n_row[:, None] * stride_knt + kv_col[None, :], K + kv_off)
            v_ptr = tl.where(is_new[:, None], VNew + n_row[:, None] * stride_vnt + kv_col[None, :], V + kv_off)
        else:
            k_ptr = K + kv_off
            v_ptr = V + kv_off
        k = tl.load(k_ptr, mask=kv_mask, other=0.0)
        v = tl.load(v_ptr, mask=kv_mask, other=0.0)
        # fmt: off
        m_i, l_i, acc = _online_block(
            q, k, v, has_key, offs_n, in_range, pos, lo, m_i, l_i, acc, qk_scale, softcap_log2, HAS_WINDOW, SOFTCAP,
            PRECISION
        )
        # fmt: on
    if OWN_BLOCK:
        if BLOCK_T == 1:
            if o_here:  # one key at the row's own position: inside the window, never masked
                m_i, l_i, acc = _online_key(q, k_own, v_own, row_valid, m_i, l_i, acc, qk_scale, softcap_log2, SOFTCAP)
        else:
            # fmt: off
            m_i, l_i, acc = _online_block(
                q, k_own, v_own, o_key, offs_o, o_range, pos, lo, m_i, l_i, acc, qk_scale, softcap_log2, HAS_WINDOW,
                SOFTCAP, PRECISION
            )
            # fmt: on

    o_ptrs = Out + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    if NUM_SPLITS == 1:
        if HAS_SINKS:  # joins the denominator only, once (in the merge when the range is split)
            sink = tl.load(Sinks + head, mask=row_valid, other=0.0) * 1.4426950408889634
            m_fin = tl.maximum(m_i, sink)
            alpha = tl.math.exp2(m_i - m_fin)
            l_i = l_i * alpha + tl.math.exp2(sink - m_fin)
            acc = acc * alpha[:, None]
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
            # each thread keeps its own (row, head-dim) elements of every split in registers: the
            # splits' loads are independent of each other and of the arithmetic, so they are all
            # in flight at once, and nothing is exchanged between threads
            offs_r = tl.arange(0, ROWS)
            r_valid = offs_r < n_rows
            r_head = hk * G + offs_r % G
            m_run = tl.full([ROWS], -1.0e30, dtype=tl.float32)
            total = tl.zeros([ROWS], dtype=tl.float32)
            merged = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
            for c in range(NUM_SPLITS // MERGE_CHUNK):  # MERGE_CHUNK splits' loads in flight at once
                for s in tl.static_range(MERGE_CHUNK):
                    srow = gbase + (c * MERGE_CHUNK + s) * ROWS + offs_r
                    m_s = tl.load(Work + srow, cache_modifier=".cg")
                    l_s = tl.load(WorkL + srow, cache_modifier=".cg")
                    a_s = tl.load(
                        WorkAcc + srow[:, None] * HEAD_DIM + offs_d[None, :],
                        mask=d_valid[None, :],
                        cache_modifier=".cg",
                    )
                    m_new = tl.maximum(m_run, m_s)
                    alpha = tl.math.exp2(m_run - m_new)
                    w = tl.math.exp2(m_s - m_new)
                    total = total * alpha + w * l_s
                    merged = merged * alpha[:, None] + a_s.to(tl.float32) * (w * l_s)[:, None]
                    m_run = m_new
            if HAS_SINKS:
                r_sink = tl.load(Sinks + r_head, mask=r_valid, other=0.0) * 1.4426950408889634
                m_fin = tl.maximum(m_run, r_sink)
                alpha = tl.math.exp2(m_run - m_fin)
                total = total * alpha + tl.math.exp2(r_sink - m_fin)
                merged = merged * alpha[:, None]
            out = merged / tl.where(total > 0.0, total, 1.0)[:, None]
            r_rows = (q_start + offs_r // G).to(tl.int64)
            r_ptrs = Out + r_rows[:, None] * stride_ot + r_head[:, None] * stride_oh + offs_d[None, :]
            tl.store(r_ptrs, out.to(Out.dtype.element_ty), mask=r_valid[:, None] & d_valid[None, :])
            tl.atomic_xchg(Tickets + pid_g, 0, sem="relaxed")  # ready for the next launch
    if PDL and not RELEASE_EARLY and not RELEASE_ENTRY:
        tl.extra.cuda.gdc_launch_dependents()


def num_sms(device: torch.device) -> int:
    """SMs of ``device`` (a small stand-in off CUDA: the interpreter)."""
    return _num_sms(device.type, device.index)


def eligible(num_reqs: int, num_kv_heads: int, max_q_len: int, group: int, num_sms: int) -> bool:
    """True when this kernel serves the step: at most ``max_q_len`` new tokens per request
    (``group`` q heads per kv head) fit one tile of rows, and there are at most
    ``GROUPS_PER_SM`` (request, kv head) groups per SM. Larger batches run faster through
    ``kv_store`` + ``paged_attention``."""
    return 1 <= max_q_len * group <= MAX_ROWS and num_reqs * num_kv_heads <= GROUPS_PER_SM * num_sms


@functools.lru_cache(maxsize=4096)
def _plan(num_reqs, num_kv_heads, group, head_dim, max_q_len, max_kv_len, window, num_sms) -> tuple:
    rows = triton.next_power_of_2(max(1, max_q_len) * group)
    block_d = triton.next_power_of_2(head_dim)
    span = max(1, max_kv_len)
    if window is not None:
        span = min(span, max(1, max_q_len) + window - 1)
    groups = max(1, num_reqs * num_kv_heads)
    # Measured on an H200 (48-layer hybrid step, bf16, D=128, 8 kv heads, W=256, 1024 keys):
    # the best split count keeps the grid within one program per SM and a split at >= 32 keys
    # (bs 1: 8 splits of 32 keys on SWA layers, 16 of 64 on full layers), and 4-draft steps
    # (16 rows) split as far as decode does (bs 1: 16 splits on full layers, 8 on SWA layers;
    # the merge takes MERGE_ROWS (split, row) pairs a trip). Decode steps then split further
    # into two programs an SM (``paired``, below).
    splits = 1
    # A window-bounded span of at most one 256-key block runs unsplit once the groups alone
    # cover a quarter of the SMs: its grid then leaves room beside it for the next layer's
    # programs, whose prologue overlaps this layer (an H200, 48-layer step, bs 8 decode, W 256:
    # SWA layers 5.39 against 6.33 us a layer with two 128-key 8-warp splits, the whole step
    # 378.6 against 410.4 us with the full layers' 256-key blocks below)
    windowed = window is not None and span == max(1, max_q_len) + window - 1
    unsplit = windowed and span <= 256 and 4 * groups >= num_sms
    while (
        not unsplit
        and splits * 2 <= MAX_SPLITS
        and groups * splits * 2 <= PROGRAMS_PER_SM * num_sms
        and span >= splits * 2 * MIN_KEYS_PER_SPLIT
        and splits * 2 * rows <= MERGE_READS
    ):
        splits *= 2
    alone = splits
    # Decode steps split on, into 4-warp programs of at most 128-key blocks, two an SM
    # (``paired``): while one program waits on its table and K/V round trips, the other's loads
    # are in flight. Full layers split while the grid stays within two programs an SM and a
    # split keeps >= 64 keys; a window of at most 256 keys takes two 128-key splits once the
    # groups cover a third of the SMs (and no more than all of them). An H200, the 48-layer
    # hybrid step, decode, µs a step (``benchmarks/step_paths.py``, the one-program-an-SM plan
    # first): bs 2 221.8 -> 212.3, bs 4 279.7 -> 261.7, bs 5 305.4 -> 289.5, bs 6 350.7 ->
    # 317.7, bs 8 370.0 -> 336.8, bs 12 579.3 -> 497.4, bs 16 638.5 -> 578.2; at 4,096 keys
    # bs 1 274.0 -> 265.6, bs 8 857.8 -> 646.6. Measured and not taken: SWA layers paired at
    # bs 5 (40 groups), 308.0 against 296.3 unsplit; 32 splits of 32 keys on full layers at
    # bs 1, 206.9 against 195.8 (hence 64 keys a split)
    decode = max_q_len <= 1
    if decode and unsplit and num_sms <= 3 * groups and groups <= PROGRAMS_PER_SM * num_sms:
        splits = 2
    # Steps of several tokens a request pair their programs the same way, windowed layers too,
    # once the groups cover a quarter of the SMs. An H200, the 48-layer hybrid step, 4 drafts,
    # µs a step (``benchmarks/step_paths.py``, one program an SM first; bs 12 and 16 with one
    # stage): bs 5 453.7 -> 365.1, bs 6 478.9 -> 380.5, bs 8 507.3 -> 431.9, bs 12 743.8 ->
    # 653.6, bs 16 792.2 -> 706.5; at 4,096 keys bs 8 1003.0 -> 721.9. Measured and not taken
    # at bs 4 (32 groups): full layers paired, 321.8 against 313.9; SWA layers on 4 warps, 341.1
    several = not decode and num_sms <= 4 * groups
    while (
        ((decode and not windowed) or several)
        and splits * 2 <= MAX_SPLITS
        and groups * splits * 2 <= PAIRED_PROGRAMS_PER_SM * PROGRAMS_PER_SM * num_sms
        and span >= splits * 2 * PAIRED_MIN_KEYS_PER_SPLIT
        and splits * 2 * rows <= MERGE_READS
    ):
        splits *= 2
    paired = splits > alone
    # one key block covers a split's keys where it can (each loop trip is a dependent chain).
    # A span set by the window is the real range: the block covers a split's share as the kernel
    # cuts it (whole 16-key steps: 4-draft steps' SWA shares of 33 keys take one 64-key block).
    # A span from ``max_kv_len`` is a host bound, often loose: the largest power of two within
    # the share (an H200, bs 1 decode, full layers, a 68-key share of 1,088: 201.6 us per step
    # with 64, 222.6 with a half-empty 128). With both rules and the split counts above, 4-draft
    # steps at bs 1 ran in 276.0 us per whole step against 383.0 us with at most 4 splits at
    # 16 rows (``hybrid_step``, two runs on an H200). Blocks reach 256 keys (8 warps) for an
    # unsplit window and for shares of 512 to 1,024 keys (2 to 4 blocks: bs 8 full layers, 544
    # keys, 16.5 against 18.2 us a layer with 128-key blocks, the same run as above); wider
    # shares keep 128-key blocks, pipelined
    share = triton.cdiv(span, splits)
    if windowed:
        block_n = triton.next_power_of_2(triton.cdiv(share, 16) * 16)
    else:
        block_n = triton.next_power_of_2(share + 1) // 2
    # More groups than SMs (then never split): several programs share an SM, so 4-warp
    # programs of at most 128 keys a block, pipelined. An H200, 48-layer step, bs 32 decode
    # (256 groups on 132 SMs): 938.9 us so on every layer against 1266.8 without this rule
    # (256-key 8-warp blocks on SWA layers, 8 warps on full layers)
    crowded = groups > PROGRAMS_PER_SM * num_sms
    wide = 256 if not (crowded or paired) and (unsplit or 512 <= share <= 1024) else 128
    widest = wide if block_d <= 128 else 64
    block_n = max(16, min(block_n, widest))
    # Decode steps of up to one (request, kv head) group an SM lay their first key block out
    # for the products before the wait (``own_block``) and fold the step's own key in as a
    # vector after their cached keys; from a sixteenth of the SMs on (bs 2 here) they also
    # release the next launch at entry, so that layout overlaps the layers before. An H100
    # (132 SMs; driver 580.159.04, Triton 3.6), 48-layer hybrid step, the own key as a vector
    # against the plan before (own_block and release_entry only at bs 5 to 12, the own keys in a
    # 16-key block), µs a step: bs 1 189.1 against 193.3 (release at entry too: 191.6), bs 2
    # 210.7 against 215.9, bs 4 250.1 against 271.6, bs 5 287.5 against 302.3, bs 8 343.3 /
    # 345.0 against 362.9 / 365.4, bs 12 507.8 against 534.8, bs 16 616.2 against 658.6
    # (``benchmarks/step_paths.py``, both trees in one run)
    own = decode and groups <= PROGRAMS_PER_SM * num_sms
    entry = own and 16 * groups >= num_sms
    return tuple(
        dict(
            BLOCK_M=max(16, rows),
            ROWS=rows,
            BLOCK_N=block_n,
            num_warps=8 if block_n * block_d >= 128 * 128 and not (crowded or paired) else 4,
            # software pipelining only where a split's share (by the host bound) holds more
            # than eight key blocks, more than four for paired programs (or the programs are
            # crowded). An H200, 48-layer step: with one block per program (bs 1; bs 8 SWA
            # layers) one stage ran 1.16x (bs 1) and 1.07x (bs 8) faster than two; with four or
            # five (bs 8 full layers, 1,025 keys, one program an SM) one stage ran the 48
            # launches in 411.5 against 427.2 us with two. Paired, two stages on full layers
            # (µs a step): shares of 514 keys in 128-key blocks, decode bs 12 496.4 -> 488.9,
            # bs 16 574.6 -> 561.6, 4 drafts bs 12 652.4 -> 631.2, bs 16 707.3 -> 691.3; shares
            # of 257, decode bs 8 335.7 -> 361.0, 4 drafts bs 8 430.1 -> 436.1 (so one stage)
            num_stages=2 if crowded or share > (4 if paired else 8) * block_n else 1,
            num_splits=splits,
            MERGE_CHUNK=max(1, min(splits, MERGE_ROWS // rows)),
            own_block=int(own),
            release_entry=int(entry),
        ).items()
    )


def plan_store_attend(
    *,
    num_reqs: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    max_q_len: int,
    max_kv_len: int,
    window: Optional[int],
    num_sms: int,
) -> dict:
    """Tile sizes, warps, stages and KV splits (a power of two) for one call, from host ints
    only (the grid never depends on device values)."""
    return dict(_plan(num_reqs, num_kv_heads, group, head_dim, max_q_len, max_kv_len, window, num_sms))


def max_split_programs(num_sms: int) -> int:
    """Most programs of a split grid on a GPU with ``num_sms`` SMs: a plan's split grid stays
    within ``PAIRED_PROGRAMS_PER_SM * PROGRAMS_PER_SM * num_sms`` programs (the doubling
    loops' bound; a window's two splits need groups within the SMs), and this leaves twice
    that much room, at least ``4 * MAX_SPLITS``, for plans a ``config`` overrides."""
    return 2 * max(PAIRED_PROGRAMS_PER_SM * PROGRAMS_PER_SM * num_sms, 2 * MAX_SPLITS)


def store_attend_workspace_numel(head_dim: int, num_sms: int) -> int:
    """fp32 elements of a workspace serving every plan on a GPU with ``num_sms`` SMs:
    ``max_split_programs`` programs, each with ``MAX_ROWS`` rows of partials."""
    return max_split_programs(num_sms) * MAX_ROWS * (head_dim + 2)


def store_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    loc: Optional[torch.Tensor],
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    *,
    cu_q_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    table: torch.Tensor,
    table_rows: torch.Tensor,
    table_start: Optional[torch.Tensor] = None,
    max_q_len: int,
    max_kv_len: int,
    sm_scale: Optional[float] = None,
    window: Optional[int] = None,
    workspace: torch.Tensor,
    tickets: torch.Tensor,
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
    pdl: bool = False,
    prologue: bool = False,
    release_early: bool = False,
    config: Optional[dict] = None,
) -> torch.Tensor:
    """Store ``k``/``v`` at ``loc`` (None: store nothing), attend ``q`` over the paged cache
    into ``out`` and return ``out``, in one launch (module docstring).

    ``max_q_len * G`` must be <= ``MAX_ROWS`` (``eligible``). ``max_q_len`` / ``max_kv_len``
    are host bounds that size the grid. ``workspace``: fp32, >= ``store_attend_workspace_numel``
    elements; ``tickets``: int32, >= ``bs * Hkv`` elements, zero-filled once when allocated
    and reused by every call (each launch leaves it zero). Both are static buffers in graph
    mode. ``softcap`` (> 0) and ``sinks`` (float32 ``[H]``) as in ``paged_attention``.
    ``prologue`` (with ``pdl``): read the step's metadata, the first key block's table entries
    and its cached K/V before ``gdc_wait`` (module docstring, PDL). Only for a launch whose
    previous kernel did not write those: never the first launch after the kernel that writes
    the step's metadata. ``release_early`` (with ``pdl``): release the next launch right after
    ``gdc_wait`` rather than after the last store.
    ``config`` overrides keys of the plan (tests, benchmarks); a ``maxnreg`` key caps the
    registers per thread.
    """
    T, H, D, hkv, G, bs = check_attention_args(
        q,
        k_cache,
        v_cache,
        out,
        cu_q_lens=cu_q_lens,
        seq_lens=seq_lens,
        table=table,
        table_rows=table_rows,
        table_start=table_start,
        max_q_len=max_q_len,
        max_kv_len=max_kv_len,
        window=window,
        softcap=softcap,
        sinks=sinks,
    )
    device = q.device
    assert 1 <= max_q_len * G <= MAX_ROWS, f"max_q_len {max_q_len} x group {G} exceeds {MAX_ROWS} rows"
    check_new_rows(k, v, loc, q, hkv)
    for name, t, dtype in (("workspace", workspace, torch.float32), ("tickets", tickets, torch.int32)):
        assert t.dtype == dtype and t.is_contiguous() and t.device == device, (
            f"{name} must be contiguous {dtype} on {device}, got {t.dtype} on {t.device}"
        )
    if T == 0 or bs == 0:
        return out
    qk_scale, softcap_log2 = log2_scales(sm_scale, softcap, D)
    plan = plan_store_attend(
        num_reqs=bs,
        num_kv_heads=hkv,
        group=G,
        head_dim=D,
        max_q_len=max_q_len,
        max_kv_len=max_kv_len,
        window=window,
        num_sms=num_sms(device),
    )
    if config:
        plan.update(config)
    splits = int(plan["num_splits"])
    groups = bs * hkv
    if splits > 1:
        assert splits & (splits - 1) == 0, f"num_splits must be a power of two, got {splits}"
        chunk = plan["MERGE_CHUNK"] = min(int(plan["MERGE_CHUNK"]), splits)
        assert chunk >= 1 and splits % chunk == 0, f"MERGE_CHUNK must divide num_splits {splits}, got {chunk}"
        need = groups * splits * plan["ROWS"] * (D + 2)
        assert workspace.numel() >= need, f"workspace needs >= {need} fp32 elements, has {workspace.numel()}"
        assert tickets.numel() >= groups, f"tickets needs >= {groups} int32 elements, has {tickets.numel()}"
    entry = bool(pdl and prologue and plan["release_entry"])  # never the first launch after the metadata
    extra = {"launch_pdl": True} if pdl else {}
    if plan.get("maxnreg"):
        extra["maxnreg"] = plan["maxnreg"]
    _store_attend_kernel[(groups, splits)](
        q,
        k,
        v,
        loc if loc is not None else cu_q_lens,
        k_cache,
        v_cache,
        out,
        workspace,
        tickets,
        cu_q_lens,
        seq_lens,
        table,
        table_rows,
        table_start if table_start is not None else table_rows,
        sinks if sinks is not None else workspace,
        qk_scale,
        softcap_log2,
        window if window is not None else 0,
        hkv,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        v.stride(0),
        out.stride(0),
        out.stride(1),
        table.stride(0),
        table.shape[1],
        table.shape[0],
        k_cache.shape[0],
        groups,
        G=G,
        HEAD_DIM=D,
        BLOCK_D=triton.next_power_of_2(D),
        BLOCK_M=plan["BLOCK_M"],
        ROWS=plan["ROWS"],
        BLOCK_T=max(1, triton.next_power_of_2(max(1, max_q_len))),
        BLOCK_O=max(16, triton.next_power_of_2(max(1, max_q_len))),
        BLOCK_N=plan["BLOCK_N"],
        NUM_SPLITS=splits,
        MERGE_CHUNK=plan["MERGE_CHUNK"],
        HAS_WINDOW=window is not None,
        HAS_TABLE_START=table_start is not None,
        STORE=loc is not None,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        SOFTCAP=softcap is not None,
        HAS_SINKS=sinks is not None,
        PDL=pdl,
        PROLOGUE=pdl and prologue,
        RELEASE_EARLY=pdl and release_early and not entry,
        OWN_BLOCK=bool(plan["own_block"]),
        RELEASE_ENTRY=entry,
        num_warps=plan["num_warps"],
        num_stages=plan["num_stages"],
        **extra,
    )
    return out
