"""Bad input to the public KV-memory API: every call is refused with an error that names the
argument and the offending value, or (for the documented "no slot" value -1) has no effect on
live data. A refused call leaves the pool (KV buffers and mapping), the allocator (free lists,
used flags, page maps, page fill) and the request table (rows, frontiers, free rows) bit for
bit as before (``memory_snapshot``), and ``check_invariants()`` still passes.

The world: a 64-slot full pool and a 32-slot SWA pool (layer 0 SWA, layer 1 full) filled with
random KV, request A holding 10 positions (the SWA slots of its first 8 evicted with a window
of 3), request B holding 3 positions, and a freed row; for ``page_size`` 1 and 4.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple

import pytest
import torch

from attnplug.memory import KVSlotError, OutOfKVSlots, ReqToTokenPool, SWAKVPool, SWATokenAllocator
from memory_snapshot import assert_same, snapshot
from worlds import small_pool

CPU = torch.device("cpu")
SIZE, SIZE_SWA, H, D, MAX_REQS, MAX_LEN, WINDOW = 64, 32, 2, 8, 5, 64, 3


class World:
    def __init__(self, page_size: int) -> None:
        self.ps = page_size
        self.pool = SWAKVPool(SIZE, SIZE_SWA, 2, [0], H, D, torch.float32, CPU, page_size=page_size)
        self.alloc = SWATokenAllocator(self.pool)
        self.rows = ReqToTokenPool(MAX_REQS, MAX_LEN, CPU)
        self.a_row, self.a = self.add(10)
        self.b_row, self.b = self.add(3)
        self.alloc.evict_out_of_window(self.rows, self.a_row, 10, WINDOW)
        self.freed_row = self.rows.alloc()
        self.rows.free(self.freed_row)
        gen = torch.Generator().manual_seed(0)
        for buf in (*self.pool.k_buffer, *self.pool.v_buffer):
            buf.copy_(torch.randn(buf.shape, generator=gen))
        self.never = 40  # a full slot no one holds (page 10 when page_size is 4)

    def add(self, n: int) -> Tuple[int, torch.Tensor]:
        row = self.rows.alloc()
        loc = self.alloc.alloc_extend([0], [n], [-1])
        self.rows.req_to_token[row, :n] = loc.to(torch.int32)
        return row, loc

    def state(self):
        return snapshot(self.alloc, self.pool, self.rows)

    def kv(self, n: int = 1, dtype=torch.float32):
        return torch.ones(n, H, D, dtype=dtype), torch.ones(n, H, D, dtype=dtype)


@dataclass
class Case:
    id: str
    call: Callable[[World], object]
    error: Optional[type]  # None: the call must succeed and change nothing
    needles: Sequence[str] = ()
    page_size: int = 1
    setup: Optional[Callable[[World], None]] = None

    @property
    def param(self):
        return pytest.param(self, id=f"{self.id}-ps{self.page_size}")


def a_last(w: World) -> int:
    return int(w.a[-1])


def b_last(w: World) -> int:
    return int(w.b[-1])


def _evict_c(w: World) -> None:
    """Request C: 2 positions whose SWA page was freed; its page cannot take new tokens."""
    w.c = w.alloc.alloc_extend([0], [2], [-1])
    w.alloc.free_swa(w.c)


def _whole_page(w: World) -> None:
    w.whole = w.alloc.alloc(4)


def _double_freed(w: World) -> None:
    w.dead = w.alloc.alloc(w.ps)
    w.alloc.free(w.dead)


E = KVSlotError
CASES = [
    # ------------------------------------------------------------------ free
    Case("free-float-list", lambda w: w.alloc.free([int(w.b[0]) + 0.7]), E, ["full_locs", "float"]),
    Case("free-float-tensor", lambda w: w.alloc.free(w.b.double() + 0.7), E, ["full_locs", "float"]),
    Case("free-bool-list", lambda w: w.alloc.free([True]), E, ["full_locs", "bool"]),
    Case("free-bool-tensor", lambda w: w.alloc.free(torch.tensor([True])), E, ["full_locs", "bool"]),
    Case("free-mixed-bool-int", lambda w: w.alloc.free([int(w.b[0]), True]), E, ["full_locs", "bool"]),
    Case("free-bool-scalar", lambda w: w.alloc.free(True), E, ["full_locs", "bool"]),
    Case("free-string", lambda w: w.alloc.free(["3"]), E, ["full_locs"]),
    Case("free-none", lambda w: w.alloc.free(None), E, ["full_locs"]),
    Case("free-minus-one", lambda w: w.alloc.free([-1]), E, ["full_locs", "-1"]),
    Case("free-minus-one-with-live", lambda w: w.alloc.free([int(w.b[0]), -1]), E, ["full_locs", "-1"]),
    Case("free-sink", lambda w: w.alloc.free([0]), E, ["full_locs", "[0]"]),
    Case("free-past-end", lambda w: w.alloc.free([SIZE + 1]), E, ["full_locs", str(SIZE + 1)]),
    Case("free-huge", lambda w: w.alloc.free([2**40]), E, ["full_locs", str(2**40)]),
    Case("free-twice-in-one-call", lambda w: w.alloc.free([int(w.b[0])] * 2), E, ["more than once"]),
    Case("free-never-allocated", lambda w: w.alloc.free([w.never]), E, ["not allocated", str(40)]),
    Case("free-double", lambda w: w.alloc.free(w.dead), E, ["not allocated"], setup=_double_freed),
    Case("free-double-paged", lambda w: w.alloc.free(w.dead[1:2]), E, ["not allocated"], 4, _double_freed),
    Case("free-sink-page", lambda w: w.alloc.free([3]), E, ["full_locs", "[3]"], 4),
    # ------------------------------------------------------------------ free_swa
    Case("free_swa-minus-one", lambda w: w.alloc.free_swa([-1]), E, ["full_locs", "-1"]),
    Case("free_swa-float", lambda w: w.alloc.free_swa([int(w.b[0]) + 0.5]), E, ["full_locs", "float"]),
    Case("free_swa-bool", lambda w: w.alloc.free_swa(torch.tensor([True, False])), E, ["full_locs", "bool"]),
    Case("free_swa-evicted", lambda w: w.alloc.free_swa(w.a[:1]), E, ["no live SWA slot"]),
    Case("free_swa-evicted-paged", lambda w: w.alloc.free_swa(w.a[:1]), E, ["no live SWA slot"], 4),
    Case("free_swa-past-end", lambda w: w.alloc.free_swa([SIZE + 4]), E, ["full_locs", str(SIZE + 4)], 4),
    Case("free_swa-never-allocated", lambda w: w.alloc.free_swa([w.never]), E, ["no live SWA slot"]),
    # ------------------------------------------------------------------ alloc
    Case("alloc-negative", lambda w: w.alloc.alloc(-1), E, ["alloc(n)", "-1"]),
    Case("alloc-float", lambda w: w.alloc.alloc(2.0), E, ["alloc(n)", "2.0"]),
    Case("alloc-bool", lambda w: w.alloc.alloc(True), E, ["alloc(n)", "True"]),
    Case("alloc-string", lambda w: w.alloc.alloc("4"), E, ["alloc(n)", "'4'"]),
    Case("alloc-partial-page", lambda w: w.alloc.alloc(6), E, ["multiple of page_size=4", "6"], 4),
    Case("alloc-too-many", lambda w: w.alloc.alloc(SIZE), OutOfKVSlots, ["need 64 tokens"]),
    # ------------------------------------------------------------------ alloc_extend
    Case("extend-float-prefix", lambda w: w.alloc.alloc_extend([1.5], [3], [b_last(w)]), E, ["prefix_lens", "float"]),
    Case("extend-bool-seq", lambda w: w.alloc.alloc_extend([0], [True], [-1]), E, ["seq_lens", "bool"]),
    Case("extend-float-last", lambda w: w.alloc.alloc_extend([3], [4], [b_last(w) + 0.0]), E, ["last_loc", "float"]),
    Case("extend-length-mismatch", lambda w: w.alloc.alloc_extend([0, 0], [1], [-1]), E, ["differ in length"]),
    Case("extend-negative-prefix", lambda w: w.alloc.alloc_extend([-1], [2], [-1]), E, ["prefix_lens", "-1"]),
    Case("extend-seq-below-prefix", lambda w: w.alloc.alloc_extend([3], [2], [b_last(w)]), E, ["seq_lens", "2"]),
    Case("extend-missing-last", lambda w: w.alloc.alloc_extend([3], [4], [-1]), E, ["last_loc", "-1"]),
    Case("extend-last-for-empty-prefix", lambda w: w.alloc.alloc_extend([0], [4], [b_last(w)]), E, ["last_loc"]),
    Case("extend-last-minus-two", lambda w: w.alloc.alloc_extend([3], [4], [-2]), E, ["last_loc", "-2"]),
    Case("extend-last-past-end", lambda w: w.alloc.alloc_extend([3], [4], [SIZE + 1]), E, ["last_loc", "65"]),
    Case(
        "extend-last-freed",
        lambda w: w.alloc.alloc_extend([1], [2], [int(w.dead[0])]),
        E,
        ["last_loc"],
        setup=_double_freed,
    ),
    Case(
        "extend-too-many", lambda w: w.alloc.alloc_extend([0, 0], [20, 20], [-1, -1]), OutOfKVSlots, ["full pool has"]
    ),
    Case("extend-wrong-offset", lambda w: w.alloc.alloc_extend([3], [4], [int(w.b[0])]), E, ["last_loc", "offset"], 4),
    # last_loc of B's first slot: the rest of B's page holds B's live positions 1 and 2
    Case(
        "extend-other-requests-slot",
        lambda w: w.alloc.alloc_extend([1], [3], [int(w.b[0])]),
        E,
        ["last_loc", str(16), "last handed-out slot"],
        4,
    ),
    Case(
        "extend-other-requests-inner",
        lambda w: w.alloc.alloc_extend([2], [3], [int(w.b[1])]),
        E,
        ["last_loc", str(17)],
        4,
    ),
    Case(
        "extend-shared-partial-page",
        lambda w: w.alloc.alloc_extend([3, 3], [4, 4], [b_last(w), b_last(w)]),
        E,
        ["last_loc", "same page"],
        4,
    ),
    Case(
        "extend-shared-page-different-slots",
        lambda w: w.alloc.alloc_extend([3, 2], [4, 3], [b_last(w), int(w.b[1])]),
        E,
        ["last_loc"],
        4,
    ),
    Case(
        "extend-inside-whole-page",
        lambda w: w.alloc.alloc_extend([2], [3], [int(w.whole[1])]),
        E,
        ["last_loc", "last handed-out slot"],
        4,
        _whole_page,
    ),
    Case(
        "extend-page-without-swa",
        lambda w: w.alloc.alloc_extend([2], [3], [int(w.c[-1])]),
        E,
        ["lost their SWA page"],
        4,
        _evict_c,
    ),
    Case("extend-evicted-page-of-a", lambda w: w.alloc.alloc_extend([2], [3], [int(w.a[1])]), E, ["last_loc"], 4),
    # ------------------------------------------------------------------ alloc_decode
    Case("decode-zero-seq", lambda w: w.alloc.alloc_decode([0], [-1]), E, ["seq_lens", "0"]),
    Case("decode-float-seq", lambda w: w.alloc.alloc_decode([4.0], [b_last(w)]), E, ["seq_lens", "float"]),
    Case("decode-missing-last", lambda w: w.alloc.alloc_decode([4], [-1]), E, ["last_loc", "-1"]),
    Case("decode-length-mismatch", lambda w: w.alloc.alloc_decode([4, 11], [b_last(w)]), E, ["differ in length"]),
    Case("decode-other-requests-slot", lambda w: w.alloc.alloc_decode([2], [int(w.b[0])]), E, ["last_loc", "16"], 4),
    Case("decode-shared-partial-page", lambda w: w.alloc.alloc_decode([4, 4], [b_last(w)] * 2), E, ["same page"], 4),
    Case("decode-bool-last", lambda w: w.alloc.alloc_decode([2], [True]), E, ["last_loc", "bool"]),
    # ------------------------------------------------------------------ evict_out_of_window
    # A holds 10 positions: a query at 12 would free positions 8, 9, which its real next query needs
    Case(
        "evict-beyond-row",
        lambda w: w.alloc.evict_out_of_window(w.rows, w.a_row, 12, WINDOW),
        E,
        ["seq_len", "12", "holds 10"],
    ),
    Case(
        "evict-beyond-row-paged",
        lambda w: w.alloc.evict_out_of_window(w.rows, w.a_row, 16, WINDOW),
        E,
        ["seq_len", "16", "holds 10"],
        4,
    ),
    Case(
        "evict-beyond-short-row",
        lambda w: w.alloc.evict_out_of_window(w.rows, w.b_row, 6, 2),
        E,
        ["seq_len", "6", "holds 3"],
    ),
    Case(
        "evict-past-max-context",
        lambda w: w.alloc.evict_out_of_window(w.rows, w.a_row, MAX_LEN + 1, WINDOW),
        E,
        ["seq_len", str(MAX_LEN + 1)],
    ),
    Case(
        "evict-negative-seq", lambda w: w.alloc.evict_out_of_window(w.rows, w.a_row, -1, WINDOW), E, ["seq_len", "-1"]
    ),
    Case(
        "evict-float-seq", lambda w: w.alloc.evict_out_of_window(w.rows, w.a_row, 10.0, WINDOW), E, ["seq_len", "10.0"]
    ),
    Case("evict-bool-seq", lambda w: w.alloc.evict_out_of_window(w.rows, w.b_row, True, 1), E, ["seq_len", "True"]),
    Case("evict-zero-window", lambda w: w.alloc.evict_out_of_window(w.rows, w.a_row, 10, 0), E, ["window", "0"]),
    Case("evict-float-window", lambda w: w.alloc.evict_out_of_window(w.rows, w.a_row, 10, 2.5), E, ["window", "2.5"]),
    Case("evict-bool-window", lambda w: w.alloc.evict_out_of_window(w.rows, w.a_row, 10, True), E, ["window", "True"]),
    Case(
        "evict-freed-row",
        lambda w: w.alloc.evict_out_of_window(w.rows, w.freed_row, 10, WINDOW),
        E,
        ["row", "not in use"],
    ),
    Case("evict-row-zero", lambda w: w.alloc.evict_out_of_window(w.rows, 0, 10, WINDOW), E, ["row", "0"]),
    Case("evict-row-negative", lambda w: w.alloc.evict_out_of_window(w.rows, -1, 10, WINDOW), E, ["row", "-1"]),
    Case("evict-row-bool", lambda w: w.alloc.evict_out_of_window(w.rows, True, 10, WINDOW), E, ["row", "True"]),
    Case(
        "evict-rows-not-a-table",
        lambda w: w.alloc.evict_out_of_window(None, w.a_row, 10, WINDOW),
        TypeError,
        ["rows", "ReqToTokenPool"],
    ),
    # ------------------------------------------------------------------ ReqToTokenPool
    Case("row-free-bool", lambda w: w.rows.free(True), E, ["row", "True"]),
    Case("row-free-float", lambda w: w.rows.free(1.0), E, ["row", "1.0"]),
    Case("row-free-negative", lambda w: w.rows.free(-1), E, ["row", "-1"]),
    Case("row-free-past-end", lambda w: w.rows.free(MAX_REQS), E, ["row", str(MAX_REQS)]),
    Case("row-free-zero", lambda w: w.rows.free(0), E, ["row", "0"]),
    Case("row-free-twice", lambda w: w.rows.free(w.freed_row), E, ["row", "not in use"]),
    Case("row-free-string", lambda w: w.rows.free("1"), E, ["row", "'1'"]),
    Case("row-frontier-of-freed", lambda w: w.rows.swa_evicted_len(w.freed_row), E, ["row", "not in use"]),
    Case("row-set-frontier-float", lambda w: w.rows.set_swa_evicted_len(w.b_row, 2.5), E, ["frontier", "2.5"]),
    Case("row-set-frontier-negative", lambda w: w.rows.set_swa_evicted_len(w.b_row, -1), E, ["frontier", "-1"]),
    Case("row-set-frontier-bool", lambda w: w.rows.set_swa_evicted_len(w.b_row, True), E, ["frontier", "True"]),
    # ------------------------------------------------------------------ set_kv_buffer (host tensors)
    Case("store-full-loc-minus-one", lambda w: w.pool.set_kv_buffer(1, torch.tensor([-1]), *w.kv()), None),
    Case(
        "store-swa-loc-minus-one",
        lambda w: w.pool.set_kv_buffer(0, torch.tensor([-1]), *w.kv(), swa_loc=torch.tensor([-1])),
        None,
    ),
    Case("store-minus-one-paged", lambda w: w.pool.set_kv_buffer(1, torch.tensor([-1, -1]), *w.kv(2)), None, (), 4),
    Case(
        "store-loc-past-end",
        lambda w: w.pool.set_kv_buffer(1, torch.tensor([SIZE + 1]), *w.kv()),
        E,
        ["loc", str(SIZE + 1)],
    ),
    Case("store-loc-minus-two", lambda w: w.pool.set_kv_buffer(1, torch.tensor([-2]), *w.kv()), E, ["loc", "-2"]),
    Case(
        "store-swa-loc-past-end",
        lambda w: w.pool.set_kv_buffer(0, w.b[:1], *w.kv(), swa_loc=torch.tensor([SIZE_SWA + 1])),
        E,
        ["swa_loc", str(SIZE_SWA + 1)],
    ),
    Case(
        "store-swa-loc-past-end-paged",
        lambda w: w.pool.set_kv_buffer(0, w.b[:1], *w.kv(), swa_loc=torch.tensor([SIZE_SWA + 4])),
        E,
        ["swa_loc", str(SIZE_SWA + 4)],
        4,
    ),
    Case(
        "store-partly-bad-writes-nothing",
        lambda w: w.pool.set_kv_buffer(1, torch.tensor([int(w.b[0]), SIZE + 5]), *w.kv(2)),
        E,
        ["loc", str(SIZE + 5)],
    ),
    Case(
        "store-full-loc-out-on-swa-layer",
        lambda w: w.pool.set_kv_buffer(0, torch.tensor([SIZE + 7]), *w.kv(), swa_loc=torch.tensor([3])),
        E,
        ["loc", str(SIZE + 7)],
    ),
    Case("store-float-loc", lambda w: w.pool.set_kv_buffer(1, torch.tensor([3.0]), *w.kv()), E, ["loc", "float"]),
    Case("store-bool-loc", lambda w: w.pool.set_kv_buffer(1, torch.tensor([True]), *w.kv()), E, ["loc", "bool"]),
    Case("store-2d-loc", lambda w: w.pool.set_kv_buffer(1, torch.tensor([[3]]), *w.kv()), E, ["loc must be [1]"]),
    Case(
        "store-k-dtype",
        lambda w: w.pool.set_kv_buffer(1, torch.tensor([3]), *w.kv(dtype=torch.float64)),
        E,
        ["k must be", "float64"],
    ),
    Case(
        "store-v-shape",
        lambda w: w.pool.set_kv_buffer(1, torch.tensor([3]), w.kv()[0], torch.ones(1, H, D + 1)),
        E,
        ["v must be"],
    ),
    Case("store-missing-swa-loc", lambda w: w.pool.set_kv_buffer(0, torch.tensor([3]), *w.kv()), E, ["swa_loc"]),
    Case(
        "store-layer-out-of-range", lambda w: w.pool.set_kv_buffer(2, torch.tensor([3]), *w.kv()), E, ["layer_id", "2"]
    ),
    Case("store-layer-bool", lambda w: w.pool.set_kv_buffer(True, torch.tensor([3]), *w.kv()), E, ["layer_id", "True"]),
    Case("store-loc-not-a-tensor", lambda w: w.pool.set_kv_buffer(1, [3], *w.kv()), E, ["loc", "tensor"]),
]


@pytest.mark.parametrize("case", [c.param for c in CASES])
def test_bad_input_is_refused_and_changes_nothing(case: Case):
    w = World(case.page_size)
    if case.setup is not None:
        case.setup(w)
    before = w.state()
    if case.error is None:
        case.call(w)
    else:
        with pytest.raises(case.error) as info:
            case.call(w)
        message = str(info.value)
        for needle in case.needles:
            assert needle in message, f"the error does not name {needle!r}: {message}"
    assert_same(before, w.state())
    w.alloc.check_invariants()


# ---------------------------------------------------------------------- construction
BAD_POOLS = [
    ({"dtype": torch.int32}, ["dtype", "int32"]),
    ({"dtype": torch.int64}, ["dtype", "int64"]),
    ({"dtype": torch.bool}, ["dtype", "bool"]),
    ({"dtype": torch.complex64}, ["dtype", "complex64"]),
    ({"dtype": torch.uint8}, ["dtype", "uint8"]),
    ({"dtype": "float32"}, ["dtype", "'float32'"]),
    ({"size": 64.0}, ["size", "64.0"]),
    ({"size": True}, ["size", "True"]),
    ({"size_swa": -4}, ["size_swa", "-4"]),
    ({"page_size": True}, ["page_size", "True"]),
    ({"head_dim": 8.0}, ["head_dim", "8.0"]),
    ({"num_kv_heads": False}, ["num_kv_heads", "False"]),
    ({"num_layers": True, "swa_layer_ids": []}, ["num_layers", "True"]),
    ({"swa_layer_ids": [True]}, ["swa_layer_ids", "True"]),
    ({"swa_layer_ids": [0.0]}, ["swa_layer_ids", "0.0"]),
]
BAD_POOLS.append(({"dtype": torch.float8_e4m3fnuz}, ["dtype", "float8_e4m3fnuz"]))  # FP8, but not a served format
BAD_POOLS.append(({"dtype": torch.int8}, ["dtype", "int8"]))


@pytest.mark.parametrize("overrides, needles", BAD_POOLS, ids=[repr(o) for o, _ in BAD_POOLS])
def test_pool_construction_refuses_loose_types(overrides, needles):
    with pytest.raises(ValueError) as info:
        small_pool(**overrides)
    for needle in needles:
        assert needle in str(info.value), str(info.value)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_pool_accepts_the_floating_dtypes_it_serves(dtype):
    pool = small_pool(dtype=dtype)
    k = torch.ones(1, H, D, dtype=dtype)
    pool.set_kv_buffer(1, torch.tensor([3]), k, k)
    assert pool.k_buffer[1].dtype == dtype and bool(pool.k_buffer[1][3].eq(1).all())


@pytest.mark.parametrize(
    "max_reqs, max_context_len, needles",
    [
        (True, 8, ["max_reqs", "True"]),
        (4, True, ["max_context_len", "True"]),
        (4, 8.0, ["max_context_len", "8.0"]),
        (4.0, 8, ["max_reqs", "4.0"]),
        (1, 8, ["max_reqs", "1"]),
    ],
)
def test_req_table_construction_refuses_loose_types(max_reqs, max_context_len, needles):
    with pytest.raises(ValueError) as info:
        ReqToTokenPool(max_reqs, max_context_len, CPU)
    for needle in needles:
        assert needle in str(info.value), str(info.value)


def test_allocator_needs_a_pool():
    with pytest.raises(TypeError, match="pool must be an SWAKVPool"):
        SWATokenAllocator(object())
