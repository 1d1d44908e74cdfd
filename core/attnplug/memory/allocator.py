"""Slot allocation for the hybrid KV cache: every new token gets a full slot and an SWA slot;
SWA slots are freed early once no future query's window can reach them.

``SWATokenAllocator`` is built in three layers, one job each: ``pages.PageTable`` keeps the
host page bookkeeping and the device mapping (and checks them), ``eviction.WindowEviction``
frees SWA slots that left every window, and this module hands out and takes back slots.
Allocation runs in the scheduler between steps, never inside graph replay, so the few host <->
device copies here (index transfers, the device ``req_to_token`` rows read by eviction, device
tensors given to ``free``) are allowed.

Paged continuation follows SGLang: the new tokens of a request first fill the remaining
slots of the page holding its last token (``slot = page_base + pos % page_size``), then
take whole new pages, so position ``p`` of a request always lies at offset
``p % page_size`` of its page.

What the allocator owns, it checks (it knows pages, not requests):

* **Fill.** Each full page records how many of its leading slots were handed out
  (``page_fill``; ``alloc(n)`` hands out whole pages). A continuation (``alloc_extend`` /
  ``alloc_decode`` with ``last_loc``) that puts new tokens into ``last_loc``'s page must
  start right after the page's last handed-out slot: ``last_loc`` must BE that slot, i.e.
  the continuing request's own last slot. So a continuation never hands out a slot that was
  already handed out (another request's, or one of the page's slots already given by
  ``alloc(n)``), and two requests cannot be given the same partial page in one call.
* **Eviction.** ``evict_out_of_window`` frees SWA slots only for positions the row really
  holds (see ``eviction``).
* **Slots.** ``-1`` ("no slot"), slot 0 / page 0 (the sink), values past the pool, bools and
  floats are refused wherever a slot is expected.

A refused call raises ``KVSlotError`` (or ``OutOfKVSlots``) before changing anything: free
lists, used flags, page maps, page fill, the device mapping and the request table are left
exactly as they were.
"""

from __future__ import annotations

import torch

from .args import HostInts, host_int
from .args import first as _first
from .args import host_ints as _host_int64
from .errors import KVSlotError
from .eviction import WindowEviction
from .swa_pool import SWAKVPool

__all__ = ["SWATokenAllocator"]


