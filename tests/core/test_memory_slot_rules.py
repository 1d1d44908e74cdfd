"""The slot rules of the KV memory, on the happy side of the bad-input matrix: what -1 means,
how out-of-range slots are kept away from live KV without a host read, which continuations
the allocator's page fill allows, when eviction reads the row, and the validation switch."""

import pytest
import torch

import attnplug.memory.swa_pool as swa_pool_module
from attnplug.env import VALIDATE, validation_enabled
from attnplug.memory import InvariantViolation, KVSlotError, ReqToTokenPool, SWAKVPool, SWATokenAllocator
from memory_snapshot import assert_same, snapshot

ENV_VALIDATE = VALIDATE.name

CPU = torch.device("cpu")
H, D = 2, 8


def make(page_size=1, size=64, size_swa=32):
    pool = SWAKVPool(size, size_swa, 2, [0], H, D, torch.float32, CPU, page_size=page_size)
    return pool, SWATokenAllocator(pool)


def random_kv(pool):
    gen = torch.Generator().manual_seed(1)
    for buf in (*pool.k_buffer, *pool.v_buffer):
        buf.copy_(torch.randn(buf.shape, generator=gen))


# ---------------------------------------------------------------------- -1 and out-of-range slots
@pytest.mark.parametrize("page_size", [1, 4])
def test_translate_maps_minus_one_and_out_of_range_to_no_slot(page_size):
    pool, alloc = make(page_size)
    loc = alloc.alloc(2 * page_size)
    end = pool.size + page_size  # first full slot past the pool
    query = torch.tensor([-1, -2, -(2**40), end, end + 5, 2**40, int(loc[0]), 0], dtype=torch.int64)
    before = pool.full_to_swa_index_mapping.clone()
    out = pool.translate_loc_from_full_to_swa(query)
    assert out.tolist() == [-1] * 6 + [int(loc[0]), 0]
    assert out.dtype == torch.int32
    assert torch.equal(pool.full_to_swa_index_mapping, before)
    small = torch.tensor([-1, -2, -(2**31), end, 2**31 - 1], dtype=torch.int32)
    assert pool.translate_loc_from_full_to_swa(small).tolist() == [-1] * 5


def test_store_skips_minus_one_and_writes_the_rest():
    pool, alloc = make()
    random_kv(pool)
    live = alloc.alloc(3)
    k = torch.full((3, H, D), 7.0)
    v = torch.full((3, H, D), 9.0)
    before = [b.clone() for b in pool.k_buffer + pool.v_buffer]
    pool.set_kv_buffer(1, torch.tensor([int(live[0]), -1, int(live[2])]), k, v)
    kb, vb = pool.get_kv_buffer(1)
    assert bool((kb[live[[0, 2]]] == 7).all()) and bool((vb[live[[0, 2]]] == 9).all())
    changed = torch.ones(kb.shape[0], dtype=torch.bool)
    changed[live[[0, 2]]] = False
    assert torch.equal(kb[changed], before[1][changed]) and torch.equal(vb[changed], before[3][changed])
    assert torch.equal(kb[-1], before[1][-1]), "slot -1 (the last slot) must never be written"
    # an SWA layer: swa_loc -1 skipped too, whatever loc says
    pool.set_kv_buffer(0, live, k, v, swa_loc=torch.tensor([-1, -1, 5], dtype=torch.int32))
    assert torch.equal(pool.k_buffer[0][:5], before[0][:5]) and torch.equal(pool.k_buffer[0][6:], before[0][6:])
    assert bool((pool.k_buffer[0][5] == 7).all())


