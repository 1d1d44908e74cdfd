"""Catalogue, batches: a step that is not consistent with the request table and the pools is
refused, naming the request, the field and the value, with nothing written (issue 37).

Each case builds a step an engine could plausibly get wrong (a slot another request holds, a
freed slot, the same slot twice, a forgotten ``req_to_token`` write, ``seq_lens`` off by one,
a row twice, a padded request pointing at a live slot, positions or an evicted window out of
step), runs it through each backend's metadata call, and checks the refusal and that every
pool tensor, the allocator's bookkeeping and the request table are bit-identical afterwards.
The controls are steps that look unusual but are right (padding, reserved positions past
``seq_lens``, chunked prefill, drafts): they pass and match the float64 oracle. Before this
issue every refused case here was accepted: the layer then wrote into another request's KV,
stored nothing, or attended over the wrong keys.

The world: three live requests (A and B in the step, C live but not in it) on a hybrid pool
(layers 0 and 2 sliding-window, W = 4), page size 1 and 2.
"""

from __future__ import annotations

import os
from typing import Callable, Dict, List, Optional, Tuple

import pytest
import torch

from attnplug import ForwardBatch, ForwardMode, ReqToTokenPool, SWAKVPool, SWATokenAllocator
from attnplug.backends.portable import PortableBackend
from attnplug.backends.reference import ReferenceBackend
from attnplug.batch import BatchError
from attnplug.oracle import exact_attention
from memory_snapshot import assert_same, snapshot

W, LAYERS, HQ, HKV, D = 4, 3, 4, 2, 16
PREFILL = {"A": 6, "B": 5, "C": 4}


def _device_of(backend_cls) -> torch.device:
    """The cuda backend runs on the GPU where there is one (its checks then read the device under
    ATTNPLUG_VALIDATE=1), else on the host under the Triton interpreter; the others on the host."""
    on_gpu = backend_cls.name == "cuda" and torch.cuda.is_available()
    return torch.device("cuda" if on_gpu else "cpu")


@pytest.fixture(autouse=True)
def _validation_on(monkeypatch):
    """Host batches are always checked; a GPU's only in validation mode, which these cases are about."""
    monkeypatch.setenv("ATTNPLUG_VALIDATE", "1")


def _backends():
    found = [ReferenceBackend, PortableBackend]
    if os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available():
        try:
            from attnplug_cuda.backend import CudaBackend

            found.append(CudaBackend)
        except ImportError:  # the cuda plugin or Triton is not installed
            pass
    return found


