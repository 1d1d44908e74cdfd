"""A world whose full layer KV buffer is past 2**31 elements, and the memory it needs.

An offset computed in 32 bits (``slot * num_kv_heads * head_dim`` in a kernel) is exact while a
layer buffer has at most ``2**31 - 1`` elements and wraps past it, so only a buffer that large
shows the bug. ``scale_layout`` picks the smallest such world a backend declares:

* one full layer and, where the backend declares sliding windows, one small SWA layer (layer
  0, window ``WINDOW``, ``SWA_SLOTS`` slots);
* 16 query heads over 8 KV heads (wide rows: fewer slots for the allocator to hand out and
  the mapping to hold), the smallest declared head dim, a 2-byte dtype where declared
  (float16, else bfloat16; else float32), the largest declared page size (fewest pages for the
  allocator's host bookkeeping);
* a full pool of ``first_page`` pages below the boundary and ``room_pages`` past it: the full
  layer's buffers have just over 2**31 elements;
* with an FP8 ``kv_cache_dtype`` (the FP8 axis) the same shapes over an FP8 cache: the same
  element count at one byte an element (a kernel's FP8 path has offsets of its own to get
  right), the 2-byte dtype as the model's.

``hold_below`` then hands out every full page below the boundary (and gives back their SWA
pages), so every slot a request gets afterwards lies past element 2**31 of the full layer's
buffers. The pools can take a lot of memory: ``require_memory`` skips (naming the bytes needed
and free) unless they need at most ``MEMORY_SHARE`` of the device's free memory,
``out_of_memory_skips`` turns an allocation failure into a skip, and ``release`` frees the
buffers even when a failure's traceback keeps the world alive.

Device-neutral: free memory comes from ``torch.<device type>.mem_get_info`` where the device's
torch module has it, from ``os.sysconf`` on the host.
"""

from __future__ import annotations

import contextlib
import gc
import os
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence, Tuple

import pytest
import torch

from attnplug import Capabilities, ForwardMode, ReqToTokenPool, SWAKVPool
from attnplug.memory.fp8 import resolve_kv_cache_dtype

from .config import TestConfig, dtype_name
from .harness import World, WorldSpec

__all__ = [
    "BOUNDARY",
    "PROMPTS",
    "STEPS",
    "MEMORY_SHARE",
    "ScaleLayout",
    "scale_layout",
    "free_memory",
    "require_memory",
    "out_of_memory_skips",
    "make_pools",
    "hold_below",
    "release",
]

#: the first element offset a signed 32-bit offset cannot hold
BOUNDARY = 2**31
#: prompt lengths of the two requests (stored directly, no attention)
PROMPTS: Tuple[int, ...] = (300, 37)
#: the steps the backend runs on them: ``(mode, new tokens per request or None)``
STEPS: Tuple[Tuple[ForwardMode, Optional[Sequence[int]]], ...] = (
    (ForwardMode.EXTEND, (5, 9)),
    (ForwardMode.DECODE, None),
    (ForwardMode.DECODE, None),
)
#: window of the SWA layer (smaller than the prompts: eviction runs)
WINDOW = 16
#: slots of the SWA pool (its layer's buffers stay small; ``hold_below`` holds this many full slots a round)
SWA_SLOTS = 2**16
#: query and KV heads of the world
NUM_HEADS, NUM_KV_HEADS = 16, 8
#: a world runs where its pools need at most this share of the device's free memory
MEMORY_SHARE = 0.6
#: dtypes in order of preference: 2 bytes an element where declared
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _tokens_added(steps=STEPS) -> Tuple[int, ...]:
    """New tokens ``STEPS`` gives each request."""
    added = [0] * len(PROMPTS)
    for mode, new in steps:
        for i in range(len(added)):
            added[i] += new[i] if mode is ForwardMode.EXTEND else 1
    return tuple(added)


