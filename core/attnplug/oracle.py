"""The float64 oracle: exact attention over the k/v each request was given, kept on the host.

The one computation of what attention must return that the soak, the conformance suite and
the tests compare backends with. It never reads the KV pool, a slot table or a backend: only
the k/v each request was given (``History`` keeps them for the soak) and the rule of the
contract — a query at position ``p`` attends to keys ``p - W < j <= p`` on SWA layers and
``0 <= j <= p`` on full layers, GQA by head groups.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch

__all__ = ["History", "stack_histories", "exact_attention", "relative_errors"]


class History:
    """The k/v one request has written, per layer, in float64 on the host.

    ``k`` / ``v``: ``[num_layers, max_context, num_kv_heads, head_dim]`` float64 (CPU);
    positions ``[0, length)`` are the request's committed tokens (the values are the
    dtype-rounded values the backend was given, so a live KV slot must hold exactly them).
    """

    def __init__(self, num_layers: int, max_context: int, num_kv_heads: int, head_dim: int) -> None:
        shape = (num_layers, max_context, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=torch.float64)
        self.v = torch.zeros(shape, dtype=torch.float64)

    def write(self, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Record positions ``start .. start + n - 1``; ``k``/``v``: ``[n, L, Hkv, D]`` float64 CPU."""
        n = k.shape[0]
        self.k[:, start : start + n] = k.transpose(0, 1)
        self.v[:, start : start + n] = v.transpose(0, 1)


def stack_histories(histories: Sequence[History], length: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Positions ``[0, length)`` of every request, stacked: ``k``, ``v`` as
    ``[bs, num_layers, length, num_kv_heads, head_dim]`` float64 (zeros past a request's end)."""
    return (torch.stack([h.k[:, :length] for h in histories]), torch.stack([h.v[:, :length] for h in histories]))


def exact_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    seq_lens: Sequence[int],
    new_tokens: Sequence[int],
    window: Optional[int],
    scaling: float,
    *,
    logit_softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Exact output of one layer for every new token of one step.

    ``q``: ``[T, H, D]`` float64 (the step's queries, request by request); ``keys`` /
    ``values``: ``[bs, K, Hkv, D]`` float64, request ``i``'s k/v at positions ``[0, K)`` (only
    ``[0, seq_lens[i])`` is read); the last ``new_tokens[i]`` of its ``seq_lens[i]`` positions
    are the queries. ``window`` is None on full layers. Logits are ``s = scaling * q.k``,
    capped to ``c * tanh(s / c)`` when ``logit_softcap=c``; ``sinks`` (``[H]``, natural-log
    units) joins each head's softmax as one more logit whose value weight is zero. Returns
    ``[T, H, D]`` float64.
    """
    T, H, D = q.shape
    bs, kmax, hkv, _ = keys.shape
    if T == 0:
        return q.new_zeros(0, H, D)
    qmax = max(new_tokens)
    group = H // hkv
    seq = torch.tensor(seq_lens, dtype=torch.int64)
    new = torch.tensor(new_tokens, dtype=torch.int64)
    token_req = torch.repeat_interleave(torch.arange(bs), new)
    token_idx = torch.arange(T) - (torch.cumsum(new, 0) - new)[token_req]
    qp = q.new_zeros(bs, qmax, H, D)
    qp[token_req, token_idx] = q
    q_pos = (seq - new)[:, None] + torch.arange(qmax)  # [bs, Q]
    k_pos = torch.arange(kmax)
    mask = k_pos[None, None, :] <= q_pos[:, :, None]  # causal, and inside the request
    if window is not None:
        mask &= k_pos[None, None, :] > q_pos[:, :, None] - window
    scores = torch.einsum("bqkgd,bjkd->bkgqj", qp.view(bs, qmax, hkv, group, D), keys) * scaling
    if logit_softcap is not None:
        scores = logit_softcap * torch.tanh(scores / logit_softcap)
    scores = scores.masked_fill(~mask[:, None, None], -math.inf)
    if sinks is not None:  # one more column per head: in the denominator, never in P.V
        sink = sinks.to("cpu", torch.float64).view(1, hkv, group, 1, 1).expand(bs, hkv, group, qmax, 1)
        scores = torch.cat([scores, sink], dim=-1)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # padded query rows have no key: zero
    if sinks is not None:
        probs = probs[..., :kmax]
    out = torch.einsum("bkgqj,bjkd->bqkgd", probs, values).reshape(bs, qmax, H, D)
    return out[token_req, token_idx]


def relative_errors(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """Per-token relative error ``||actual_t - expected_t|| / ||expected_t||`` (``[T]`` float64;
    ``inf`` where ``actual_t`` is not finite). Shapes ``[T, ...]``."""
    a = actual.to(torch.float64).flatten(1)
    e = expected.flatten(1)
    err = (a - e).norm(dim=1) / e.norm(dim=1).clamp_min(1e-12)
    return torch.where(torch.isfinite(a).all(dim=1), err, torch.full_like(err, math.inf))
