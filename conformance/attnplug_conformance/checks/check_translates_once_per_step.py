"""check_translates_once_per_step — rule 1 (hoisted SWA writes).

All layers of a step share ``out_cache_loc``; its translation to SWA slots happens ONCE, in
metadata preparation, never in the layer loop. Two independent observations, eager and in
graph replay:

* a counter around ``pool.translate_loc_from_full_to_swa``: no call inside ``forward`` (also
  while graphs are captured), at most one per metadata call;
* a behavioural poison that also catches a translation done without the pool's method (a
  direct gather, or inside a fused kernel, per layer): right after the metadata call and
  before the first layer, the mapping entries of the step's new tokens are rewritten to
  other, free SWA slots (filled with random values); the layers must still write the SWA KV
  at the slots translated in metadata, and the output must not change (a window table
  translated per layer would read the poisoned slots). The mapping is restored
  afterwards. When metadata made no counted call, the graph buffer (replay) and the written
  slots prove the translation happened in metadata. The output of the poisoned run is compared
  with the backend's own unpoisoned run of the same step (so a wrong window is reported by
  check_attention_matches_reference, not here).

Also over each declared FP8 cache (``...-kv_fp8_e4m3``): the slots are compared byte for byte,
the step's rows with its k/v quantised by the rule.
"""

from __future__ import annotations

import pytest
import torch

from attnplug import ForwardMode
from attnplug_conformance.support import (
    PREFIX,
    REPLAY_TOL,
    RULE_1,
    MappingPoison,
    TranslationProbe,
    assert_attention_close,
    base_config,
    conformance_check,
    kv_axis,
    kv_bits,
    new_tokens_of,
    require,
    require_graph_mode,
    same_bits,
)

__all__ = ["check_translates_once_per_step"]

CASES = [
    ("eager", ForwardMode.EXTEND),
    ("eager", ForwardMode.DECODE),
    ("eager", ForwardMode.TARGET_VERIFY),
    ("replay", ForwardMode.DECODE),
    ("replay", ForwardMode.TARGET_VERIFY),
    ("replay", ForwardMode.DRAFT_EXTEND),
]
_N = 3  # requests; replay pads them to the bucket of 4


@conformance_check(rule=RULE_1)
@pytest.mark.parametrize(*kv_axis("path,mode", CASES, [f"{p}-{m.name}" for p, m in CASES]))
def check_translates_once_per_step(path, mode, kv_cache_dtype, attnplug_capabilities, attnplug_world):
    """Exactly one translation per step, in metadata; the layers use the hoisted slots."""
    caps = attnplug_capabilities
    cfg = base_config(caps, kv_cache_dtype=kv_cache_dtype)
    require(cfg.sliding_window, "capabilities().sliding_window is False: no SWA layer, nothing to translate")
    if path == "replay":
        require_graph_mode(caps, mode)
    spec = cfg.spec()
    world = attnplug_world(spec, 21)
    L = spec.num_layers
    reqs = world.prefill(PREFIX[:_N], backend=world.reference_backend)
    new, ndt = new_tokens_of(mode, _N)
    method = "init_forward_metadata" if path == "eager" else "init_forward_metadata_replay_cuda_graph"
    where = f"{path} {mode.name} step"

    with TranslationProbe(world) as probe:
        runner = None
        if path == "replay":
            runner = world.graph_runner(max_bs=4, num_draft_tokens=ndt, bucket_sizes=[1, 2, 4], modes=[mode])
            during_capture = probe.count("layer")
            if during_capture:
                pytest.fail(
                    f"{RULE_1}: translated {during_capture} times in the layer loop while capturing "
                    f"{mode.name} graphs ({L} layers per step): the captured layers must read the hoisted "
                    "swa_out_cache_loc, never translate out_cache_loc themselves"
                )
        step = world.plan(mode, reqs, new, num_draft_tokens=ndt)
        n = step.batch.num_tokens

        def run():
            out = runner.run(step.batch, step.inputs).clone() if runner is not None else world.run_eager(step)
            world.backend.synchronize(world.device)
            return out

        # 1. Count the translations of one plain step.
        before = world.snapshot_kv()
        probe.reset()
        plain = run()
        meta, layer = probe.count("metadata"), probe.count("layer")
        total = meta + layer
        if layer or meta > 1:
            pytest.fail(
                f"{RULE_1}: translated {total} times in one {L}-layer {where} ({meta} in metadata, "
                f"{layer} in the layer loop); translate out_cache_loc once per step, in metadata, and pass "
                "the result to every layer"
            )
        if method not in probe.metadata_calls:
            pytest.fail(f"{RULE_1}: {where}: {method} was never called; the step's metadata must be prepared there")

        # 2. The same step again, with the mapping rewritten between metadata and the layers.
        world.restore_kv(before)
        poison = MappingPoison(world, step)
        seen = {}

        def after_metadata(where_called):
            if where_called != method or poison.applied:
                return
            buf = getattr(world.backend, "cuda_graph_swa_out_cache_loc", None)
            if path == "replay" and isinstance(buf, torch.Tensor):
                seen["buffer"] = buf[:n].clone()
            poison.apply()

        probe.after_metadata = after_metadata
        try:
            poisoned = run()
        finally:
            poison.restore()

    # The layers wrote the SWA KV at the slots translated in metadata, not at the poisoned ones.
    original, targets = poison.original, poison.targets
    for l in poison.swa_layers:
        kb, vb = world.pool.get_kv_buffer(l)
        k_in, v_in = world.pool.quantize(l, step.inputs["k"][:, l], step.inputs["v"][:, l])  # as stored
        pk, pv = poison.poison[l]
        if not (same_bits(kv_bits(kb)[targets], kv_bits(pk)) and same_bits(kv_bits(vb)[targets], kv_bits(pv))):
            pytest.fail(
                f"{RULE_1}: {where}: layer {l} (SWA) wrote the step's KV at SWA slots translated AFTER the "
                f"metadata call (the full->SWA mapping of the new tokens was rewritten between metadata and "
                f"the layers): the layer loop translates out_cache_loc itself ({total} counted translations)"
            )
        if not (same_bits(kv_bits(kb)[original], kv_bits(k_in)) and same_bits(kv_bits(vb)[original], kv_bits(v_in))):
            pytest.fail(
                f"{RULE_1}: {where}: layer {l} (SWA) did not store the step's KV at the SWA slots "
                f"translate(out_cache_loc) = {original[:8].tolist()} computed in metadata"
            )
    if meta == 0 and "buffer" in seen and not torch.equal(seen["buffer"].to(torch.int64), original):
        pytest.fail(
            f"{RULE_1}: {where}: metadata made no call to pool.translate_loc_from_full_to_swa and "
            f"cuda_graph_swa_out_cache_loc[:{n}] = {seen['buffer'][:8].tolist()} after it, not "
            f"translate(out_cache_loc) = {original[:8].tolist()}: the translation did not happen in metadata"
        )

    # A window table translated per layer reads the rewritten entries: the output would change.
    assert_attention_close(
        poisoned,
        plain,
        world,
        rule=RULE_1,
        tol=REPLAY_TOL[spec.dtype],
        what=f"{where} with the new tokens' full->SWA mapping rewritten after the metadata call "
        "vs the same step without (the window's SWA slots must be translated in metadata, "
        "not per layer)",
    )
