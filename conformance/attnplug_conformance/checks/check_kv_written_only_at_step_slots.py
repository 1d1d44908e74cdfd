"""check_kv_written_only_at_step_slots — the KV of a step goes to its slots and nowhere else.

``forward`` stores k/v at ``out_cache_loc`` on full layers and at the hoisted
``translate(out_cache_loc)`` on SWA layers, and writes no other row. Every row of every
layer that holds no live token is first filled with random values; after one step (eager,
or replayed with padding) exactly the step's rows changed, and they hold the step's k and v
bit for bit. In a padded replay the padded tokens may write slot 0 (the padding sink) and
nothing else. With ``save_kv_cache=False`` (the engine stored the step's KV itself) a step
writes nothing at all. The worlds' SWA free lists are scrambled (SWA slots differ from full
slots). Twin-world comparisons in the other checks repeat the same integrity check in every
configuration they run (every declared dtype, head dim and page size).

Over each declared FP8 cache (``...-kv_fp8_e4m3``) the step's rows must hold the step's k/v
quantised by the one rule (``attnplug.memory.fp8``: the pool's ``quantize`` with its per-head
scales) byte for byte; the free rows hold FP8 noise.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from attnplug import ForwardMode
from attnplug_conformance.support import (
    KV_SLOTS,
    PREFIX,
    base_config,
    changed_rows,
    conformance_check,
    dtype_name,
    kv_axis,
    kv_bits,
    layer_kind,
    new_tokens_of,
    poison_free_rows,
    require,
    require_graph_mode,
    show_rows,
)

__all__ = ["check_kv_written_only_at_step_slots"]

CASES = [
    ("eager_paged", ForwardMode.EXTEND),  # the smallest declared page size > 1: neighbours share a page
    ("eager_no_save", ForwardMode.EXTEND),
    ("eager", ForwardMode.EXTEND),
    ("eager_no_save", ForwardMode.DECODE),
    ("eager", ForwardMode.DECODE),
    ("eager", ForwardMode.TARGET_VERIFY),
    ("replay_padded", ForwardMode.DECODE),
    ("replay_padded", ForwardMode.TARGET_VERIFY),
]
_N = 3


@conformance_check(rule=KV_SLOTS)
@pytest.mark.parametrize(*kv_axis("path,mode", CASES, [f"{p}-{m.name}" for p, m in CASES]))
def check_kv_written_only_at_step_slots(path, mode, kv_cache_dtype, attnplug_capabilities, attnplug_world):
    """Only the step's rows change, and they hold the step's k/v (quantised in an FP8 cache)."""
    caps = attnplug_capabilities
    if path.startswith("replay"):
        require_graph_mode(caps, mode)
    if path == "eager_paged":
        paged = sorted(p for p in caps.page_sizes if p > 1)
        require(bool(paged), "capabilities().page_sizes declares no page size > 1")
        cfg = base_config(caps, page_size=paged[0], kv_cache_dtype=kv_cache_dtype)
    else:
        cfg = base_config(caps, kv_cache_dtype=kv_cache_dtype)
    world = attnplug_world(cfg.spec(), 51)
    pool = world.pool
    reqs = world.prefill(PREFIX[:_N], backend=world.reference_backend)
    new, ndt = new_tokens_of(mode, _N)
    runner = None
    if path.startswith("replay"):
        runner = world.graph_runner(max_bs=4, num_draft_tokens=ndt, bucket_sizes=[4], modes=[mode])
    step = world.plan(mode, reqs, new, num_draft_tokens=ndt)

    # Poison every row that holds no live token (the step's rows and slot 0 included).
    poison_free_rows(world, seed=7)
    save = path != "eager_no_save"
    path = "eager" if path == "eager_paged" else path
    if not save:
        world.store_kv(step)  # the engine's own store
    before = world.snapshot_kv()

    if runner is not None:
        runner.run(step.batch, step.inputs)
    elif save:
        world.run_eager(step)
    else:
        # The layers get other k/v than the engine stored: a layer that stores anyway shows.
        other = dict(step.inputs, k=-step.inputs["k"], v=-step.inputs["v"])
        world.run_eager(dataclasses.replace(step, inputs=other), save_kv_cache=False)
    world.backend.synchronize(world.device)

    loc = step.batch.out_cache_loc.to(torch.int64)
    swa_loc = pool.translate_loc_from_full_to_swa(loc).to(torch.int64)
    padded = runner is not None and runner.bucket_for(step.batch) * (ndt or 1) > step.batch.num_tokens
    where = f"{path.replace('_', ' ')} {mode.name} step (page size {cfg.page_size})"
    for layer, (kb0, vb0) in enumerate(before):
        kb, vb = pool.get_kv_buffer(layer)
        slots = swa_loc if pool.is_swa_layer(layer) else loc
        allowed = torch.cat([slots.cpu(), torch.zeros(1, dtype=torch.int64)]) if padded else slots.cpu()
        changed = torch.unique(torch.cat([changed_rows(kb0, kb), changed_rows(vb0, vb)]))
        if not save and changed.numel():
            pytest.fail(
                f"{KV_SLOTS}: {where} with save_kv_cache=False: layer {layer} ({layer_kind(world, layer)}) "
                f"wrote slots {show_rows(changed)}; with save_kv_cache=False a layer must not write the KV cache"
            )
        outside = changed[~torch.isin(changed, allowed)]
        if outside.numel():
            sink = " (slot 0, the padding sink, is allowed in a padded replay)" if padded else ""
            pytest.fail(
                f"{KV_SLOTS}: {where}: layer {layer} ({layer_kind(world, layer)}) wrote slots {show_rows(outside)} "
                f"outside the step's slots {show_rows(slots)}{sink}"
            )
        stored = pool.quantize(layer, step.inputs["k"][:, layer], step.inputs["v"][:, layer])  # as given, or FP8
        for name, buf, given in (("k", kb, stored[0]), ("v", vb, stored[1])):
            wrong = torch.nonzero((kv_bits(buf)[slots] != kv_bits(given)).flatten(1).any(1)).flatten().cpu()
            if wrong.numel():
                rule = f" quantised by the rule ({dtype_name(pool.dtype)}, the layer's scales)" if pool.is_fp8 else ""
                pytest.fail(
                    f"{KV_SLOTS}: {where}: layer {layer} ({layer_kind(world, layer)}) did not store the step's "
                    f"{name}{rule} at its slots: tokens {show_rows(wrong)} (slots {show_rows(slots.cpu()[wrong])}) "
                    "hold other values"
                )
