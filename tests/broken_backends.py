"""Deliberately broken backends: each subclass of ``ReferenceBackend`` breaks ONE rule of the
contract, so that tests/conformance/test_conformance_fails_broken.py can prove the conformance suite fails
it with a message naming that rule. Run one with
``pytest --attnplug-backend=broken_backends:TranslatePerLayer`` (tests/ on ``sys.path``).
"""

from __future__ import annotations

import os

import torch

from attnplug import Capabilities
from attnplug.backends.reference import ReferenceBackend


class TranslatePerLayer(ReferenceBackend):
    """Rule 1: every SWA layer translates ``out_cache_loc`` itself through the pool."""

    name = "broken-translate-per-layer"

    def forward(self, q, k, v, layer_id, batch, save_kv_cache=True, *, sinks=None):
        if save_kv_cache and self.pool.is_swa_layer(layer_id):
            swa_loc = self.pool.translate_loc_from_full_to_swa(batch.out_cache_loc)
            self.pool.set_kv_buffer(layer_id, batch.out_cache_loc, k, v, swa_loc=swa_loc)
            return super().forward(q, k, v, layer_id, batch, save_kv_cache=False, sinks=sinks)
        return super().forward(q, k, v, layer_id, batch, save_kv_cache, sinks=sinks)


class GatherPerLayer(ReferenceBackend):
    """Rule 1, hidden from a counter: SWA layers gather the mapping directly (as a fused kernel
    would), never calling ``pool.translate_loc_from_full_to_swa`` in the layer loop."""

    name = "broken-gather-per-layer"

    def forward(self, q, k, v, layer_id, batch, save_kv_cache=True, *, sinks=None):
        if save_kv_cache and self.pool.is_swa_layer(layer_id):
            swa_loc = self.pool.full_to_swa_index_mapping[batch.out_cache_loc]
            self.pool.set_kv_buffer(layer_id, batch.out_cache_loc, k, v, swa_loc=swa_loc)
            return super().forward(q, k, v, layer_id, batch, save_kv_cache=False, sinks=sinks)
        return super().forward(q, k, v, layer_id, batch, save_kv_cache, sinks=sinks)


class RenamedBuffer(ReferenceBackend):
    """Rule 1: the graph buffer is called ``cuda_graph_swa_loc`` (a per-backend synonym)."""

    name = "broken-renamed-buffer"

    def init_cuda_graph_state(self, max_bs, max_num_tokens):
        super().init_cuda_graph_state(max_bs, max_num_tokens)
        self.cuda_graph_swa_loc = self.cuda_graph_swa_out_cache_loc
        self.cuda_graph_swa_out_cache_loc = None

    def _graph_views(self, batch):
        self.cuda_graph_swa_out_cache_loc = self.cuda_graph_swa_loc
        try:
            return super()._graph_views(batch)
        finally:
            self.cuda_graph_swa_out_cache_loc = None

    def _fill_graph_metadata(self, batch):
        md = self._graph_views(batch)
        md.copy_(self._build_metadata(batch, md.q_len_max))
        self.cuda_graph_swa_loc[batch.num_tokens :].zero_()
        self.forward_metadata = md


class DirtyTail(ReferenceBackend):
    """Rule 1: replay fills ``buf[:n]`` but leaves ``buf[n:]`` as the previous step left it."""

    name = "broken-dirty-tail"

    def _fill_graph_metadata(self, batch):
        md = self._graph_views(batch)
        md.copy_(self._build_metadata(batch, md.q_len_max))
        self.forward_metadata = md  # no zeroing of the tail


class DirtyTailDeclared(DirtyTail):
    """``DirtyTail`` that declares the failure: the suite marks it xfail(strict)."""

    conformance_xfail = {"check_swa_buffer_contract": "the tail of the graph buffer is not zeroed yet"}


class ReferenceDeclaresBogusXfail(ReferenceBackend):
    """A correct backend that declares an expected failure: the strict xfail must fail."""

    conformance_xfail = {"check_swa_buffer_contract[DECODE]": "claimed broken, but is not"}


class ItemInReplay(ReferenceBackend):
    """Rule 2: replay metadata reads the longest sequence with ``.item()`` (a host sync)."""

    name = "broken-item-in-replay"

    def init_forward_metadata_replay_cuda_graph(self, batch):
        self._longest = int(batch.seq_lens.max().item())
        super().init_forward_metadata_replay_cuda_graph(batch)