def test_store_on_an_accelerator_redirects_bad_slots_to_the_sink(monkeypatch):
    """Device tensors are never read on the host: -1 and out-of-range entries go to the padding
    sink (slot 0) through a device ``where``. Simulated on CPU tensors by declaring their values
    not host-readable."""
    monkeypatch.setattr(swa_pool_module, "_values_on_host", lambda t: False)
    pool, alloc = make()
    random_kv(pool)
    live = alloc.alloc(2)
    before = [b.clone() for b in pool.k_buffer]
    k = torch.arange(4, dtype=torch.float32)[:, None, None].expand(4, H, D) + 10
    loc = torch.tensor([-1, pool.size + 1, 2**40, int(live[1])])
    pool.set_kv_buffer(1, loc, k, k)  # no error: nothing is read
    kb = pool.k_buffer[1]
    assert bool((kb[live[1]] == 13).all())
    untouched = torch.ones(kb.shape[0], dtype=torch.bool)
    untouched[[0, int(live[1])]] = False
    assert torch.equal(kb[untouched], before[1][untouched]), "a bad slot reached a live or free slot"
    assert float(kb[0, 0, 0]) in (10.0, 11.0, 12.0)  # the sink took one of the bad tokens
    swa = torch.tensor([-1, pool.size_swa + 1, int(live[0]), -7], dtype=torch.int32)
    pool.set_kv_buffer(0, loc, k, k, swa_loc=swa)
    assert bool((pool.k_buffer[0][live[0]] == 12).all())
    untouched = torch.ones(pool.k_buffer[0].shape[0], dtype=torch.bool)
    untouched[[0, int(live[0])]] = False
    assert torch.equal(pool.k_buffer[0][untouched], before[0][untouched])


# ---------------------------------------------------------------------- page fill and ownership
def test_continuation_follows_the_page_fill():
    ps = 4
    _, alloc = make(ps)
    a = alloc.alloc_extend([0], [2], [-1])  # page 1, slots 4, 5
    assert alloc.page_fill[1] == 2
    a2 = alloc.alloc_extend([2], [3], [int(a[-1])])  # slot 6: from the page's last slot
    assert a2.tolist() == [6] and alloc.page_fill[1] == 3
    with pytest.raises(KVSlotError, match=r"last_loc \[5\] is not the last handed-out slot"):
        alloc.alloc_extend([2], [3], [5])  # a stale last_loc: slot 6 is taken
    assert alloc.alloc_decode([4], [6]).tolist() == [7] and alloc.page_fill[1] == 4
    assert alloc.alloc_decode([5], [7]).tolist() == [8]  # a new page
    alloc.check_invariants()


def test_whole_pages_continue_only_at_a_page_end_and_fill_resets_on_free():
    ps = 4
    _, alloc = make(ps)
    whole = alloc.alloc(8)  # pages 1, 2 handed out whole
    assert alloc.page_fill[1:3].tolist() == [4, 4]
    # a request holding all 8 slots continues on a new page
    assert alloc.alloc_decode([9], [int(whole[-1])]).tolist() == [12]
    with pytest.raises(KVSlotError, match="last handed-out slot"):
        alloc.alloc_decode([3], [int(whole[1])])  # slot 6 was already handed out by alloc(8)
    alloc.free(whole)
    assert alloc.page_fill[1:3].tolist() == [0, 0]
    again = alloc.alloc_extend([0], [1], [-1])  # the next free page (4), partially
    assert again.tolist() == [16] and alloc.page_fill[4] == 1
    alloc.check_invariants()


def test_one_request_per_partial_page_in_one_call_but_distinct_pages_are_fine():
    ps = 4
    _, alloc = make(ps)
    a = alloc.alloc_extend([0], [3], [-1])
    b = alloc.alloc_extend([0], [1], [-1])
    out = alloc.alloc_extend([3, 1], [5, 3], [int(a[-1]), int(b[-1])])
    assert out.tolist() == [int(a[-1]) + 1, 12, int(b[-1]) + 1, int(b[-1]) + 2]
    alloc.check_invariants()


def test_check_invariants_catches_a_wrong_page_fill():
    _, alloc = make(4)
    loc = alloc.alloc_extend([0], [2], [-1])
    page = int(loc[0]) // 4
    alloc.page_fill[page] = 0
    with pytest.raises(InvariantViolation, match="page_fill"):
        alloc.check_invariants()
    alloc.page_fill[page] = 2
    alloc.page_fill[page + 5] = 1  # a free page with slots handed out
    with pytest.raises(InvariantViolation, match="page_fill"):
        alloc.check_invariants()


# ---------------------------------------------------------------------- eviction and the row's length
def _row_with(alloc, rows, n):
    row = rows.alloc()
    rows.req_to_token[row, :n] = alloc.alloc(n).to(torch.int32)
    return row


def test_eviction_up_to_the_held_length_works():
    _, alloc = make()
    rows = ReqToTokenPool(3, 32, CPU)
    row = _row_with(alloc, rows, 10)
    assert alloc.evict_out_of_window(rows, row, 10, 3) == 8


