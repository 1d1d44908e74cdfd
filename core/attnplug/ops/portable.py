"""``PortableOps``: the op layer in plain PyTorch, and the attention math it shares with
``PortableBackend`` (one copy: ``attend_gathered``).

Each layer gathers every request's keys into a padded ``[B, K, Hkv, D]`` block and runs a
masked softmax in float32 (float64 for float64 inputs). Written for clarity, not speed; it runs
unchanged on any device PyTorch supports and is the op layer of the reference, Ascend and XPU
backends. An FP8 cache is quantised at store (``attnplug.memory.fp8.quantize_kv``) and its
gathered rows dequantised in float32 (``gather_rows``) before the same math.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ..memory.fp8 import FP8_KV_DTYPES, dequantize_kv, is_fp8, quantize_kv
from .base import PagedOps

__all__ = ["PortableOps", "attend_gathered", "gather_rows", "NO_KEY"]

#: key position given to a column with no slot: past every query, so every mask drops it
NO_KEY = 1 << 62


def gather_rows(cache: torch.Tensor, slots: torch.Tensor, scale: Optional[torch.Tensor]) -> torch.Tensor:
    """``cache[slots]`` (``cache`` ``[S, Hkv, D]``, ``slots`` any int shape): an FP8 cache's rows
    gathered as bytes (every device indexes uint8) and dequantised with the per-head ``scale``
    ``[Hkv]`` in float32; other caches as they are."""
    if not is_fp8(cache.dtype):
        return cache[slots]
    rows = cache.view(torch.uint8)[slots].view(cache.dtype)
    return dequantize_kv(rows, scale)


def store_rows(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, scale: Optional[torch.Tensor]) -> None:
    """``cache[slots] = rows`` for the slots in ``[1, S)``; any other slot writes slot 0's own
    value back (nothing changes, nothing wraps). An FP8 cache quantises ``rows`` with the
    per-head ``scale`` first and writes bytes."""
    slots = slots.long()
    keep = (slots >= 1) & (slots < cache.shape[0])
    idx = torch.where(keep, slots, 0)
    if is_fp8(cache.dtype):
        if rows.dtype != cache.dtype:
            rows = quantize_kv(rows, scale, cache.dtype)
        cache, rows = cache.view(torch.uint8), rows.view(torch.uint8)
    cache[idx] = torch.where(keep[:, None, None], rows, cache[0])


def attend_gathered(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    key_pos: torch.Tensor,
    *,
    q_start: torch.Tensor,
    seq_lens: Optional[torch.Tensor],
    token_req: torch.Tensor,
    token_idx: torch.Tensor,
    q_len_max: int,
    scaling: float,
    window: Optional[int],
    softcap: Optional[float],
    sinks: Optional[torch.Tensor],
) -> torch.Tensor:
    """Attention of ``q`` [T, H, D] over gathered ``keys`` / ``values`` [B, K, Hkv, D] at
    positions ``key_pos`` [B or 1, K] (``NO_KEY``: no key). Token ``t`` is index
    ``token_idx[t]`` of request ``token_req[t]``, at position ``q_start[b] + token_idx[t]``;
    keys at or past ``seq_lens[b]`` are unseen. Logits ``scaling * q.k``, capped to
    ``softcap * tanh(s / softcap)`` before the mask; ``sinks`` (float32 [H]) join each head's
    denominator only. A column no query sees contributes exactly zero whatever it holds (NaN
    and Inf included): it is replaced with ``torch.where``, never weighted by zero."""
    T, H, D = q.shape
    bs, K, Hkv, _ = keys.shape
    G, Q = H // Hkv, q_len_max
    cdt = torch.promote_types(q.dtype, torch.float32)
    qp = torch.zeros(bs, Q, H, D, dtype=cdt, device=q.device)
    qp[token_req, token_idx] = q.to(cdt)
    q_pos = q_start[:, None] + torch.arange(Q, device=q.device)  # [bs, Q]
    kp, qq = key_pos[:, None, :], q_pos[:, :, None]
    mask = kp <= qq  # causal
    if seq_lens is not None:  # padded q rows sit past seq_len: keys past it stay unseen
        mask = mask & (kp < seq_lens[:, None, None])
    if window is not None:
        mask = mask & (kp > qq - window)
    seen = mask.any(1)[:, :, None, None]  # [bs, K, 1, 1]
    keys = torch.where(seen, keys, 0)
    values = torch.where(seen, values, 0)
    scores = torch.einsum("bqhgd,bkhd->bhgqk", qp.view(bs, Q, Hkv, G, D), keys.to(cdt)) * scaling
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
    row_max = scores.amax(-1, keepdim=True)
    sink = None
    if sinks is not None:
        sink = sinks.to(cdt).view(1, Hkv, G, 1, 1)
        row_max = torch.maximum(row_max, sink)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    p = torch.exp(scores - row_max)
    denom = p.sum(-1, keepdim=True)
    if sink is not None:
        denom = denom + torch.exp(sink - row_max)
    out = torch.einsum("bhgqk,bkhd->bqhgd", p / denom.clamp_min(torch.finfo(cdt).tiny), values.to(cdt))
    return out.reshape(bs, Q, H, D)[token_req, token_idx].to(q.dtype)


class PortableOps(PagedOps):
    """The op layer in plain PyTorch (module docstring); ``plan`` adds the token -> request
    map the gathered layout needs."""

    name = "portable"
    fp8_kv_dtypes = FP8_KV_DTYPES

    def __init__(self, device, *, name: Optional[str] = None, dtypes=None, fp8_kv_dtypes=None) -> None:
        """``name`` / ``dtypes`` / ``fp8_kv_dtypes``: the backend's whose math these are
        (default: portable's)."""
        super().__init__(device)
        if name is not None:
            self.name = name
        if dtypes is not None:
            self.dtypes = tuple(dtypes)
        if fp8_kv_dtypes is not None:
            self.fp8_kv_dtypes = tuple(fp8_kv_dtypes)

    def plan(self, query_start_loc, seq_lens, block_table, block_size, *, num_tokens, max_query_len, max_seq_len):
        step = super().plan(
            query_start_loc,
            seq_lens,
            block_table,
            block_size,
            num_tokens=num_tokens,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
        )
        dev = self.device
        B = step.num_reqs
        starts = query_start_loc.long()
        q_lens = starts[1:] - starts[:-1]
        tok = torch.arange(step.num_tokens, device=dev)
        token_req = torch.searchsorted(starts[1:], tok, right=True).clamp_max(max(B - 1, 0))
        token_idx = tok - starts[:-1][token_req]
        return dataclasses.replace(step, token_req=token_req, token_idx=token_idx, q_start=seq_lens.long() - q_lens)

    def store_kv(self, key, value, key_cache, value_cache, slot_mapping, *, k_scale=None, v_scale=None) -> None:
        kc, vc, n = self.check_store(key, value, key_cache, value_cache, slot_mapping)
        ks, vs = self.check_scales(k_scale, v_scale, kc)
        if n == 0:
            return
        self._store(key[:n], value[:n], kc, vc, slot_mapping[:n], ks, vs)

    @staticmethod
    def _store(key, value, kc, vc, slots, ks, vs) -> None:
        """``store_kv`` after its checks: the flat caches (``check_store``), one slot per row,
        the scales as ``check_scales`` returns them (a subclass's fallback calls it)."""
        store_rows(kc, slots, key, ks)
        store_rows(vc, slots, value, vs)

    def attend(
        self,
        query,
        key_cache,
        value_cache,
        step,
        *,
        scale,
        window=None,
        softcap=None,
        sinks=None,
        out=None,
        k_scale=None,
        v_scale=None,
    ):
        kc, vc, out = self.check_attend(query, key_cache, value_cache, step, scale, window, softcap, sinks, out)
        ks, vs = self.check_scales(k_scale, v_scale, kc)
        if step.num_tokens == 0 or step.num_reqs == 0:
            return out
        return self._attend(query, kc, vc, step, out, ks, vs, scale=scale, window=window, softcap=softcap, sinks=sinks)

    def _attend(self, query, kc, vc, step, out, ks, vs, *, scale, window, softcap, sinks):
        """``attend`` of a non-empty step after its checks: the flat caches and output
        ``check_attend`` returns, the scales ``check_scales`` returns (a subclass's fallback
        calls it); writes and returns ``out``."""
        if step.token_req is None:
            step = self.plan(
                step.query_start_loc,
                step.seq_lens,
                step.slot_table,
                1,
                num_tokens=step.num_tokens,
                max_query_len=step.max_query_len,
                max_seq_len=step.max_seq_len,
            )
        slots = step.slot_table.long()
        has_key = (slots >= 1) & (slots < kc.shape[0])
        slots = torch.where(has_key, slots, 0)
        key_pos = torch.arange(slots.shape[1], device=query.device)[None, :]
        key_pos = torch.where(has_key, key_pos, NO_KEY)
        out.copy_(
            attend_gathered(
                query,
                gather_rows(kc, slots, ks),
                gather_rows(vc, slots, vs),
                key_pos,
                q_start=step.q_start,
                seq_lens=step.seq_lens.long(),
                token_req=step.token_req,
                token_idx=step.token_idx,
                q_len_max=max(1, step.max_query_len),
                scaling=float(scale),
                window=window,
                softcap=None if softcap is None else float(softcap),
                sinks=sinks,
            )
        )
        return out