class World:
    """Pools, three prefilled requests (A, B, C), a backend; ``step(...)`` builds a step of A
    and B with slots allocated and written as a correct engine does, for cases to break."""

    def __init__(self, backend_cls, page_size: int = 1) -> None:
        torch.manual_seed(0)
        self.ps = page_size
        dev = self.device = _device_of(backend_cls)
        dtype = torch.float16 if dev.type == "cuda" else torch.float32
        self.pool = SWAKVPool(64, 48, LAYERS, [0, 2], HKV, D, dtype, dev, page_size=page_size)
        self.alloc = SWATokenAllocator(self.pool)
        self.rows = ReqToTokenPool(6, 32, dev)
        self.backend = backend_cls(self.pool, self.rows, num_heads=HQ, sliding_window=W)
        self.row: Dict[str, int] = {}
        self.slots: Dict[str, List[int]] = {}
        for name, n in PREFILL.items():
            self.row[name] = self.rows.alloc()
            self.slots[name] = []
            self._give(name, n)
        names = list(PREFILL)
        loc = torch.tensor([s for n in names for s in self.slots[n]])
        self.run(self._batch(ForwardMode.EXTEND, names, [PREFILL[n] for n in names], loc))

    # ------------------------------------------------------------------ a correct engine
    def _give(self, name: str, n: int) -> List[int]:
        """Allocate ``n`` more slots for request ``name`` and write them into its row."""
        held = self.slots[name]
        last = held[-1] if held else -1
        new = self.alloc.alloc_extend([len(held)], [len(held) + n], [last], host=True).tolist()
        row = self.row[name]
        self.rows.req_to_token[row, len(held) : len(held) + n] = torch.tensor(new, dtype=torch.int32)
        held += new
        return new

    def _batch(self, mode, names, ext, loc, *, rows=None, seq=None, positions=None, q_len=None) -> ForwardBatch:
        rows = rows if rows is not None else [self.row[n] if n else 0 for n in names]
        seq = seq if seq is not None else [len(self.slots[n]) if n else 1 for n in names]
        dev = self.device
        return ForwardBatch(
            mode,
            len(names),
            torch.tensor(rows).to(dev),
            torch.tensor(seq).to(dev),
            loc.to(dev),
            positions=None if positions is None else positions.to(dev),
            extend_seq_lens=torch.tensor(ext).to(dev),
            extend_seq_lens_cpu=list(ext),
            num_draft_tokens=q_len,
        )

    def step(self, mode=ForwardMode.DECODE, names=("A", "B"), ext=None) -> dict:
        """The fields of a correct step (slots allocated, rows written)."""
        q = {ForwardMode.DECODE: 1, ForwardMode.TARGET_VERIFY: 3, ForwardMode.DRAFT_EXTEND: 2}.get(mode)
        ext = list(ext) if ext is not None else [q] * len(names)
        loc = [s for n, e in zip(names, ext) for s in self._give(n, e)]
        return dict(mode=mode, names=list(names), ext=ext, loc=torch.tensor(loc), q_len=None if q is None else q)

    def build(self, f: dict) -> ForwardBatch:
        loc = f["loc"] if isinstance(f["loc"], torch.Tensor) else torch.tensor(f["loc"])
        return self._batch(
            f["mode"],
            f["names"],
            f["ext"],
            loc,
            rows=f.get("rows"),
            seq=f.get("seq"),
            positions=f.get("positions"),
            q_len=f.get("q_len") if f["mode"].is_speculative else None,
        )

    def positions(self, f: dict) -> torch.Tensor:
        seq = f.get("seq") or [len(self.slots[n]) if n else 1 for n in f["names"]]
        return torch.tensor([s - e + j for s, e in zip(seq, f["ext"]) for j in range(e)])

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        self.backend.init_forward_metadata(batch)
        g = torch.Generator().manual_seed(batch.num_tokens)
        T = batch.num_tokens
        q, k, v = (torch.randn(T, h, D, generator=g).to(self.device, self.pool.dtype) for h in (HQ, HKV, HKV))
        return torch.stack([self.backend.forward(q, k, v, layer, batch) for layer in range(LAYERS)])

    def state(self):
        return snapshot(self.pool, self.alloc, self.rows)

    def slot_of(self, name: str, pos: int) -> int:
        return self.slots[name][pos]

    def write(self, name: str, pos: int, slot: int) -> None:
        """A wrong engine: put ``slot`` at ``pos`` of ``name``'s row."""
        self.rows.req_to_token[self.row[name], pos] = slot


# --------------------------------------------------------------------- the cases
# A case: (world, fields) -> fields' changes, the needles its message must hold.
Case = Tuple[Callable[[World, dict], Optional[dict]], Tuple[str, ...]]


def _steal(owner: str, pos: int, rule_needle: str) -> Case:
    """A's new token takes ``owner``'s slot at ``pos`` (A's row written with it, as an engine
    that mixed up its bookkeeping would)."""

    def change(w: World, f: dict):
        slot = w.slot_of(owner, pos)
        p = len(w.slots["A"]) - f["ext"][0]
        w.write("A", p, slot)
        loc = f["loc"].clone()
        loc[0] = slot
        return dict(loc=loc)

    return change, (rule_needle,)