@dataclass(frozen=True)
class ScaleLayout:
    """A world past the boundary: ``spec`` and ``first_page``, the first full page whose slots all
    lie at element offsets ``>= BOUNDARY`` of the full layer's buffers (pages ``1 ..
    first_page - 1`` are the ones ``hold_below`` hands out)."""

    spec: WorldSpec
    first_page: int

    @property
    def row_elements(self) -> int:
        """Elements of one slot's row: ``num_kv_heads * head_dim``."""
        return self.spec.num_kv_heads * self.spec.head_dim

    @property
    def first_slot(self) -> int:
        """The first slot a request gets (``first_page * page_size``)."""
        return self.first_page * self.spec.page_size

    @property
    def full_elements(self) -> int:
        """Elements of each of the full layer's k and v buffers: ``(size + page_size) * row``."""
        return (self.spec.size + self.spec.page_size) * self.row_elements

    def bytes_needed(self) -> int:
        """Bytes of the pools on the device: every layer's k and v buffers, the full -> SWA
        mapping (int32, ``size + page_size + 1``) and the request table (int32)."""
        s = self.spec
        item = torch.empty((), dtype=resolve_kv_cache_dtype(s.kv_cache_dtype, s.dtype)).element_size()
        swa = len(s.swa_layers())
        rows = (s.num_layers - swa) * (s.size + s.page_size) + swa * (s.size_swa + s.page_size)
        kv = 2 * rows * self.row_elements * item
        return kv + 4 * (s.size + s.page_size + 1) + 4 * s.max_reqs * s.max_context_len

    def describe(self) -> str:
        s = self.spec
        cache = dtype_name(resolve_kv_cache_dtype(s.kv_cache_dtype, s.dtype))
        model = f" under a {dtype_name(s.dtype)} model" if s.kv_cache_dtype not in (None, s.dtype) else ""
        return (
            f"a full layer buffer of {self.full_elements:,} elements ({s.size + s.page_size:,} slots x "
            f"{s.num_kv_heads} KV heads x head_dim {s.head_dim}, {cache}{model}, page size {s.page_size})"
        )