def test_eviction_that_frees_nothing_reads_nothing_unless_validating(monkeypatch):
    _, alloc = make()
    rows = ReqToTokenPool(3, 32, CPU)
    row = _row_with(alloc, rows, 4)
    monkeypatch.delenv(ENV_VALIDATE, raising=False)
    assert alloc.evict_out_of_window(rows, row, 6, 8) == 0  # beyond the row, but frees nothing
    monkeypatch.setenv(ENV_VALIDATE, "1")
    before = snapshot(alloc, alloc.pool, rows)
    with pytest.raises(KVSlotError, match="holds 4 positions"):
        alloc.evict_out_of_window(rows, row, 6, 8)
    assert_same(before, snapshot(alloc, alloc.pool, rows))


def test_eviction_refuses_positions_whose_slots_were_freed():
    """A row whose tail slots were freed (a rollback that did not zero the row) holds only
    the positions before them."""
    _, alloc = make()
    rows = ReqToTokenPool(3, 32, CPU)
    row = _row_with(alloc, rows, 10)
    alloc.free(rows.req_to_token[row, 8:10])
    before = snapshot(alloc, alloc.pool, rows)
    with pytest.raises(KVSlotError, match="holds 8 positions"):
        alloc.evict_out_of_window(rows, row, 10, 3)
    assert_same(before, snapshot(alloc, alloc.pool, rows))
    assert alloc.evict_out_of_window(rows, row, 8, 3) == 6


# ---------------------------------------------------------------------- rows in use
def test_check_in_use_names_freed_and_out_of_range_rows():
    rows = ReqToTokenPool(4, 8, CPU)
    a, b = rows.alloc(), rows.alloc()
    rows.free(b)
    rows.check_in_use([a])
    rows.check_in_use(torch.tensor([a, 0]), allow_padding_row=True)
    for bad, shown in (([a, b], f"[{b}]"), ([0], "[0]"), ([-1], "[-1]"), ([4], "[4]")):
        with pytest.raises(KVSlotError) as info:
            rows.check_in_use(bad, "req_pool_indices")
        assert "req_pool_indices" in str(info.value) and shown in str(info.value)
    with pytest.raises(KVSlotError, match="bool"):
        rows.check_in_use([True])


# ---------------------------------------------------------------------- the switch
@pytest.mark.parametrize(
    "value, on",
    [
        ("1", True),
        ("true", True),
        (" YES ", True),
        ("on", True),
        ("0", False),
        ("", False),
        ("no", False),
        (None, False),
    ],
)
def test_validation_switch(monkeypatch, value, on):
    if value is None:
        monkeypatch.delenv(ENV_VALIDATE, raising=False)
    else:
        monkeypatch.setenv(ENV_VALIDATE, value)
    assert validation_enabled() is on


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an accelerator (the device path of the pool)")
def test_device_store_and_translate_are_sync_free_and_keep_bad_slots_off_live_kv():
    dev = torch.device("cuda")
    pool = SWAKVPool(64, 32, 2, [0], H, D, torch.float32, dev)
    alloc = SWATokenAllocator(pool)
    live = alloc.alloc(2)
    for buf in (*pool.k_buffer, *pool.v_buffer):
        buf.normal_()
    before = [b.clone() for b in pool.k_buffer]
    loc = torch.tensor([-1, pool.size + 1, 2**40, int(live[1])], device=dev)
    k = torch.full((4, H, D), 5.0, device=dev)
    torch.cuda.set_sync_debug_mode("error")
    try:
        swa = pool.translate_loc_from_full_to_swa(loc)
        pool.set_kv_buffer(1, loc, k, k)
        pool.set_kv_buffer(0, loc, k, k, swa_loc=swa)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert swa.tolist() == [-1, -1, -1, int(live[1])]
    for layer, slot in ((1, int(live[1])), (0, int(live[1]))):
        kb = pool.k_buffer[layer]
        assert bool((kb[slot] == 5).all())
        untouched = torch.ones(kb.shape[0], dtype=torch.bool, device=dev)
        untouched[[0, slot]] = False
        assert torch.equal(kb[untouched], before[layer][untouched]), f"layer {layer}: a bad slot reached live KV"
