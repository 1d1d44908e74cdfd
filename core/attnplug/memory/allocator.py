"""Slot allocation for the hybrid KV cache: every new token gets a full slot and an SWA slot;
SWA slots are freed early once no future query's window can reach them.

The bookkeeping lives on the HOST, as CPU tensors at page granularity (a page is
``page_size`` consecutive slots; with ``page_size == 1`` pages are slots). Full pages are
``1..size/page_size``, SWA pages ``1..size_swa/page_size``; page 0 of both pools is
reserved. Allocation runs in the scheduler between steps, never inside graph replay, so
the few host <-> device copies here (index transfers, the device ``req_to_token`` rows read
by eviction, device tensors given to ``free``) are allowed.

The device mapping ``pool.full_to_swa_index_mapping`` (token granularity) is kept equal to
the host page mapping by scatter writes on every alloc and free:
``mapping[fp * page_size + i] = sp * page_size + i`` for every slot ``i`` of a full page
``fp`` mapped to SWA page ``sp``, and 0 elsewhere.

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
  holds: every position in ``[frontier, seq_len)`` of the row must hold a live full slot
  (the engine writes a request's slots into its row right after allocating them and zeroes
  or rewrites the positions it drops, as ``ReqToTokenPool.free`` does for a whole row).
* **Slots.** ``-1`` ("no slot"), slot 0 / page 0 (the sink), values past the pool, bools and
  floats are refused wherever a slot is expected.

A refused call raises ``KVSlotError`` (or ``OutOfKVSlots``) before changing anything: free
lists, used flags, page maps, page fill, the device mapping and the request table are left
exactly as they were.
"""

from __future__ import annotations

import torch

from ..env import validation_enabled
from .args import HostInts, host_int
from .args import first as _first
from .args import host_ints as _host_int64
from .errors import InvariantViolation, KVSlotError, OutOfKVSlots
from .req_to_token import ReqToTokenPool
from .swa_pool import SWAKVPool

__all__ = ["SWATokenAllocator"]


class _PagePool:
    """Free list and used flags of one pool's pages (host).

    * ``free``: ``[num_free]`` int64 CPU, free page ids; taken from the front, returned at
      the back (initially ``1..num_pages``, so the lowest ids go first).
    * ``used``: ``[num_pages + 1]`` bool CPU; ``used[0]`` stays False (page 0 is reserved).
    """

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self.free = torch.arange(1, num_pages + 1, dtype=torch.int64)
        self.used = torch.zeros(num_pages + 1, dtype=torch.bool)

    def take(self, k: int) -> torch.Tensor:
        """Mark the first ``k`` free pages used and return them (``[k]`` int64 CPU); the
        caller checked that ``k <= len(free)``."""
        pages, self.free = self.free[:k], self.free[k:]
        self.used[pages] = True
        return pages

    def give_back(self, pages: torch.Tensor) -> None:
        """Return used, distinct ``pages`` (``[k]`` int64 CPU) to the free list."""
        self.used[pages] = False
        self.free = torch.cat([self.free, pages])


