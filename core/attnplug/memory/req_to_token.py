"""The request table: which full-pool slot holds each position of each live request.

``ReqToTokenPool`` owns ``req_to_token`` (device) and hands out its rows. Row 0 is never
handed out: padded requests of a captured graph point at it, and it stays all zero (slot 0
is the padding sink of both KV pools). The engine writes a request's slots into its row
after allocating them; backends read rows on the device.

A row holds position ``p`` while ``req_to_token[row, p]`` is a live full slot. The engine
must zero (or overwrite) the positions a request drops, e.g. rejected draft tokens whose
slots it frees: eviction refuses a ``seq_len`` beyond the positions a row holds.

Each row also carries its SWA eviction frontier (host): the number of leading positions
whose SWA slots ``SWATokenAllocator.evict_out_of_window`` already freed. It is reset when
the row is freed.

Rows are ints: bools, floats, row 0, rows past ``max_reqs`` and rows not in use are refused
with ``KVSlotError`` naming the row.
"""

from __future__ import annotations

from typing import List

import torch

from .args import first, host_int, host_ints
from .errors import KVSlotError, OutOfReqSlots

__all__ = ["ReqToTokenPool"]


class ReqToTokenPool:
    """Rows of full-pool slots, one per live request.

    Fields:

    * ``req_to_token``: ``[max_reqs, max_context_len]`` int32, device, zero-filled;
      ``req_to_token[r, p]`` is the full slot of position ``p`` of row ``r``.
    * ``max_reqs``, ``max_context_len``: host ints; ``max_reqs - 1`` rows are usable.
    * ``device``: ``torch.device`` of ``req_to_token``.
    * free rows, used flags and eviction frontiers: host Python lists.
    """

    def __init__(self, max_reqs: int, max_context_len: int, device) -> None:
        max_reqs = host_int(max_reqs, "max_reqs (row 0 is reserved)", lo=2, error=ValueError)
        max_context_len = host_int(max_context_len, "max_context_len", lo=1, error=ValueError)
        self.max_reqs = max_reqs
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.req_to_token = torch.zeros(max_reqs, max_context_len, dtype=torch.int32, device=self.device)
        self.device = self.req_to_token.device  # concrete ("cuda" becomes "cuda:0")
        # Popped from the end: the lowest row is handed out first.
        self._free_rows: List[int] = list(range(max_reqs - 1, 0, -1))
        self._in_use: List[bool] = [False] * max_reqs
        self._swa_evicted_len: List[int] = [0] * max_reqs

    def alloc(self) -> int:
        """Hand out a free row (host int in ``[1, max_reqs)``); raises ``OutOfReqSlots``."""
        if not self._free_rows:
            raise OutOfReqSlots(f"all {self.max_reqs - 1} request rows are in use")
        row = self._free_rows.pop()
        self._in_use[row] = True
        return row

    def free(self, row: int) -> None:
        """Give ``row`` back: zero it on the device (no sync) and reset its frontier.

        Raises ``KVSlotError`` for row 0, an out-of-range row or a row that is not in use.
        The row's KV slots are the caller's to free (``SWATokenAllocator.free``) beforehand.
        """
        row = self._check_used(row)
        self.req_to_token[row].zero_()
        self._in_use[row] = False
        self._swa_evicted_len[row] = 0
        self._free_rows.append(row)

    def available_size(self) -> int:
        """Number of free rows (host int)."""
        return len(self._free_rows)

    def rows_in_use(self) -> List[int]:
        """The rows handed out and not yet freed, ascending (host ints)."""
        return [row for row, used in enumerate(self._in_use) if used]

    def check_in_use(self, rows, name: str = "req_pool_indices", *, allow_padding_row: bool = False) -> None:
        """Raise ``KVSlotError`` naming ``name`` unless every entry of ``rows`` (host ints or a
        tensor of any device and shape; a device tensor is copied to the host, which syncs) is a
        row in use. ``allow_padding_row``: row 0, which padded requests of a captured graph
        point at, is accepted too. Changes nothing."""
        values = host_ints(rows, name)
        in_use = torch.tensor(self._in_use, dtype=torch.bool)
        inside = (values >= 0) & (values < self.max_reqs)
        ok = inside.clone()
        ok[inside] = in_use[values[inside]] | (allow_padding_row & (values[inside] == 0))
        if not bool(ok.all()):
            raise KVSlotError(
                f"{name} holds rows {first(values[~ok])} that are not request rows in use "
                f"(freed, never allocated, or outside [1, {self.max_reqs}))"
            )

    def swa_evicted_len(self, row: int) -> int:
        """Eviction frontier of ``row`` (host int): positions ``[0, frontier)`` of the row
        have had their SWA slots freed."""
        return self._swa_evicted_len[self._check_used(row)]

    def set_swa_evicted_len(self, row: int, length: int) -> None:
        """Set the eviction frontier of ``row`` (called by the allocator after evicting)."""
        row = self._check_used(row)
        self._swa_evicted_len[row] = host_int(length, f"eviction frontier of row {row}", lo=0, hi=self.max_context_len)

    def _check_used(self, row) -> int:
        """``row`` as a host int, after checking that it is a handed-out row (an int, not a
        bool, in ``[1, max_reqs)``, in use)."""
        index = host_int(row, "request row")
        if not 0 < index < self.max_reqs:
            raise KVSlotError(f"request row {index} is outside [1, {self.max_reqs}) (row 0 is reserved)")
        if not self._in_use[index]:
            raise KVSlotError(f"request row {index} is not in use (double free or never allocated)")
        return index
