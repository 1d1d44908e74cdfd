"""Attention over the paged KV cache, for every forward mode (decode, extend, verify).

Shapes (``T`` new tokens, ``bs`` requests, ``H`` q heads, ``Hkv`` kv heads, ``G = H / Hkv``,
``D`` head dim, ``S`` cache slots, ``R`` table rows):

============  =========================  ==================================================
tensor        shape / dtype              meaning
============  =========================  ==================================================
q, out        [T, H, D] fp16/bf16/fp32   rows ``cu_q_lens[b] .. cu_q_lens[b+1]`` belong to
                                         request ``b`` (every row belongs to a request);
                                         last dim contiguous, other strides free
k_cache,      [S, Hkv, D], q's dtype     contiguous
v_cache
cu_q_lens     [bs + 1] int32             exclusive prefix sum of the new tokens per request
seq_lens      [bs] int32/int64           KV length of each request INCLUDING its new tokens
table         [R, width] int32           slot table: the slot of key position ``j`` of
                                         request ``b`` is
                                         ``table[table_rows[b], j - table_start[b]]``
table_rows    [bs] int32/int64           table row of each request
table_start   [bs] int32/int64 | None    position of column 0 (None: 0 for every request)
============  =========================  ==================================================

Full layers pass ``table=req_to_token, table_rows=req_pool_indices, table_start=None``; SWA
layers pass the step's ``swa_window_table`` with ``table_rows=arange(bs)`` and
``table_start=window_start``, so they read only the keys the window reaches.

Semantics: new token ``i`` of request ``b`` sits at position ``p = seq_len - q_len_b + i`` and
attends to keys ``lo <= j <= p`` with ``lo = max(0, p - W + 1)`` under a window ``W``, else
0; q head ``h`` uses kv head ``h // G``. Logits are ``s = sm_scale * q.k``, the
softmax runs in base 2 with ``log2(e)`` folded into the scale, accumulation is fp32, the
output has q's dtype. A query with no valid key (a padded request) outputs zeros.

Soft-capping (``softcap=c``, constexpr ``SOFTCAP``): logits become ``c * tanh(s / c)`` before
the masks. The cap is taken in natural units (the scale passed is ``sm_scale / c``) and the
result converted to base 2 by multiplying with ``c * log2(e)``; ``tanh`` is computed from
``exp2`` of a clamped argument (no ``inf``, no NaN, the same on every Triton version and
under the interpreter). Sinks (``sinks``: float32 ``[H]``, natural-log units, constexpr
``HAS_SINKS``): each head's denominator gains ``exp(sink_h - m)``; with KV splits only the
combine kernel adds it (once), without splits the attention kernel's epilogue does. With
neither, both kernels compile to the plain path.

Out-of-range indices never read outside the tensors: a ``table_rows`` entry outside
``[0, R)`` reads row 0, and a table entry outside ``[1, S)`` (0 = the padding sink, -1 = no
slot) is no key: its K/V rows are not loaded and it contributes exactly zero, whatever the
sink holds (NaN and Inf included).

Design (one program = one request x one kv head x ``BLOCK_M`` rows x one KV split):

* rows are (token, q head of the kv head's group) pairs flattened, so the ``G`` query heads
  sharing a kv head are one tile: every K/V row is read once per kv head, and decode
  (``q_len * G <= 16`` rows) is a single ``[16, D] x [D, BLOCK_N]`` ``tl.dot`` per key block;
  long extends use ``BLOCK_M`` = 64/128 rows (flash-attention tiling);
* the program's key range is ``[lo of its first token, p of its last token]``, clipped;
  with ``NUM_SPLITS > 1`` (flash-decoding) that range is cut into ``NUM_SPLITS`` chunks,
  each program writes a partial ``(m, l, acc)`` and ``_split_combine_kernel`` merges them in a
  second launch. The number of splits comes from host bounds only (``bs``, ``Hkv``,
  ``max_q_len``, ``max_kv_len``, the SM count), so the grid never depends on device values;
  programs past a request's real lengths do no work;
* large tiles (``PHASES``) run the key blocks every row sees whole in an unmasked loop
  between the masked edge blocks (diagonal, window start, split end); decode keeps one
  masked loop (measured faster there);
* block sizes come from a fixed heuristic (``plan_attention``; no autotuning: the launch
  must be capturable), tuned on an H200: bs=64 SWA decode over 4096 keys (1.07 GB of K/V)
  in ~245 us (~4.4 TB/s), a causal 8192-token prefill at ~385 TFLOP/s (bf16, D=128).

Workspace: with splits, the partials take ``T * H * splits * (D + 2)`` fp32 elements; pass a
buffer of ``workspace_numel(max_num_tokens, H, D)`` elements (enough for every heuristic
plan) in graph mode, otherwise the wrapper allocates one per call.

PDL: both kernels ``gdc_wait`` before their first load (q and the cache were just written)
and release dependents after their last store; with ``prologue`` the attention kernel reads
the step's metadata before its wait, with ``release_early`` it releases right after it. With
``prologue`` a program also reads its first ``PREFETCH`` key blocks' table entries before the
wait and sends their cached K/V lines to L2 (``prefetch.global.L2``: a hint that holds no
register and changes no result; columns without a key prefetch the cache's first line, inside
the cache). The plan prefetches one block on the decode tiles.

Storing the step (``loc``, decode and draft steps): every program first stores kv head ``hk``
of its request's new K/V rows (the programs of one group's KV splits write the same bytes),
then a CTA barrier orders those stores before its reads of the cache, so the layer needs no
KV store launch; the cache and the output are those of ``kv_store`` followed by this kernel.
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from .interpret import ensure_interpreter_compat

__all__ = [
    "paged_attention",
    "plan_attention",
    "workspace_numel",
    "check_attention_args",
    "check_new_rows",
    "log2_scales",
]

_LOG2E = 1.4426950408889634
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: most KV splits of one program group (flash-decoding)
MAX_SPLITS = 64
#: at most this many (token, split) pairs get a partial: bounds the workspace
SPLIT_TOKEN_BUDGET = 2048
#: a split covers at least this many keys (fewer keys: the combine costs more than it saves)
MIN_KEYS_PER_SPLIT = 256
#: most (token, q head) rows of one request whose new K/V rows the attention kernel stores
#: (``loc``): one 16-row tile, decode and short drafts
STORE_ROWS = 16
#: split the KV range until about this many programs per SM exist (H200, bs=8/32/64 decode
#: over 4096 keys: 7, 2 and 1 splits came out best or within 3% of it)
PROGRAMS_PER_SM = 3

ensure_interpreter_compat()


@triton.jit
def _tanh(x):
    """tanh(x) = 1 - 2 / (exp(2x) + 1), with exp through exp2 of x clamped to [-15, 15]
    (tanh(15) rounds to 1 in fp32): never inf, never NaN."""
    e = tl.math.exp2(tl.minimum(tl.maximum(x, -15.0), 15.0) * 2.8853900817779268)  # 2 * log2(e)
    return 1.0 - 2.0 / (e + 1.0)


@triton.jit
def _prefetch_l2(ptrs):
    """``prefetch.global.L2`` of every address in ``ptrs`` (a hint: no register holds the
    data, nothing waits for it). CUDA only: the interpreter cannot run inline PTX."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def _key_slots(t_row, start, s_hi, t_start, table_width, num_slots, BLOCK_N: tl.constexpr, IN_RANGE: tl.constexpr):
    """Positions ``start + [0, BLOCK_N)``, their cache slots and which of them are keys. A
    column outside the table, or with ``IN_RANGE`` a position at or past ``s_hi``, reads slot
    0; a slot outside ``[1, num_slots)`` is no key."""
    offs_n = start + tl.arange(0, BLOCK_N)
    col = offs_n - t_start
    if IN_RANGE:
        slot = tl.load(t_row + col, mask=(offs_n < s_hi) & (col >= 0) & (col < table_width), other=0)
    else:
        slot = tl.load(t_row + col, mask=(col >= 0) & (col < table_width), other=0)
    return offs_n, slot, (slot >= 1) & (slot < num_slots)


