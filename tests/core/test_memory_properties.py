"""Random alloc / extend / decode / evict / finish / bad-free sequences against a model of
what every live request must hold, for page_size 1 and 4. After every operation the
allocator's invariants hold and its free counts equal the model's; at the end, once every
request is finished, both pools are whole again."""

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from attnplug.memory import KVSlotError, OutOfKVSlots, ReqToTokenPool, SWAKVPool, SWATokenAllocator

SIZE, SIZE_SWA, MAX_REQS, MAX_LEN, WINDOW = 96, 48, 6, 48, 5


class AllocatorMachine(RuleBasedStateMachine):
    page_size = 1

    def __init__(self):
        super().__init__()
        ps = self.page_size
        self.pool = SWAKVPool(SIZE, SIZE_SWA, 2, [1], 1, 4, torch.float32, torch.device("cpu"), page_size=ps)
        self.alloc = SWATokenAllocator(self.pool)
        self.rows = ReqToTokenPool(MAX_REQS, MAX_LEN, torch.device("cpu"))
        self.seq = {}  # row -> seq_len of each live request
        self.finished = []  # full slots of finished requests (freeing them again must fail)

    # ------------------------------------------------------------------ model
    def pages(self, n):
        return -(-n // self.page_size)

    def extend(self, rows, new):
        """Allocate ``new[i]`` tokens for ``rows[i]``; on OutOfKVSlots check that the model
        agrees the pools were short and that nothing changed."""
        ps = self.page_size
        prefix = [self.seq[r] for r in rows]
        seq = [p + n for p, n in zip(prefix, new)]
        last = [int(self.rows.req_to_token[r, p - 1]) if p else -1 for r, p in zip(rows, prefix)]
        need = sum(self.pages(s) - self.pages(p) for p, s in zip(prefix, seq))
        before = (self.alloc.full_available_size(), self.alloc.swa_available_size())
        try:
            if all(n == 1 for n in new) and all(prefix):
                out = self.alloc.alloc_decode(seq, last)
            elif ps == 1 and prefix == [0] * len(rows):
                out = self.alloc.alloc(sum(new))
            else:
                out = self.alloc.alloc_extend(prefix, seq, last)
        except OutOfKVSlots as err:
            assert need * ps > min(before), f"OutOfKVSlots although {need} pages fit: {err}"
            assert (err.full_available, err.swa_available) == before
            assert (self.alloc.full_available_size(), self.alloc.swa_available_size()) == before
            return False
        assert need * ps <= min(before)
        assert out.numel() == sum(new)
        offset = 0
        for r, p, n in zip(rows, prefix, new):
            self.rows.req_to_token[r, p : p + n] = out[offset : offset + n].to(torch.int32)
            self.seq[r] = p + n
            offset += n
        return True

    # ------------------------------------------------------------------ rules
    @precondition(lambda self: self.rows.available_size() > 0)
    @rule(n=st.integers(1, 20))
    def new_request(self, n):
        row = self.rows.alloc()
        self.seq[row] = 0
        if not self.extend([row], [n]):
            del self.seq[row]
            self.rows.free(row)

    @precondition(lambda self: self.seq)
    @rule(data=st.data())
    def extend_some(self, data):
        rows = [
            r
            for r in data.draw(st.lists(st.sampled_from(sorted(self.seq)), min_size=1, unique=True))
            if self.seq[r] < MAX_LEN
        ]
        new = [data.draw(st.integers(1, min(9, MAX_LEN - self.seq[r]))) for r in rows]
        if rows:
            self.extend(rows, new)

    @precondition(lambda self: self.seq)
    @rule(data=st.data())
    def decode(self, data):
        rows = [
            r
            for r in data.draw(st.lists(st.sampled_from(sorted(self.seq)), min_size=1, unique=True))
            if 0 < self.seq[r] < MAX_LEN
        ]
        if rows:
            self.extend(rows, [1] * len(rows))

    @precondition(lambda self: self.seq)
    @rule(data=st.data())
    def evict(self, data):
        row = data.draw(st.sampled_from(sorted(self.seq)))
        frontier = self.rows.swa_evicted_len(row)
        swa_before = self.alloc.swa_available_size()
        seq, ps = self.seq[row], self.page_size
        freed = self.alloc.evict_out_of_window(self.rows, row, seq, WINDOW)
        assert self.rows.swa_evicted_len(row) == max(frontier, max(0, seq - WINDOW + 1) // ps * ps)
        assert freed == self.rows.swa_evicted_len(row) - frontier
        assert self.alloc.swa_available_size() - swa_before == freed
        swa = self.pool.translate_loc_from_full_to_swa(self.rows.req_to_token[row, :seq])
        assert int((swa != 0).sum()) <= WINDOW + ps

    @precondition(lambda self: self.seq)
    @rule(data=st.data())
    def finish(self, data):
        row = data.draw(st.sampled_from(sorted(self.seq)))
        locs = self.rows.req_to_token[row, : self.seq.pop(row)].to(torch.int64)
        self.alloc.free(locs)
        self.rows.free(row)
        if locs.numel():
            self.finished.append(locs)

    @precondition(lambda self: self.finished)
    @rule(data=st.data(), swa_only=st.booleans())
    def double_free(self, data, swa_only):
        locs = data.draw(st.sampled_from(self.finished))
        if bool(torch.isin(locs // self.page_size, self.live_slots() // self.page_size).any()):
            return  # the page was handed out again: freeing it would be legitimate
        before = (self.alloc.full_available_size(), self.alloc.swa_available_size())
        with pytest.raises(KVSlotError):
            (self.alloc.free_swa if swa_only else self.alloc.free)(locs)
        assert (self.alloc.full_available_size(), self.alloc.swa_available_size()) == before

    # ------------------------------------------------------------------ invariants
    @invariant()
    def bookkeeping_matches_model(self):
        ps = self.page_size
        self.alloc.check_invariants()
        full_pages = sum(self.pages(s) for s in self.seq.values())
        swa_pages = sum(self.pages(s) - self.rows.swa_evicted_len(r) // ps for r, s in self.seq.items())
        assert self.alloc.full_available_size() == SIZE - full_pages * ps
        assert self.alloc.swa_available_size() == SIZE_SWA - swa_pages * ps
        for row, s in self.seq.items():
            slots = self.rows.req_to_token[row, :s].long()
            assert bool((slots % ps == torch.arange(s) % ps).all()), "a position is off its page offset"
            swa = self.pool.translate_loc_from_full_to_swa(slots)
            frontier = self.rows.swa_evicted_len(row)
            assert not swa[:frontier].any(), "an evicted position still maps to an SWA slot"
            assert bool((swa[frontier:] > 0).all()), "a live position lost its SWA slot"
        live = self.live_slots()
        assert torch.unique(live).numel() == live.numel(), "two positions share a full slot"

    def live_slots(self):
        """Full slots of every live position, ``[n]`` int64."""
        rows = [self.rows.req_to_token[r, :s].long() for r, s in self.seq.items()]
        return torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64)

    def teardown(self):
        for row in list(self.seq):
            self.alloc.free(self.rows.req_to_token[row, : self.seq.pop(row)])
            self.rows.free(row)
        self.alloc.check_invariants()
        assert (self.alloc.full_available_size(), self.alloc.swa_available_size()) == (SIZE, SIZE_SWA)
        assert self.rows.available_size() == MAX_REQS - 1


class PagedAllocatorMachine(AllocatorMachine):
    page_size = 4


FAST = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestAllocatorPageSize1 = AllocatorMachine.TestCase
TestAllocatorPageSize1.settings = FAST
TestAllocatorPageSize4 = PagedAllocatorMachine.TestCase
TestAllocatorPageSize4.settings = FAST
