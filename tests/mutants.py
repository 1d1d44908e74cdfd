"""Subtle mutants of the reference backend: each one a small, plausible kernel bug of the kind
a vendor's backend could ship. ``tests/conformance/test_conformance_mutants.py`` shows that each one is
really wrong (a direct comparison or a direct observation of the broken rule, its
``WITNESS``) and that the conformance suite fails it with a message naming the rule.

Every mutant subclasses ``ReferenceBackend`` and overrides one method (or wraps one helper),
so it keeps working when the reference gets small edits. ``NoOpMutant`` is the control: it
overrides a method without changing anything and must pass the suite.

A mutant's ``WITNESS`` says how it is shown to be wrong:

* ``("output", spec overrides, plan)``: twin worlds (the mutant and the reference, same
  inputs and slots) run ``plan``; the outputs differ beyond the dtype's tolerance, the KV
  caches differ, or the mutant raises;
* ``("sync",)``: its graph-replay metadata makes a host read or a data-dependent-size op
  (seen by a minimal dispatcher-level counter in the test, independent of the suite);
* ``("mapping",)``: rewriting the full->SWA mapping after the metadata call changes its
  output (the layers read the mapping);
* ``("dtype",)``: a half-precision step returns another dtype;
* ``("no_save",)``: ``forward(save_kv_cache=False)`` changes the KV cache.
"""

from __future__ import annotations

import math

import torch

from attnplug import ForwardMode
from attnplug.backends.reference import ReferenceBackend

HALF = (torch.float16, torch.bfloat16)


class NoOpMutant(ReferenceBackend):
    """Control: overrides ``forward`` and changes nothing."""

    WITNESS = None

    def forward(self, q, k, v, layer_id, batch, save_kv_cache=True, *, sinks=None):
        return super().forward(q, k, v, layer_id, batch, save_kv_cache, sinks=sinks)


# ------------------------------------------------------------------------ rule 1 / slots
class IdentityTranslation(ReferenceBackend):
    """SWA layers use full-pool slot numbers: the metadata never translates (harmless while
    every allocator hands out equal numbers in both pools)."""

    WITNESS = ("output", dict(size=256, size_swa=128, scramble_swa=True), [("EXTEND", [5, 9])])

    def _build_metadata(self, batch, q_len_max):
        md = super()._build_metadata(batch, q_len_max)
        if md.swa_out_cache_loc is not None:
            md.swa_out_cache_loc = batch.out_cache_loc.to(torch.int32)
            ks = md.swa_slots.shape[1]
            cols = md.swa_start[:, None] + torch.arange(ks, device=self.device)
            full = torch.gather(md.full_slots, 1, cols.clamp_max(md.full_slots.shape[1] - 1))
            md.swa_slots = torch.where(md.swa_slots != 0, full, 0)
        return md


class RegatherWindowPerLayer(ReferenceBackend):
    """Rule 1: every SWA layer re-gathers the window prefix's SWA slots from the mapping (a
    fused kernel's direct read), instead of using the table built in metadata."""

    WITNESS = ("mapping",)

    def forward(self, q, k, v, layer_id, batch, save_kv_cache=True, *, sinks=None):
        md = self.forward_metadata
        if md is not None and md.swa_slots is not None and self.pool.is_swa_layer(layer_id):
            ks = md.swa_slots.shape[1]
            cols = md.swa_start[:, None] + torch.arange(ks, device=self.device)
            full = torch.gather(md.full_slots, 1, cols.clamp_max(md.full_slots.shape[1] - 1))
            fresh = self.pool.full_to_swa_index_mapping[full].long()
            md.swa_slots.copy_(torch.where(md.swa_slots != 0, fresh, 0))
        return super().forward(q, k, v, layer_id, batch, save_kv_cache, sinks=sinks)


class NeighbourWriteInPage(ReferenceBackend):
    """KV slots: at page size > 1 the store writes two slots per token (a vector store of the
    pair), so the slot after each token's in its page receives the token's k/v."""

    WITNESS = ("output", dict(page_size=4), [("EXTEND", [5, 6])])

    def forward(self, q, k, v, layer_id, batch, save_kv_cache=True, *, sinks=None):
        ps = self.pool.page_size
        if save_kv_cache and ps > 1 and k.shape[0]:
            md = self.forward_metadata
            loc = (md.swa_out_cache_loc if self.pool.is_swa_layer(layer_id) else batch.out_cache_loc).long()
            nxt = loc + 1
            same = nxt % ps != 0
            kb, vb = self.pool.get_kv_buffer(layer_id)
            kb[nxt[same]] = k[same]
            vb[nxt[same]] = v[same]
        return super().forward(q, k, v, layer_id, batch, save_kv_cache, sinks=sinks)  # the step's own slots rewritten


