"""SWATokenAllocator: all-or-nothing allocation, paged continuation, freeing, eviction and
the invariant checker."""

import pytest
import torch

from attnplug.memory import (
    InvariantViolation,
    KVSlotError,
    OutOfKVSlots,
    ReqToTokenPool,
    SWAKVPool,
    SWATokenAllocator,
)

CPU = torch.device("cpu")


def make(page_size=1, size=64, size_swa=32):
    pool = SWAKVPool(size, size_swa, 2, [0], 2, 8, torch.float32, CPU, page_size=page_size)
    return pool, SWATokenAllocator(pool)


def snapshot(alloc):
    """Everything an all-or-nothing failure must leave unchanged."""
    return (
        alloc.full_available_size(),
        alloc.swa_available_size(),
        alloc.pool.full_to_swa_index_mapping.clone(),
        alloc.full_to_swa_page.clone(),
        alloc.swa_to_full_page.clone(),
    )


def assert_unchanged(alloc, before):
    after = snapshot(alloc)
    assert after[:2] == before[:2]
    assert all(torch.equal(a, b) for a, b in zip(after[2:], before[2:]))
    alloc.check_invariants()


def translate(pool, slots):
    return pool.translate_loc_from_full_to_swa(torch.as_tensor(slots, dtype=torch.int64)).tolist()


# ---------------------------------------------------------------------- alloc
@pytest.mark.parametrize("page_size", [1, 4])
def test_alloc_hands_out_lowest_pages_first_with_swa_slots(page_size):
    pool, alloc = make(page_size)
    loc = alloc.alloc(2 * page_size)
    assert loc.dtype == torch.int64 and loc.device == CPU
    assert loc.tolist() == list(range(page_size, 3 * page_size))
    assert translate(pool, loc) == list(range(page_size, 3 * page_size))
    assert alloc.full_available_size() == 64 - 2 * page_size
    assert alloc.swa_available_size() == 32 - 2 * page_size
    assert alloc.available_size() == 32 - 2 * page_size
    alloc.check_invariants()


def test_paged_alloc_needs_whole_pages():
    _, alloc = make(4)
    with pytest.raises(KVSlotError, match="multiple of page_size=4"):
        alloc.alloc(6)


@pytest.mark.parametrize("page_size", [1, 4])
def test_alloc_is_all_or_nothing_when_swa_pool_is_short(page_size):
    _, alloc = make(page_size, size=64, size_swa=16)
    alloc.alloc(8)
    before = snapshot(alloc)
    with pytest.raises(OutOfKVSlots) as info:
        alloc.alloc(12)
    err = info.value
    assert (err.requested, err.full_available, err.swa_available) == (12, 56, 8)
    assert str(err) == "need 12 tokens: full pool has 56 free, SWA pool has 8 free"
    assert_unchanged(alloc, before)
    assert alloc.alloc(8).numel() == 8  # exactly what is left still fits


def test_alloc_is_all_or_nothing_when_full_pool_is_short():
    _, alloc = make(1, size=16, size_swa=32)
    alloc.alloc(10)
    before = snapshot(alloc)
    with pytest.raises(OutOfKVSlots, match="need 7 tokens: full pool has 6 free, SWA pool has 22 free"):
        alloc.alloc(7)
    assert_unchanged(alloc, before)


def test_alloc_extend_is_all_or_nothing_across_requests():
    _, alloc = make(4, size=64, size_swa=16)
    first = alloc.alloc_extend([0], [6], [-1])  # 2 pages: SWA has 2 pages left
    before = snapshot(alloc)
    # request 0 continues its page (no new page) and needs 1 more; request 1 needs 2: 3 > 2
    with pytest.raises(OutOfKVSlots) as info:
        alloc.alloc_extend([6, 0], [10, 5], [int(first[-1]), -1])
    assert (info.value.requested, info.value.swa_available) == (12, 8)
    assert_unchanged(alloc, before)