def _unallocated(freed: bool) -> Case:
    def change(w: World, f: dict):
        if freed:
            extra = w.alloc.alloc(w.ps)  # handed out, then given back
            w.alloc.free(extra)
            slot = int(extra[0])
        else:  # never handed out: the pool's last slot
            slot = w.pool.size + w.ps - 1
        p = len(w.slots["A"]) - f["ext"][0]
        w.write("A", p, slot)
        loc = f["loc"].clone()
        loc[0] = slot
        return dict(loc=loc)

    return change, ("out_cache_loc[0]", "not an allocated slot")


def _same_slot_twice(w: World, f: dict):
    """B's new token gets A's new slot too (both rows written)."""
    e = f["ext"][0]
    slot = int(f["loc"][0])
    w.write("B", len(w.slots["B"]) - f["ext"][1], slot)
    loc = f["loc"].clone()
    loc[e] = slot
    return dict(loc=loc)


def _forgot_row(w: World, f: dict):
    w.write("A", len(w.slots["A"]) - 1, 0)


def _row_at_wrong_position(w: World, f: dict):
    p = len(w.slots["A"]) - 1
    w.write("A", p + 1, w.slot_of("A", p))
    w.write("A", p, 0)


def _seq(delta: int, which: int = 0):
    def change(w: World, f: dict):
        seq = [len(w.slots[n]) for n in f["names"]]
        seq[which] += delta
        return dict(seq=seq)

    return change


def _row_twice(w: World, f: dict):
    return dict(rows=[w.row["A"], w.row["A"]])


def _padded(slot_of: Callable[[World], int]):
    """A third, padded request (row 0) whose token writes to ``slot_of(world)``."""

    def change(w: World, f: dict):
        loc = torch.cat([f["loc"], torch.tensor([slot_of(w)])])
        return dict(names=f["names"] + [None], ext=f["ext"] + [1], loc=loc)

    return change


def _positions(delta: int):
    def change(w: World, f: dict):
        pos = w.positions(f)
        pos[-1] += delta
        return dict(positions=pos)

    return change


def _evict_inside_window(w: World, f: dict):
    """Free the SWA slot of A's position seq - W (the new token's window reaches it only on a
    multi-token step; for decode seq - W + 1 is the oldest key), as a wrong engine would."""
    s, e = len(w.slots["A"]), f["ext"][0]
    first_key = max(0, s - e - W + 1)
    page = w.slot_of("A", first_key) // w.ps * w.ps
    w.alloc.free_swa(list(range(page, page + w.ps)) if w.ps > 1 else [page])


def _garbage_in_row(value: int):
    def change(w: World, f: dict):
        w.write("A", 1, value)

    return change


def _swap_tokens(i: int, j: int):
    def change(w: World, f: dict):
        loc = f["loc"].clone()
        loc[[i, j]] = loc[[j, i]]
        return dict(loc=loc)

    return change


def _draft_of_other(w: World, f: dict):
    """The last draft of A takes C's slot at position 1 (row written)."""
    q = f["ext"][0]
    slot = w.slot_of("C", 1)
    w.write("A", len(w.slots["A"]) - 1, slot)
    loc = f["loc"].clone()
    loc[q - 1] = slot
    return dict(loc=loc)


def _forgot_draft(w: World, f: dict):
    w.write("B", len(w.slots["B"]) - 1, 0)


