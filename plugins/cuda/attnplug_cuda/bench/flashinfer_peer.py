"""Peer ``flashinfer``: FlashInfer's batch decode on the ``hybrid_step`` world, attention only.

FlashInfer is optional, never a dependency: it is imported when the peer first runs, and
where ``import flashinfer`` fails the benchmark records one row saying why
(``PeerUnavailable``). What is measured, for each DECODE batch size of ``hybrid_step``:

* the same pool, the same keys: attnplug's per-layer caches ``[S, Hkv, D]`` are a page-size-1
  ``NHD`` paged cache, passed as ``[S, 1, Hkv, D]`` views. The page indices of a request are
  the slots of its keys: on SWA layers the window's SWA slots (``full_to_swa_index_mapping``
  of the last ``min(seq_len, W)`` positions of its ``req_to_token`` row), on full layers its
  ``req_to_token`` row ``[:seq_len]``;
* ``BatchDecodeWithPagedKVCacheWrapper`` with tensor cores and CUDA-graph buffers, one
  wrapper per layer kind, planned once per batch size outside the timed region
  (``window_left = W - 1`` on SWA layers, -1 on full layers; the first plan JIT-compiles
  FlashInfer's kernels);
* every layer's attention (FlashInfer stores no KV) captured in ONE graph with the run's
  graph class, timed as attnplug's whole steps are (``Timer.replay_us``);
* checked against float32 PyTorch attention over the same gathered keys (the first SWA
  layer and the first full layer): a row ``max |out diff|`` held to ``<= 2e-2``.
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch

from attnplug import ForwardMode
from attnplug.bench import Ctx, row
from attnplug.bench.step_case import PeerUnavailable
from attnplug.bench.world import HybridWorld

__all__ = ["NAME", "measure", "request_keys", "reference_attention"]

NAME = "flashinfer"
WORKSPACE_BYTES = 128 << 20
CHECK_TOLERANCE = 2e-2


def _flashinfer():
    try:
        import flashinfer
    except Exception as exc:  # ImportError, or a broken install (missing runtime dependency)
        raise PeerUnavailable(
            f"flashinfer not installed: `import flashinfer` failed ({type(exc).__name__}: {exc})"
        ) from None
    return flashinfer


def request_keys(world: HybridWorld, bs: int, seq_len: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(full [bs, seq_len], swa [bs, min(seq_len, W)])`` int32 slots of the first ``bs``
    requests' keys: full-pool slots (``req_to_token``) and the window's SWA slots. Raises
    ``ValueError`` when a window key has no live SWA slot (the world is not what a step sees)."""
    rows = torch.tensor(world.req_rows[:bs], dtype=torch.int64, device=world.pool.device)
    full = world.rows.req_to_token[rows, :seq_len].to(torch.int32).contiguous()
    keys = min(seq_len, world.window)
    swa = world.pool.full_to_swa_index_mapping[full[:, seq_len - keys :].long()].to(torch.int32).contiguous()
    if bool((full <= 0).any()) or bool((swa <= 0).any()):
        raise ValueError(f"request_keys: a key of the first {bs} requests has no live slot (seq_len={seq_len})")
    return full, swa


def reference_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, scale: float
):
    """float32 attention of ``q [bs, H, D]`` over the keys at ``slots [bs, n]`` of
    ``k_cache``/``v_cache [S, Hkv, D]`` (grouped-query: head ``h`` reads KV head ``h // (H // Hkv)``);
    returns ``[bs, H, D]`` float32."""
    bs, H, D = q.shape
    Hkv = k_cache.shape[1]
    k = k_cache[slots.long()].float()  # [bs, n, Hkv, D]
    v = v_cache[slots.long()].float()
    qg = q.float().view(bs, Hkv, H // Hkv, D)
    s = torch.einsum("bkgd,bnkd->bkgn", qg, k) * scale
    return torch.einsum("bkgn,bnkd->bkgd", torch.softmax(s, dim=-1), v).reshape(bs, H, D)


def _wrapper(fi, slots: torch.Tensor, window_left: int, world: HybridWorld, scale: float):
    """A CUDA-graph decode wrapper planned for the requests' ``slots [bs, n]``."""
    bs, n = slots.shape
    dev = slots.device
    indptr = torch.arange(bs + 1, dtype=torch.int32, device=dev) * n
    indices = slots.reshape(-1).contiguous()
    last_page_len = torch.ones(bs, dtype=torch.int32, device=dev)
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
        torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=dev),
        kv_layout="NHD",
        use_cuda_graph=True,
        use_tensor_cores=True,
        paged_kv_indptr_buffer=torch.empty_like(indptr),
        paged_kv_indices_buffer=torch.empty_like(indices),
        paged_kv_last_page_len_buffer=torch.empty_like(last_page_len),
    )
    wrapper.plan(
        indptr,
        indices,
        last_page_len,
        world.num_heads,
        world.num_kv_heads,
        world.head_dim,
        1,  # page size
        pos_encoding_mode="NONE",
        window_left=window_left,
        q_data_type=world.pool.dtype,
        kv_data_type=world.pool.dtype,
        sm_scale=scale,
    )
    return wrapper