# ---------------------------------------------------------------------- paged continuation
def test_alloc_extend_and_decode_continue_the_last_page():
    ps = 4
    pool, alloc = make(ps)
    a = alloc.alloc_extend([0], [6], [-1])  # request A, positions 0..5: pages 1, 2
    assert a.tolist() == [4, 5, 6, 7, 8, 9]
    b = alloc.alloc_extend([0], [3], [-1])  # request B, positions 0..2: page 3
    assert b.tolist() == [12, 13, 14]
    # one batch: A positions 6..10 fill page 2 then take page 4; B position 3 fills page 3
    out = alloc.alloc_extend([6, 3], [11, 4], [int(a[-1]), int(b[-1])])
    assert out.tolist() == [10, 11, 16, 17, 18, 15]
    a_slots = a.tolist() + out[:5].tolist()
    assert all(slot % ps == pos % ps for pos, slot in enumerate(a_slots))  # positions aligned
    # decode: A position 11 -> slot 19 (same page); B position 4 -> a new page (5)
    dec = alloc.alloc_decode([12, 5], [18, 15])
    assert dec.tolist() == [19, 20]
    # every new token has its own SWA slot at the same page offset
    swa = translate(pool, a_slots + [19])
    assert 0 not in swa and len(set(swa)) == len(swa)
    assert all(s % ps == f % ps for s, f in zip(swa, a_slots + [19]))
    assert alloc.full_available_size() == 64 - 5 * ps and alloc.swa_available_size() == 32 - 5 * ps
    alloc.check_invariants()


def test_alloc_extend_and_decode_with_page_size_one():
    pool, alloc = make(1)
    first = alloc.alloc_extend([0, 0], [3, 2], [-1, -1])
    assert first.tolist() == [1, 2, 3, 4, 5]
    assert alloc.alloc_decode([4, 3], [3, 5]).tolist() == [6, 7]
    assert translate(pool, range(1, 8)) == list(range(1, 8))
    alloc.check_invariants()


@pytest.mark.parametrize(
    "prefix, seq, last, needle",
    [
        ([2], [5], [-1], "last_loc must be -1 for an empty prefix"),
        ([0], [5], [4], "last_loc must be -1 for an empty prefix"),
        ([2], [5], [4], "page offset"),  # position 1 lives at offset 1, slot 4 has offset 0
        ([2], [5], [9], "not allocated"),  # page 2 belongs to nobody
        ([3], [2], [6], "prefix_lens <= seq_lens"),
    ],
)
def test_alloc_extend_rejects_bad_arguments(prefix, seq, last, needle):
    _, alloc = make(4)
    alloc.alloc(4)  # page 1 = slots 4..7
    before = snapshot(alloc)
    with pytest.raises(KVSlotError) as info:
        alloc.alloc_extend(prefix, seq, last)
    assert needle in str(info.value)
    assert_unchanged(alloc, before)


def test_alloc_extend_refuses_a_page_without_swa_page():
    _, alloc = make(4)
    loc = alloc.alloc_extend([0], [2], [-1])
    alloc.free_swa(loc)
    with pytest.raises(KVSlotError, match="lost their SWA page"):
        alloc.alloc_extend([2], [3], [int(loc[-1])])


# ---------------------------------------------------------------------- freeing
@pytest.mark.parametrize("page_size", [1, 4])
def test_free_everything_returns_all_counts(page_size):
    pool, alloc = make(page_size)
    a = alloc.alloc(4 * page_size)
    b = alloc.alloc(2 * page_size)
    alloc.free_swa(a[:page_size])
    alloc.free(torch.cat([b, a]))
    assert (alloc.full_available_size(), alloc.swa_available_size()) == (64, 32)
    assert not pool.full_to_swa_index_mapping[:-1].any()
    alloc.check_invariants()
    assert alloc.alloc(32).numel() == 32  # everything can be handed out again


