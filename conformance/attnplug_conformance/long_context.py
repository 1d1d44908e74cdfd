"""The long-context case of ``check_attention_matches_reference``: precision over thousands of
keys, measured against attention computed in float64.

A kernel that keeps its softmax sum or its P·V accumulator in a half-precision type passes
short sequences (a few rounding steps) and drifts as the number of keys grows. Comparing with
the reference backend would hide part of that (it rounds its output to the same dtype), so
this case compares with a dense float64 computation from the tokens' history and bounds the
relative error ``||out - exact|| / ||exact||`` of every (token, layer, head) row.
"""

from __future__ import annotations

from typing import Dict, List, Sequence

import pytest
import torch
from torch.nn.utils.rnn import pad_sequence

from attnplug import ForwardMode
from attnplug.oracle import exact_attention

from .compare import layer_kind
from .config import TestConfig, dtype_name, require, spec_sizes
from .harness import Step, World
from .rules import ATTENTION

__all__ = ["LONG_CONTEXT", "LONG_TOL", "dense_attention", "long_context_world", "run_long_context"]

#: prompt lengths: one long request past 4,096 keys and one short one
LONG_CONTEXT = (4100, 37)
#: bound on the relative error per (token, layer, head) against float64. A correct kernel
#: (inputs in the dtype, float32 accumulation, P rounded to the dtype before P·V, output
#: rounded to the dtype) stays within a few units of the dtype's epsilon.
LONG_TOL: Dict[torch.dtype, float] = {torch.float16: 2e-3, torch.bfloat16: 1.2e-2, torch.float32: 1e-4}


def dense_attention(world: World, step: Step) -> torch.Tensor:
    """Exact attention of ``step`` (planned, not committed) in float64 on the host:
    ``[T, L, H, D]``, from ``attnplug.oracle.exact_attention`` (the contract's rule: causal,
    ``p - W < j <= p`` on SWA layers, GQA by head groups, the spec's ``logit_softcap`` and the
    world's per-layer ``sinks``). Keys of a request: its committed history (float64) then the
    step's own k/v."""
    spec = world.spec
    q_all = step.inputs["q"].detach().to("cpu", torch.float64)
    k_new = step.inputs["k"].detach().to("cpu", torch.float64)
    v_new = step.inputs["v"].detach().to("cpu", torch.float64)
    starts = [sum(step.new_tokens[:i]) for i in range(len(step.new_tokens))]
    per_layer: List[torch.Tensor] = []
    for layer in range(spec.num_layers):
        keys, values = [], []
        for req, start, n in zip(step.requests, starts, step.new_tokens):
            k_hist, v_hist = req.history[layer]
            keys.append(torch.cat([k_hist, k_new[start : start + n, layer]]))  # [S, Hkv, D]
            values.append(torch.cat([v_hist, v_new[start : start + n, layer]]))
        seq_lens = [k.shape[0] for k in keys]
        window = spec.sliding_window if world.pool.is_swa_layer(layer) else None
        per_layer.append(
            exact_attention(
                q_all[:, layer],
                pad_sequence(keys, batch_first=True),
                pad_sequence(values, batch_first=True),
                seq_lens,
                list(step.new_tokens),
                window,
                world.backend.scaling,
                logit_softcap=spec.logit_softcap,
                sinks=world.sinks[layer] if world.sinks is not None else None,
            )
        )
    return torch.stack(per_layer, dim=1)


def _check(out: torch.Tensor, exact: torch.Tensor, world: World, what: str) -> None:
    dtype = world.spec.dtype
    tol = LONG_TOL[dtype]
    a = out.detach().to("cpu", torch.float64)
    if a.shape != exact.shape:
        pytest.fail(f"{ATTENTION}: {what}: output shape {tuple(a.shape)}, expected {tuple(exact.shape)}")
    if not torch.isfinite(a).all():
        pytest.fail(f"{ATTENTION}: {what}: non-finite output")
    err = (a - exact).norm(dim=-1) / exact.norm(dim=-1).clamp_min(1e-12)  # [T, L, H]
    worst = float(err.max())
    if worst > tol:
        t, l, h = [int(i) for i in torch.unravel_index(torch.argmax(err), err.shape)]
        pytest.fail(
            f"{ATTENTION}: {what}: relative error {worst:.3g} against float64 attention at token {t}, "
            f"layer {l} ({layer_kind(world, l)}), head {h} (bound {tol:g} for {dtype_name(dtype)}: "
            "accumulate the softmax sum and P·V in float32)"
        )


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
        _check(out, exact, world, f"{mode.name} step over {LONG_CONTEXT[0]} keys ({dtype_name(dtype)})")
        world.advance(step)