class SWATokenAllocator:
    """Allocates full + SWA slots of an ``SWAKVPool`` (see module docstring).

    Host state (CPU tensors, page granularity; ``N = size / page_size``,
    ``M = size_swa / page_size``):

    * the full and SWA free lists and used flags (``_PagePool``);
    * ``full_to_swa_page``: ``[N + 1]`` int64, SWA page of each full page (0 = none);
    * ``swa_to_full_page``: ``[M + 1]`` int64, its reverse (0 = SWA page free);
    * ``page_fill``: ``[N + 1]`` int64, leading slots of each full page handed out
      (0 for a free page, ``page_size`` for a page from ``alloc(n)``).

    Device state: ``pool.full_to_swa_index_mapping`` (owned by the pool, written here).
    Slots returned by the ``alloc*`` methods are int64 tensors on the pool's device.
    """

    def __init__(self, pool: SWAKVPool) -> None:
        if not isinstance(pool, SWAKVPool):
            raise TypeError(f"pool must be an SWAKVPool, got {type(pool).__name__}")
        self.pool = pool
        self.page_size = pool.page_size
        self.device = pool.device
        self._full = _PagePool(pool.size // pool.page_size)
        self._swa = _PagePool(pool.size_swa // pool.page_size)
        self.full_to_swa_page = torch.zeros(self._full.num_pages + 1, dtype=torch.int64)
        self.swa_to_full_page = torch.zeros(self._swa.num_pages + 1, dtype=torch.int64)
        self.page_fill = torch.zeros(self._full.num_pages + 1, dtype=torch.int64)
        self._page_offsets = torch.arange(self.page_size, dtype=torch.int64)

    # ------------------------------------------------------------------ sizes
    def full_available_size(self) -> int:
        """Free slots of the full pool (host int, tokens)."""
        return self._full.free.numel() * self.page_size

    def swa_available_size(self) -> int:
        """Free slots of the SWA pool (host int, tokens)."""
        return self._swa.free.numel() * self.page_size

    def available_size(self) -> int:
        """Tokens that can be allocated now: the smaller of the two pools' free slots."""
        return min(self.full_available_size(), self.swa_available_size())

    # ------------------------------------------------------------------ allocation
    def alloc(self, n: int) -> torch.Tensor:
        """``n`` new full slots, each with a live SWA slot: ``[n]`` int64, device.

        With ``page_size > 1``, ``n`` must be a multiple of ``page_size`` (whole pages;
        use ``alloc_extend`` / ``alloc_decode`` to continue a request's last page).
        All-or-nothing: raises ``OutOfKVSlots`` with both pools' free counts, changing
        nothing, when either pool is short.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 0 or n % self.page_size:
            raise KVSlotError(
                f"alloc(n) needs an int n >= 0 that is a multiple of page_size={self.page_size}, got {n!r}"
            )
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
        (floats, bools), or slots whose page is not allocated (double free)."""
        pages, slots = self._full_pages_of(full_locs, "free")
        idle = ~self._full.used[pages]
        if bool(idle.any()):
            raise KVSlotError(
                f"free: full slots {_first(self._slots_in(slots, pages[idle]))} are not allocated "
                "(double free or never allocated)"
            )
        swa_pages = self.full_to_swa_page[pages]
        self._unmap(pages[swa_pages != 0])
        self._full.give_back(pages)
        self.page_fill[pages] = 0

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
        pages, slots = self._full_pages_of(full_locs, "rollback")
        idle = ~self._full.used[pages]
        if bool(idle.any()):
            raise KVSlotError(
                f"rollback: full slots {_first(self._slots_in(slots, pages[idle]))} are not allocated "
                "(double free or never allocated)"
            )
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
            swa_pages = self.full_to_swa_page[emptied]
            self._unmap(emptied[swa_pages != 0])
            self._full.give_back(emptied)
            self.page_fill[emptied] = 0

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
        live = (held_all >= ps) & (held_all < self.pool.size + ps)
        live[live.clone()] = self._full.used[held_all[live] // ps]
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
        ps = self.page_size
        live = (held >= ps) & (held < self.pool.size + ps)
        live[live.clone()] = self._full.used[held[live] // ps]
        if not bool(live.all()):
            length = frontier + int((~live).to(torch.int8).argmax())
            raise KVSlotError(
                f"evict_out_of_window: seq_len={seq_len} is beyond what row {req_row} holds: it holds "
                f"{length} positions (req_to_token[{req_row}, {length}] = {int(held[length - frontier])} "
                "is not a live full slot); evicting for it would free SWA slots the request still needs"
            )

    # ------------------------------------------------------------------ checking
    def check_invariants(self) -> None:
        """Raise ``InvariantViolation`` naming the first broken rule of the bookkeeping.
        Copies the device mapping to the host: a debugging check, not for the hot path."""
        for name, pool in (("full", self._full), ("SWA", self._swa)):
            free = pool.free
            if bool(pool.used[0]) or bool((free == 0).any()):
                raise InvariantViolation(f"{name} page 0 (the padding sink) was handed out or is in the free list")
            if bool(((free < 1) | (free > pool.num_pages)).any()):
                raise InvariantViolation(f"{name} free list holds out-of-range pages {_first(free)}")
            if torch.unique(free).numel() != free.numel():
                raise InvariantViolation(f"{name} free list holds a page twice: {_first(free)}")
            both = free[pool.used[free]]
            if both.numel():
                raise InvariantViolation(f"{name} pages {_first(both)} are both free and used")
            used = int(pool.used.sum())
            if free.numel() + used != pool.num_pages:
                raise InvariantViolation(f"{name} pool: {free.numel()} free + {used} used pages != {pool.num_pages}")

        fill, used = self.page_fill, self._full.used
        wrong = torch.nonzero(torch.where(used, (fill < 1) | (fill > self.page_size), fill != 0)).flatten()
        if wrong.numel():
            raise InvariantViolation(
                f"full pages {_first(wrong)} have page_fill {_first(fill[wrong])}: a used page "
                f"has 1..{self.page_size} slots handed out, a free page 0"
            )
        f2s, s2f = self.full_to_swa_page, self.swa_to_full_page
        if int(f2s[0]) or int(s2f[0]):
            raise InvariantViolation("page 0 is part of the full -> SWA page mapping")
        mapped = torch.nonzero(f2s).flatten()  # full pages with an SWA page
        bad = mapped[~self._full.used[mapped]]
        if bad.numel():
            raise InvariantViolation(f"free full pages {_first(bad)} are mapped to SWA pages {_first(f2s[bad])}")
        targets = f2s[mapped]
        if torch.unique(targets).numel() != targets.numel():
            raise InvariantViolation(f"two full pages map to one SWA page: {_first(targets)}")
        bad = mapped[s2f[targets] != mapped]
        if bad.numel():
            raise InvariantViolation(
                f"full pages {_first(bad)} map to SWA pages {_first(f2s[bad])} that are not owned by them"
            )
        if not torch.equal(self._swa.used, s2f != 0):
            wrong = torch.nonzero(self._swa.used != (s2f != 0)).flatten()
            raise InvariantViolation(
                f"SWA pages {_first(wrong)}: used flag disagrees with ownership (used but unmapped, or mapped but free)"
            )
        owners = torch.nonzero(s2f).flatten()
        bad = owners[f2s[s2f[owners]] != owners]
        if bad.numel():
            raise InvariantViolation(f"SWA pages {_first(bad)} are owned by full pages that do not map to them")

        device_map = self.pool.full_to_swa_index_mapping.to("cpu", torch.int64)
        if int(device_map[-1]) != -1:
            raise InvariantViolation(f"full_to_swa_index_mapping[-1] is {int(device_map[-1])}, must be -1")
        expected = torch.zeros_like(device_map)
        expected[-1] = -1
        expected[self._page_slots(mapped)] = self._page_slots(targets)
        if not torch.equal(device_map, expected):
            diff = torch.nonzero(device_map != expected).flatten()
            raise InvariantViolation(
                f"device full_to_swa_index_mapping differs from the host state at full slots "
                f"{_first(diff)}: device {_first(device_map[diff])}, "
                f"host {_first(expected[diff])}"
            )

    # ------------------------------------------------------------------ internals
    def _page_slots(self, pages: torch.Tensor) -> torch.Tensor:
        """Every slot of ``pages`` (``[k]`` int64 CPU) in page order: ``[k * page_size]``."""
        return (pages[:, None] * self.page_size + self._page_offsets).reshape(-1)

    def _take_pages(self, k: int, fill: int = -1) -> torch.Tensor:
        """Take ``k`` full pages, give each an SWA page, write the device mapping, set their
        ``page_fill`` to ``fill`` (default: whole pages); returns the full pages (``[k]`` int64
        CPU). Raises ``OutOfKVSlots`` before taking anything."""
        if k > self._full.free.numel() or k > self._swa.free.numel():
            raise OutOfKVSlots(k * self.page_size, self.full_available_size(), self.swa_available_size())
        full, swa = self._full.take(k), self._swa.take(k)
        self.page_fill[full] = self.page_size if fill < 0 else fill
        self.full_to_swa_page[full] = swa
        self.swa_to_full_page[swa] = full
        self._write_mapping(self._page_slots(full), self._page_slots(swa))
        return full

    def _unmap(self, pages: torch.Tensor) -> None:
        """Free the SWA pages of the mapped full ``pages`` (``[k]`` int64 CPU, distinct) and
        zero the mapping of every slot of those full pages."""
        swa = self.full_to_swa_page[pages]
        self.full_to_swa_page[pages] = 0
        self.swa_to_full_page[swa] = 0
        self._swa.give_back(swa)
        slots = self._page_slots(pages)
        self._write_mapping(slots, torch.zeros_like(slots))

    def _write_mapping(self, full_slots: torch.Tensor, swa_slots: torch.Tensor) -> None:
        """Scatter ``mapping[full_slots] = swa_slots`` on the device (one host -> device copy,
        from pinned memory off the host: asynchronous, so the host never waits for the work
        queued on the device, e.g. a step in flight)."""
        if full_slots.numel() == 0:
            return
        both = torch.stack([full_slots, swa_slots])
        if self.device.type != "cpu":
            both = both.pin_memory().to(self.device, non_blocking=True)
        self.pool.full_to_swa_index_mapping.index_copy_(0, both[0], both[1].to(torch.int32))

    def _full_pages_of(self, full_locs: HostInts, what: str):
        """Validate full slots and return ``(pages, slots)``: the distinct full pages they
        lie in (``[k]`` int64 CPU, sorted) and the slots themselves (flat int64 CPU)."""
        slots = _host_int64(full_locs, f"{what}: full_locs")
        ps = self.page_size
        out = slots[(slots < ps) | (slots >= self.pool.size + ps)]
        if out.numel():
            raise KVSlotError(
                f"{what}: full_locs {_first(out)} are outside [{ps}, {self.pool.size + ps}) "
                "(-1 is 'no slot' and slot 0 / page 0 the padding sink: neither is ever handed out)"
            )
        unique_slots, counts = torch.unique(slots, return_counts=True)
        if bool((counts > 1).any()):
            raise KVSlotError(f"{what}: full slots {_first(unique_slots[counts > 1])} are given more than once")
        return torch.unique(slots // ps), slots

    def _slots_in(self, slots: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
        """The entries of ``slots`` that lie in ``pages`` (both int64 CPU), for messages."""
        return slots[torch.isin(slots // self.page_size, pages)]

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
