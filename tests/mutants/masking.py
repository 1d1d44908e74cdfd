"""Mutants of which keys a query sees: the window, the causal mask inside speculative steps,
the GQA head mapping, per-request rows past the 8th, cached prefixes and the host mirror."""

from __future__ import annotations

import torch

from attnplug import ForwardMode
from attnplug.backends.reference import ReferenceBackend


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