@pytest.mark.parametrize(
    "locs, needle",
    [
        ([3, 5], "not allocated"),  # 3 was freed below: double free
        ([12], "not allocated"),  # never allocated
        ([0], "outside [1, 65)"),
        ([65], "outside [1, 65)"),
        ([4, 4], "more than once"),
    ],
)
def test_bad_free_raises_and_changes_nothing(locs, needle):
    _, alloc = make(1)
    alloc.alloc(8)
    alloc.free([3])
    before = snapshot(alloc)
    with pytest.raises(KVSlotError) as info:
        alloc.free(torch.tensor(locs))
    assert needle in str(info.value)
    assert str(locs[0]) in str(info.value)  # names the offending slots
    assert_unchanged(alloc, before)


def test_paged_free_releases_each_page_once():
    _, alloc = make(4)
    loc = alloc.alloc(8)  # pages 1, 2
    alloc.free(loc.tolist()[::-1])  # every slot of both pages, in any order: each page once
    assert (alloc.full_available_size(), alloc.swa_available_size()) == (64, 32)
    alloc.check_invariants()
    with pytest.raises(KVSlotError, match="not allocated"):
        alloc.free(loc[:1])


def test_paged_free_never_releases_a_slot_still_held():
    """Trust II: freeing two slots of a page gave the whole page back while its other slots
    were still held (the next request overwrote them; the later free said "double free")."""
    _, alloc = make(4)
    alloc.alloc(8)  # pages 1, 2: slots 4..11
    before = snapshot(alloc)
    with pytest.raises(KVSlotError, match=r"page 1, whose slots \[4, 7\] are still handed out"):
        alloc.free([5, 6, 8, 9, 10, 11])
    assert_unchanged(alloc, before)
    alloc.free([4, 5, 6, 7])
    assert alloc.full_available_size() == 64 - 4
    alloc.check_invariants()


def test_paged_free_swa_releases_whole_pages_once():
    pool, alloc = make(4)
    loc = alloc.alloc(12)  # full pages 1..3 = slots 4..15
    mapping = pool.full_to_swa_index_mapping
    alloc.free_swa(torch.tensor([5, 6]))  # two slots of page 1: the whole SWA page, once
    assert alloc.swa_available_size() == 32 - 8 and alloc.full_available_size() == 64 - 12
    assert not mapping[4:8].any()  # EVERY full slot of the page, not just 5 and 6
    assert mapping[8:16].tolist() == list(range(8, 16))
    alloc.check_invariants()
    before = snapshot(alloc)
    with pytest.raises(KVSlotError, match=r"\[4\]"):
        alloc.free_swa([4, 8])  # 4 lost its SWA slot already; 8 must stay mapped
    assert_unchanged(alloc, before)
    alloc.free(loc)  # frees full pages 1..3 and the SWA pages of 2..3 only
    assert (alloc.full_available_size(), alloc.swa_available_size()) == (64, 32)
    alloc.check_invariants()


def test_free_accepts_int32_tensors_of_any_shape():
    _, alloc = make(1)
    loc = alloc.alloc(6)
    alloc.free(loc.to(torch.int32).view(2, 3))
    assert alloc.full_available_size() == 64
    with pytest.raises(KVSlotError, match="integers"):
        alloc.free(torch.tensor([1.0]))


