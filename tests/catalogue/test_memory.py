"""Catalogue, memory: every pool, allocator and request-table API given an index tensor it
cannot use refuses it, naming the call, the argument and the problem, and changes nothing
(issue 37).

Slots, rows and lengths are int32 or int64 tensors on the pool's device (or Python / numpy
ints). Before this issue: a uint8 or bool tensor indexed as a mask (``translate`` answered
for the wrong slots or raised a bare ``IndexError``), int8 / int16 raised ``IndexError`` or
were accepted (a wrapped 300 frees slot 44), a meta tensor "stored" nothing and
``translate`` returned uninitialised memory, and tensors on another device were written
nowhere. Each case snapshots the pool, the allocator and the request table bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnplug.memory import KVSlotError, ReqToTokenPool, SWAKVPool, SWATokenAllocator
from memory_snapshot import assert_same, snapshot


class World:
    """A hybrid pool (layer 1 sliding-window), its allocator, a request table, four live slots."""

    def __init__(self, page_size: int = 1) -> None:
        self.pool = SWAKVPool(64, 32, 2, [1], 2, 16, torch.float32, "cpu", page_size=page_size)
        self.alloc = SWATokenAllocator(self.pool)
        self.rows = ReqToTokenPool(4, 32, "cpu")
        self.row = self.rows.alloc()
        self.slots = self.alloc.alloc(4 if page_size == 1 else 2 * page_size)
        self.rows.req_to_token[self.row, : self.slots.numel()] = self.slots.to(torch.int32)

    def state(self):
        return snapshot(self.pool, self.alloc, self.rows)


def _as(kind: str, values):
    if kind == "meta":
        return torch.tensor(values, dtype=torch.int64, device="meta")
    if kind == "numpy-uint8":
        return np.asarray(values, dtype=np.uint8)
    return torch.tensor(values, dtype=getattr(torch, kind))


KV = lambda n: torch.ones(n, 2, 16)  # noqa: E731


def _calls(w: World, kind: str):
    """API name -> a call with the bad index tensor where the API takes one."""
    two = [int(s) for s in w.slots[:2]]
    return {
        "translate": lambda: w.pool.translate_loc_from_full_to_swa(_as(kind, two)),
        "set_kv_buffer-loc": lambda: w.pool.set_kv_buffer(0, _as(kind, two), KV(2), KV(2)),
        "set_kv_buffer-swa_loc": lambda: w.pool.set_kv_buffer(
            1, torch.tensor(two), KV(2), KV(2), swa_loc=_as(kind, [1, 2])
        ),
        "free": lambda: w.alloc.free(_as(kind, [int(s) for s in w.slots])),
        "free_swa": lambda: w.alloc.free_swa(_as(kind, two)),
        "rollback": lambda: w.alloc.rollback(_as(kind, [int(w.slots[-1])])),
        "alloc_extend-seq_lens": lambda: w.alloc.alloc_extend([4], _as(kind, [6]), [int(w.slots[-1])]),
        "alloc_decode-last_loc": lambda: w.alloc.alloc_decode([5], _as(kind, [int(w.slots[-1])])),
        "check_in_use": lambda: w.rows.check_in_use(_as(kind, [w.row])),
    }


API = list(_calls(World(), "int64"))
#: what each kind must be called
KINDS = {
    "uint8": "must be int32 or int64, got uint8",
    "int8": "must be int32 or int64, got int8",
    "int16": "must be int32 or int64, got int16",
    "bool": "bool",
    "meta": "meta",
    "numpy-uint8": "uint8",
}


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("api", API)
def test_an_index_tensor_of_the_wrong_kind_is_refused(api, kind):
    if kind == "numpy-uint8" and api.startswith(("translate", "set_kv_buffer")):
        pytest.skip("device-side calls take tensors only (a numpy array is refused as not a tensor)")
    w = World()
    before = w.state()
    with pytest.raises(KVSlotError) as info:
        _calls(w, kind)[api]()
    assert KINDS[kind] in str(info.value), str(info.value)
    assert_same(before, w.state())


@pytest.mark.parametrize("field", ["k", "v", "loc"])
def test_set_kv_buffer_refuses_tensors_on_another_device(field):
    """A meta tensor stands in for "another device": it was "stored" with no effect."""
    w = World()
    args = dict(k=KV(2), v=KV(2), loc=w.slots[:2].clone())
    args[field] = args[field].to("meta")
    before = w.state()
    with pytest.raises(KVSlotError, match=f"{field} is on meta, the pool on cpu"):
        w.pool.set_kv_buffer(0, args["loc"], args["k"], args["v"])
    assert_same(before, w.state())


def test_translate_refuses_a_numpy_array():
    w = World()
    with pytest.raises(KVSlotError, match="loc must be a tensor"):
        w.pool.translate_loc_from_full_to_swa(np.array([1, 2]))


@pytest.mark.parametrize("what", ["meta", "float", "bool"])
def test_request_rows_refuse_scalars_that_are_not_ints(what):
    w = World()
    row = {
        "meta": torch.tensor(w.row, device="meta"),
        "float": torch.tensor(float(w.row)),
        "bool": torch.tensor(True),
    }[what]
    before = w.state()
    with pytest.raises(KVSlotError, match="request row must be an int"):
        w.rows.free(row)
    assert_same(before, w.state())


@pytest.mark.parametrize("row", [np.int64(1), np.int32(1), torch.tensor(1), torch.tensor(1, dtype=torch.int32)])
def test_request_rows_take_integer_scalars(row):
    w = World()
    w.rows.free(row)
    assert w.rows.available_size() == 3


@pytest.mark.parametrize("kind", ["int32", "int64", "list", "numpy-int32"])
def test_slots_of_every_integer_kind_are_freed(kind):
    w = World()
    values = [int(s) for s in w.slots]
    slots = {
        "int32": torch.tensor(values, dtype=torch.int32),
        "int64": torch.tensor(values),
        "list": values,
        "numpy-int32": np.asarray(values, dtype=np.int32),
    }[kind]
    w.alloc.free(slots)
    assert w.alloc.full_available_size() == w.pool.size


def test_a_partial_page_is_never_freed_while_a_slot_of_it_is_held():
    """page_size 2: freeing one slot of a page released the page under the other."""
    w = World(page_size=2)
    before = w.state()
    with pytest.raises(KVSlotError, match="still handed out"):
        w.alloc.free(w.slots[:1])
    assert_same(before, w.state())
    w.alloc.free(w.slots[:2])  # the page whole: fine
