"""Freeing SWA slots early: once no future query's window can reach a position, its SWA slot
goes back to the SWA pool while its full slot stays (``WindowEviction``, a part of
``SWATokenAllocator``).

``evict_out_of_window`` frees SWA slots only for positions the row really holds: every
position in ``[frontier, seq_len)`` of the row must hold a live full slot (the engine writes a
request's slots into its row right after allocating them and zeroes or rewrites the positions
it drops, as ``ReqToTokenPool.free`` does for a whole row). A refused call raises
``KVSlotError`` before changing anything.
"""

from __future__ import annotations

import torch

from ..env import validation_enabled
from .args import HostInts, host_int
from .args import first as _first
from .args import host_ints as _host_int64
from .errors import KVSlotError
from .pages import PageTable
from .req_to_token import ReqToTokenPool

__all__ = ["WindowEviction"]


class WindowEviction(PageTable):
    """``free_swa`` and the eviction of the SWA slots that left a request's window."""

    def free_swa(self, full_locs: HostInts) -> None:
        """Free only the SWA slots of the full slots ``full_locs`` (any shape, host or device
        ints). With ``page_size > 1`` whole SWA pages are freed, each once, and the mapping
        of EVERY full slot of those pages becomes 0. Raises ``KVSlotError`` (nothing
        changed) if a slot has no live SWA slot (double free, never allocated) or is
        invalid."""
        pages, slots = self._full_pages_of(full_locs, "free_swa")
        unmapped = self.full_to_swa_page[pages] == 0
        if bool(unmapped.any()):
            raise KVSlotError(
                f"free_swa: full slots {_first(self._slots_in(slots, pages[unmapped]))} have no live "
                "SWA slot (double free, already evicted or never allocated)"
            )
        self._unmap(pages)

    def window_limit(self, seq_len: int, window: int) -> int:
        """The eviction limit of a request of ``seq_len`` positions: positions below it lie
        outside every future query's window (a query at ``>= seq_len`` sees keys
        ``> pos - window``), rounded down to a whole page. Host ints; no checks."""
        return max(0, seq_len - window + 1) // self.page_size * self.page_size

    def evict_out_of_window(self, rows: ReqToTokenPool, req_row: int, seq_len: int, window: int) -> int:
        """Free the SWA slots no future query of request row ``req_row`` can attend to.

        A future query sits at position ``>= seq_len`` and sees keys ``> pos - window``, so
        positions ``< seq_len - window + 1`` are dead. Frees positions ``[frontier, limit)``
        of ``rows.req_to_token[req_row]`` (read from the device), ``limit`` being
        ``max(0, seq_len - window + 1)`` rounded down to a page boundary, and moves the
        row's frontier to ``limit``. Afterwards a request holds at most
        ``window + page_size`` positions with live SWA slots. Returns the number of SWA
        slots freed (host int; whole pages).

        ``seq_len`` may not exceed what the row holds: every position in ``[frontier, seq_len)``
        must hold a live full slot, otherwise ``KVSlotError`` naming the row's length, nothing
        changed. This reads ``seq_len - frontier`` entries of the row from the device when the
        call frees something (always under ``ATTNPLUG_VALIDATE=1``); a call that frees nothing
        reads nothing.
        """
        if not isinstance(rows, ReqToTokenPool):
            raise TypeError(f"evict_out_of_window: rows must be a ReqToTokenPool, got {type(rows).__name__}")
        window = host_int(window, "evict_out_of_window: window", lo=1)
        seq_len = host_int(seq_len, "evict_out_of_window: seq_len", lo=0, hi=rows.max_context_len)
        ps = self.page_size
        frontier = rows.swa_evicted_len(req_row)
        limit = self.window_limit(seq_len, window)
        if limit <= frontier and not validation_enabled():
            return 0
        held = rows.req_to_token[req_row, frontier:seq_len].to("cpu", torch.int64)  # positions to check
        self._check_held(req_row, frontier, seq_len, held)
        if limit <= frontier:
            return 0
        self.free_swa(held[: limit - frontier : ps])  # one slot per page
        rows.set_swa_evicted_len(req_row, limit)
        return limit - frontier

    def evict_out_of_window_many(
        self, rows: ReqToTokenPool, req_rows: HostInts, seq_lens: HostInts, window: int
    ) -> int:
        """``evict_out_of_window`` for several request rows at once (a decode step's batch),
        with ONE read of the device rows instead of one per row: frees the same SWA slots and
        moves the same frontiers as calling it row by row, and returns the total freed.
        ``req_rows`` and ``seq_lens`` are host ints of equal length, each row once. Every row
        is checked before anything changes: a refused call (a row not in use, a row twice, a
        ``seq_len`` beyond what its row holds) raises ``KVSlotError`` naming the row, nothing
        changed."""
        if not isinstance(rows, ReqToTokenPool):
            raise TypeError(f"evict_out_of_window_many: rows must be a ReqToTokenPool, got {type(rows).__name__}")
        window = host_int(window, "evict_out_of_window_many: window", lo=1)
        req = _host_int64(req_rows, "evict_out_of_window_many: req_rows").tolist()
        seqs = _host_int64(seq_lens, "evict_out_of_window_many: seq_lens").tolist()
        if len(req) != len(seqs):
            raise KVSlotError(f"evict_out_of_window_many: {len(req)} req_rows but {len(seqs)} seq_lens")
        if len(set(req)) != len(req):
            raise KVSlotError(f"evict_out_of_window_many: req_rows name a row twice: {req}")
        ps, check_all = self.page_size, validation_enabled()
        plans = []  # (row, frontier, limit, seq_len) of the rows to read
        for row, seq_len in zip(req, seqs):
            seq_len = host_int(
                seq_len, f"evict_out_of_window_many: seq_len of row {row}", lo=0, hi=rows.max_context_len
            )
            frontier = rows.swa_evicted_len(row)
            limit = self.window_limit(seq_len, window)
            if limit > frontier or check_all:
                plans.append((row, frontier, limit, seq_len))
        if not plans:
            return 0
        # One read of the rows' spans; every check and every slot to free as whole-batch ops.
        row_t, frontier_t, limit_t, seq_t = (torch.tensor(col, dtype=torch.int64) for col in zip(*plans))
        lo = int(frontier_t.min())
        hi = max(int(seq_t.max()), lo)
        index = row_t.to(rows.req_to_token.device)
        held_all = rows.req_to_token[index, lo:hi].to("cpu", torch.int64)  # the one device read
        col = torch.arange(lo, hi, dtype=torch.int64)[None, :]
        span = (col >= frontier_t[:, None]) & (col < seq_t[:, None])  # positions each row must hold
        live = self._live_full(held_all)
        bad_rows = (span & ~live).any(dim=1)
        if bool(bad_rows.any()):
            i = int(bad_rows.to(torch.int8).argmax())
            row, frontier, _, seq_len = plans[i]
            self._check_held(row, frontier, seq_len, held_all[i, frontier - lo : seq_len - lo])  # raises
        # positions [frontier, limit) leave the window; frontier and limit are page multiples
        gone = (col >= frontier_t[:, None]) & (col < limit_t[:, None]) & (col % ps == 0)
        if not bool(gone.any()):
            return 0
        self.free_swa(held_all[gone])  # one slot per page; checks every slot before changing anything
        total = 0
        for row, frontier, limit, _ in plans:
            if limit > frontier:
                rows.set_swa_evicted_len(row, limit)
                total += limit - frontier
        return total

    def _check_held(self, req_row: int, frontier: int, seq_len: int, held: torch.Tensor) -> None:
        """Every position in ``[frontier, seq_len)`` of the row (``held``: its entries, host
        int64) must hold a live full slot, else ``KVSlotError`` naming the row's length."""
        live = self._live_full(held)
        if not bool(live.all()):
            length = frontier + int((~live).to(torch.int8).argmax())
            raise KVSlotError(
                f"evict_out_of_window: seq_len={seq_len} is beyond what row {req_row} holds: it holds "
                f"{length} positions (req_to_token[{req_row}, {length}] = {int(held[length - frontier])} "
                "is not a live full slot); evicting for it would free SWA slots the request still needs"
            )