class WritesOtherLayer(ReferenceBackend):
    """KV slots: a layer-stride bug: an SWA layer followed by a full layer also stores its
    k/v into that layer's buffers (at the SWA slots)."""

    WITNESS = ("output", dict(size=512, size_swa=256, scramble_swa=True), [("EXTEND", [5, 9]), ("DECODE", None)])

    def forward(self, q, k, v, layer_id, batch, save_kv_cache=True, *, sinks=None):
        out = super().forward(q, k, v, layer_id, batch, save_kv_cache, sinks=sinks)
        nxt = layer_id + 1
        if (
            save_kv_cache
            and nxt < self.pool.num_layers
            and self.pool.is_swa_layer(layer_id)
            and not self.pool.is_swa_layer(nxt)
        ):
            kb, vb = self.pool.get_kv_buffer(nxt)
            loc = self.forward_metadata.swa_out_cache_loc.long()
            kb[loc] = k
            vb[loc] = v
        return out


class WritesSink(ReferenceBackend):
    """KV slots: the store always writes one padding row (the last token's k/v) to slot 0,
    also in eager steps, where nothing may touch the sink."""

    WITNESS = ("output", dict(), [("EXTEND", [5, 9])])

    def forward(self, q, k, v, layer_id, batch, save_kv_cache=True, *, sinks=None):
        out = super().forward(q, k, v, layer_id, batch, save_kv_cache, sinks=sinks)
        if save_kv_cache and k.shape[0]:
            kb, vb = self.pool.get_kv_buffer(layer_id)
            kb[0] = k[-1]
            vb[0] = v[-1]
        return out


class IgnoresSaveKvCacheFalse(ReferenceBackend):
    """``save_kv_cache=False`` is ignored: the layer stores k/v anyway."""

    WITNESS = ("no_save",)

    def forward(self, q, k, v, layer_id, batch, save_kv_cache=True, *, sinks=None):
        return super().forward(q, k, v, layer_id, batch, True, sinks=sinks)


class PageOffset3Bit(ReferenceBackend):
    """Paging: the in-page offset is kept in a 3-bit field, right for pages of up to 8 slots
    and wrong from page size 16 on (offsets >= 8 wrap)."""

    WITNESS = ("output", dict(page_size=16, size=512, size_swa=256), [("EXTEND", [12, 9]), ("DECODE", None)])

    def _build_metadata(self, batch, q_len_max):
        md = super()._build_metadata(batch, q_len_max)
        ps = self.pool.page_size
        if ps > 8:
            cols = torch.arange(md.full_slots.shape[1], device=self.device)
            md.full_slots = md.full_slots // ps * ps + ((cols % ps) & 7)
        return md


# ------------------------------------------------------------------------ attention numerics
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
        dict(
            dtype=torch.bfloat16,
            max_context_len=4160,
            size=8192,
            size_swa=8192,
            sliding_window=None,
            swa_layer_ids=(),
            num_heads=4,
            num_kv_heads=1,
        ),
        [("EXTEND_DIRECT", [4100]), ("DECODE", None)],
    )

    def _attend(self, q, keys, values, key_pos, window, md, *, sinks=None):
        if q.dtype not in HALF:
            return super()._attend(q, keys, values, key_pos, window, md, sinks=sinks)
        T, H, D = q.shape
        bs, K, Hkv, _ = keys.shape
        G, Q = H // Hkv, md.q_len_max
        qp = torch.zeros(bs, Q, H, D, dtype=torch.float32, device=q.device)
        qp[md.token_req, md.token_idx] = q.float()
        q_pos = md.q_start[:, None] + torch.arange(Q, device=q.device)
        kp, qq = key_pos[:, None, :], q_pos[:, :, None]
        mask = kp <= qq
        if window is not None:
            mask = mask & (kp > qq - window)
        scores = torch.einsum("bqhgd,bkhd->bhgqk", qp.view(bs, Q, Hkv, G, D), keys.float()) * self.scaling
        scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
        out = _blocked_softmax_pv(scores, values, q.dtype, 32)  # [bs, Hkv, G, Q, D]
        out = out.permute(0, 3, 1, 2, 4).reshape(bs, Q, H, D)
        return out[md.token_req, md.token_idx].to(q.dtype)


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


class WindowPlusOne(ReferenceBackend):
    """Window: SWA queries at position p also attend to the key at p - W (W + 1 keys)."""

    WITNESS = ("output", dict(sliding_window=4), [("EXTEND", [9, 12])])

    def _attend(self, q, keys, values, key_pos, window, md, *, sinks=None):
        return super()._attend(q, keys, values, key_pos, None if window is None else window + 1, md, sinks=sinks)