class TensorFromListInReplay(ReferenceBackend):
    """Rule 2: replay metadata builds a tensor from a Python list on the device."""

    name = "broken-tensor-from-list"

    def init_forward_metadata_replay_cuda_graph(self, batch):
        self._q = torch.tensor([batch.q_len] * batch.batch_size, device=self.device)
        super().init_forward_metadata_replay_cuda_graph(batch)


class WindowOffByOne(ReferenceBackend):
    """Attention: SWA layers attend to W - 1 keys instead of W."""

    name = "broken-window-off-by-one"

    def _attend(self, q, keys, values, key_pos, window, md, *, sinks=None):
        return super()._attend(q, keys, values, key_pos, None if window is None else window - 1, md, sinks=sinks)


class WrongSlot(ReferenceBackend):
    """KV slots: SWA layers store the new tokens' KV one slot too far (slot + 1)."""

    name = "broken-wrong-slot"

    def forward(self, q, k, v, layer_id, batch, save_kv_cache=True, *, sinks=None):
        if save_kv_cache and self.pool.is_swa_layer(layer_id):
            md = self.forward_metadata
            self.pool.set_kv_buffer(layer_id, batch.out_cache_loc, k, v, swa_loc=md.swa_out_cache_loc + 1)
            return super().forward(q, k, v, layer_id, batch, save_kv_cache=False, sinks=sinks)
        return super().forward(q, k, v, layer_id, batch, save_kv_cache, sinks=sinks)


class ReallocatingReplay(ReferenceBackend):
    """Rule 1 / static graph state: every replay allocates a new translation buffer (a
    captured graph would keep reading the old one)."""

    name = "broken-reallocating-replay"

    def init_forward_metadata_replay_cuda_graph(self, batch):
        self.cuda_graph_swa_out_cache_loc = torch.zeros_like(self.cuda_graph_swa_out_cache_loc)
        self._graph_metadata = {}
        super().init_forward_metadata_replay_cuda_graph(batch)


class HonestPdl(ReferenceBackend):
    """A correct backend that claims PDL unless ``ATTNPLUG_DISABLE_PDL=1`` (read at construction)."""

    name = "honest-pdl"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pdl = os.environ.get("ATTNPLUG_DISABLE_PDL", "0") != "1"

    def capabilities(self) -> Capabilities:
        caps = super().capabilities()
        return Capabilities(**{**caps.__dict__, "pdl": self.pdl})


class PdlChangesResults(HonestPdl):
    """Rule 3: results with PDL differ from results without (a missing wait, simulated)."""

    name = "broken-pdl-race"

    def forward(self, q, k, v, layer_id, batch, save_kv_cache=True, *, sinks=None):
        out = super().forward(q, k, v, layer_id, batch, save_kv_cache, sinks=sinks)
        return out * (1 + 2**-10) if self.pdl else out


class PdlIgnoresEnv(HonestPdl):
    """Capabilities: claims PDL even when ``ATTNPLUG_DISABLE_PDL=1``."""

    name = "broken-pdl-ignores-env"

    def capabilities(self) -> Capabilities:
        return Capabilities(**{**super().capabilities().__dict__, "pdl": True})


class NeedsSeqLensCpu(ReferenceBackend):
    """Declares ``needs_cpu_seq_lens = False`` but reads ``seq_lens_cpu`` anyway."""

    name = "broken-needs-seq-lens-cpu"

    def init_forward_metadata(self, batch):
        self._longest = max(batch.seq_lens_cpu)  # TypeError when the engine passes None
        super().init_forward_metadata(batch)


class ReplayDiffers(ReferenceBackend):
    """Replay: graph replay computes something else than eager (a perturbed output)."""

    name = "broken-replay-differs"
    _replaying = False

    def init_forward_metadata(self, batch):
        self._replaying = False
        super().init_forward_metadata(batch)

    def init_forward_metadata_replay_cuda_graph(self, batch):
        self._replaying = True
        super().init_forward_metadata_replay_cuda_graph(batch)

    def forward(self, q, k, v, layer_id, batch, save_kv_cache=True, *, sinks=None):
        out = super().forward(q, k, v, layer_id, batch, save_kv_cache, sinks=sinks)
        return out * (1 + 2**-8) if self._replaying else out


__all__ = [
    name
    for name, obj in list(globals().items())
    if isinstance(obj, type) and issubclass(obj, ReferenceBackend) and obj is not ReferenceBackend
]
