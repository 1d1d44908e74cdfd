"""Mutants of the attention numerics: KV tiling, accumulation precision, head-dim tails,
split-KV combines, the scaling argument and the output dtype."""

from __future__ import annotations

import torch

from attnplug.backends.reference import ReferenceBackend

from .layout import FULL_MQA, HALF, padded_queries, per_token, qk_logits, visible


def _tile_mask(key_pos, keep):
    """``key_pos`` with the keys where ``keep`` is False moved out of every query's reach."""
    return torch.where(keep, key_pos, torch.full_like(key_pos, 1 << 40))


class TileSkipsFirstKey(ReferenceBackend):
    """Tiling: every KV tile after the first starts one key late (32 * i + 1), so keys at
    positions 32, 64, ... are never read. Invisible below 33 keys."""

    WITNESS = ("output", dict(max_context_len=96, sliding_window=None, swa_layer_ids=()), [("EXTEND", [40, 33])])

    def _attend(self, q, keys, values, key_pos, window, md, *, sinks=None):
        keep = ~((key_pos % 32 == 0) & (key_pos > 0))
        return super()._attend(q, keys, values, _tile_mask(key_pos, keep), window, md, sinks=sinks)


class LastPartialTileDropped(ReferenceBackend):
    """Tiling: the number of KV tiles is ``kv_len // 32`` (rounded down) once there is more
    than one tile, so the keys of a last partial tile are dropped."""

    WITNESS = ("output", dict(max_context_len=96, sliding_window=None, swa_layer_ids=()), [("EXTEND", [40, 20])])

    def _attend(self, q, keys, values, key_pos, window, md, *, sinks=None):
        bs = keys.shape[0]
        counts = torch.zeros(bs, dtype=torch.int64, device=q.device).scatter_add_(
            0, md.token_req, torch.ones_like(md.token_req)
        )
        kv_len = (md.q_start + counts)[:, None]
        cut = kv_len // 32 * 32
        keep = ~((kv_len > 32) & (key_pos >= cut))
        return super()._attend(q, keys, values, _tile_mask(key_pos, keep), window, md, sinks=sinks)


def _blocked_softmax_pv(scores, values, acc_dtype, block):
    """``softmax(scores) @ values`` over the key axis in blocks of ``block`` keys, with the
    running sum and accumulator rounded to ``acc_dtype`` after every block.
    scores [bs, Hkv, G, Q, K] (masked with -inf), values [bs, K, Hkv, D]."""
    m = scores.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    K = scores.shape[-1]
    acc = None
    denom = None
    for s in range(0, K, block):
        p = torch.exp(scores[..., s : s + block] - m)
        part = torch.einsum("bhgqk,bkhd->bhgqd", p, values[:, s : s + block].float())
        l = p.sum(-1, keepdim=True)
        acc = part.to(acc_dtype) if acc is None else (acc.float() + part).to(acc_dtype)
        denom = l.to(acc_dtype) if denom is None else (denom.float() + l).to(acc_dtype)
    return acc.float() / denom.float().clamp_min(1e-30)


class HalfPrecisionAccumulation(ReferenceBackend):
    """Precision: the softmax sum and the P·V accumulator of the KV loop are kept in the
    input's half-precision type (rounded after every 32-key tile) instead of float32."""

    WITNESS = (
        "output",
        dict(FULL_MQA, dtype=torch.bfloat16, max_context_len=4160, size=8192, size_swa=8192),
        [("EXTEND_DIRECT", [4100]), ("DECODE", None)],
    )

    def _attend(self, q, keys, values, key_pos, window, md, *, sinks=None):
        if q.dtype not in HALF:
            return super()._attend(q, keys, values, key_pos, window, md, sinks=sinks)
        qp, kp, qq = padded_queries(q, keys, key_pos, md)
        mask = visible(kp, qq, window)
        logits = qk_logits(qp, keys, self.scaling).masked_fill(~mask[:, None, None], float("-inf"))
        out = _blocked_softmax_pv(logits, values, q.dtype, 32)  # [bs, Hkv, G, Q, D]
        return per_token(out.permute(0, 3, 1, 2, 4), md, q.dtype)


class HeadDimTailUnmasked(ReferenceBackend):
    """Head dims that are not a power of two (80, 96): the kernel loads a power-of-two block
    without masking the tail, so the dot products include the next head's leading values."""

    WITNESS = ("output", dict(head_dim=80), [("EXTEND", [5, 9])])

    def _attend(self, q, keys, values, key_pos, window, md, *, sinks=None):
        D = q.shape[-1]
        P = 1 << (D - 1).bit_length()
        if P == D:
            return super()._attend(q, keys, values, key_pos, window, md, sinks=sinks)
        pad = P - D
        qn = torch.cat([q, q.roll(-1, dims=1)[..., :pad]], -1)
        kn = torch.cat([keys, keys.roll(-1, dims=2)[..., :pad]], -1)
        vn = torch.cat([values, values.roll(-1, dims=2)[..., :pad]], -1)
        return super()._attend(qn, kn, vn, key_pos, window, md, sinks=sinks)[..., :D].contiguous()


class SplitKVSmallBatch(ReferenceBackend):
    """Decode at batch size <= 2 splits the KV range in two halves for occupancy and combines
    the halves' normalised outputs with equal weights (ignoring their softmax sums)."""

    WITNESS = ("output", dict(), [("EXTEND", [9, 30]), ("DECODE", None)])

    def _attend(self, q, keys, values, key_pos, window, md, *, sinks=None):
        if md.q_len_max != 1 or keys.shape[0] > 2 or keys.shape[1] < 2:
            return super()._attend(q, keys, values, key_pos, window, md, sinks=sinks)
        h = keys.shape[1] // 2
        kp = key_pos.expand(keys.shape[0], -1)
        a = super()._attend(q, keys[:, :h], values[:, :h], kp[:, :h], window, md, sinks=sinks)
        b = super()._attend(q, keys[:, h:], values[:, h:], kp[:, h:], window, md, sinks=sinks)
        return ((a.float() + b.float()) / 2).to(q.dtype)


class IgnoresScaling(ReferenceBackend):
    """The explicit ``scaling`` argument is ignored: always ``1/sqrt(head_dim)``."""

    WITNESS = ("output", dict(scaling=0.3), [("EXTEND", [5, 9])])

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.scaling = self.head_dim**-0.5


class ReturnsFp32(ReferenceBackend):
    """Half-precision steps return the float32 accumulator instead of q's dtype."""

    WITNESS = ("dtype",)

    def forward(self, q, k, v, layer_id, batch, save_kv_cache=True, *, sinks=None):
        out = super().forward(q, k, v, layer_id, batch, save_kv_cache, sinks=sinks)
        return out.float() if out.dtype in HALF else out
