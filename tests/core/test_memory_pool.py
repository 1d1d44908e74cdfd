"""SWAKVPool (buffers, translation, set_kv_buffer) and ReqToTokenPool (rows, frontiers)."""

import pytest
import torch

from attnplug.memory import KVSlotError, OutOfReqSlots, ReqToTokenPool, SWAKVPool, SWATokenAllocator
from worlds import small_pool

CPU = torch.device("cpu")
H, D = 2, 8


def make_pool(page_size=1, size=32, size_swa=16, dtype=torch.float32):
    return SWAKVPool(size, size_swa, 4, [0, 1, 2], H, D, dtype, CPU, page_size=page_size)


# ---------------------------------------------------------------------- SWAKVPool
@pytest.mark.parametrize("page_size", [1, 4])
def test_buffers_and_mapping_layout(page_size):
    pool = make_pool(page_size)
    assert pool.swa_layer_ids == frozenset({0, 1, 2})
    assert [pool.is_swa_layer(i) for i in range(4)] == [True, True, True, False]
    for layer in range(4):
        k, v = pool.get_kv_buffer(layer)
        rows = (16 if layer < 3 else 32) + page_size
        assert k.shape == v.shape == (rows, H, D) and k.dtype == torch.float32
        assert pool.num_slots(layer) == rows
        assert pool.get_key_buffer(layer) is pool.k_buffer[layer]
        assert pool.get_value_buffer(layer) is pool.v_buffer[layer]
    m = pool.full_to_swa_index_mapping
    assert m.dtype == torch.int32 and m.shape == (32 + page_size + 1,)
    assert m[-1] == -1 and not m[:-1].any()


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(size=30, page_size=4), "size must be a positive multiple of page_size=4"),
        (dict(size_swa=6, page_size=4), "size_swa must be a positive multiple of page_size=4"),
        (dict(size=0), "size must be a positive multiple"),
        (dict(swa_layer_ids=[4]), "swa_layer_ids [4]"),
        (dict(page_size=0), "page_size must be a positive int"),
    ],
)
def test_pool_rejects_bad_configuration(kwargs, needle):
    with pytest.raises(ValueError) as info:
        small_pool(**{"size": 32, "size_swa": 16, "num_layers": 4, **kwargs})
    assert needle in str(info.value)


@pytest.mark.parametrize("page_size", [1, 4])
def test_translate_is_a_gather_with_sentinels(page_size):
    pool = make_pool(page_size)
    alloc = SWATokenAllocator(pool)
    loc = alloc.alloc(2 * page_size)  # full pages 1, 2 -> SWA pages 1, 2
    before = pool.full_to_swa_index_mapping.clone()
    expected = torch.arange(page_size, 3 * page_size, dtype=torch.int32)
    assert torch.equal(pool.translate_loc_from_full_to_swa(loc), expected)
    query = torch.tensor([[-1, 0], [int(loc[-1]), 3 * page_size]], dtype=torch.int32)
    out = pool.translate_loc_from_full_to_swa(query)
    assert out.dtype == torch.int32 and out.shape == (2, 2)
    assert out.tolist() == [[-1, 0], [3 * page_size - 1, 0]]  # -1 -> -1, 0 -> 0, unallocated -> 0
    assert torch.equal(pool.full_to_swa_index_mapping, before)


def test_set_kv_buffer_requires_hoisted_swa_loc_on_swa_layers():
    pool = make_pool()
    k = torch.ones(2, H, D)
    with pytest.raises(ValueError) as info:
        pool.set_kv_buffer(1, torch.tensor([3, 4]), k, k)
    assert "layer 1" in str(info.value) and "swa_out_cache_loc" in str(info.value)
    assert not any(b.any() for b in pool.k_buffer + pool.v_buffer)  # nothing written