DECODE_CASES: Dict[str, Case] = {
    "slot-of-C-not-in-step": _steal("C", 2, "held by live request row"),
    "slot-of-B-in-step": _steal("B", 2, "held twice"),
    "slot-of-A-own-prefix": _steal("A", 1, "held twice"),
    "freed-slot": _unallocated(freed=True),
    "never-allocated-slot": _unallocated(freed=False),
    "same-slot-twice": (_same_slot_twice, ("held twice",)),
    "forgot-req_to_token": (_forgot_row, ("out_cache_loc[0]", "req_to_token[1, 6] = 0")),
    "row-written-one-late": (_row_at_wrong_position, ("out_cache_loc[0]", "req_to_token[1, 6] = 0")),
    "seq-lens-beyond-row": (_seq(+2), ("seq_lens[0] = 9", "req_to_token[1, 8] = 0")),
    "seq-lens-short-by-one": (_seq(-1), ("out_cache_loc[0]", "position 5")),
    "seq-lens-of-B-short": (_seq(-2, which=1), ("out_cache_loc[1]", "request 1")),
    "row-twice": (_row_twice, ("req_pool_indices[1]", "appears once")),
    "padded-into-C": (_padded(lambda w: w.slot_of("C", 0)), ("out_cache_loc[2]", "padded request 2")),
    "padded-into-A": (_padded(lambda w: w.slot_of("A", 3)), ("out_cache_loc[2]", "padded request 2")),
    "padded-into-free-slot": (_padded(lambda w: w.pool.size), ("out_cache_loc[2]", "padded request 2")),
    "positions-off-by-one": (_positions(+1), ("positions[1]", "position 5")),
    "positions-behind": (_positions(-3), ("positions[1]",)),
    "swa-evicted-inside-window": (_evict_inside_window, ("SWA slot was freed", "request 0")),
    "row-holds-minus-1": (_garbage_in_row(-1), ("req_to_token[1, 1]", "seq_lens[0]")),
    "row-holds-sink": (_garbage_in_row(0), ("req_to_token[1, 1]", "nothing")),
    "row-holds-out-of-pool": (_garbage_in_row(10_000), ("req_to_token[1, 1]", "10000")),
    "tokens-swapped": (_swap_tokens(0, 1), ("out_cache_loc[0]", "request 0")),
}

EXTEND_CASES: Dict[str, Case] = {
    "extend-tokens-reversed": (_swap_tokens(0, 2), ("out_cache_loc[0]", "request 0")),
    "extend-requests-interleaved": (_swap_tokens(2, 3), ("out_cache_loc[2]",)),
    "extend-forgot-row": (_forgot_row, ("out_cache_loc[2]", "= 0")),
    "extend-slot-of-C": _steal("C", 0, "held by live request row"),
    "extend-seq-short": (_seq(-1), ("request 0",)),
    "extend-positions": (_positions(+1), ("positions[4]",)),
    "extend-swa-evicted-inside-window": (_evict_inside_window, ("SWA slot was freed",)),
}

SPEC_CASES: Dict[str, Case] = {
    "draft-slot-of-C": (_draft_of_other, ("held by live request row",)),
    "draft-forgot-row": (_forgot_draft, ("request 1", "= 0")),
    "draft-seq-short": (_seq(-1), ("request 0",)),
    "draft-row-twice": (_row_twice, ("appears once",)),
}


def _refused(backend_cls, page_size, mode, ext, case: Case) -> None:
    w = World(backend_cls, page_size)
    f = w.step(mode, ext=ext)
    change, needles = case
    f.update(change(w, f) or {})
    before = w.state()
    with pytest.raises(BatchError) as info:
        w.run(w.build(f))
    message = str(info.value)
    for needle in needles:
        assert needle in message, message
    assert_same(before, w.state())


BACKENDS = _backends()
IDS = [cls.name for cls in BACKENDS]


@pytest.mark.parametrize("backend_cls", BACKENDS, ids=IDS)
@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_decode_step_refused(case, backend_cls):
    _refused(backend_cls, 1, ForwardMode.DECODE, None, DECODE_CASES[case])


@pytest.mark.parametrize("case", ["slot-of-C-not-in-step", "freed-slot", "same-slot-twice", "forgot-req_to_token"])
def test_decode_step_refused_on_pages_of_two(case):
    change, needles = DECODE_CASES[case]
    needles = tuple(n for n in needles if "req_to_token[" not in n)
    _refused(ReferenceBackend, 2, ForwardMode.DECODE, None, (change, needles))


@pytest.mark.parametrize("backend_cls", BACKENDS, ids=IDS)
@pytest.mark.parametrize("case", list(EXTEND_CASES))
def test_extend_step_refused(case, backend_cls):
    _refused(backend_cls, 1, ForwardMode.EXTEND, [3, 2], EXTEND_CASES[case])


