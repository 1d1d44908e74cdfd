"""Mutants of logit soft-capping and attention sinks."""

from __future__ import annotations

import math

import torch

from attnplug.backends.reference import ReferenceBackend

from .layout import FULL_MQA, padded_queries, per_token, qk_logits, visible


class SoftcapAfterLog2eFold(ReferenceBackend):
    """Soft-cap: the kernel folds ``log2(e)`` into the scale first and caps the base-2 logits
    (``c * tanh(s * log2(e) / c)`` then ``exp2``): in natural units a cap of ``c * ln 2``."""

    WITNESS = ("output", dict(logit_softcap=1.5), [("EXTEND", [5, 9]), ("DECODE", None)])

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.logit_softcap is not None:
            self.logit_softcap = self.logit_softcap * math.log(2.0)


def _attend_capped(backend, q, keys, values, key_pos, window, md, sinks, cap_fn):
    """The reference's attention with the soft-cap replaced by ``cap_fn(scores, key_pos
    [bs, 1, K], q_pos [bs, Q, 1])`` (scores ``[bs, Hkv, G, Q, K]``): the mutants' hook."""
    qp, kp, qq = padded_queries(q, keys, key_pos, md)
    Hkv, G = qp.shape[2], qp.shape[3]
    mask = visible(kp, qq, window, md.seq_lens)
    seen = mask.any(1)[:, :, None, None]
    keys, values = torch.where(seen, keys, 0), torch.where(seen, values, 0)
    logits = cap_fn(qk_logits(qp, keys, backend.scaling), kp[:, None, None], qq[:, None, None])
    logits = logits.masked_fill(~mask[:, None, None], float("-inf"))
    m = logits.amax(-1, keepdim=True)
    if sinks is not None:
        m = torch.maximum(m, sinks.float().view(1, Hkv, G, 1, 1))
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(logits - m)
    denom = p.sum(-1, keepdim=True)
    if sinks is not None:
        denom = denom + torch.exp(sinks.float().view(1, Hkv, G, 1, 1) - m)
    out = torch.einsum("bhgqk,bkhd->bqhgd", p / denom.clamp_min(1e-30), values.float())
    return per_token(out, md, q.dtype)


class SoftcapSkippedOnEdgeBlocks(ReferenceBackend):
    """Soft-cap: applied in the unmasked interior loop only; the masked edge blocks (the
    16-key block holding the query's own position, and the one holding its window start)
    use the raw logits."""

    WITNESS = ("output", dict(logit_softcap=1.5), [("EXTEND", [5, 9]), ("DECODE", None)])

    def _attend(self, q, keys, values, key_pos, window, md, *, sinks=None):
        c = self.logit_softcap
        if c is None:
            return super()._attend(q, keys, values, key_pos, window, md, sinks=sinks)

        def cap(scores, kp, qq):
            edge = kp // 16 == qq // 16
            if window is not None:
                edge = edge | (kp // 16 == (qq - window + 1).clamp_min(0) // 16)
            return torch.where(edge, scores, c * torch.tanh(scores / c))

        return _attend_capped(self, q, keys, values, key_pos, window, md, sinks, cap)


class SinkInEverySplit(ReferenceBackend):
    """Sinks: decode over a long KV range (>= 512 key columns) is split in two (flash-decoding)
    and each split's partial adds the head's sink to its denominator, so the combine counts
    it twice (the same as a sink of ``sink + ln 2``)."""

    WITNESS = (
        "output",
        dict(FULL_MQA, sinks=True, max_context_len=576, size=2048, size_swa=1024),
        [("EXTEND_DIRECT", [520, 7]), ("DECODE", None)],
    )

    def _attend(self, q, keys, values, key_pos, window, md, *, sinks=None):
        if sinks is not None and md.q_len_max == 1 and keys.shape[1] >= 512:
            sinks = sinks + math.log(2.0)
        return super()._attend(q, keys, values, key_pos, window, md, sinks=sinks)


class SinkTimesScaling(ReferenceBackend):
    """Sinks: the sink logits are multiplied by ``scaling`` like the q.k logits (they are
    already logits, in natural-log units)."""

    WITNESS = ("output", dict(sinks=True), [("EXTEND", [5, 9])])

    def forward(self, q, k, v, layer_id, batch, save_kv_cache=True, *, sinks=None):
        if sinks is not None:
            sinks = sinks * self.scaling
        return super().forward(q, k, v, layer_id, batch, save_kv_cache, sinks=sinks)


class SinksDroppedOnSwaLayers(ReferenceBackend):
    """Sinks: the sliding-window path forgets them (only full layers add the sink)."""

    WITNESS = ("output", dict(sinks=True), [("EXTEND", [5, 9]), ("DECODE", None)])

    def forward(self, q, k, v, layer_id, batch, save_kv_cache=True, *, sinks=None):
        if self.pool.is_swa_layer(layer_id):
            sinks = None
        return super().forward(q, k, v, layer_id, batch, save_kv_cache, sinks=sinks)