def test_set_kv_buffer_writes_only_the_given_rows():
    pool = make_pool()
    k = torch.randn(2, H, D)
    v = torch.randn(2, H, D)
    pool.set_kv_buffer(0, torch.tensor([3, 4]), k, v, swa_loc=torch.tensor([7, 2], dtype=torch.int32))
    kb, vb = pool.get_kv_buffer(0)
    assert torch.equal(kb[[7, 2]], k) and torch.equal(vb[[7, 2]], v)
    untouched = torch.ones(kb.shape[0], dtype=torch.bool)
    untouched[[7, 2]] = False
    assert not kb[untouched].any() and not vb[untouched].any()  # rows 3, 4 (the full slots) untouched
    assert not any(pool.k_buffer[i].any() for i in (1, 2, 3))

    pool.set_kv_buffer(3, torch.tensor([30, 5]), k, v)  # full layer: at loc, swa_loc not needed
    kb, vb = pool.get_kv_buffer(3)
    assert torch.equal(kb[[30, 5]], k) and torch.equal(vb[[30, 5]], v)
    assert int((kb.abs().sum((1, 2)) != 0).sum()) == 2


@pytest.mark.parametrize(
    "k_shape, k_dtype, loc, needle",
    [
        ((2, H, D + 1), torch.float32, [3, 4], "k must be"),
        ((2, H, D), torch.float16, [3, 4], "k must be"),
        ((2, H, D), torch.float32, [3, 4, 5], "loc must be [2]"),
    ],
)
def test_set_kv_buffer_validates_on_the_host(k_shape, k_dtype, loc, needle):
    pool = make_pool()
    with pytest.raises(ValueError) as info:
        pool.set_kv_buffer(3, torch.tensor(loc), torch.zeros(k_shape, dtype=k_dtype), torch.zeros(2, H, D))
    assert needle in str(info.value)


# ---------------------------------------------------------------------- ReqToTokenPool
def test_req_rows_skip_row_zero_and_run_out():
    rows = ReqToTokenPool(4, 16, CPU)
    assert rows.req_to_token.shape == (4, 16) and rows.req_to_token.dtype == torch.int32
    assert [rows.alloc() for _ in range(3)] == [1, 2, 3]
    assert rows.available_size() == 0
    with pytest.raises(OutOfReqSlots):
        rows.alloc()
    rows.free(2)
    assert rows.available_size() == 1 and rows.alloc() == 2


@pytest.mark.parametrize("bad", [0, 4, -1, 3], ids=["row0", "past-end", "negative", "never-allocated"])
def test_req_row_free_rejects_bad_rows(bad):
    rows = ReqToTokenPool(4, 16, CPU)
    assert (rows.alloc(), rows.alloc()) == (1, 2)
    with pytest.raises(KVSlotError) as info:
        rows.free(bad)
    assert str(bad) in str(info.value)
    assert rows.available_size() == 1


def test_req_row_double_free_and_frontier_reset():
    rows = ReqToTokenPool(4, 16, CPU)
    row = rows.alloc()
    rows.req_to_token[row, :5] = torch.arange(1, 6, dtype=torch.int32)
    rows.set_swa_evicted_len(row, 3)
    assert rows.swa_evicted_len(row) == 3
    rows.free(row)
    assert not rows.req_to_token.any()
    with pytest.raises(KVSlotError, match="not in use"):
        rows.free(row)
    assert rows.alloc() == row and rows.swa_evicted_len(row) == 0


def test_pools_report_the_concrete_device_of_their_tensors():
    """Regression (seen on the H200): a pool built with device "cuda" and a request table built
    with "cuda:0" are on the same device; the backend must not refuse them. "cpu:0" / "cpu"
    reproduces the same naming difference without an accelerator."""
    from attnplug.backends.reference import ReferenceBackend

    pool = SWAKVPool(64, 32, 2, [0], 2, 16, torch.float32, "cpu:0")
    rows = ReqToTokenPool(4, 32, "cpu")
    assert pool.device == pool.full_to_swa_index_mapping.device
    assert rows.device == rows.req_to_token.device
    ReferenceBackend(pool, rows, num_heads=4, sliding_window=8)
