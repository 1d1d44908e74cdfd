"""What the core tests compare a committed step with: ``attnplug.oracle.exact_attention`` over
each request's token history, and a relative-error assertion.

It never looks at the KV pool, the slot tables or any backend: only the k/v each request was
given (``Request.history``, which holds the step's tokens once it is committed), the window
rule ``p - W < j <= p`` and the contract's default scaling ``1/sqrt(head_dim)``.
"""

from __future__ import annotations

import math

import torch
from torch.nn.utils.rnn import pad_sequence

from attnplug.oracle import exact_attention


def dense_attention(step, layer: int, *, window) -> torch.Tensor:
    """Expected output of ``layer`` for every new token of a committed ``step``:
    ``[T, num_heads, head_dim]`` float64. ``window`` is None for full layers."""
    q = step.inputs["q"][:, layer].detach().to("cpu", torch.float64)
    if q.shape[0] == 0:
        return q
    keys = [req.history[layer][0] for req in step.requests]  # [seq_len, Hkv, D], with this step's tokens
    values = [req.history[layer][1] for req in step.requests]
    return exact_attention(
        q,
        pad_sequence(keys, batch_first=True),
        pad_sequence(values, batch_first=True),
        [k.shape[0] for k in keys],
        list(step.new_tokens),
        window,
        1.0 / math.sqrt(q.shape[-1]),
    )


def assert_close_rel(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str = "") -> None:
    actual = actual.detach().to("cpu", torch.float64)
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    if expected.numel() == 0:
        return
    err = (actual - expected).norm() / expected.norm().clamp_min(1e-30)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e}"