@triton.jit
def _attend_block(
    acc,
    l_i,
    m_i,
    q,
    qk_scale,
    softcap_log2,
    start,
    s_hi,
    pos,
    lo,
    t_row,
    t_start,
    table_width,
    num_slots,
    K,
    V,
    kv_stride,
    kv_col,
    d_valid,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    EVEN_D: tl.constexpr,
    PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """One block of BLOCK_N keys from ``start``: online-softmax update of (acc, l, m).
    Logits in base 2: ``qk * qk_scale`` (``qk_scale = sm_scale * log2(e)``), or with
    ``SOFTCAP`` ``tanh(qk * qk_scale) * softcap_log2`` (``qk_scale = sm_scale / c``,
    ``softcap_log2 = c * log2(e)``), in every block, masked or not.
    MASKED=False only for blocks that every row sees whole (no causal / window / range mask).
    A column whose slot is outside ``[1, num_slots)`` (the sink 0, -1 "no slot", garbage) is
    no key in both kinds of block: its K/V are never loaded (masked loads, zeros) and its
    logit is -inf (a bias folded into the scaling multiply-add), so it contributes exactly
    zero whatever the sink holds. With ``EVEN_D`` (head dim == BLOCK_D) the load mask is
    constant along the head dim, so K/V rows still load as full-width vectors."""
    offs_n, slot, has_key = _key_slots(t_row, start, s_hi, t_start, table_width, num_slots, BLOCK_N, MASKED)
    if EVEN_D:
        kv_mask = has_key[:, None]
    else:
        kv_mask = has_key[:, None] & d_valid[None, :]
    no_key = tl.where(has_key, 0.0, float("-inf"))
    kv_off = slot.to(tl.int64)[:, None] * kv_stride + kv_col[None, :]
    k = tl.load(K + kv_off, mask=kv_mask, other=0.0)
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    if SOFTCAP:
        qk = _tanh(qk * qk_scale) * softcap_log2 + no_key[None, :]
    else:
        qk = qk * qk_scale + no_key[None, :]
    if MASKED:
        keep = (offs_n[None, :] <= pos[:, None]) & (offs_n < s_hi)[None, :]
        if HAS_WINDOW:
            keep = keep & (offs_n[None, :] >= lo[:, None])
        qk = tl.where(keep, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(V + kv_off, mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, l_i, m_new


@triton.jit
def _paged_attention_kernel(
    Q,
    K,
    V,
    Out,
    KNew,  # with STORE: [T, Hkv, D] the step's new K rows, stored at Loc
    VNew,
    Loc,  # with STORE: [>= T] cache slot of each new token ([1, S) stored, anything else skipped)
    PartM,
    PartL,
    PartAcc,
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
    stride_ot,
    stride_oh,
    stride_knt,
    stride_vnt,
    stride_table,
    table_width,
    table_rows_len,  # R: rows of the table
    num_slots,  # S: rows of the cache
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_TABLE_START: tl.constexpr,
    PRECISION: tl.constexpr,
    PHASES: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    STORE: tl.constexpr,
    PDL: tl.constexpr,
    PROLOGUE: tl.constexpr,  # with PDL: read the step's metadata before gdc_wait
    RELEASE_EARLY: tl.constexpr,  # with PDL: release the dependents right after gdc_wait
    PREFETCH: tl.constexpr,  # with PROLOGUE: key blocks whose K/V lines go to L2 before the wait
    PF_LINES: tl.constexpr,  # 128-byte lines of one K/V row of a kv head (power of 2)
    LINE_ELEMS: tl.constexpr,  # elements of a 128-byte line
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_s = tl.program_id(2)
    b = pid_bh // num_kv_heads
    hk = pid_bh % num_kv_heads
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
    if HAS_WINDOW:
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

    t_idx = tl.where((t_idx >= 0) & (t_idx < table_rows_len), t_idx, 0)  # outside the table: row 0
    t_row = Table + t_idx * stride_table
    kv_stride = num_kv_heads * HEAD_DIM
    if PREFETCH > 0:
        # The cached K/V rows of the first PREFETCH key blocks do not depend on the previous
        # kernel: send their lines to L2 now, so the loads after the wait find them there or
        # on their way. Columns without a key prefetch the cache's first line (in bounds).
        offs_line = tl.arange(0, PF_LINES) * LINE_ELEMS
        line_ok = offs_line < HEAD_DIM
        for i in range(PREFETCH):
            _, pf_slot, pf_key = _key_slots(
                t_row, s_lo + i * BLOCK_N, s_hi, t_start, table_width, num_slots, BLOCK_N, True
            )
            pf_ok = pf_key[:, None] & line_ok[None, :]
            pf_off = tl.where(pf_ok, pf_slot.to(tl.int64)[:, None] * kv_stride + hk * HEAD_DIM + offs_line[None, :], 0)
            _prefetch_l2(K + pf_off)
            _prefetch_l2(V + pf_off)
    if PDL and PROLOGUE:
        tl.extra.cuda.gdc_wait()
    if PDL and RELEASE_EARLY:
        tl.extra.cuda.gdc_launch_dependents()

    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(Q + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :], mask=rd_mask, other=0.0)

    kv_col = hk * HEAD_DIM + offs_d
    if STORE:
        # Every program of the group stores kv head hk of the request's new rows (the tile
        # holds all of them: one row block; the first head of each token is its row), then
        # waits for the CTA's stores before reading the cache. Programs of one group (its KV
        # splits) write the same bytes, so each reads the new rows whoever wrote last.
        first = row_valid & (offs_m % G == 0)
        slot_new = tl.load(Loc + q_rows, mask=first, other=0).to(tl.int64)
        # the new rows' loads do not wait for their slots: both round trips overlap
        ld_mask = first[:, None] & d_valid[None, :]
        st_mask = ld_mask & ((slot_new >= 1) & (slot_new < num_slots))[:, None]
        kn = tl.load(KNew + q_rows[:, None] * stride_knt + kv_col[None, :], mask=ld_mask)
        vn = tl.load(VNew + q_rows[:, None] * stride_vnt + kv_col[None, :], mask=ld_mask)
        dst = slot_new[:, None] * kv_stride + kv_col[None, :]
        tl.store(K + dst, kn, mask=st_mask)
        tl.store(V + dst, vn, mask=st_mask)
        tl.debug_barrier()

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if PHASES:
        # Key blocks every row of the program may see whole (below the first token's position,
        # at or past the last token's window start, inside the split) need no mask: run them
        # in a loop of their own between the masked edge blocks.
        n_blocks = tl.cdiv(s_hi - s_lo, BLOCK_N)
        if HAS_WINDOW:
            i0 = tl.minimum(tl.cdiv(tl.maximum(tl.maximum(kv_hi - window, 0) - s_lo, 0), BLOCK_N), n_blocks)
        else:
            i0 = n_blocks * 0
        i1 = tl.maximum(tl.minimum(pos_first + 1, s_hi) - s_lo, 0) // BLOCK_N
        i1 = tl.minimum(tl.maximum(i1, i0), n_blocks)
        # the three phases differ only in their block range and MASKED: one compact call each
        # fmt: off
        for i in range(0, i0):
            acc, l_i, m_i = _attend_block(
                acc, l_i, m_i, q, qk_scale, softcap_log2, s_lo + i * BLOCK_N, s_hi, pos, lo, t_row, t_start,
                table_width, num_slots, K, V, kv_stride, kv_col, d_valid, BLOCK_N, True, HAS_WINDOW, EVEN_D,
                PRECISION, SOFTCAP
            )
        for i in range(i0, i1):
            acc, l_i, m_i = _attend_block(
                acc, l_i, m_i, q, qk_scale, softcap_log2, s_lo + i * BLOCK_N, s_hi, pos, lo, t_row, t_start,
                table_width, num_slots, K, V, kv_stride, kv_col, d_valid, BLOCK_N, False, HAS_WINDOW, EVEN_D,
                PRECISION, SOFTCAP
            )
        for i in range(i1, n_blocks):
            acc, l_i, m_i = _attend_block(
                acc, l_i, m_i, q, qk_scale, softcap_log2, s_lo + i * BLOCK_N, s_hi, pos, lo, t_row, t_start,
                table_width, num_slots, K, V, kv_stride, kv_col, d_valid, BLOCK_N, True, HAS_WINDOW, EVEN_D,
                PRECISION, SOFTCAP
            )
        # fmt: on
    else:
        # fmt: off
        for start in range(s_lo, s_hi, BLOCK_N):
            acc, l_i, m_i = _attend_block(
                acc, l_i, m_i, q, qk_scale, softcap_log2, start, s_hi, pos, lo, t_row, t_start, table_width,
                num_slots, K, V, kv_stride, kv_col, d_valid, BLOCK_N, True, HAS_WINDOW, EVEN_D, PRECISION, SOFTCAP
            )
        # fmt: on

    if NUM_SPLITS == 1:
        if HAS_SINKS:  # the sink joins the denominator only (with splits: in the combine kernel, once)
            sink = tl.load(Sinks + head, mask=row_valid, other=0.0) * 1.4426950408889634
            m_fin = tl.maximum(m_i, sink)
            alpha = tl.math.exp2(m_i - m_fin)
            l_i = l_i * alpha + tl.math.exp2(sink - m_fin)
            acc = acc * alpha[:, None]
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        o_ptrs = Out + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=rd_mask)
    else:
        # partials laid out [T, H, NUM_SPLITS, (HEAD_DIM)]
        prow = (q_rows * (num_kv_heads * G) + head) * NUM_SPLITS + pid_s
        tl.store(PartM + prow, m_i, mask=row_valid)
        tl.store(PartL + prow, l_i, mask=row_valid)
        tl.store(PartAcc + prow[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=rd_mask)
    if PDL and not RELEASE_EARLY:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _split_combine_kernel(
    PartM,
    PartL,
    PartAcc,
    Out,
    Sinks,  # [H] float32 sink logits (natural log); read only with HAS_SINKS
    num_heads,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    PDL: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    if PDL:
        tl.extra.cuda.gdc_wait()
    base = (t * num_heads + h) * NUM_SPLITS
    offs_s = tl.arange(0, BLOCK_S)
    s_valid = offs_s < NUM_SPLITS
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM
    m = tl.load(PartM + base + offs_s, mask=s_valid, other=float("-inf"))
    l = tl.load(PartL + base + offs_s, mask=s_valid, other=0.0)
    m_max = tl.max(m, 0)
    if HAS_SINKS:  # the head's sink joins the denominator once, here (never per split)
        sink = tl.load(Sinks + h) * 1.4426950408889634
        m_max = tl.maximum(m_max, sink)
    w = tl.math.exp2(m - m_max)
    total = tl.sum(w * l, 0)
    if HAS_SINKS:
        total += tl.math.exp2(sink - m_max)
    acc = tl.load(
        PartAcc + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
        mask=s_valid[:, None] & d_valid[None, :],
        other=0.0,
    )
    out = tl.sum(acc * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(Out + t * stride_ot + h * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=d_valid)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@functools.lru_cache(maxsize=None)
def _num_sms(device_type: str, index: Optional[int]) -> int:
    if device_type == "cuda":
        return torch.cuda.get_device_properties(
            index if index is not None else torch.cuda.current_device()
        ).multi_processor_count
    return 8  # interpreter / other devices: a small stand-in


def plan_attention(
    *,
    num_reqs: int,
    num_tokens: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    max_q_len: int,
    max_kv_len: int,
    window: Optional[int],
    num_sms: int,
) -> dict:
    """Block sizes, warps, stages, KV splits, loop shape (``PHASES``: unmasked interior loop)
    and the key blocks prefetched to L2 before a PDL prologue's wait (``PREFETCH``) for one
    call, from host ints only. Cached: the wrapper asks on every launch."""
    return dict(_plan(num_reqs, num_tokens, num_kv_heads, group, head_dim, max_q_len, max_kv_len, window, num_sms))


@functools.lru_cache(maxsize=4096)
def _plan(num_reqs, num_tokens, num_kv_heads, group, head_dim, max_q_len, max_kv_len, window, num_sms) -> tuple:
    block_d = triton.next_power_of_2(head_dim)
    rows = max(1, max_q_len) * group
    big_m = 128 if block_d <= 128 else 64
    block_m = min(max(16, triton.next_power_of_2(rows)), big_m)
    # Measured on an H200 (bf16, D=128): decode over 4096 keys streams K/V at 4.3 TB/s with
    # 16 x 64 tiles, 4 warps, 2 stages; a causal 8192-token prefill runs at ~390 TFLOP/s with
    # 128 x 128 tiles, 8 warps, 2 stages and the unmasked interior loop (PHASES).
    # PREFETCH (used with the PDL prologue only): key blocks whose cached K/V lines a program
    # sends to L2 before its wait. H200, hybrid_step layers at bs 64 / 128 (decode and 4
    # drafts): one block 0.9-1.5 % faster a step than none; every block of an SWA window
    # 1.05-1.10x slower, and 16 blocks on the full layers too 1.25-1.32x slower.
    if block_m <= 16:  # decode / short verify: memory-bound streaming of K and V
        block_n = 64 if block_d <= 128 else 32
        num_warps, num_stages = 4, 2
    else:  # flash-attention tiles
        block_n = 128 if (block_m == 128 and block_d <= 128) else (64 if block_d <= 128 else 32)
        num_warps = 8 if block_m * block_d >= 128 * 128 else 4
        num_stages = 2
    span = max(1, max_kv_len)
    if window is not None:
        span = min(span, max(1, max_q_len) + window - 1)
    n_qblocks = triton.cdiv(rows, block_m)
    base = max(1, num_reqs * num_kv_heads * n_qblocks)
    splits = 1
    target = PROGRAMS_PER_SM * num_sms
    if base < target:
        splits = min(triton.cdiv(target, base), triton.cdiv(span, MIN_KEYS_PER_SPLIT), MAX_SPLITS)
        splits = min(splits, SPLIT_TOKEN_BUDGET // max(1, num_tokens))
        splits = max(1, splits)
    return tuple(
        dict(
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            num_warps=num_warps,
            num_stages=num_stages,
            num_splits=splits,
            PHASES=block_m > 16,
            PREFETCH=1 if block_m <= 16 else 0,
        ).items()
    )


def workspace_numel(max_num_tokens: int, num_heads: int, head_dim: int) -> int:
    """fp32 elements of a workspace that serves every heuristic plan of up to
    ``max_num_tokens`` tokens (allocate it once, e.g. with the graph buffers)."""
    pairs = min(SPLIT_TOKEN_BUDGET, max(1, max_num_tokens) * MAX_SPLITS)
    return pairs * num_heads * (head_dim + 2)


def check_attention_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    *,
    cu_q_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    table: torch.Tensor,
    table_rows: torch.Tensor,
    table_start: Optional[torch.Tensor],
    max_q_len: int,
    max_kv_len: int,
    window: Optional[int],
    softcap: Optional[float],
    sinks: Optional[torch.Tensor],
) -> Tuple[int, int, int, int, int, int]:
    """The host checks of every attention wrapper of this package (shapes, dtypes, devices,
    layouts, the scalar options); returns ``(T, H, D, Hkv, G, bs)``."""
    assert q.dim() == 3 and out.shape == q.shape, f"q {tuple(q.shape)} and out {tuple(out.shape)} must be [T, H, D]"
    T, H, D = q.shape
    assert k_cache.dim() == 3 and k_cache.shape[2] == D, f"k_cache must be [S, Hkv, {D}], got {tuple(k_cache.shape)}"
    assert v_cache.shape == k_cache.shape, f"v_cache {tuple(v_cache.shape)} != k_cache {tuple(k_cache.shape)}"
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "k_cache and v_cache must be contiguous"
    hkv = k_cache.shape[1]
    assert H % hkv == 0, f"{H} q heads are not a multiple of {hkv} kv heads"
    G = H // hkv
    assert q.dtype in _DTYPES, f"q dtype {q.dtype} is not one of {_DTYPES}"
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
        assert t.dtype == q.dtype, f"{name} is {t.dtype}, q is {q.dtype}"
    assert q.stride(2) == 1 and out.stride(2) == 1, "q and out need a contiguous last dim"
    assert D >= 16, f"head_dim {D} < 16 is not supported"
    device = q.device
    bs = cu_q_lens.shape[0] - 1
    assert cu_q_lens.dim() == 1 and bs >= 0 and cu_q_lens.dtype == torch.int32, "cu_q_lens must be [bs + 1] int32"
    assert seq_lens.dim() == 1 and seq_lens.shape[0] >= bs and seq_lens.dtype in (torch.int32, torch.int64)
    assert table.dim() == 2 and table.dtype == torch.int32 and (table.stride(1) == 1 or table.shape[1] <= 1), (
        f"table must be [R, width] int32 with contiguous rows, got {tuple(table.shape)} {table.dtype}"
    )
    assert table_rows.dim() == 1 and table_rows.shape[0] >= bs and table_rows.dtype in (torch.int32, torch.int64)
    if table_start is not None:
        assert table_start.dim() == 1 and table_start.shape[0] >= bs
        assert table_start.dtype in (torch.int32, torch.int64)
    for name, t in (
        ("k_cache", k_cache),
        ("v_cache", v_cache),
        ("out", out),
        ("cu_q_lens", cu_q_lens),
        ("seq_lens", seq_lens),
        ("table", table),
        ("table_rows", table_rows),
        ("table_start", table_start),
    ):
        assert t is None or t.device == device, f"{name} is on {t.device}, q on {device}"
    if window is not None:
        assert isinstance(window, int) and window >= 1, f"window must be None or an int >= 1, got {window!r}"
    if softcap is not None:
        assert math.isfinite(softcap) and softcap > 0, f"softcap must be None or a finite float > 0, got {softcap!r}"
    if sinks is not None:
        assert sinks.shape == (H,) and sinks.dtype == torch.float32 and sinks.is_contiguous(), (
            f"sinks must be contiguous float32 [{H}], got {tuple(sinks.shape)} {sinks.dtype}"
        )
        assert sinks.device == device, f"sinks is on {sinks.device}, q on {device}"
    assert isinstance(max_q_len, int) and isinstance(max_kv_len, int), "max_q_len / max_kv_len are host ints"
    return T, H, D, hkv, G, bs


def check_new_rows(
    k: torch.Tensor, v: torch.Tensor, loc: Optional[torch.Tensor], q: torch.Tensor, num_kv_heads: int
) -> None:
    """The host checks of the step's new K/V rows and their slots that an attention kernel
    stores: ``k``, ``v`` ``[T, Hkv, D]`` in q's dtype on q's device with a contiguous last dim
    and dense heads, ``loc`` (None: nothing stored) ``[>= T]`` int32/int64 on q's device."""
    T, _, D = q.shape
    for name, t in (("k", k), ("v", v)):
        assert t is not None, f"{name} is needed with loc (the rows to store)"
        assert t.dim() == 3 and t.shape == (T, num_kv_heads, D), (
            f"{name} must be [{T}, {num_kv_heads}, {D}], got {tuple(t.shape)}"
        )
        assert t.stride(2) == 1 and (num_kv_heads == 1 or t.stride(1) == D), (
            f"{name} needs a contiguous last dim, dense heads"
        )
        assert t.dtype == q.dtype and t.device == q.device, (
            f"{name} is {t.dtype} on {t.device}, q {q.dtype} on {q.device}"
        )
    if loc is None:
        return
    assert loc.dim() == 1 and loc.shape[0] >= T and loc.dtype in (torch.int32, torch.int64), (
        f"loc must be [>= {T}] int32/int64, got {tuple(loc.shape)} {loc.dtype}"
    )
    assert loc.device == q.device, f"loc is on {loc.device}, q on {q.device}"


def log2_scales(sm_scale: Optional[float], softcap: Optional[float], head_dim: int) -> Tuple[float, float]:
    """``(qk_scale, softcap_log2)`` the kernels take: base-2 logits are ``qk * qk_scale``, or
    with a cap ``c`` ``tanh(qk * qk_scale) * softcap_log2`` (``qk_scale = sm_scale / c``,
    ``softcap_log2 = c * log2(e)``). ``sm_scale`` None: ``1 / sqrt(head_dim)``."""
    scale = float(sm_scale) if sm_scale is not None else 1.0 / math.sqrt(head_dim)
    if softcap is not None:
        return scale / softcap, float(softcap) * _LOG2E
    return scale * _LOG2E, 0.0


def paged_attention(
    q: torch.Tensor,
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
    workspace: Optional[torch.Tensor] = None,
    pdl: bool = False,
    config: Optional[dict] = None,
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
    k: Optional[torch.Tensor] = None,
    v: Optional[torch.Tensor] = None,
    loc: Optional[torch.Tensor] = None,
    prologue: bool = False,
    release_early: bool = False,
) -> torch.Tensor:
    """Write attention of ``q`` over the paged cache into ``out`` and return ``out``.

    ``loc`` (with ``k`` and ``v``): first store the step's new rows in the same launch,
    ``k_cache[loc[t]] = k[t]`` and ``v_cache[loc[t]] = v[t]`` for every ``loc[t]`` in
    ``[1, S)`` (``kv_store``'s rule; the result is that of ``kv_store`` then this call).
    ``k``, ``v``: ``[T, Hkv, D]``, q's dtype, last dim contiguous, heads dense; ``loc``:
    ``[>= T]`` int32/int64. Only for steps whose rows fit one tile (``max_q_len * G <= 16``,
    decode and short drafts). None: nothing stored.

    ``prologue`` (with ``pdl``): read the step's metadata (``cu_q_lens``, ``seq_lens``,
    ``table_rows``, ``table_start``) before ``gdc_wait``; only for a launch whose previous
    kernel did not write them. ``release_early`` (with ``pdl``): release the next launch right
    after ``gdc_wait`` rather than after the last store.

    ``softcap``: None, or ``c > 0``: logits ``c * tanh(sm_scale * q.k / c)``. ``sinks``: None,
    or float32 ``[H]`` on q's device: per-head sink logits (natural log) added to the softmax
    denominator.

    ``max_q_len`` (>= every request's new tokens) and ``max_kv_len`` (>= every ``seq_len``)
    are host bounds that size the grid; the kernels read the real lengths on the device.
    ``workspace``: fp32, >= ``workspace_numel(T, H, D)`` elements, used when the plan splits
    the KV range; allocated here when None (pass one for graph capture). ``config``
    overrides keys of ``plan_attention``'s result (tests, benchmarks).
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
    if loc is not None:
        check_new_rows(k, v, loc, q, hkv)
        assert max(1, max_q_len) * G <= STORE_ROWS, (
            f"storing the new rows needs max_q_len x group <= {STORE_ROWS}, got {max_q_len} x {G}"
        )
    if T == 0 or bs == 0:
        return out
    qk_scale, softcap_log2 = log2_scales(sm_scale, softcap, D)

    plan = plan_attention(
        num_reqs=bs,
        num_tokens=T,
        num_kv_heads=hkv,
        group=G,
        head_dim=D,
        max_q_len=max_q_len,
        max_kv_len=max_kv_len,
        window=window,
        num_sms=_num_sms(device.type, device.index),
    )
    if config:
        plan.update(config)
    splits = int(plan["num_splits"])
    block_d = triton.next_power_of_2(D)
    extra = {"launch_pdl": True} if pdl else {}
    if loc is not None:
        assert plan["BLOCK_M"] >= max(1, max_q_len) * G, f"storing the new rows needs one row block, got {plan}"

    if splits > 1:
        need = T * H * splits * (D + 2)
        if workspace is None:
            workspace = torch.empty(need, dtype=torch.float32, device=device)
        assert workspace.dtype == torch.float32 and workspace.is_contiguous() and workspace.numel() >= need, (
            f"workspace must be contiguous float32 with >= {need} elements"
        )
        assert workspace.device == device, f"workspace is on {workspace.device}, q on {device}"
        n_ml = T * H * splits
        part_m = workspace[:n_ml]
        part_l = workspace[n_ml : 2 * n_ml]
        part_acc = workspace[2 * n_ml : need]
    else:
        part_m = part_l = part_acc = out  # unused

    n_qblocks = triton.cdiv(max(1, max_q_len) * G, plan["BLOCK_M"])
    grid = (n_qblocks, bs * hkv, splits)
    _paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        k if loc is not None else q,  # not read without STORE
        v if loc is not None else q,
        loc if loc is not None else cu_q_lens,
        part_m,
        part_l,
        part_acc,
        cu_q_lens,
        seq_lens,
        table,
        table_rows,
        table_start if table_start is not None else table_rows,
        sinks if sinks is not None else q,  # not read without HAS_SINKS
        qk_scale,
        softcap_log2,
        window if window is not None else 0,
        hkv,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k.stride(0) if loc is not None else 0,
        v.stride(0) if loc is not None else 0,
        table.stride(0),
        table.shape[1],
        table.shape[0],
        k_cache.shape[0],
        G=G,
        HEAD_DIM=D,
        BLOCK_D=block_d,
        BLOCK_M=plan["BLOCK_M"],
        BLOCK_N=plan["BLOCK_N"],
        NUM_SPLITS=splits,
        HAS_WINDOW=window is not None,
        HAS_TABLE_START=table_start is not None,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        PHASES=bool(plan["PHASES"]),
        SOFTCAP=softcap is not None,
        HAS_SINKS=sinks is not None,
        STORE=loc is not None,
        PDL=pdl,
        PROLOGUE=pdl and prologue,
        RELEASE_EARLY=pdl and release_early,
        PREFETCH=int(plan["PREFETCH"]) if pdl and prologue else 0,
        PF_LINES=triton.next_power_of_2(triton.cdiv(D * q.element_size(), 128)),
        LINE_ELEMS=128 // q.element_size(),
        num_warps=plan["num_warps"],
        num_stages=plan["num_stages"],
        **extra,
    )
    if splits > 1:
        block_s = triton.next_power_of_2(splits)
        _split_combine_kernel[(T, H)](
            part_m,
            part_l,
            part_acc,
            out,
            sinks if sinks is not None else out,  # not read without HAS_SINKS
            H,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=D,
            BLOCK_D=block_d,
            NUM_SPLITS=splits,
            BLOCK_S=block_s,
            HAS_SINKS=sinks is not None,
            PDL=pdl,
            num_warps=1 if block_s * block_d <= 1024 else 4,
            **extra,
        )
    return out
