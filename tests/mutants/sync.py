"""Mutants of rule 2: replay metadata that reads the device (a host sync) or sizes an op by
device values."""

from __future__ import annotations

import torch

from attnplug.backends.reference import ReferenceBackend


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
