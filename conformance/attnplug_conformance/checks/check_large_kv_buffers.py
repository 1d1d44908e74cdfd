"""check_large_kv_buffers — a layer KV buffer past 2**31 elements is addressed correctly, or refused.

A kernel that computes the offset of a slot's row in 32 bits (``slot * num_kv_heads *
head_dim``) is exact while a layer buffer has at most ``2**31 - 1`` elements and wraps past
it: the layer reads or writes another row, silently. Only a buffer that large shows it, so
this check builds one (``attnplug_conformance.scale``: one full layer whose k and v buffers
have just over 2**31 elements, one small SWA layer where sliding windows are declared, 16 query
heads over 8 KV heads, the smallest declared head dim, a 2-byte dtype where declared, the
largest declared page size). ``capabilities().large_kv_buffers`` decides the case:

* ``past_2_31`` (declared): the allocator first hands out every page below the boundary, so
  every slot the two requests get lies past element 2**31 of the full layer's buffers. Their
  prompts (300 and 37 tokens) are stored directly (no attention); then an EXTEND step on the
  prefixes (5 and 9 tokens) and two DECODE steps run on the backend, each compared with
  attention computed in float64 from the tokens' history (``exact.dense_attention``: relative
  error per (token, layer, head) within ``LONG_TOL``), and the rows the step stored (full
  layer: ``out_cache_loc``; SWA layer: its translation) compared bit for bit with its k/v.
* ``undeclared_refused`` (not declared): constructing the backend over such a pool raises
  ``BackendConfigError`` naming the buffer's element count and ``large_kv_buffers`` (the core
  constructor's rule, ``AttentionBackend.__init__``), and leaves the pools as they were.

Both need the pools' memory on the device (8,690,999,812 bytes for the reference backend:
float16, head dim 16, page size 128): each is skipped, naming the bytes needed and free, unless
they take at most 60 % of the free memory, and skipped when allocating them runs out of memory.
Either way the pools are released before the check returns, a failure included.

Both also run over each declared FP8 cache (``...-kv_fp8_e4m3``): the same element count at one
byte an element (4,379,058,692 bytes for the reference backend), the stored rows compared byte
for byte with the step's k/v quantised by the rule, the outputs with float64 attention over the
dequantised cache. A kernel's FP8 path loads and stores through offsets of its own (bytes, a
reinterpreted pointer), so its 32-bit wrap is a bug of its own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
import torch

from attnplug import BackendConfigError, ForwardMode
from attnplug_conformance.exact import assert_matches_exact, dense_attention
from attnplug_conformance.rules import SCALE
from attnplug_conformance.scale import (
    BOUNDARY,
    PROMPTS,
    STEPS,
    ScaleLayout,
    hold_below,
    make_pools,
    out_of_memory_skips,
    release,
    require_memory,
    scale_layout,
)
from attnplug_conformance.support import (
    base_config,
    conformance_check,
    kv_axis,
    kv_bits,
    layer_kind,
    require,
    same_bits,
)

__all__ = ["check_large_kv_buffers", "CASES"]


@dataclass(frozen=True)
class Case:
    id: str
    kind: str  # past_2_31 / undeclared_refused


CASES = [Case("past_2_31", "past_2_31"), Case("undeclared_refused", "undeclared_refused")]


def _slots_past(step, layout: ScaleLayout) -> str:
    """``"slots a..b"`` of the step; raises ``RuntimeError`` when one lies below the boundary
    (the world is not what this check means to run: a harness error, not the backend's)."""
    loc = step.batch.out_cache_loc.to("cpu", torch.int64)
    lo, hi = int(loc.min()), int(loc.max())
    if lo < layout.first_slot:
        raise RuntimeError(
            f"check_large_kv_buffers: the step got slot {lo}, below the first slot past the boundary "
            f"({layout.first_slot}): hold_below did not hold every page below it"
        )
    return f"slots {lo:,}..{hi:,} (element offsets {lo * layout.row_elements:,}.., past 2**31 = {BOUNDARY:,})"


def _compare_rows(world, step, what: str) -> None:
    """The rows the step stored hold its k/v bit for bit (full layers at ``out_cache_loc``, SWA
    layers at its translation; an FP8 cache: quantised by the rule)."""
    loc = step.batch.out_cache_loc
    for layer in range(world.spec.num_layers):
        swa = world.pool.is_swa_layer(layer)
        rows = world.pool.translate_loc_from_full_to_swa(loc).long() if swa else loc.long()
        stored = world.pool.quantize(layer, step.inputs["k"][:, layer], step.inputs["v"][:, layer])
        for name, buf, given in zip("kv", world.pool.get_kv_buffer(layer), stored):
            got = kv_bits(buf)[rows].cpu()
            want = kv_bits(given).cpu()
            if not same_bits(got, want):
                t = int((got != want).flatten(1).any(1).nonzero()[0])
                pytest.fail(
                    f"{SCALE}: {what}: layer {layer} ({layer_kind(world, layer)}): the {name} row stored for "
                    f"token {t} (slot {int(rows[t]):,}) is not the step's {name} (a store offset computed in "
                    "32 bits writes another row)"
                )


def _past_2_31(caps, make_world, device, kv_cache_dtype) -> None:
    require(
        caps.large_kv_buffers,
        "capabilities().large_kv_buffers is False: layer buffers past 2**31 - 1 elements are not claimed "
        "(undeclared_refused checks that they are refused)",
    )
    layout = scale_layout(caps, kv_cache_dtype)  # its dtypes all have a float64 bound (exact.LONG_TOL)
    spec = layout.spec
    require_memory(layout, device)
    world = None
    try:
        with out_of_memory_skips(layout, device):
            world = make_world(spec, 131)
        hold_below(world, layout.first_page)
        reqs = [world.new_request() for _ in PROMPTS]
        prompt = world.plan(ForwardMode.EXTEND, reqs, list(PROMPTS))
        _slots_past(prompt, layout)
        world.store_kv(prompt)
        world.advance(prompt)
        for number, (mode, new) in enumerate(STEPS, 1):
            step = world.plan(mode, reqs, list(new) if new is not None else None)
            where = _slots_past(step, layout)
            what = f"{mode.name} step {number} of {len(STEPS)} at {where} of {layout.describe()}"
            exact = dense_attention(world, step)
            out = world.run_eager(step)
            world.backend.synchronize(world.device)
            assert_matches_exact(
                out, exact, world, what, rule=SCALE, hint="an offset computed in 32 bits reads another row"
            )
            _compare_rows(world, step, what)
            world.advance(step)
    finally:
        if world is not None:
            release(world.pool)


def _numbers(text: str) -> set:
    """The integers written in ``text`` (digits with optional ``,`` or ``_`` separators)."""
    return {int(re.sub(r"[,_]", "", m)) for m in re.findall(r"\d[\d,_]*\d|\d", text)}


def _undeclared_refused(caps, backend_cls, device, kv_cache_dtype) -> None:
    require(
        not caps.large_kv_buffers,
        "capabilities().large_kv_buffers is True: nothing to refuse (past_2_31 runs a buffer past 2**31 elements)",
    )
    layout = scale_layout(caps, kv_cache_dtype)
    spec = layout.spec
    require_memory(layout, device)
    pool = None
    try:
        with out_of_memory_skips(layout, device):
            pool, rows = make_pools(layout, device)
        elements = max(t.numel() for t in pool.k_buffer)
        mapping, table = pool.full_to_swa_index_mapping.clone(), rows.req_to_token.clone()
        what = f"a pool with {layout.describe()}"
        try:
            backend_cls(pool, rows, num_heads=spec.num_heads, sliding_window=spec.sliding_window)
        except BackendConfigError as exc:
            text = str(exc)
            if "large_kv_buffers" not in text or elements not in _numbers(text):
                pytest.fail(
                    f"{SCALE}: the BackendConfigError refusing {what} must name the buffer's {elements} elements "
                    f"and large_kv_buffers: {text}"
                )
        except Exception as exc:
            pytest.fail(
                f"{SCALE}: constructing the backend over {what} raised {type(exc).__name__}: {exc}; expected "
                "BackendConfigError naming the element count and large_kv_buffers"
            )
        else:
            pytest.fail(
                f"{SCALE}: capabilities().large_kv_buffers is False but the backend accepted {what} (more than "
                "2**31 - 1 elements): its constructor must raise BackendConfigError (AttentionBackend.__init__ "
                "does; a subclass must call it first)"
            )
        backend_cls.synchronize(pool.device)
        for layer in range(spec.num_layers):
            for name, buf in zip("kv", pool.get_kv_buffer(layer)):
                written = int(torch.count_nonzero(kv_bits(buf)))  # no copy of the buffer
                if written:
                    pytest.fail(
                        f"{SCALE}: refusing {what}, the constructor wrote {written} elements of layer {layer}'s "
                        f"{name} buffer (the pool is the engine's: a refused constructor leaves it as it was)"
                    )
        if not torch.equal(pool.full_to_swa_index_mapping, mapping):
            pytest.fail(f"{SCALE}: refusing {what}, the constructor changed the full -> SWA mapping")
        if not torch.equal(rows.req_to_token, table):
            pytest.fail(f"{SCALE}: refusing {what}, the constructor changed req_to_token")
    finally:
        if pool is not None:
            release(pool)


@conformance_check(rule=SCALE)
@pytest.mark.parametrize(*kv_axis("case", CASES, [c.id for c in CASES]))
def check_large_kv_buffers(
    case, kv_cache_dtype, attnplug_capabilities, attnplug_world, attnplug_backend_cls, attnplug_device
):
    """A buffer past 2**31 elements attended correctly where declared, refused where not."""
    caps = attnplug_capabilities
    if kv_cache_dtype is not None:
        base_config(caps, kv_cache_dtype=kv_cache_dtype)  # skips, naming fp8_kv_dtypes, where undeclared
    if case.kind == "past_2_31":
        _past_2_31(caps, attnplug_world, attnplug_device, kv_cache_dtype)
    else:
        _undeclared_refused(caps, attnplug_backend_cls, attnplug_device, kv_cache_dtype)