# ---------------------------------------------------------------------- eviction
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("window", [1, 5, 8])
def test_eviction_keeps_reachable_positions_and_bounds_swa_slots(page_size, window):
    pool, alloc = make(page_size, size=64, size_swa=32)
    rows = ReqToTokenPool(4, 64, CPU)
    row = rows.alloc()
    table = rows.req_to_token[row]
    seq = 0
    for new in [7] + [1] * 30 + [3, 3]:
        prev = int(table[seq - 1]) if seq else -1
        table[seq : seq + new] = alloc.alloc_extend([seq], [seq + new], [prev]).to(torch.int32)
        seq += new
        swa_before = alloc.swa_available_size()
        freed = alloc.evict_out_of_window(rows, row, seq, window)
        assert alloc.swa_available_size() - swa_before == freed
        frontier = rows.swa_evicted_len(row)
        assert frontier % page_size == 0 and frontier <= max(0, seq - window + 1)
        swa = pool.translate_loc_from_full_to_swa(table[:seq])
        reachable = max(0, seq - window + 1)
        assert bool((swa[reachable:] != 0).all()), "a position a future query can reach lost its SWA slot"
        assert not swa[:frontier].any()
        assert int((swa != 0).sum()) <= window + page_size
        alloc.check_invariants()
    assert alloc.evict_out_of_window(rows, row, seq, window) == 0  # idempotent
    alloc.free(table[:seq])
    rows.free(row)
    assert (alloc.full_available_size(), alloc.swa_available_size()) == (64, 32)


def test_eviction_is_a_noop_inside_the_window():
    _, alloc = make(1)
    rows = ReqToTokenPool(2, 16, CPU)
    row = rows.alloc()
    rows.req_to_token[row, :4] = alloc.alloc(4).to(torch.int32)
    assert alloc.evict_out_of_window(rows, row, 4, 5) == 0  # a query at 4 still sees 0..4
    assert alloc.evict_out_of_window(rows, row, 4, 2) == 3  # positions 0..2 are dead
    assert rows.swa_evicted_len(row) == 3 and alloc.swa_available_size() == 31
    with pytest.raises(KVSlotError, match="window"):
        alloc.evict_out_of_window(rows, row, 4, 0)


def _twin_rows(page_size, lengths, seed):
    """An allocator with requests of ``lengths`` positions written into their rows (a slot
    each), in a state built identically for every call with the same arguments."""
    pool, alloc = make(page_size, size=256, size_swa=128)
    rows = ReqToTokenPool(6, 96, CPU)
    gen = torch.Generator().manual_seed(seed)
    req = []
    for n in lengths:
        row = rows.alloc()
        done = 0
        while done < n:  # grow in random chunks, continuing each request's last page
            new = min(n - done, int(torch.randint(1, 6, (1,), generator=gen)))
            prev = int(rows.req_to_token[row, done - 1]) if done else -1
            rows.req_to_token[row, done : done + new] = alloc.alloc_extend([done], [done + new], [prev]).to(torch.int32)
            done += new
        req.append(row)
    return pool, alloc, rows, req


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("window", [1, 6, 40])
def test_evicting_many_rows_equals_evicting_them_one_by_one(page_size, window):
    lengths = [30, 5, 57, 12]
    _, one, rows_one, req = _twin_rows(page_size, lengths, seed=page_size * 100 + window)
    _, many, rows_many, _ = _twin_rows(page_size, lengths, seed=page_size * 100 + window)
    for seq in (lengths, [n + 1 for n in lengths]):  # the second round: rows hold one more position
        if seq is not lengths:
            for a, r in ((one, rows_one), (many, rows_many)):
                for row, n in zip(req, lengths):
                    prev = int(r.req_to_token[row, n - 1])
                    r.req_to_token[row, n] = int(a.alloc_decode([n + 1], [prev])[0])
        freed = sum(one.evict_out_of_window(rows_one, row, n, window) for row, n in zip(req, seq))
        assert many.evict_out_of_window_many(rows_many, req, seq, window) == freed
        assert [rows_many.swa_evicted_len(r) for r in req] == [rows_one.swa_evicted_len(r) for r in req]
        assert torch.equal(many.pool.full_to_swa_index_mapping, one.pool.full_to_swa_index_mapping)
        assert many.swa_available_size() == one.swa_available_size()
        many.check_invariants()
    assert many.evict_out_of_window_many(rows_many, [], [], window) == 0


