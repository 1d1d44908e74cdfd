"""What a whole-step benchmark checks besides time: a DECODE step's attention against float32
attention over the keys the step reads (``reference_attention``), on the cache as it holds
them (an FP8 cache dequantised with its scales, ``attnplug.memory.fp8.dequantize_kv``), so the
implementation's own error is judged, not the quantisation's.

``decode_check`` runs one eager step of a backend and compares the first SWA layer and the
first full layer; a peer compares its own outputs with ``reference_attention`` over the same
``request_keys``. ``CHECK_TOLERANCE`` is what both are held to.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

import torch

from ..batch import ForwardMode
from ..memory.fp8 import dequantize_kv
from .rows import row
from .world import HybridWorld, make_step, request_keys

__all__ = ["CHECK_TOLERANCE", "reference_attention", "layer_keys", "decode_check", "check_row"]

#: the largest |output - float32 attention| a checked step may show (bf16 outputs)
CHECK_TOLERANCE = 2e-2


def reference_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """float32 attention of ``q [bs, H, D]`` over the keys at ``slots [bs, n]`` (int) of
    ``k_cache`` / ``v_cache [S, Hkv, D]`` (grouped-query: head ``h`` reads KV head
    ``h // (H // Hkv)``), each query attending all ``n`` keys. An FP8 cache is read dequantised
    with ``k_scale`` / ``v_scale`` (float32 ``[Hkv]``; None: the cache is read as it is).
    Returns ``[bs, H, D]`` float32."""
    bs, H, D = q.shape
    Hkv = k_cache.shape[1]
    k = k_cache[slots.long()]  # [bs, n, Hkv, D]
    v = v_cache[slots.long()]
    k = dequantize_kv(k, k_scale) if k_scale is not None else k.float()
    v = dequantize_kv(v, v_scale) if v_scale is not None else v.float()
    qg = q.float().view(bs, Hkv, H // Hkv, D)
    s = torch.einsum("bkgd,bnkd->bkgn", qg, k) * scale
    return torch.einsum("bkgn,bnkd->bkgd", torch.softmax(s, dim=-1), v).reshape(bs, H, D)


def layer_keys(world: HybridWorld, bs: int, seq_len: int) -> Dict[bool, Tuple[int, torch.Tensor]]:
    """``{is_swa: (layer, slots [bs, n])}``: the first SWA layer and the first full layer of the
    world (where it has one) with the slots their attention reads (``request_keys``)."""
    full, swa = request_keys(world, bs, seq_len)
    out: Dict[bool, Tuple[int, torch.Tensor]] = {}
    for layer in range(world.num_layers):
        kind = world.pool.is_swa_layer(layer)
        if kind not in out:
            out[kind] = (layer, swa if kind else full)
    return out


def decode_check(backend, world: HybridWorld, bs: int, *, with_cpu: bool = False) -> Dict[str, Tuple[int, float]]:
    """One eager DECODE step of the first ``bs`` requests through ``backend`` (``make_step``'s
    tensors), then, for the first SWA and the first full layer, ``max |output -
    reference_attention|`` over the cache after the step (its new keys stored, read
    dequantised). Returns ``{"SWA" | "full": (layer, max abs difference)}``."""
    batch = world.batch(ForwardMode.DECODE, bs, with_cpu=with_cpu)
    step = make_step(backend, world, batch.num_tokens, record=True)
    backend.init_forward_metadata(batch)
    step(batch, {})
    q_all = step.tensors[0]
    seq_len = world.context - world.num_draft + 1  # a DECODE step of the world (world.py)
    scale = 1.0 / math.sqrt(world.head_dim)
    diffs: Dict[str, Tuple[int, float]] = {}
    for is_swa, (layer, slots) in layer_keys(world, bs, seq_len).items():
        k_cache, v_cache = world.pool.get_kv_buffer(layer)
        k_scale, v_scale = world.pool.kv_scales(layer)
        ref = reference_attention(q_all[layer, :bs], k_cache, v_cache, slots, scale, k_scale, v_scale)
        got = step.recorded[layer].float()
        diffs["SWA" if is_swa else "full"] = (layer, (got - ref).abs().max().item())
    return diffs


def check_row(
    bench: str, label: str, who: str, diffs: Dict[str, Tuple[int, float]], world: HybridWorld, *, key: bool = False
) -> dict:
    """The row of a ``decode_check`` (or a peer's same comparison) of ``who`` in the case
    ``label``: the largest difference, held to ``CHECK_TOLERANCE``; ``key``: shown in the
    table even when met."""
    worst = max(d for _, d in diffs.values())
    cache = str(world.pool.dtype).replace("torch.", "")
    how = "dequantised " if world.pool.is_fp8 else ""
    parts: List[str] = [f"{kind} layer {layer}: {d:.2e}" for kind, (layer, d) in diffs.items()]
    return row(
        bench,
        f"{label} {who} vs float32 torch (same keys)",
        "max |out diff|",
        worst,
        "",
        target=f"<= {CHECK_TOLERANCE:g}",
        met=worst <= CHECK_TOLERANCE,
        key=key,
        detail=f"over the {how}{cache} cache: " + "; ".join(parts),
    )