def measure(
    ctx: Ctx, world: HybridWorld, mode: ForwardMode, bs: int, *, bench: str = "hybrid_step"
) -> Tuple[float, str]:
    """Microseconds per replay of every layer's FlashInfer decode attention for the first
    ``bs`` requests, and a detail line; appends the check row to ``ctx.rows``."""
    import time

    if mode is not ForwardMode.DECODE:
        raise ValueError(f"the flashinfer peer runs DECODE steps only, got {mode.name}")
    fi = _flashinfer()
    pool, L = world.pool, world.num_layers
    seq_len = world.context - world.num_draft + 1  # a DECODE step of the world (world.py)
    scale = 1.0 / math.sqrt(world.head_dim)
    full, swa = request_keys(world, bs, seq_len)
    t0 = time.monotonic()
    wrappers = {True: _wrapper(fi, swa, world.window - 1, world, scale), False: _wrapper(fi, full, -1, world, scale)}
    plan_s = time.monotonic() - t0
    gen = torch.Generator(device=pool.device).manual_seed(2)
    q = torch.randn(L, bs, world.num_heads, world.head_dim, generator=gen, device=pool.device).to(pool.dtype)
    out = torch.empty_like(q)
    caches: List[Tuple[torch.Tensor, torch.Tensor]] = []
    for layer in range(L):
        k_cache, v_cache = pool.get_kv_buffer(layer)
        caches.append((k_cache.unsqueeze(1), v_cache.unsqueeze(1)))  # [S, page 1, Hkv, D]
    kinds = [pool.is_swa_layer(layer) for layer in range(L)]

    def every_layer() -> torch.Tensor:
        for layer in range(L):
            wrappers[kinds[layer]].run(q[layer], caches[layer], out=out[layer])
        return out

    every_layer()
    ctx.timer.sync()
    diffs = {}
    for is_swa, slots in ((True, swa), (False, full)):
        layer: Optional[int] = next((i for i in range(L) if kinds[i] == is_swa), None)
        if layer is None:
            continue
        k_cache, v_cache = pool.get_kv_buffer(layer)
        ref = reference_attention(q[layer], k_cache, v_cache, slots, scale)
        diffs["SWA" if is_swa else "full"] = (layer, (out[layer].float() - ref).abs().max().item())
    worst = max(d for _, d in diffs.values())
    ctx.rows.append(
        row(
            bench,
            f"decode bs={bs} {NAME} vs float32 torch (same keys)",
            "max |out diff|",
            worst,
            "",
            target=f"<= {CHECK_TOLERANCE:g}",
            met=worst <= CHECK_TOLERANCE,
            key=bs == 1,
            detail="; ".join(f"{kind} layer {layer}: {d:.2e}" for kind, (layer, d) in diffs.items()),
        )
    )
    calls = 100 if bs < 64 else 40
    us = ctx.timer.replay_us(every_layer, calls=calls, repeats=3 if ctx.quick else 5)
    version = getattr(fi, "__version__", "?")
    detail = (
        f"flashinfer {version}: {L} layers' decode attention in one graph (tensor cores, page size 1, "
        f"window_left {world.window - 1} on SWA layers); planned in {plan_s:.1f} s; check max diff {worst:.1e}"
    )
    return us, detail
