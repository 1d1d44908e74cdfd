"""A hybrid full + SWA world for whole-step benchmarks, on any device.

``build_world`` makes one pool, allocator and request table, then ``max_bs`` requests of
``context - num_draft`` prefix tokens each, allocated through ``SWATokenAllocator`` (so
the full -> SWA mapping is the allocator's), with the out-of-window SWA slots evicted as an
engine would between steps. Each request then gets ``num_draft`` more slots for the step
(positions ``context - num_draft .. context - 1``): a DECODE step uses the first of them
(``seq_len = context - num_draft + 1``), TARGET_VERIFY / DRAFT_EXTEND use all of them
(``seq_len = context``). The steps are replayed many times over the same slots.

The cache holds the model's dtype, or an FP8 dtype (``kv_cache_dtype``, with per-layer
``kv_scales``; ``bench_kv_scales`` gives the benchmarks' own): then its values are the same
random numbers a model-dtype world of the same seed holds, quantised by the pool's rule
(``attnplug.memory.fp8.quantize_kv``), so the two worlds hold the same keys up to the
quantisation. ``request_keys`` gives the slots a step of the first requests reads.

``make_step`` is the "model": every layer's attention over random per-layer q/k/v of the
model's dtype (static tensors, so the graph runner's only per-step input copy is a tiny one).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Tuple

import torch

from attnplug import ForwardBatch, ForwardMode, ReqToTokenPool, SWAKVPool, SWATokenAllocator

from ..memory.fp8 import is_fp8, quantize_kv

__all__ = ["HybridWorld", "build_world", "make_step", "request_keys", "bench_kv_scales", "INPUTS"]

#: the GraphRunner's per-token input: one element (q/k/v live in the step, see make_step)
INPUTS = {"x": ((1,), torch.float32)}


@dataclass
class HybridWorld:
    """The world of a step benchmark (see the module docstring): ``pool`` (its ``dtype`` is
    what the cache stores), ``dtype`` (the model's: q, k, v and the outputs), the requests'
    rows ``req_rows`` and their step slots ``step_slots``."""

    pool: SWAKVPool
    rows: ReqToTokenPool
    alloc: SWATokenAllocator
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    window: int
    context: int
    num_draft: int
    req_rows: List[int]
    step_slots: torch.Tensor  # [max_bs, num_draft] int64, device
    dtype: torch.dtype  # the model's dtype (q, k, v); pool.dtype is the cache's
    _batches: Dict[Tuple[ForwardMode, int, bool], ForwardBatch] = field(default_factory=dict)

    def batch(self, mode: ForwardMode, bs: int, *, with_cpu: bool) -> ForwardBatch:
        """The step of the first ``bs`` requests; ``with_cpu`` adds ``seq_lens_cpu``."""
        key = (mode, bs, with_cpu)
        if key in self._batches:
            return self._batches[key]
        dev = self.pool.device
        q = 1 if mode is ForwardMode.DECODE else self.num_draft
        seq_len = self.context - self.num_draft + q
        start = self.context - self.num_draft
        rows = torch.tensor(self.req_rows[:bs], dtype=torch.int64).to(dev)
        loc = self.step_slots[:bs, :q].reshape(-1).contiguous()
        positions = (start + torch.arange(q, dtype=torch.int64, device=dev)).repeat(bs)
        batch = ForwardBatch(
            forward_mode=mode,
            batch_size=bs,
            req_pool_indices=rows,
            seq_lens=torch.full((bs,), seq_len, dtype=torch.int64, device=dev),
            out_cache_loc=loc,
            positions=positions,
            seq_lens_cpu=[seq_len] * bs if with_cpu else None,
            num_draft_tokens=q if mode.is_speculative else None,
        )
        self._batches[key] = batch
        return batch


def build_world(
    *,
    num_layers: int,
    max_bs: int,
    context: int,
    window: int,
    num_draft: int = 4,
    num_heads: int = 32,
    num_kv_heads: int = 8,
    head_dim: int = 128,
    dtype: torch.dtype = torch.bfloat16,
    device: object = "cpu",
    fill_random: bool = True,
    seed: int = 0,
    kv_cache_dtype: Optional[torch.dtype] = None,
    kv_scales: Optional[Mapping[int, Tuple[object, object]]] = None,
) -> HybridWorld:
    """See the module docstring. SWA layers: ``layer % 4 != 3``. ``dtype``: the model's;
    ``kv_cache_dtype``: what the pool stores (None: ``dtype``); ``kv_scales``: ``{layer:
    (k_scale, v_scale)}`` of an FP8 cache (``SWAKVPool.set_kv_scales``; layers not named keep
    1.0), set before the fill. The caller synchronises the device before timing anything (the
    random fill is queued work)."""
    prefix = context - num_draft
    if prefix < 1 or window < 1 or max_bs < 1:
        raise ValueError(
            f"build_world needs context > num_draft, window >= 1 and max_bs >= 1; got context={context}, "
            f"num_draft={num_draft}, window={window}, max_bs={max_bs}"
        )
    swa_layers = [l for l in range(num_layers) if l % 4 != 3]
    size = max_bs * (context + 8)
    # Live SWA slots per request after eviction: window - 1 + num_draft; plus one prefix in flight.
    size_swa = max_bs * (window + num_draft + 8) + context + 64
    cache_dtype = dtype if kv_cache_dtype is None else kv_cache_dtype
    pool = SWAKVPool(size, size_swa, num_layers, swa_layers, num_kv_heads, head_dim, cache_dtype, device)
    if kv_scales:
        if not pool.is_fp8:
            raise ValueError(f"build_world: kv_scales apply to an FP8 cache, this one stores {cache_dtype}")
        for layer, (k_scale, v_scale) in kv_scales.items():
            pool.set_kv_scales(layer, k_scale, v_scale)
    alloc = SWATokenAllocator(pool)
    rows = ReqToTokenPool(max_bs + 2, context + 64, device)
    req_rows: List[int] = []
    step_slots = []
    for _ in range(max_bs):
        row = rows.alloc()
        loc = alloc.alloc(prefix)
        rows.req_to_token[row, :prefix] = loc.to(torch.int32)
        alloc.evict_out_of_window(rows, row, prefix, window)
        req_rows.append(row)
    for row in req_rows:
        loc = alloc.alloc(num_draft)
        rows.req_to_token[row, prefix:context] = loc.to(torch.int32)
        step_slots.append(loc)
    if fill_random:
        _fill_random(pool, dtype, seed)
    return HybridWorld(
        pool=pool,
        rows=rows,
        alloc=alloc,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        window=window,
        context=context,
        num_draft=num_draft,
        req_rows=req_rows,
        step_slots=torch.stack(step_slots),
        dtype=dtype,
    )


def _fill_random(pool: SWAKVPool, dtype: torch.dtype, seed: int) -> None:
    """Every K then every V buffer drawn from N(0, 1) in ``dtype`` (one generator, in layer
    order); an FP8 pool stores the same draws quantised with each layer's scales."""
    gen = torch.Generator(device=pool.device).manual_seed(seed)
    if not is_fp8(pool.dtype):
        for buf in (*pool.k_buffer, *pool.v_buffer):
            buf.normal_(generator=gen)
        return
    for which, buffers in ((0, pool.k_buffer), (1, pool.v_buffer)):
        for layer, buf in enumerate(buffers):
            drawn = torch.empty(buf.shape, dtype=dtype, device=pool.device).normal_(generator=gen)
            buf.copy_(quantize_kv(drawn, pool.kv_scales(layer)[which], pool.dtype))
            del drawn


def bench_kv_scales(num_layers: int) -> Dict[int, Tuple[float, float]]:
    """The benchmarks' FP8 scales, ``{layer: (k_scale, v_scale)}``: a different pair on every
    layer (``k = (1 + (layer % 7) / 8) / 32``, ``v = (1 + ((layer + 3) % 5) / 8) / 32``, 1/32 to
    7/128), so a kernel that ignores a layer's scale, or swaps K's and V's, computes something
    else. N(0, 1) keys and values quantised at these scales use at most about 5 / (1/32) = 160 of
    float8_e4m3fn's 448: no saturation."""
    return {layer: ((1 + (layer % 7) / 8) / 32, (1 + ((layer + 3) % 5) / 8) / 32) for layer in range(num_layers)}


def request_keys(world: HybridWorld, bs: int, seq_len: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(full [bs, seq_len], swa [bs, min(seq_len, W)])`` int32 slots of the first ``bs``
    requests' keys when they hold ``seq_len`` tokens: full-pool slots (``req_to_token``) and
    the window's SWA slots, in position order. Raises ``ValueError`` when a key has no live
    slot (the world is not what a step sees)."""
    rows = torch.tensor(world.req_rows[:bs], dtype=torch.int64, device=world.pool.device)
    full = world.rows.req_to_token[rows, :seq_len].to(torch.int32).contiguous()
    keys = min(seq_len, world.window)
    swa = world.pool.full_to_swa_index_mapping[full[:, seq_len - keys :].long()].to(torch.int32).contiguous()
    if bool((full <= 0).any()) or bool((swa <= 0).any()):
        raise ValueError(f"request_keys: a key of the first {bs} requests has no live slot (seq_len={seq_len})")
    return full, swa


def make_step(backend, world: HybridWorld, max_tokens: int, *, seed: int = 1, record: bool = False):
    """``step(batch, inputs)``: every layer's attention over static random q/k/v of that
    layer, of the model's dtype ``world.dtype`` (the same tensors for the same ``seed``,
    whatever the backend and the cache's dtype); returns the last layer's output
    ``[T, H, D]``. ``record``: each call also leaves every layer's output in ``step.recorded``
    (a list of ``L`` tensors; for eager checks, never inside a graph)."""
    L, H, Hkv, D = world.num_layers, world.num_heads, world.num_kv_heads, world.head_dim
    dev, dtype = world.pool.device, world.dtype
    gen = torch.Generator(device=dev).manual_seed(seed)
    q_all = torch.randn(L, max_tokens, H, D, device=dev, dtype=dtype, generator=gen)
    k_all = torch.randn(L, max_tokens, Hkv, D, device=dev, dtype=dtype, generator=gen)
    v_all = torch.randn(L, max_tokens, Hkv, D, device=dev, dtype=dtype, generator=gen)

    def step(batch: ForwardBatch, inputs: Dict[str, torch.Tensor]) -> torch.Tensor:
        T = batch.num_tokens
        out: Optional[torch.Tensor] = None
        if record:
            step.recorded = []
        for l in range(L):
            out = backend.forward(q_all[l, :T], k_all[l, :T], v_all[l, :T], l, batch)
            if record:
                step.recorded.append(out)
        return out

    step.tensors = (q_all, k_all, v_all)  # keep alive with the step
    return step
