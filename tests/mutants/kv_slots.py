"""Mutants of rule 1 and of the KV slots: slot translation, the window table, stores that
write where they must not, paging."""

from __future__ import annotations

import torch

from attnplug.backends.reference import ReferenceBackend


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