@pytest.mark.parametrize("mode", ForwardMode.speculative(), ids=lambda m: m.name)
@pytest.mark.parametrize("case", list(SPEC_CASES))
def test_speculative_step_refused(case, mode):
    _refused(ReferenceBackend, 1, mode, None, SPEC_CASES[case])


# --------------------------------------------------------------------- the controls
def _reserved_ahead(w: World, f: dict):
    """The engine reserved (and wrote) A's next two positions before they are used."""
    extra = w.alloc.alloc_extend([len(w.slots["A"])], [len(w.slots["A"]) + 2], [w.slots["A"][-1]]).tolist()
    w.rows.req_to_token[w.row["A"], len(w.slots["A"]) : len(w.slots["A"]) + 2] = torch.tensor(extra, dtype=torch.int32)


CONTROLS = {
    "decode": (ForwardMode.DECODE, None, None),
    "decode-with-positions": (ForwardMode.DECODE, None, lambda w, f: dict(positions=w.positions(f))),
    "decode-padded-to-sink": (ForwardMode.DECODE, None, _padded(lambda w: 0)),
    "decode-padded-to-no-slot": (ForwardMode.DECODE, None, _padded(lambda w: -1)),
    "decode-reserved-ahead": (ForwardMode.DECODE, None, _reserved_ahead),
    "extend-chunk": (ForwardMode.EXTEND, [3, 2], None),
    "extend-long-chunk": (ForwardMode.EXTEND, [7, 1], None),
    "target-verify": (ForwardMode.TARGET_VERIFY, None, None),
    "draft-extend": (ForwardMode.DRAFT_EXTEND, None, None),
}


@pytest.mark.parametrize("backend_cls", BACKENDS, ids=IDS)
@pytest.mark.parametrize("case", list(CONTROLS))
def test_consistent_step_passes_and_matches_the_oracle(case, backend_cls):
    mode, ext, change = CONTROLS[case]
    w = World(backend_cls)
    tol = 1e-5 if w.pool.dtype == torch.float32 else 2e-3
    f = w.step(mode, ext=ext)
    if change is not None:
        f.update(change(w, f) or {})
    batch = w.build(f)
    out = w.run(batch)  # [layers, T, HQ, D]
    # the oracle over what the step stored: every real token attends to its request's keys
    g = torch.Generator().manual_seed(batch.num_tokens)
    T = batch.num_tokens
    q = torch.randn(T, HQ, D, generator=g).to(w.pool.dtype).cpu()  # what run() gave the layers
    t = 0
    for name, e, seq in zip(f["names"], f["ext"], batch.seq_lens.tolist()):
        if name is None:
            t += e
            continue
        for layer in range(LAYERS):
            window = W if layer in (0, 2) else None
            slots = w.rows.req_to_token[w.row[name], :seq].long()
            if window is not None:
                slots = w.pool.full_to_swa_index_mapping[slots].long()
                slots = torch.where(slots > 0, slots, 0)
            k_buf, v_buf = (b[slots][None].cpu().double() for b in w.pool.get_kv_buffer(layer))
            want = exact_attention(q[t : t + e].double(), k_buf, v_buf, [seq], [e], window, D**-0.5)
            torch.testing.assert_close(out[layer, t : t + e].cpu().double(), want, atol=tol, rtol=tol)
        t += e


def test_cuda_backend_refuses_a_head_dim_its_kernels_cannot_tile():
    """head_dim 8 failed inside the first kernel launch with a bare AssertionError."""
    try:
        from attnplug_cuda.backend import CudaBackend
    except ImportError:
        pytest.skip("the cuda plugin is not installed")
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("needs the Triton interpreter or a GPU")
    from attnplug.backend import BackendConfigError

    device = "cuda" if torch.cuda.is_available() else "cpu"
    pool = SWAKVPool(16, 16, 1, [], 2, 8, torch.float16, device)
    with pytest.raises(BackendConfigError, match="head_dim=8"):
        CudaBackend(pool, ReqToTokenPool(2, 8, device), num_heads=2)