class WindowStartOffByOne(ReferenceBackend):
    """Window: the window table's first column is labelled one position late (p - W + 2),
    so every key of the table is attributed the next position."""

    WITNESS = ("output", dict(sliding_window=4), [("EXTEND", [9, 12]), ("DECODE", None)])

    def _build_metadata(self, batch, q_len_max):
        md = super()._build_metadata(batch, q_len_max)
        if md.swa_start is not None:
            md.swa_start = md.swa_start + 1
        return md


class NoCausalInVerify(ReferenceBackend):
    """TARGET_VERIFY / DRAFT_EXTEND: the drafts see each other (no causal mask inside the
    step, as for a tree mask that was never set)."""

    WITNESS = ("output", dict(), [("EXTEND", [5, 9]), ("TARGET_VERIFY", 3)])
    _speculative = False

    def init_forward_metadata(self, batch):
        self._speculative = batch.forward_mode.is_speculative
        super().init_forward_metadata(batch)

    def init_forward_metadata_replay_cuda_graph(self, batch):
        self._speculative = batch.forward_mode.is_speculative
        super().init_forward_metadata_replay_cuda_graph(batch)

    def _attend(self, q, keys, values, key_pos, window, md, *, sinks=None):
        if self._speculative:
            start = md.q_start[:, None]
            key_pos = torch.where(key_pos >= start, start, key_pos.expand(start.shape[0], -1))
        return super()._attend(q, keys, values, key_pos, window, md, sinks=sinks)


class GqaHeadMapping(ReferenceBackend):
    """GQA: query head h reads KV head ``h % num_kv_heads`` instead of ``h // group``."""

    WITNESS = ("output", dict(num_heads=8, num_kv_heads=2), [("EXTEND", [5, 9])])

    def _attend(self, q, keys, values, key_pos, window, md, *, sinks=None):
        H, Hkv = q.shape[1], keys.shape[2]
        G = H // Hkv
        if G == 1 or Hkv == 1:
            return super()._attend(q, keys, values, key_pos, window, md, sinks=sinks)
        perm = torch.arange(H, device=q.device).view(G, Hkv).t().reshape(-1)  # slot j holds head perm[j]
        out = super()._attend(q[:, perm], keys, values, key_pos, window, md, sinks=sinks)
        back = torch.empty_like(perm)
        back[perm] = torch.arange(H, device=q.device)
        return out[:, back]


class LargeBatchScratch(ReferenceBackend):
    """Batch size: the per-request q layout has 8 rows; requests past the 8th share the last
    row (correct up to batch size 8)."""

    WITNESS = ("output", dict(max_reqs=12), [("EXTEND", [3, 4, 5, 3, 4, 5, 3, 4, 5, 6])])

    def _build_metadata(self, batch, q_len_max):
        md = super()._build_metadata(batch, q_len_max)
        md.token_req = md.token_req.clamp_max(7)
        return md


class ExtendIgnoresPrefix(ReferenceBackend):
    """Chunked prefill: EXTEND positions are computed as if the request had no cached prefix
    when every request extends by more than one token."""

    WITNESS = ("output", dict(), [("EXTEND", [5, 9]), ("EXTEND", [4, 2])])

    def _build_metadata(self, batch, q_len_max):
        md = super()._build_metadata(batch, q_len_max)
        if (
            batch.forward_mode is ForwardMode.EXTEND
            and batch.extend_seq_lens_cpu is not None
            and min(batch.extend_seq_lens_cpu, default=0) > 1
        ):
            md.q_start = torch.zeros_like(md.q_start)
        return md


class MisreadsSeqLensCpu(ReferenceBackend):
    """Host mirror: in TARGET_VERIFY / DRAFT_EXTEND, when the engine supplies ``seq_lens_cpu``
    the backend takes it for the length BEFORE the drafts (a decode habit)."""

    WITNESS = ("output", dict(), [("EXTEND", [5, 9]), ("TARGET_VERIFY_MIRROR", 3)])

    def init_forward_metadata(self, batch):
        super().init_forward_metadata(batch)
        if batch.forward_mode.is_speculative and batch.seq_lens_cpu is not None:
            md = self.forward_metadata
            md.q_start = torch.tensor(batch.seq_lens_cpu, dtype=torch.int64, device=self.device) - 1


