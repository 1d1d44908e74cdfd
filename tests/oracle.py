"""An independent float64 oracle: dense masked softmax over each request's token history.

It never looks at the KV pool, the slot tables or any backend: only the k/v each request
was given (``Request.history``) and the window rule ``p - W < j <= p``.
"""

from __future__ import annotations

import math

import torch


def dense_attention(step, layer: int, *, num_heads: int, window) -> torch.Tensor:
    """Expected output of ``layer`` for every new token of a committed ``step``:
    ``[T, num_heads, head_dim]`` float64. ``window`` is None for full layers."""
    q_all = step.inputs["q"][:, layer].detach().to("cpu", torch.float64)
    outs = []
    offset = 0
    for req, n in zip(step.requests, step.new_tokens):
        k, v = req.history[layer]  # [seq_len, Hkv, D], includes this step's tokens
        seq_len, hkv, d = k.shape
        group = num_heads // hkv
        k = k.repeat_interleave(group, dim=1)  # [seq, H, D]
        v = v.repeat_interleave(group, dim=1)
        for i in range(n):
            p = seq_len - n + i
            lo = 0 if window is None else max(0, p - window + 1)
            q = q_all[offset + i]  # [H, D]
            scores = torch.einsum("hd,jhd->hj", q, k[lo : p + 1]) / math.sqrt(d)
            outs.append(torch.einsum("hj,jhd->hd", torch.softmax(scores, dim=-1), v[lo : p + 1]))
        offset += n
    if not outs:
        return torch.zeros(0, num_heads, q_all.shape[-1], dtype=torch.float64)
    return torch.stack(outs)


def assert_close_rel(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str = "") -> None:
    actual = actual.detach().to("cpu", torch.float64)
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    if expected.numel() == 0:
        return
    err = (actual - expected).norm() / expected.norm().clamp_min(1e-30)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e}"
