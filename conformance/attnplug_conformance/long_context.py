"""The long-context case of ``check_attention_matches_reference``: precision over thousands of
keys, measured against attention computed in float64.

A kernel that keeps its softmax sum or its P·V accumulator in a half-precision type passes
short sequences (a few rounding steps) and drifts as the number of keys grows. Comparing with
the reference backend would hide part of that (it rounds its output to the same dtype), so
this case compares with a dense float64 computation from the tokens' history and bounds the
relative error of every (token, layer, head) row (``attnplug_conformance.exact``).
"""

from __future__ import annotations

from typing import Sequence

from attnplug import ForwardMode

from .config import TestConfig, dtype_name, require, spec_sizes
from .exact import LONG_TOL, assert_matches_exact, dense_attention
from .rules import ATTENTION

__all__ = ["LONG_CONTEXT", "long_context_world", "run_long_context"]

#: prompt lengths: one long request past 4,096 keys and one short one
LONG_CONTEXT = (4100, 37)


def long_context_world(cfg: TestConfig, make_world, lengths: Sequence[int], *, seed: int, window: int, **features):
    """``(world, requests)``: a world of 2 layers (one SWA when supported, one full), 4 q heads
    over 1 KV head, pools sized for requests of ``lengths`` keys, holding one request per
    length whose prompt is stored directly (no attention: only the steps under test attend).
    ``features``: further ``WorldSpec`` fields (``logit_softcap``, ``sinks``)."""
    ps = cfg.page_size
    size, size_swa = spec_sizes(ps, min_swa=sum(lengths) + 64 * ps)
    longest = max(lengths) + 8
    spec = cfg.spec(
        num_layers=2,
        swa_layer_ids=(0,) if cfg.sliding_window else (),
        num_heads=4,
        num_kv_heads=1,
        sliding_window=window,
        size=size,
        size_swa=size_swa,
        max_reqs=4,
        max_context_len=-(-longest // max(ps, 16)) * max(ps, 16),
        **features,
    )
    world = make_world(spec, seed)
    reqs = [world.new_request() for _ in lengths]
    prompt = world.plan(ForwardMode.EXTEND, reqs, list(lengths))
    world.store_kv(prompt)
    world.advance(prompt)
    return world, reqs


def run_long_context(cfg: TestConfig, make_world) -> None:
    """One request of ``LONG_CONTEXT[0]`` keys and one short one (prompts stored directly,
    no attention), then DECODE and TARGET_VERIFY on the backend, each compared with
    ``dense_attention``. 2 layers (one SWA when supported, one full)."""
    dtype = cfg.dtype
    require(dtype in LONG_TOL, f"no long-context bound for {dtype_name(dtype)}")
    world, reqs = long_context_world(cfg, make_world, LONG_CONTEXT, seed=97, window=64)
    for mode, ndt in ((ForwardMode.DECODE, None), (ForwardMode.TARGET_VERIFY, 3)):
        step = world.plan(mode, reqs, num_draft_tokens=ndt)
        exact = dense_attention(world, step)
        out = world.run_eager(step)
        world.backend.synchronize(world.device)
        assert_matches_exact(
            out,
            exact,
            world,
            f"{mode.name} step over {LONG_CONTEXT[0]} keys ({dtype_name(dtype)})",
            rule=ATTENTION,
            hint="accumulate the softmax sum and P·V in float32",
        )
        world.advance(step)