@pytest.mark.parametrize(
    "case, needle",
    [
        ("row twice", "twice"),
        ("row not in use", "not in use"),
        ("beyond the row", "beyond what row"),
        ("lengths differ", "seq_lens"),
        ("bad window", "window"),
    ],
)
def test_bad_evict_many_raises_and_changes_nothing(case, needle):
    from memory_snapshot import assert_same
    from memory_snapshot import snapshot as full_snapshot

    _, alloc, rows, req = _twin_rows(1, [30, 20, 25], seed=3)
    seq, window = [30, 20, 25], 4
    if case == "row twice":
        req, seq = req + [req[0]], seq + [30]
    elif case == "row not in use":
        req, seq = req + [5], seq + [3]
    elif case == "beyond the row":
        seq = [30, 20, 26]  # row 3 holds 25 positions: the other rows must not be evicted either
    elif case == "lengths differ":
        seq = seq[:2]
    else:
        window = 0
    before = full_snapshot(alloc, alloc.pool, rows)
    with pytest.raises(KVSlotError, match=needle):
        alloc.evict_out_of_window_many(rows, req, seq, window)
    assert_same(before, full_snapshot(alloc, alloc.pool, rows))


# ---------------------------------------------------------------------- the checker
def test_check_invariants_catches_corruption():
    pool, alloc = make(1)
    alloc.alloc(4)
    alloc.check_invariants()

    pool.full_to_swa_index_mapping[2] = 9
    with pytest.raises(InvariantViolation, match="differs from the host state at full slots \\[2\\]"):
        alloc.check_invariants()
    pool.full_to_swa_index_mapping[2] = 2

    pool.full_to_swa_index_mapping[-1] = 0
    with pytest.raises(InvariantViolation, match="must be -1"):
        alloc.check_invariants()
    pool.full_to_swa_index_mapping[-1] = -1

    alloc.swa_to_full_page[3] = 4  # SWA page 3 owned by a full page that maps elsewhere
    with pytest.raises(InvariantViolation, match="not owned by them"):
        alloc.check_invariants()
    alloc.swa_to_full_page[3] = 3

    alloc.full_to_swa_page[2] = 1  # full pages 1 and 2 share SWA page 1
    with pytest.raises(InvariantViolation, match="two full pages map to one SWA page"):
        alloc.check_invariants()
    alloc.full_to_swa_page[2] = 2
    alloc.check_invariants()


@pytest.mark.parametrize("page_size", [1, 4])
def test_rollback_of_rejected_drafts_then_continue_from_the_kept_slot(page_size):
    """Verify with 5 drafts, 2 accepted: the 3 rejected slots go back and the partly kept page
    is continued right after the new last slot."""
    pool, alloc = make(page_size)
    prompt = alloc.alloc_extend([0], [3], [-1])  # positions 0..2
    drafts = alloc.alloc_extend([3], [8], [int(prompt[-1])])  # positions 3..7
    before_full = alloc.full_available_size()
    alloc.rollback(drafts[2:])  # keep positions 3, 4
    alloc.check_invariants()
    kept_last = int(drafts[1])
    again = alloc.alloc_extend([5], [8], [kept_last])  # positions 5..7 again
    if page_size > 1:
        assert int(again[0]) == kept_last + 1  # the kept page is continued, not skipped
    assert not set(again.tolist()) & set(prompt.tolist() + drafts[:2].tolist())
    assert alloc.full_available_size() == before_full
    slots = prompt.tolist() + drafts[:2].tolist() + again.tolist()
    assert all(s % page_size == p % page_size for p, s in enumerate(slots))
    alloc.check_invariants()


