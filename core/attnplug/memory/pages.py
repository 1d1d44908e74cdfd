"""The allocator's page bookkeeping: which pages of each pool are free, which SWA page each full
page holds, how many slots of each full page were handed out, and the device mapping kept equal
to it (``PageTable``, the base of ``SWATokenAllocator``).

The bookkeeping lives on the HOST, as CPU tensors at page granularity (a page is
``page_size`` consecutive slots; with ``page_size == 1`` pages are slots). Full pages are
``1..size/page_size``, SWA pages ``1..size_swa/page_size``; page 0 of both pools is
reserved.

The device mapping ``pool.full_to_swa_index_mapping`` (token granularity) is kept equal to
the host page mapping by scatter writes on every alloc and free:
``mapping[fp * page_size + i] = sp * page_size + i`` for every slot ``i`` of a full page
``fp`` mapped to SWA page ``sp``, and 0 elsewhere. ``check_invariants`` checks all of it.
"""

from __future__ import annotations

import torch

from .args import HostInts
from .args import first as _first
from .args import host_ints as _host_int64
from .errors import InvariantViolation, KVSlotError, OutOfKVSlots
from .swa_pool import SWAKVPool

__all__ = ["PageTable"]


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


class PageTable:
    """The host page state of an ``SWAKVPool`` and the device mapping (see module docstring).

    Host state (CPU tensors, page granularity; ``N = size / page_size``,
    ``M = size_swa / page_size``):

    * the full and SWA free lists and used flags (``_PagePool``);
    * ``full_to_swa_page``: ``[N + 1]`` int64, SWA page of each full page (0 = none);
    * ``swa_to_full_page``: ``[M + 1]`` int64, its reverse (0 = SWA page free);
    * ``page_fill``: ``[N + 1]`` int64, leading slots of each full page handed out
      (0 for a free page, ``page_size`` for a page from ``alloc(n)``).

    Device state: ``pool.full_to_swa_index_mapping`` (owned by the pool, written here).
    """

    def __init__(self, pool: SWAKVPool) -> None:
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

    def _allocated_pages_of(self, full_locs: HostInts, what: str):
        """``_full_pages_of``, and every page must be allocated (else ``KVSlotError`` naming
        the slots: a double free, or slots never handed out)."""
        pages, slots = self._full_pages_of(full_locs, what)
        idle = ~self._full.used[pages]
        if bool(idle.any()):
            raise KVSlotError(
                f"{what}: full slots {_first(self._slots_in(slots, pages[idle]))} are not allocated "
                "(double free or never allocated)"
            )
        return pages, slots

    def _release_full_pages(self, pages: torch.Tensor) -> None:
        """Free the allocated full ``pages`` (``[k]`` int64 CPU, distinct) with their SWA pages
        where they still have one."""
        swa_pages = self.full_to_swa_page[pages]
        self._unmap(pages[swa_pages != 0])
        self._full.give_back(pages)
        self.page_fill[pages] = 0

    def _live_full(self, slots: torch.Tensor) -> torch.Tensor:
        """Bool mask of the entries of ``slots`` (int64 CPU, any shape) that are allocated full
        slots (in the pool's range, on a used page)."""
        ps = self.page_size
        live = (slots >= ps) & (slots < self.pool.size + ps)
        live[live.clone()] = self._full.used[slots[live] // ps]
        return live

    def _slots_in(self, slots: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
        """The entries of ``slots`` that lie in ``pages`` (both int64 CPU), for messages."""
        return slots[torch.isin(slots // self.page_size, pages)]
