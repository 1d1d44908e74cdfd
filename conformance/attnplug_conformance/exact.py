"""Attention computed in float64 from the tokens' history, and the bound a backend's output is
held to against it.

The reference backend rounds its output to the dtype like any backend, so comparing with it
hides part of a half-precision error; the checks that judge precision (the long context, the
soft-cap and sinks, the sampled worlds, the op layer) compare with ``dense_attention`` instead:
``attnplug.oracle.exact_attention`` over the k/v each request was given, never the KV pool. In an
FP8 world that is what the cache holds for them (``World.cached_values``: dequantised in float64,
exact), so the bound judges a backend's own error, never the quantisation's: the model dtype's
bound applies (the backend and the oracle read the same bytes).

The measure is a relative error per (token, layer, head) row,
``||out - exact|| / max(||exact||, 1e-3 * sqrt(head_dim))``: inputs are about N(0, 1), so an
output row has a norm of order ``sqrt(head_dim)`` unless a sink takes nearly all of its head's
weight, and then the floor keeps a half-precision output rounded to zero from counting as a
100 % error. A correct kernel (inputs in the dtype, float32 accumulation, P rounded to the
dtype before P·V, output rounded to the dtype) stays within a few units of the dtype's
epsilon: ``LONG_TOL``.
"""

from __future__ import annotations

import math
from typing import Dict, List

import pytest
import torch
from torch.nn.utils.rnn import pad_sequence

from attnplug.oracle import exact_attention

from .compare import cache_note, layer_kind
from .config import dtype_name
from .harness import Step, World

__all__ = ["LONG_TOL", "dense_attention", "row_errors", "assert_matches_exact"]

#: bound on the relative error per (token, layer, head) against float64 attention
LONG_TOL: Dict[torch.dtype, float] = {torch.float16: 2e-3, torch.bfloat16: 1.2e-2, torch.float32: 1e-4}


def dense_attention(world: World, step: Step) -> torch.Tensor:
    """Exact attention of ``step`` (planned, not committed) in float64 on the host:
    ``[T, L, H, D]``, from ``attnplug.oracle.exact_attention`` (the contract's rule: causal,
    ``p - W < j <= p`` on SWA layers, GQA by head groups, the spec's ``logit_softcap`` and the
    world's per-layer ``sinks``). Keys of a request: its committed history (float64) then the
    step's own k/v, both as the cache holds them (``World.cached_values``: dequantised in an
    FP8 world)."""
    spec = world.spec
    q_all = step.inputs["q"].detach().to("cpu", torch.float64)
    starts = [sum(step.new_tokens[:i]) for i in range(len(step.new_tokens))]
    per_layer: List[torch.Tensor] = []
    for layer in range(spec.num_layers):
        k_new, v_new = world.cached_values(layer, step.inputs["k"][:, layer], step.inputs["v"][:, layer])
        keys, values = [], []
        for req, start, n in zip(step.requests, starts, step.new_tokens):
            k_hist, v_hist = req.history[layer]
            keys.append(torch.cat([k_hist, k_new[start : start + n]]))  # [S, Hkv, D]
            values.append(torch.cat([v_hist, v_new[start : start + n]]))
        if not keys:  # an IDLE step
            per_layer.append(q_all[:, layer])
            continue
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


def row_errors(out: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """``[T, L, H]`` float64: the relative error of every (token, layer, head) row of ``out``
    (``[T, L, H, D]``, any dtype and device) against ``exact`` (float64, host), with the floor
    ``1e-3 * sqrt(D)`` on the denominator; ``inf`` where a row of ``out`` is not finite."""
    a = out.detach().to("cpu", torch.float64)
    floor = 1e-3 * a.shape[-1] ** 0.5
    err = (a - exact).norm(dim=-1) / exact.norm(dim=-1).clamp_min(floor)
    return torch.where(torch.isfinite(a).all(-1), err, torch.full_like(err, math.inf))


def assert_matches_exact(out: torch.Tensor, exact: torch.Tensor, world: World, what: str, *, rule: str, hint: str = ""):
    """Fail the running check (message: ``rule: what: ...``) unless every (token, layer, head)
    row of ``out`` is within ``LONG_TOL`` of ``exact`` (``row_errors``). The message names the
    worst row (token, layer and its kind, head), its error and the bound; ``hint`` is added in
    parentheses after the bound."""
    dtype = world.spec.dtype
    tol = LONG_TOL[dtype]
    if tuple(out.shape) != tuple(exact.shape):
        pytest.fail(f"{rule}: {what}: output shape {tuple(out.shape)}, expected {tuple(exact.shape)}")
    if out.numel() == 0:
        return
    err = row_errors(out, exact)
    worst = float(err.max())
    if worst <= tol:
        return
    t, l, h = [int(i) for i in torch.unravel_index(torch.argmax(err), err.shape)]
    where = f"token {t}, layer {l} ({layer_kind(world, l)}), head {h}"
    bad = int((err > tol).sum())
    if math.isinf(worst):
        found = f"non-finite output at {where}"
    else:
        found = f"relative error {worst:.3g} against float64 attention at {where}"
    pytest.fail(
        f"{rule}: {what}: {found} ({bad} of {err.numel()} rows out of bounds; bound {tol:g} for "
        f"{dtype_name(dtype)}{cache_note(world)}{'; ' + hint if hint else ''})"
    )
