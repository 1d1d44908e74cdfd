"""What the mutants that recompute attention share: the per-request query layout the
reference's ``_attend`` works in, and the way back to one row per token."""

from __future__ import annotations

import torch

HALF = (torch.float16, torch.bfloat16)
#: spec overrides of the long-context witnesses: full attention only, 4 query heads on 1 KV head
FULL_MQA = dict(sliding_window=None, swa_layer_ids=(), num_heads=4, num_kv_heads=1)


def padded_queries(q, keys, key_pos, md):
    """``q`` [T, H, D] laid out per request: ``(qp [bs, Q, Hkv, G, D] float32, key positions
    [bs, 1, K], query positions [bs, Q, 1])``, the positions shaped for the causal and window
    masks."""
    T, H, D = q.shape
    bs, K, Hkv, _ = keys.shape
    G, Q = H // Hkv, md.q_len_max
    qp = torch.zeros(bs, Q, H, D, dtype=torch.float32, device=q.device)
    qp[md.token_req, md.token_idx] = q.float()
    q_pos = md.q_start[:, None] + torch.arange(Q, device=q.device)
    return qp.view(bs, Q, Hkv, G, D), key_pos[:, None, :], q_pos[:, :, None]


def visible(kp, qq, window, seq_lens=None):
    """Which keys each query sees ``[bs, Q, K]``: causal, within ``window`` (None: all), and
    below ``seq_lens`` when given."""
    mask = kp <= qq
    if seq_lens is not None:
        mask = mask & (kp < seq_lens[:, None, None])
    if window is not None:
        mask = mask & (kp > qq - window)
    return mask


def qk_logits(qp, keys, scaling):
    """The scaled q.k logits ``[bs, Hkv, G, Q, K]`` in float32."""
    return torch.einsum("bqhgd,bkhd->bhgqk", qp, keys.float()) * scaling


def per_token(out, md, dtype):
    """``out`` [bs, Q, Hkv, G, D] back to one row per token, [T, H, D] in ``dtype``."""
    bs, Q, Hkv, G, D = out.shape
    return out.reshape(bs, Q, Hkv * G, D)[md.token_req, md.token_idx].to(dtype)