def scale_layout(caps: Capabilities, kv_cache_dtype: Optional[torch.dtype] = None) -> ScaleLayout:
    """The world past the boundary for a backend of ``caps`` (see the module docstring), over a
    cache of ``kv_cache_dtype`` (None: the model's; an FP8 dtype the caller checked is
    declared)."""
    dtype = next((d for d in _DTYPES if d in caps.dtypes), None)
    if dtype is None:
        pytest.skip(
            f"capabilities().dtypes declares none of {', '.join(dtype_name(d) for d in _DTYPES)} "
            f"(declared: {', '.join(dtype_name(d) for d in caps.dtypes)})"
        )
    head_dim, ps = min(caps.head_dims), max(caps.page_sizes)
    boundary_slot = -(-BOUNDARY // (NUM_KV_HEADS * head_dim))  # first slot at an offset >= 2**31
    first_page = -(-boundary_slot // ps)
    lengths = [p + a for p, a in zip(PROMPTS, _tokens_added())]
    room_pages = sum(-(-n // ps) for n in lengths) + 1
    width = max(ps, 16)
    spec = TestConfig(dtype, head_dim, ps, bool(caps.sliding_window), caps.graphs, kv_cache_dtype).spec(
        num_layers=2 if caps.sliding_window else 1,
        swa_layer_ids=(0,) if caps.sliding_window else (),
        num_heads=NUM_HEADS,
        num_kv_heads=NUM_KV_HEADS,
        sliding_window=WINDOW,
        size=(first_page - 1 + room_pages) * ps,
        size_swa=max(SWA_SLOTS // ps, 1) * ps,
        max_reqs=len(PROMPTS) + 2,
        max_context_len=-(-max(lengths) // width) * width,
        scramble_swa=False,  # hold_below needs the full free list in page order
    )
    return ScaleLayout(spec, first_page)


# ---------------------------------------------------------------------------- memory
def free_memory(device: torch.device) -> Tuple[Optional[int], str]:
    """``(free bytes or None, where the number comes from)`` on ``device``: the host's
    available physical pages for ``cpu``, else ``torch.<type>.mem_get_info(device)`` (after the
    module's ``empty_cache`` where it has one); None when the device's module has no
    ``mem_get_info`` or it fails."""
    if device.type == "cpu":
        pages, size = os.sysconf("SC_AVPHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        return pages * size, "os.sysconf('SC_AVPHYS_PAGES') x os.sysconf('SC_PAGE_SIZE')"
    module = getattr(torch, device.type, None)
    source = f"torch.{device.type}.mem_get_info"
    info = getattr(module, "mem_get_info", None)
    if info is None:
        return None, f"{source} does not exist"
    empty_cache = getattr(module, "empty_cache", None)
    if callable(empty_cache):
        empty_cache()
    try:
        free, _total = info(device)
    except Exception as exc:  # a runtime that cannot answer: unknown
        return None, f"{source} raised {type(exc).__name__}: {exc}"
    return int(free), source


def require_memory(layout: ScaleLayout, device: torch.device) -> None:
    """Skip the running check unless ``layout``'s pools need at most ``MEMORY_SHARE`` of the
    free memory of ``device`` (the reason names both numbers), or when it is unknown."""
    needed = layout.bytes_needed()
    what = f"{needed:,} bytes ({needed / 2**30:.2f} GiB) on {device} for {layout.describe()}"
    free, source = free_memory(device)
    if free is None:
        pytest.skip(f"needs {what}; the free memory of {device} is unknown ({source})")
    if needed > MEMORY_SHARE * free:
        pytest.skip(
            f"needs {what}; {free:,} bytes ({free / 2**30:.2f} GiB) are free ({source}): it runs where it "
            f"needs at most {MEMORY_SHARE:.0%} of the free memory"
        )


@contextlib.contextmanager
def out_of_memory_skips(layout: ScaleLayout, device: torch.device) -> Iterator[None]:
    """Allocating inside the block: the device's out-of-memory error (``torch.OutOfMemoryError``,
    or the host allocator's ``RuntimeError`` "can't allocate memory") skips the running check,
    naming the error and the bytes the pools need."""
    try:
        yield
    except (torch.OutOfMemoryError, RuntimeError) as exc:
        if not isinstance(exc, torch.OutOfMemoryError) and "allocate memory" not in str(exc):
            raise
        gc.collect()
        pytest.skip(
            f"out of memory allocating {layout.bytes_needed():,} bytes on {device} for {layout.describe()}: "
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        )


def make_pools(layout: ScaleLayout, device) -> Tuple[SWAKVPool, ReqToTokenPool]:
    """The KV pool and request table of ``layout.spec`` on ``device`` (what ``World`` builds,
    without the allocator, the FP8 scales or a backend)."""
    s = layout.spec
    pool = SWAKVPool(
        s.size,
        s.size_swa,
        s.num_layers,
        s.swa_layers(),
        s.num_kv_heads,
        s.head_dim,
        resolve_kv_cache_dtype(s.kv_cache_dtype, s.dtype),
        device,
        page_size=s.page_size,
    )
    return pool, ReqToTokenPool(s.max_reqs, s.max_context_len, pool.device)


def hold_below(world: World, first_page: int) -> None:
    """Hand out every full page ``1 .. first_page - 1`` of ``world`` through its allocator and
    give back their SWA pages, so the pages handed out next start at ``first_page``. Rounds of
    as many pages as the SWA pool has free (every page handed out takes an SWA page). Run it
    on a fresh world (an unscrambled free list: pages go out in order)."""
    alloc, ps = world.alloc, world.spec.page_size
    left = first_page - 1
    while left:
        pages = min(left, alloc.swa_available_size() // ps)
        slots = alloc.alloc(pages * ps)
        alloc.free_swa(slots[::ps].cpu())  # one slot per page names the page
        left -= pages


def release(pool: SWAKVPool) -> None:
    """Drop ``pool``'s KV buffers and mapping and return the memory (``gc.collect`` and the
    device module's ``empty_cache`` where it has one): a failed check's traceback keeps its
    world alive, never its buffers. The pool is unusable afterwards."""
    pool.k_buffer.clear()
    pool.v_buffer.clear()
    pool.full_to_swa_index_mapping = torch.zeros(0, dtype=torch.int32, device=pool.device)
    gc.collect()
    empty_cache = getattr(getattr(torch, pool.device.type, None), "empty_cache", None)
    if callable(empty_cache):
        empty_cache()