class SWATokenAllocator(WindowEviction):
    """Allocates full + SWA slots of an ``SWAKVPool`` (see module docstring).

    Host state: the page bookkeeping of ``PageTable`` (``full_to_swa_page``,
    ``swa_to_full_page``, ``page_fill``, the free lists). Device state:
    ``pool.full_to_swa_index_mapping`` (owned by the pool, written here).
    Slots returned by the ``alloc*`` methods are int64 tensors on the pool's device.
    """

    def __init__(self, pool: SWAKVPool) -> None:
        if not isinstance(pool, SWAKVPool):
            raise TypeError(f"pool must be an SWAKVPool, got {type(pool).__name__}")
        super().__init__(pool)

    # ------------------------------------------------------------------ allocation
    def alloc(self, n: int) -> torch.Tensor:
        """``n`` new full slots, each with a live SWA slot: ``[n]`` int64, device.

        With ``page_size > 1``, ``n`` must be a multiple of ``page_size`` (whole pages;
        use ``alloc_extend`` / ``alloc_decode`` to continue a request's last page).
        All-or-nothing: raises ``OutOfKVSlots`` with both pools' free counts, changing
        nothing, when either pool is short.
        """
        n = host_int(n, "alloc(n)", lo=0)  # numpy and torch integer scalars are ints; bools are not
        if n % self.page_size:
            raise KVSlotError(f"alloc(n) needs a multiple of page_size={self.page_size}, got {n}")
        pages = self._take_pages(n // self.page_size)
        return self._page_slots(pages).to(self.device)

    def alloc_extend(
        self, prefix_lens: HostInts, seq_lens: HostInts, last_loc: HostInts, *, host: bool = False
    ) -> torch.Tensor:
        """Slots for positions ``prefix_lens[i] .. seq_lens[i] - 1`` of each request ``i``.

        Arguments: ``[bs]`` host ints (sequences or CPU tensors); ``last_loc[i]`` is the full
        slot of position ``prefix_lens[i] - 1``, or -1 when the prefix is empty.
        Returns ``out_cache_loc``: ``[sum(seq_lens - prefix_lens)]`` int64, device, request
        by request in position order; with ``host=True`` the same slots as a CPU tensor (for
        an engine that keeps them on the host and uploads them with the rest of its step:
        no device copy here, so nothing waits for the device queue). The tokens first fill the rest of the page of
        ``last_loc`` (already mapped to an SWA page), then take new pages (each given an
        SWA page). All-or-nothing across both pools (``OutOfKVSlots``).

        ``last_loc`` must be the request's own last slot (see the module docstring): an
        allocated slot at the page offset of position ``prefix_lens[i] - 1`` and, when new
        tokens go into its page, the page's last handed-out slot; at most one request of a
        call may continue a given page. Otherwise ``KVSlotError``, nothing changed.
        """
        ps = self.page_size
        prefix = _host_int64(prefix_lens, "prefix_lens")
        seq = _host_int64(seq_lens, "seq_lens")
        last = _host_int64(last_loc, "last_loc")
        if not prefix.numel() == seq.numel() == last.numel():
            raise KVSlotError(
                f"prefix_lens, seq_lens and last_loc differ in length: {prefix.numel()}, {seq.numel()}, {last.numel()}"
            )
        if bool((prefix < 0).any()) or bool((seq < prefix).any()):
            raise KVSlotError(
                f"need 0 <= prefix_lens <= seq_lens, got prefix_lens={_first(prefix)}, seq_lens={_first(seq)}"
            )
        if prefix.numel() and int(seq.max()) > self.pool.size:  # also keeps the arithmetic below in range
            raise KVSlotError(
                f"seq_lens {_first(seq[seq > self.pool.size])} exceed the full pool's "
                f"{self.pool.size} slots: no request can hold that many positions"
            )
        self._check_last_loc(prefix, seq, last)
        if ps == 1:  # every new token takes a page of its own, request by request in order
            slots = self._take_pages(int((seq - prefix).sum()), fill=1)
            return slots if host else slots.to(self.device)

        ext = seq - prefix  # [bs] new tokens
        prefix_pages = (prefix + ps - 1) // ps  # pages already (partly) held
        new_pages = (seq + ps - 1) // ps - prefix_pages  # [bs]
        pages = self._take_pages(int(new_pages.sum()), fill=0)

        # Token t of the output: request token_req[t], position pos[t].
        bs, total = ext.numel(), int(ext.sum())
        token_req = torch.repeat_interleave(torch.arange(bs), ext)
        starts = torch.cumsum(ext, 0) - ext
        pos = prefix[token_req] + torch.arange(total) - starts[token_req]
        page_start = torch.cumsum(new_pages, 0) - new_pages  # first new page of each request
        in_last = pos < prefix_pages[token_req] * ps  # still inside the page of last_loc
        page_idx = (page_start[token_req] + pos // ps - prefix_pages[token_req]).clamp_min(0)
        new_base = pages[page_idx] * ps if pages.numel() else torch.zeros_like(pos)
        base = torch.where(in_last, last[token_req] // ps * ps, new_base)
        slots = base + pos % ps
        self.page_fill.scatter_reduce_(0, slots // ps, slots % ps + 1, reduce="amax")
        return slots if host else slots.to(self.device)

    def alloc_decode(self, seq_lens: HostInts, last_loc: HostInts, *, host: bool = False) -> torch.Tensor:
        """One new token per request: ``seq_lens`` (``[bs]`` host ints) INCLUDE it, so its
        position is ``seq_lens[i] - 1``; ``last_loc`` and ``host`` as in ``alloc_extend``.
        Returns ``[bs]`` int64, device (CPU with ``host=True``). All-or-nothing
        (``OutOfKVSlots``)."""
        seq = _host_int64(seq_lens, "seq_lens")
        if bool((seq < 1).any()):
            raise KVSlotError(f"alloc_decode needs seq_lens >= 1 (they include the new token), got {_first(seq)}")
        return self.alloc_extend(seq - 1, seq, last_loc, host=host)

    # ------------------------------------------------------------------ freeing
    def free(self, full_locs: HostInts) -> None:
        """Free the full slots ``full_locs`` (any shape, host or device ints; a device tensor
        is copied to the host) and their SWA slots where still live. With ``page_size > 1``
        the distinct pages they lie in are freed, each once. Raises ``KVSlotError`` (nothing
        changed) for -1, slot 0 / page 0, out-of-range or repeated slots, non-integer values
        (floats, bools), slots whose page is not allocated (double free), and slots that
        leave others of their page handed out: a page is freed whole, so freeing part of it
        would release slots still in use (``rollback`` gives back a page's last slots)."""
        pages, slots = self._allocated_pages_of(full_locs, "free")
        ps = self.page_size
        if ps > 1:
            page_of, offset = slots // ps, slots % ps
            count = torch.zeros_like(self.page_fill).index_add_(0, page_of, torch.ones_like(slots))[pages]
            highest = torch.full_like(self.page_fill, -1).scatter_reduce_(0, page_of, offset, reduce="amax")[pages]
            fill = self.page_fill[pages]
            partial = (count != fill) | (highest >= fill)
            if bool(partial.any()):
                p = int(pages[partial][0])
                given = sorted(int(x) for x in slots[page_of == p])
                held = [p * ps + i for i in range(int(self.page_fill[p])) if p * ps + i not in given]
                raise KVSlotError(
                    f"free: slots {given} are part of page {p}, whose slots {held} are still handed out (or the "
                    f"slots are past its {int(self.page_fill[p])} handed-out ones): free a page's slots together; "
                    "rollback gives back its last ones"
                )
        self._release_full_pages(pages)

    def rollback(self, full_locs: HostInts) -> None:
        """Give back the LAST handed-out slots of pages, e.g. the rejected drafts of a
        TARGET_VERIFY step (any shape, host or device ints).

        For every page the slots lie in, they must be exactly the page's trailing handed-out
        slots ``[k, page_fill)``: a page left with ``k == 0`` slots is freed (with its SWA
        page); a partly kept page stays allocated with ``page_fill = k``, so the request
        continues it from its new last slot (``alloc_extend`` / ``alloc_decode`` with
        ``last_loc`` = the slot of position ``k - 1`` of the page). With ``page_size == 1``
        this is ``free``. Raises ``KVSlotError`` (nothing changed) for invalid, repeated or
        unallocated slots, or slots that are not the tail of their page.
        """
        pages, slots = self._allocated_pages_of(full_locs, "rollback")
        ps = self.page_size
        page_of, offset = slots // ps, slots % ps
        fill = self.page_fill[pages]
        # per page: how many slots are given and the lowest offset; a tail [k, fill) has
        # count == fill - k, lowest == k and no offset >= fill
        count = torch.zeros_like(self.page_fill).index_add_(0, page_of, torch.ones_like(slots))[pages]
        lowest = torch.full_like(self.page_fill, ps).scatter_reduce_(0, page_of, offset, reduce="amin")[pages]
        highest = torch.full_like(self.page_fill, -1).scatter_reduce_(0, page_of, offset, reduce="amax")[pages]
        bad = (highest != fill - 1) | (count != fill - lowest)
        if bool(bad.any()):
            raise KVSlotError(
                f"rollback: full slots {_first(self._slots_in(slots, pages[bad]))} are not the trailing "
                f"handed-out slots of their page (page_fill {_first(fill[bad])}): only a request's "
                "last slots can be rolled back"
            )
        emptied = pages[lowest == 0]
        kept = pages[lowest != 0]
        self.page_fill[kept] = lowest[lowest != 0]
        if emptied.numel():
            self._release_full_pages(emptied)

    def _check_last_loc(self, prefix: torch.Tensor, seq: torch.Tensor, last: torch.Tensor) -> None:
        """``last`` must be -1 exactly where the prefix is empty, otherwise an allocated slot
        at the page offset of position ``prefix - 1``. Where new tokens go into ``last``'s
        page: the page must still have its SWA page, ``last`` must be the page's last
        handed-out slot (``page_fill``), and no two requests may continue the same page."""
        ps = self.page_size
        empty = prefix == 0
        bad = (empty & (last != -1)) | (~empty & ((last < ps) | (last >= self.pool.size + ps)))
        if bool(bad.any()):
            raise KVSlotError(
                f"last_loc must be -1 for an empty prefix and a valid full slot otherwise; "
                f"got last_loc={_first(last[bad])} for prefix_lens={_first(prefix[bad])}"
            )
        held = ~empty
        pages = last[held] // ps
        bad = last[held][~self._full.used[pages] | (last[held] % ps != (prefix[held] - 1) % ps)]
        if bad.numel():
            raise KVSlotError(
                f"last_loc {_first(bad)} are not allocated or not at the page offset of their position prefix_lens - 1"
            )
        fills = held & (prefix % ps != 0) & (seq > prefix)  # new tokens go into last_loc's page
        if not bool(fills.any()):  # every request starts a new page (always with page_size 1)
            return
        filled = last[fills]
        pages = filled // ps
        bad = filled[self.full_to_swa_page[pages] == 0]
        if bad.numel():
            raise KVSlotError(f"the pages of last_loc {_first(bad)} lost their SWA page; they cannot take new tokens")
        frontier = pages * ps + self.page_fill[pages] - 1  # the last handed-out slot of each page
        bad = filled != frontier
        if bool(bad.any()):
            raise KVSlotError(
                f"last_loc {_first(filled[bad])} is not the last handed-out slot of its page "
                f"(that is {_first(frontier[bad])}): a continuation must start from the request's own "
                "last slot, and never hands out a slot twice"
            )
        unique_pages, counts = torch.unique(pages, return_counts=True)
        if bool((counts > 1).any()):
            shared = filled[torch.isin(pages, unique_pages[counts > 1])]
            raise KVSlotError(
                f"last_loc {_first(shared)}: several requests continue the same page in one call; "
                "a partial page belongs to one request"
            )