def test_rollback_frees_pages_left_empty_and_keeps_their_neighbours():
    ps = 4
    pool, alloc = make(ps)
    a = alloc.alloc_extend([0], [10], [-1])  # pages 1, 2, 3 (page 3 holds positions 8, 9)
    full, swa = alloc.full_available_size(), alloc.swa_available_size()
    alloc.rollback(a[6:])  # positions 6..9: tail of page 2 and all of page 3
    assert alloc.full_available_size() == full + ps and alloc.swa_available_size() == swa + ps
    assert translate(pool, a[:6]) == translate(pool, a[:6]) and 0 not in translate(pool, a[:6])
    assert translate(pool, a[8:]) == [0, 0]
    assert int(alloc.page_fill[int(a[5]) // ps]) == 2
    alloc.check_invariants()


@pytest.mark.parametrize(
    "pick, needle",
    [
        (lambda a: a[4:6], "trailing"),  # positions 4, 5 of 4..6: not the tail of page 2
        (lambda a: a[[4, 6]], "trailing"),  # a hole at position 5
        (lambda a: a[0:2], "trailing"),  # the head of a full page
        (lambda a: a[[6, 6]], "more than once"),
        (lambda a: torch.tensor([-1]), "outside"),
        (lambda a: torch.tensor([40]), "not allocated"),
    ],
)
def test_bad_rollback_raises_and_changes_nothing(pick, needle):
    ps = 4
    pool, alloc = make(ps)
    a = alloc.alloc_extend([0], [7], [-1])  # positions 0..6: page 1 full, page 2 holds 4..6
    locs = pick(a)
    before = snapshot(alloc)
    fill = alloc.page_fill.clone()
    with pytest.raises(KVSlotError, match=needle):
        alloc.rollback(locs)
    assert_unchanged(alloc, before)
    assert torch.equal(alloc.page_fill, fill)


@pytest.mark.parametrize("page_size", [1, 4])
def test_host_slots_are_the_slots_the_device_version_hands_out(page_size):
    """``host=True`` returns the same slots as a CPU tensor and changes the same state."""
    (_, a), (_, b) = make(page_size), make(page_size)
    got = a.alloc_extend([0, 0], [5, 3], [-1, -1], host=True)
    want = b.alloc_extend([0, 0], [5, 3], [-1, -1])
    assert got.device.type == "cpu" and got.dtype == torch.int64 and torch.equal(got, want.cpu())
    last = [int(got[4]), int(got[7])]
    got = a.alloc_decode([6, 4], last, host=True)
    want = b.alloc_decode([6, 4], last)
    assert got.device.type == "cpu" and torch.equal(got, want.cpu())
    assert all(torch.equal(x, y) for x, y in zip(snapshot(a)[2:], snapshot(b)[2:]))
    a.check_invariants()


def test_page_size_1_hands_out_the_free_list_in_order_through_any_history():
    """With page size 1 every new token takes the next free slot, request by request in
    position order, whatever was allocated and freed before (a FIFO model of the free list)."""
    import random

    rng = random.Random(0)
    pool, alloc = make(1, size=64, size_swa=64)
    free = list(range(1, 65))  # the model: taken from the front, freed slots appended sorted
    held = []  # (slots of one request)
    for _ in range(200):
        if held and (rng.random() < 0.4 or len(free) < 8):
            slots = held.pop(rng.randrange(len(held)))
            alloc.free(torch.tensor(slots))
            free += sorted(slots)
            continue
        reqs = [held[i] for i in rng.sample(range(len(held)), min(len(held), rng.randint(0, 2)))]
        new_reqs = rng.randint(0 if reqs else 1, 2)
        prefix = [len(r) for r in reqs] + [0] * new_reqs
        grow = [rng.randint(0, 3) for _ in prefix]
        if sum(grow) > len(free):
            continue
        last = [r[-1] for r in reqs] + [-1] * new_reqs
        got = alloc.alloc_extend(prefix, [p + g for p, g in zip(prefix, grow)], last).tolist()
        want, free = free[: sum(grow)], free[sum(grow) :]
        assert got == want
        offset = 0
        for i, g in enumerate(grow):
            taken = got[offset : offset + g]
            offset += g
            if i < len(reqs):
                reqs[i] += taken
            elif taken:
                held.append(taken)
        alloc.check_invariants()
    assert alloc.full_available_size() == len(free)