# ------------------------------------------------------------------------ soft-cap and sinks
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
    T, H, D = q.shape
    bs, K, Hkv, _ = keys.shape
    G, Q = H // Hkv, md.q_len_max
    qp = torch.zeros(bs, Q, H, D, dtype=torch.float32, device=q.device)
    qp[md.token_req, md.token_idx] = q.float()
    q_pos = md.q_start[:, None] + torch.arange(Q, device=q.device)
    kp, qq = key_pos[:, None, :], q_pos[:, :, None]
    mask = (kp <= qq) & (kp < md.seq_lens[:, None, None])
    if window is not None:
        mask = mask & (kp > qq - window)
    seen = mask.any(1)[:, :, None, None]
    keys, values = torch.where(seen, keys, 0), torch.where(seen, values, 0)
    scores = torch.einsum("bqhgd,bkhd->bhgqk", qp.view(bs, Q, Hkv, G, D), keys.float()) * backend.scaling
    scores = cap_fn(scores, kp[:, None, None], qq[:, None, None])
    scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
    m = scores.amax(-1, keepdim=True)
    if sinks is not None:
        m = torch.maximum(m, sinks.float().view(1, Hkv, G, 1, 1))
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(scores - m)
    denom = p.sum(-1, keepdim=True)
    if sinks is not None:
        denom = denom + torch.exp(sinks.float().view(1, Hkv, G, 1, 1) - m)
    out = torch.einsum("bhgqk,bkhd->bqhgd", p / denom.clamp_min(1e-30), values.float())
    return out.reshape(bs, Q, H, D)[md.token_req, md.token_idx].to(q.dtype)


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
        dict(
            sinks=True,
            max_context_len=576,
            size=2048,
            size_swa=1024,
            sliding_window=None,
            swa_layer_ids=(),
            num_heads=4,
            num_kv_heads=1,
        ),
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


# ------------------------------------------------------------------------ rule 2: sync forms
class _SyncInReplay(ReferenceBackend):
    WITNESS = ("sync",)

    def sync_op(self, batch):  # pragma: no cover - overridden
        raise NotImplementedError

    def init_forward_metadata_replay_cuda_graph(self, batch):
        self._scratch = self.sync_op(batch)
        super().init_forward_metadata_replay_cuda_graph(batch)


class ArangeOfMaxInReplay(_SyncInReplay):
    """Replay metadata sizes a position range by the longest sequence: ``arange(seq_lens.max())``."""

    def sync_op(self, batch):
        return torch.arange(batch.seq_lens.max(), device=self.device)


class ZerosOfMaxInReplay(_SyncInReplay):
    """Replay metadata allocates a scratch row of ``zeros(seq_lens.max())``."""

    def sync_op(self, batch):
        return torch.zeros(batch.seq_lens.max(), device=self.device)


class FullOfMaxInReplay(_SyncInReplay):
    """Replay metadata builds ``full((seq_lens.max(),), 0)``."""

    def sync_op(self, batch):
        return torch.full((batch.seq_lens.max(),), 0, device=self.device)


class SliceWithTensorBoundInReplay(_SyncInReplay):
    """Replay metadata slices the request table with a tensor bound: ``rows[:, :seq_lens.max()]``."""

    def sync_op(self, batch):
        return self.req_to_token_pool.req_to_token[:, : batch.seq_lens.max()]


class NarrowWithTensorInReplay(_SyncInReplay):
    """Replay metadata narrows the request table to ``seq_lens.max()`` columns."""

    def sync_op(self, batch):
        return self.req_to_token_pool.req_to_token.narrow(1, 0, batch.seq_lens.max())


class BincountInReplay(_SyncInReplay):
    """Replay metadata counts tokens per request with ``bincount`` (its output size depends on
    the values, even with ``minlength``)."""

    def sync_op(self, batch):
        return torch.bincount(batch.req_pool_indices, minlength=batch.batch_size)


class RepeatInterleaveInReplay(_SyncInReplay):
    """Replay metadata expands per-request lengths with ``repeat_interleave`` and no ``output_size``."""

    def sync_op(self, batch):
        return torch.repeat_interleave(batch.req_pool_indices, torch.ones_like(batch.req_pool_indices))


SUBTLE = [
    IdentityTranslation,
    RegatherWindowPerLayer,
    NeighbourWriteInPage,
    WritesOtherLayer,
    WritesSink,
    IgnoresSaveKvCacheFalse,
    PageOffset3Bit,
    TileSkipsFirstKey,
    LastPartialTileDropped,
    HalfPrecisionAccumulation,
    HeadDimTailUnmasked,
    SplitKVSmallBatch,
    IgnoresScaling,
    ReturnsFp32,
    WindowPlusOne,
    WindowStartOffByOne,
    NoCausalInVerify,
    GqaHeadMapping,
    LargeBatchScratch,
    ExtendIgnoresPrefix,
    MisreadsSeqLensCpu,
    SoftcapAfterLog2eFold,
    SoftcapSkippedOnEdgeBlocks,
    SinkInEverySplit,
    SinkTimesScaling,
    SinksDroppedOnSwaLayers,
    ArangeOfMaxInReplay,
    ZerosOfMaxInReplay,
    FullOfMaxInReplay,
    SliceWithTensorBoundInReplay,
    NarrowWithTensorInReplay,
    BincountInReplay,
    RepeatInterleaveInReplay,
]
