"""Paged prefill on Hopper (sm_90): ``paged_attention``'s flash tiles written in Gluon, where
one key block's softmax runs while the tensor cores multiply the block before it by its values.

Same inputs, outputs and semantics as ``paged_attention`` (its module docstring), for the
launches the planner gives these tiles (``PagedPlan.WGMMA``): q, the cache and the output in
one 16-bit dtype (no FP8 cache), head dim 128, 128 (token, q head) rows of one kv head's group
a program, one KV split, no rows to store; key tables, windows, soft caps and sinks as there.

Design (one program = one request x one kv head x 128 rows, 8 warps = two warpgroups of 64
rows, each key block 128 keys):

* K and V blocks reach shared memory by ``cp.async`` gathers (16 bytes a thread a copy, rows
  from the key table's slots; a column without a key is zero-filled and masked): a page of
  any size, no TMA (Hopper's TMA has no row gather). ``STAGES`` (``num_stages``) buffers of
  each; block ``j``'s K travels with block ``j - 1``'s V (one copy group), issued
  ``STAGES - 1`` blocks ahead, the slots read one block before that;
* block ``i``: ``S_i = Q K_i^T`` and ``O += P_{i-1} V_{i-1}`` are issued as asynchronous
  ``wgmma``; the tile waits for ``S_i`` alone, computes its softmax (``P_i``, the rescale
  ``alpha_i``) while ``P_{i-1} V_{i-1}`` runs, then waits for it and rescales ``O`` by
  ``alpha_i`` (FlashAttention-3's overlap within a warpgroup). Then one CTA barrier frees
  ``K_i`` and ``V_{i-1}``'s buffers for the next group;
* block 0 is masked; the blocks every row sees whole (no causal / window edge) run unmasked
  between the masked edges, as ``paged_attention``'s ``PHASES``.

No PDL (Gluon has no ``griddepcontrol``): the launch waits for the kernels before it as any
launch does. Compiled, never interpreted: under ``TRITON_INTERPRET`` the planner never plans
these tiles (the host tests compile them for sm_90: ``tests/cuda/sm90_compile.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from ..planner import PagedPlan
from .common import (
    VALUES_ONLY,
    AttentionInputs,
    causal_window,
    check_attention_args,
    fold_sink,
    log2_scales,
    scaled_logits,
    slot_is_key,
    softmax_block,
    table_entry,
    table_row,
)

__all__ = ["paged_prefill_sm90", "HEAD_DIMS", "BLOCK_M", "BLOCK_N", "NUM_WARPS"]

#: the head dims, rows and keys of a tile, and its warps (the planner plans these tiles only so)
HEAD_DIMS = (128,)
BLOCK_M = BLOCK_N = 128
NUM_WARPS = 8

# (Triton 3.6 names the cp.async gather async_copy_global_to_shared, later versions async_load)
_gather = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared


@triton.jit
def _cta_barrier():
    tl.debug_barrier()


@gluon.jit
def _block_slots(t_row, start, s_hi, t_start, width, BLOCK: gl.constexpr, layout: gl.constexpr):
    """The slots of positions ``start + [0, BLOCK)`` in ``layout`` (``common.key_slots``' rule:
    outside the table or at / past ``s_hi``, slot 0)."""
    offs = start + gl.arange(0, BLOCK, layout=layout)
    col = offs - t_start
    return offs, gl.load(t_row + col, mask=(offs < s_hi) & (col >= 0) & (col < width), other=0)


@gluon.jit
def _gather_rows(buf, base, slot, num_slots, kv_stride, offs_d):
    """``cp.async`` of the cache rows ``slot`` (kv head at ``base``) into ``buf``; a slot with
    no key is zero-filled."""
    ptrs = base + (slot.to(gl.int64)[:, None] * kv_stride + offs_d[None, :])
    _gather(buf, ptrs, mask=slot_is_key(slot, num_slots)[:, None])


@gluon.jit
def _issue(j, n_blocks, k_bufs, v_bufs, K, V, slot_k, slot_v, num_slots, kv_stride, offs_d, STAGES: gl.constexpr):
    """Copy group ``j``: block ``j``'s K and block ``j - 1``'s V (those that exist)."""
    if j < n_blocks:
        _gather_rows(k_bufs.index(j % STAGES), K, slot_k, num_slots, kv_stride, offs_d)
    if j - 1 < n_blocks:
        _gather_rows(v_bufs.index((j - 1) % STAGES), V, slot_v, num_slots, kv_stride, offs_d)
    async_copy.commit_group()


@gluon.jit
def _landed(outstanding: gl.constexpr):
    """Every copy group but the last ``outstanding`` has landed in every warp, visible to the
    tensor cores (``cp.async`` writes through the generic proxy, ``wgmma`` reads through the
    async one)."""
    async_copy.wait_group(outstanding)
    fence_async_shared()
    _cta_barrier()


@gluon.jit
def _probs(s, start, s_hi, pos, lo, t_row, t_start, width, num_slots, qk_scale, softcap_log2, window, m_i, l_i,
           BLOCK: gl.constexpr, layout: gl.constexpr, MASKED: gl.constexpr):  # fmt: skip
    """One block's products ``s`` into probabilities: ``(p, alpha, m_i, l_i)``
    (``common.scaled_logits`` / ``causal_window`` / ``softmax_block``)."""
    offs_n, slot = _block_slots(t_row, start, s_hi, t_start, width, BLOCK, gl.SliceLayout(0, layout))
    no_key = gl.where(slot_is_key(slot, num_slots), 0.0, float("-inf"))
    qk = scaled_logits(s, no_key, qk_scale, softcap_log2)
    if MASKED:
        qk = causal_window(qk, offs_n, offs_n < s_hi, pos, lo, window)
    return softmax_block(qk, m_i, l_i)


@gluon.jit
def _attend_blocks(i_begin, i_end, o, m_i, l_i, p_prev, slot_k, slot_v, q_smem, k_bufs, v_bufs, K, V, s_lo, s_hi,
                   pos, lo, n_blocks, t_row, t_start, width, num_slots, kv_stride, qk_scale, softcap_log2, window,
                   offs_d, BLOCK: gl.constexpr, STAGES: gl.constexpr, MASKED: gl.constexpr,
                   mma: gl.constexpr, p_layout: gl.constexpr, ld_rows: gl.constexpr):  # fmt: skip
    """Key blocks ``i_begin <= i < i_end`` (``i >= 1``), all of one kind (``MASKED``): the
    pipeline of the module docstring. Carries ``O``, the running max and sum, ``P_{i-1}`` and
    the slots of the next copy group's K and V."""
    for i in range(i_begin, i_end):
        zero = gl.zeros([BLOCK, BLOCK], gl.float32, layout=mma)
        s = warpgroup_mma(q_smem, k_bufs.index(i % STAGES).permute((1, 0)), zero, use_acc=False, is_async=True)
        o = warpgroup_mma(p_prev, v_bufs.index((i - 1) % STAGES), o, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
        p, alpha, m_i, l_i = _probs(s, s_lo + i * BLOCK, s_hi, pos, lo, t_row, t_start, width, num_slots, qk_scale,
                                    softcap_log2, window, m_i, l_i, BLOCK, mma, MASKED)  # fmt: skip
        p_prev = gl.convert_layout(p.to(K.dtype.element_ty), p_layout)
        o = warpgroup_mma_wait(num_outstanding=0, deps=(o,))
        o = o * alpha[:, None]
        _landed(STAGES - 2)  # group i + 1 (K_{i+1}, V_i); K_i and V_{i-1} free everywhere
        _issue(i + STAGES, n_blocks, k_bufs, v_bufs, K, V, slot_k, slot_v, num_slots, kv_stride, offs_d, STAGES)
        slot_v = slot_k
        _, slot_k = _block_slots(t_row, s_lo + (i + STAGES + 1) * BLOCK, s_hi, t_start, width, BLOCK, ld_rows)
    return o, m_i, l_i, p_prev, slot_k, slot_v


@gluon.jit(do_not_specialize=VALUES_ONLY)
def _paged_prefill_sm90_kernel(
    Q,
    K,
    V,
    Out,
    CuQ,
    SeqLens,
    keys,  # KeyTable
    Sinks,  # [H] float32 sink logits (natural log), or None
    qk_scale,
    softcap_log2,  # or None
    window,  # or None
    num_kv_heads,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    kv_stride,
    kv_head_stride,
    num_slots,
    G: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    STAGES: gl.constexpr,
    num_warps: gl.constexpr,
):
    BLOCK: gl.constexpr = HEAD_DIM  # rows and keys of a tile: one wgmma layout serves S and O
    dtype: gl.constexpr = Q.dtype.element_ty
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    rows_layout: gl.constexpr = gl.SliceLayout(1, mma)
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])  # 16-byte copies
    ld_rows: gl.constexpr = gl.SliceLayout(1, ld)
    smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK, HEAD_DIM], dtype)

    pid_m = gl.program_id(0)
    pid_bh = gl.program_id(1)
    b = pid_bh // num_kv_heads
    hk = pid_bh % num_kv_heads
    q_start = gl.load(CuQ + b)
    q_len = gl.load(CuQ + b + 1) - q_start
    seq_len = gl.load(SeqLens + b).to(gl.int32)
    t_idx, t_start = table_entry(keys, b)
    n_rows = q_len * G
    row0 = pid_m * BLOCK
    if row0 < n_rows:  # (programs past the request's rows do no work)
        # the program's key range and its phases, as paged_attention's
        t_last = gl.minimum((row0 + BLOCK - 1) // G, q_len - 1)
        kv_hi = seq_len - q_len + t_last + 1
        pos_first = seq_len - q_len + row0 // G
        offs_m = row0 + gl.arange(0, BLOCK, layout=rows_layout)
        pos = seq_len - q_len + offs_m // G
        if window is not None:
            lo = gl.maximum(pos - window + 1, 0)
            s_lo = gl.maximum(pos_first - window + 1, 0)
        else:
            lo = 0
            s_lo = seq_len * 0
        s_hi = gl.maximum(kv_hi, s_lo)
        # (at least one block: a request with no key in range runs block 0, all masked, to zeros)
        n_blocks = gl.maximum(gl.cdiv(s_hi - s_lo, BLOCK), 1)
        if window is not None:
            i0 = gl.minimum(gl.cdiv(gl.maximum(gl.maximum(kv_hi - window, 0) - s_lo, 0), BLOCK), n_blocks)
        else:
            i0 = n_blocks * 0
        i1 = gl.maximum(gl.minimum(pos_first + 1, s_hi) - s_lo, 0) // BLOCK
        i1 = gl.minimum(gl.maximum(i1, i0), n_blocks)

        m_i = gl.full([BLOCK], -1.0e30, gl.float32, layout=rows_layout)
        l_i = gl.zeros([BLOCK], gl.float32, layout=rows_layout)
        o = gl.zeros([BLOCK, HEAD_DIM], gl.float32, layout=mma)
        t_row = table_row(keys, t_idx)
        width = keys.width
        K += hk.to(gl.int64) * kv_head_stride
        V += hk.to(gl.int64) * kv_head_stride
        offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, ld))
        k_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK, HEAD_DIM], smem)
        v_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK, HEAD_DIM], smem)

        # copy groups 0 .. STAGES - 1
        _, slot_k = _block_slots(t_row, s_lo, s_hi, t_start, width, BLOCK, ld_rows)
        slot_v = slot_k
        _gather_rows(k_bufs.index(0), K, slot_k, num_slots, kv_stride, offs_d)
        async_copy.commit_group()
        _, slot_k = _block_slots(t_row, s_lo + BLOCK, s_hi, t_start, width, BLOCK, ld_rows)
        for j in gl.static_range(1, STAGES):
            _issue(j, n_blocks, k_bufs, v_bufs, K, V, slot_k, slot_v, num_slots, kv_stride, offs_d, STAGES)
            slot_v = slot_k
            _, slot_k = _block_slots(t_row, s_lo + (j + 1) * BLOCK, s_hi, t_start, width, BLOCK, ld_rows)

        # q: rows are (token, q head of the group) pairs, as paged_attention's
        offs_q = row0 + gl.arange(0, BLOCK, layout=ld_rows)
        q_rows = (q_start + offs_q // G).to(gl.int64)
        q_heads = (hk * G + offs_q % G).to(gl.int64)
        q_ptrs = Q + q_rows[:, None] * stride_qt + q_heads[:, None] * stride_qh + offs_d[None, :]
        q = gl.load(q_ptrs, mask=(offs_q < n_rows)[:, None], other=0.0)
        q_smem = gl.allocate_shared_memory(dtype, [BLOCK, HEAD_DIM], smem, q)

        # block 0 (masked), then the pipeline
        _landed(STAGES - 1)
        zero = gl.zeros([BLOCK, BLOCK], gl.float32, layout=mma)
        s = warpgroup_mma(q_smem, k_bufs.index(0).permute((1, 0)), zero, use_acc=False)
        p, alpha, m_i, l_i = _probs(s, s_lo, s_hi, pos, lo, t_row, t_start, width, num_slots, qk_scale,
                                    softcap_log2, window, m_i, l_i, BLOCK, mma, True)  # fmt: skip
        p_prev = gl.convert_layout(p.to(dtype), p_layout)
        _landed(STAGES - 2)
        _issue(STAGES, n_blocks, k_bufs, v_bufs, K, V, slot_k, slot_v, num_slots, kv_stride, offs_d, STAGES)
        slot_v = slot_k
        _, slot_k = _block_slots(t_row, s_lo + (STAGES + 1) * BLOCK, s_hi, t_start, width, BLOCK, ld_rows)
        a = gl.maximum(i0, 1)
        c = gl.maximum(i1, a)
        # fmt: off
        o, m_i, l_i, p_prev, slot_k, slot_v = _attend_blocks(
            1, a, o, m_i, l_i, p_prev, slot_k, slot_v, q_smem, k_bufs, v_bufs, K, V, s_lo, s_hi, pos, lo,
            n_blocks, t_row, t_start, width, num_slots, kv_stride, qk_scale, softcap_log2, window, offs_d,
            BLOCK, STAGES, True, mma, p_layout, ld_rows)
        o, m_i, l_i, p_prev, slot_k, slot_v = _attend_blocks(
            a, c, o, m_i, l_i, p_prev, slot_k, slot_v, q_smem, k_bufs, v_bufs, K, V, s_lo, s_hi, pos, lo,
            n_blocks, t_row, t_start, width, num_slots, kv_stride, qk_scale, softcap_log2, window, offs_d,
            BLOCK, STAGES, False, mma, p_layout, ld_rows)
        o, m_i, l_i, p_prev, slot_k, slot_v = _attend_blocks(
            c, n_blocks, o, m_i, l_i, p_prev, slot_k, slot_v, q_smem, k_bufs, v_bufs, K, V, s_lo, s_hi, pos,
            lo, n_blocks, t_row, t_start, width, num_slots, kv_stride, qk_scale, softcap_log2, window, offs_d,
            BLOCK, STAGES, True, mma, p_layout, ld_rows)
        # fmt: on
        o = warpgroup_mma(p_prev, v_bufs.index((n_blocks - 1) % STAGES), o)
        async_copy.wait_group(0)

        heads = hk * G + offs_m % G
        row_valid = offs_m < n_rows
        if Sinks is not None:
            l_i, o = fold_sink(m_i, l_i, o, Sinks, heads, row_valid)
        o = o / gl.where(l_i > 0.0, l_i, 1.0)[:, None]
        offs_d_o = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, mma))
        o_rows = (q_start + offs_m // G).to(gl.int64)
        o_ptrs = Out + o_rows[:, None] * stride_ot + heads.to(gl.int64)[:, None] * stride_oh + offs_d_o[None, :]
        gl.store(o_ptrs, o.to(dtype), mask=row_valid[:, None])


def paged_prefill_sm90(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    inputs: AttentionInputs,
    plan: PagedPlan,
) -> torch.Tensor:
    """``paged_attention(q, k_cache, v_cache, out, inputs, plan)`` for a plan with ``WGMMA``
    (module docstring): writes ``out`` and returns it."""
    T, H, D, hkv, G, bs = check_attention_args(q, k_cache, v_cache, out, inputs)
    assert plan.WGMMA and plan.NUM_SPLITS == 1 and plan.BLOCK_M == BLOCK_M and plan.BLOCK_N == BLOCK_N, (
        f"not a plan of these tiles: {plan}"
    )
    assert D in HEAD_DIMS and q.dtype in (torch.float16, torch.bfloat16) and k_cache.dtype == q.dtype, (
        f"these tiles serve head dims {HEAD_DIMS} of a float16 / bfloat16 q and cache, got {D}, {q.dtype} "
        f"and {k_cache.dtype}"
    )
    if T == 0 or bs == 0:
        return out
    qk_scale, softcap_log2 = log2_scales(inputs.sm_scale, inputs.softcap, D)
    grid = (triton.cdiv(max(1, inputs.max_q_len) * G, BLOCK_M), bs * hkv)
    _paged_prefill_sm90_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        inputs.cu_q_lens,
        inputs.seq_lens,
        inputs.keys,
        inputs.sinks,
        qk_scale,
        softcap_log2,
        inputs.window,
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
        STAGES=plan.num_stages,
        num_warps=plan.num_warps,
    )
    return out
