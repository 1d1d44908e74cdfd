"""check_paged_ops — the op layer over caches an engine owns (``AttentionBackend.paged_ops``).

An engine that allocates its own KV memory (vLLM, SGLang) calls a backend's ``PagedOps``:
``plan`` once per step and cache group, ``store_kv`` and ``attend`` per layer
(``attnplug.ops``). Here an engine-like world does exactly that, every step compared with
attention computed in float64 from the k/v each request was given
(``attnplug.oracle.exact_attention``; relative error per (token, head) within ``LONG_TOL``):

* caches as vLLM lays them out: separate ``[num_blocks, block_size, Hkv, D]`` K and V, and
  the K / V halves of one interleaved ``[num_blocks, block_size, Hkv, 2 * D]`` cache;
* block sizes 1 and 16; blocks handed out scrambled, block 0 never (the engine's null block),
  block-table padding of 0 and -1, slot-mapping padding of -1 (skipped). An op layer whose
  kernels serve only some block sizes declares them in ``native_block_sizes`` (an operator's
  blocks of 128 and up, say; other block sizes run a slower path or are refused): each case then
  runs at the declared size of its block size's rank among 1 and 16 (``block_size_for``), the
  same checks at a size its kernels serve. Op layers without the attribute run 1 and 16;
* a mixed batch: fresh prompts, chunks of prompts with a cached prefix, decodes, a request
  long enough (300 keys) that a kernel splits the KV range; GQA, a window, soft-cap and sinks
  where declared;
* poison: every slot no request owns holds NaN, so a read outside a request's keys shows;
* ``store_kv`` writes the mapped slots exactly and leaves every other slot bit for bit;
* bad arguments (a query of another dtype, a cache of another shape, a wrong block size
  type) raise ``OpsInputError`` and write nothing.

FP8 caches (``...-kv_fp8_e4m3``, where the ops list the dtype in ``fp8_kv_dtypes``): every case
again over FP8 caches under a half-precision model dtype, with ``k_scale`` / ``v_scale`` as
engines pass them: one float32 value per layer (a 0-dim tensor, vLLM's ``layer._k_scale``) for
separate caches, one per KV head (``[Hkv]``) for the interleaved ones; values from
``harness.fp8_scales`` (part of the heads saturating). ``store_kv`` must write each mapped slot's
k/v quantised by the one rule (``attnplug.memory.fp8``) byte for byte; the oracle attends over
the dequantised values. ``bad_arguments`` adds an FP8 cache without scales, a float64 scale, a
scale of 3 elements and a query of an undeclared dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import pytest
import torch

from attnplug.memory.fp8 import dequantize_kv, quantize_kv
from attnplug.ops import OpsInputError
from attnplug.oracle import exact_attention
from attnplug_conformance.exact import LONG_TOL
from attnplug_conformance.harness import fp8_scales
from attnplug_conformance.support import (
    OPS,
    base_config,
    conformance_check,
    dtype_name,
    fp8_model_dtype,
    kv_axis,
    kv_bits,
    require,
    same_bits,
)

__all__ = ["check_paged_ops", "CASES", "block_size_for"]


@dataclass(frozen=True)
class Case:
    id: str
    block_size: int
    interleaved: bool
    window: Optional[int] = None
    softcap: Optional[float] = None
    sinks: bool = False
    half: bool = False  # the backend's half dtype (bf16, else fp16) instead of its most precise
    kind: str = "ops"  # the suite's run order (plugin.run_order)


CASES = [
    Case("bs16-interleaved-window", 16, True, window=24),
    Case("bs1-separate", 1, False),
    Case("bs16-separate", 16, False),
    Case("bs1-interleaved-window", 1, True, window=7),
    Case("bs16-interleaved-softcap_sinks", 16, True, window=24, softcap=1.5, sinks=True),
    Case("bs16-interleaved-half", 16, True, window=24, half=True),
    Case("bad_arguments", 16, True),
]

NUM_HEADS, NUM_KV_HEADS = 8, 2

#: the block sizes the cases name, in rank order (``block_size_for``)
CASE_BLOCK_SIZES = (1, 16)


def padded_block_table(blocks: List[List[int]]) -> torch.Tensor:
    """An engine's block table (int32 ``[B, max blocks + 2]``) of each request's ``blocks``:
    a request's row padded past its blocks with the null block 0, then ``-1``."""
    table = torch.full((len(blocks), max(len(b) for b in blocks) + 2), -1, dtype=torch.int32)
    for i, b in enumerate(blocks):
        table[i, : len(b)] = torch.tensor(b, dtype=torch.int32)
        table[i, len(b)] = 0  # padding: the null block
    return table


def block_size_for(ops, case: Case) -> int:
    """The block size ``case`` runs at over ``ops``: its own, unless the ops declare
    ``native_block_sizes`` (the block sizes their kernels serve) without it; then the declared
    size of the same rank as the case's among ``CASE_BLOCK_SIZES`` (the largest declared one
    when fewer are declared)."""
    declared = sorted({int(p) for p in (getattr(ops, "native_block_sizes", None) or ())})
    if not declared or case.block_size in declared:
        return case.block_size
    return declared[min(CASE_BLOCK_SIZES.index(case.block_size), len(declared) - 1)]


class _Engine:
    """An engine that owns its paged caches: block allocation, slot mappings, each request's
    k/v history in float64 (the oracle's input: what the cache holds). ``dtype``: the model's
    (q, k, v); ``kv_cache_dtype``: the caches' (None: ``dtype``; an FP8 dtype: k / v quantised
    with the engine's scales, ``scale_kwargs``)."""

    def __init__(
        self, ops, case: Case, dtype, head_dim: int, device, seed: int, kv_cache_dtype=None, block_size=None
    ) -> None:
        self.ops, self.case, self.dtype, self.D, self.device = ops, case, dtype, head_dim, device
        self.P = case.block_size if block_size is None else block_size
        self.gen = torch.Generator().manual_seed(seed)
        self.num_blocks = (640 // self.P) + 8
        self.cache_dtype = kv_cache_dtype or dtype
        #: ``k_scale`` / ``v_scale`` as store_kv and attend take them ({} for an unquantised cache)
        self.scale_kwargs = {}
        #: per head, float32 host ``[Hkv]``: the scales the caches' bytes mean (FP8)
        self.head_scales = None
        if kv_cache_dtype is not None:  # its own generator: the inputs stay those of the unquantised case
            k_s, v_s = fp8_scales(kv_cache_dtype, NUM_KV_HEADS, 0, torch.Generator().manual_seed(seed + 1))
            # interleaved caches: one scale a KV head ([Hkv]); separate ones: one a layer (a 0-dim
            # tensor, as vLLM's layer._k_scale), head 0's
            given = (k_s, v_s) if case.interleaved else (k_s[0], v_s[0])
            self.head_scales = tuple(t.float().expand(NUM_KV_HEADS) for t in given)
            self.scale_kwargs = {name: t.to(device, torch.float32) for name, t in zip(("k_scale", "v_scale"), given)}
        shape = (self.num_blocks, self.P, NUM_KV_HEADS)
        nan = dict(dtype=self.cache_dtype, device=device)
        if case.interleaved:
            self.kv = torch.full((*shape, 2 * head_dim), float("nan"), **nan)
            self.k_cache, self.v_cache = self.kv[..., :head_dim], self.kv[..., head_dim:]
        else:
            self.k_cache = torch.full((*shape, head_dim), float("nan"), **nan)
            self.v_cache = torch.full_like(self.k_cache, float("nan"))
        free = (torch.randperm(self.num_blocks - 1, generator=self.gen) + 1).tolist()  # never block 0
        self.free: List[int] = free
        self.blocks: List[List[int]] = []
        self.hist_k: List[torch.Tensor] = []
        self.hist_v: List[torch.Tensor] = []

    def add(self) -> int:
        self.blocks.append([])
        empty = torch.zeros(0, NUM_KV_HEADS, self.D, dtype=torch.float64)
        self.hist_k.append(empty)
        self.hist_v.append(empty.clone())
        return len(self.blocks) - 1

    def _slot(self, r: int, pos: int) -> int:
        while len(self.blocks[r]) <= pos // self.P:
            self.blocks[r].append(self.free.pop())
        return self.blocks[r][pos // self.P] * self.P + pos % self.P

    def rand(self, *shape) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen).to(self.dtype)

    def stored(self, rows: torch.Tensor, part: int) -> torch.Tensor:
        """What the cache stores for ``rows`` ``[n, Hkv, D]`` (host; ``part`` 0: keys, 1:
        values): as given, or quantised by the rule with the head's scale."""
        if self.head_scales is None:
            return rows.to(self.cache_dtype)
        return quantize_kv(rows, self.head_scales[part], self.cache_dtype)

    def held(self, rows: torch.Tensor, part: int) -> torch.Tensor:
        """What the cache holds for ``rows`` in float64 (host): the oracle's keys or values."""
        if self.head_scales is None:
            return rows.double()
        return dequantize_kv(self.stored(rows, part), self.head_scales[part], torch.float64)

    def step(self, reqs: List[int], new: List[int], sinks=None, scale: float = 0.125):
        """Store and attend one step: request ``reqs[i]`` gets ``new[i]`` tokens."""
        T = sum(new)
        k, v = self.rand(T, NUM_KV_HEADS, self.D), self.rand(T, NUM_KV_HEADS, self.D)
        q = self.rand(T, NUM_HEADS, self.D)
        slots, seq = [], []
        for r, n in zip(reqs, new):
            start = self.hist_k[r].shape[0]
            slots += [self._slot(r, start + i) for i in range(n)]
            seq.append(start + n)
        pad = 3  # the engine's padded tokens: slot -1, never stored
        slot_mapping = torch.tensor(slots + [-1] * pad, dtype=torch.int64)
        k_in = torch.cat([k, self.rand(pad, NUM_KV_HEADS, self.D)])
        v_in = torch.cat([v, self.rand(pad, NUM_KV_HEADS, self.D)])
        table = padded_block_table([self.blocks[r] for r in reqs])
        qsl = torch.tensor([0] + torch.tensor(new).cumsum(0).tolist(), dtype=torch.int32)
        dev = self.device
        before = self._snapshot()
        self.ops.store_kv(
            k_in.to(dev), v_in.to(dev), self.k_cache, self.v_cache, slot_mapping.to(dev), **self.scale_kwargs
        )
        self._check_store(before, slot_mapping[:T], k, v)
        step = self.ops.plan(
            qsl.to(dev),
            torch.tensor(seq, dtype=torch.int32, device=dev),
            table.to(dev),
            self.P,
            num_tokens=T,
            max_query_len=max(new),
            max_seq_len=max(seq),
        )
        out = self.ops.attend(
            q.to(dev),
            self.k_cache,
            self.v_cache,
            step,
            scale=scale,
            window=self.case.window,
            softcap=self.case.softcap,
            sinks=None if sinks is None else sinks.to(dev),
            **self.scale_kwargs,
        )
        for (r, n), lo in zip(zip(reqs, new), qsl[:-1].tolist()):
            self.hist_k[r] = torch.cat([self.hist_k[r], self.held(k[lo : lo + n], 0)])
            self.hist_v[r] = torch.cat([self.hist_v[r], self.held(v[lo : lo + n], 1)])
        keys = torch.zeros(len(reqs), max(seq), NUM_KV_HEADS, self.D, dtype=torch.float64)
        values = keys.clone()
        for i, r in enumerate(reqs):
            keys[i, : seq[i]], values[i, : seq[i]] = self.hist_k[r], self.hist_v[r]
        exact = exact_attention(
            q.double(),
            keys,
            values,
            seq,
            new,
            self.case.window,
            scale,
            logit_softcap=self.case.softcap,
            sinks=None if sinks is None else sinks.double(),
        )
        return out, exact

    def _snapshot(self):
        return self.k_cache.detach().cpu().clone(), self.v_cache.detach().cpu().clone()

    def _check_store(self, before, slots: torch.Tensor, k, v) -> None:
        after = self._snapshot()
        pairs = (("key", before[0], after[0], k), ("value", before[1], after[1], v))
        for part, (name, old, new, rows) in enumerate(pairs):
            old, new = kv_bits(old.flatten(0, 1)), kv_bits(new.flatten(0, 1))
            stored = torch.zeros(old.shape[0], dtype=torch.bool)
            stored[slots] = True
            if not same_bits(new[slots], kv_bits(self.stored(rows, part))):
                rule = "" if self.head_scales is None else f" quantised by the rule ({dtype_name(self.cache_dtype)})"
                pytest.fail(f"{OPS}: store_kv did not write the {name}s{rule} at their slots exactly")
            same = (old[~stored] == new[~stored]).flatten(1).all(1)
            if not bool(same.all()):
                bad = int((~stored).nonzero()[(~same).nonzero()[0]][0])
                pytest.fail(f"{OPS}: store_kv changed {name} slot {bad}, which the slot mapping does not name")


def _compare(out: torch.Tensor, exact: torch.Tensor, dtype, head_dim: int, what: str) -> None:
    a = out.detach().to("cpu", torch.float64)
    if not torch.isfinite(a).all():
        t = int((~torch.isfinite(a)).flatten(1).any(1).nonzero()[0])
        pytest.fail(f"{OPS}: {what}: non-finite output at token {t} (a read of a slot no request owns?)")
    floor = 1e-3 * head_dim**0.5
    err = (a - exact).norm(dim=-1) / exact.norm(dim=-1).clamp_min(floor)
    worst = float(err.max())
    if worst > LONG_TOL[dtype]:
        t, h = [int(i) for i in torch.unravel_index(torch.argmax(err), err.shape)]
        pytest.fail(
            f"{OPS}: {what}: relative error {worst:.3g} against float64 attention at token {t}, head {h} "
            f"(bound {LONG_TOL[dtype]:g} for {dtype_name(dtype)})"
        )


def _refused(what: str, call) -> None:
    try:
        call()
    except OpsInputError:
        return
    pytest.fail(f"{OPS}: {what} was accepted (expected OpsInputError naming the argument)")


def _other_dtype(engine: _Engine):
    """A q / k dtype the ops must refuse over ``engine``'s caches: another dtype than an
    unquantised cache's; over an FP8 cache one the ops do not declare (None when they declare
    every candidate)."""
    if engine.head_scales is None:
        return torch.float32 if engine.dtype != torch.float32 else torch.float16
    candidates = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
    return next((d for d in candidates if d not in tuple(engine.ops.dtypes)), None)


def _bad_arguments(engine: _Engine) -> None:
    """Each bad call raises OpsInputError and leaves the caches as they were."""
    dev, D = engine.device, engine.D
    r = engine.add()
    k = engine.rand(4, NUM_KV_HEADS, D).to(dev)
    slots = torch.tensor([engine._slot(r, i) for i in range(4)], device=dev)
    before = engine._snapshot()
    other = _other_dtype(engine)
    scales = engine.scale_kwargs

    def store(key, value, slot_mapping, **kw):
        return engine.ops.store_kv(key, value, *engine_caches(engine), slot_mapping, **{**scales, **kw})

    bad_calls = {
        "a key of another head count": lambda: store(k[:, :1], k[:, :1], slots),
        "a float slot mapping": lambda: store(k, k, slots.float()),
        "a block size that is not an int": lambda: engine.ops.plan(
            torch.tensor([0, 4], dtype=torch.int32, device=dev),
            torch.tensor([4], dtype=torch.int32, device=dev),
            torch.zeros(1, 2, dtype=torch.int32, device=dev),
            2.5,
            num_tokens=4,
            max_query_len=4,
            max_seq_len=4,
        ),
    }
    if other is not None:
        bad_calls[f"a key of another dtype ({dtype_name(other)})"] = lambda: store(k.to(other), k.to(other), slots)
    if scales:  # an FP8 cache: the scales are required, float32, 1 or Hkv elements
        bad_calls.update(
            {
                "an FP8 cache without scales": lambda: engine.ops.store_kv(k, k, *engine_caches(engine), slots),
                "a float64 k_scale": lambda: store(k, k, slots, k_scale=scales["k_scale"].double()),
                "a v_scale of 3 elements": lambda: store(
                    k, k, slots, v_scale=torch.ones(3, dtype=torch.float32, device=dev)
                ),
            }
        )
    for what, call in bad_calls.items():
        _refused(what, call)
        after = engine._snapshot()
        for old, new in zip(before, after):
            if not same_bits(old, new):
                pytest.fail(f"{OPS}: a refused call ({what}) wrote into the cache")
    step = engine.ops.plan(
        torch.tensor([0, 4], dtype=torch.int32, device=dev),
        torch.tensor([4], dtype=torch.int32, device=dev),
        torch.tensor([engine.blocks[r] + [0]], dtype=torch.int32, device=dev),
        engine.P,
        num_tokens=4,
        max_query_len=4,
        max_seq_len=4,
    )
    q = engine.rand(4, NUM_HEADS, D).to(dev)

    def attend(query, **kw):
        return engine.ops.attend(query, *engine_caches(engine), step, **{**scales, "scale": 0.1, **kw})

    bad_attends = {
        "a query with too many rows": lambda: attend(torch.cat([q, q])),
        "a negative scale": lambda: attend(q, scale=-1.0),
        "a window of 0": lambda: attend(q, window=0),
    }
    if other is not None:
        bad_attends[f"a query of another dtype ({dtype_name(other)})"] = lambda: attend(q.to(other))
    if scales:
        bad_attends["attention over an FP8 cache without scales"] = lambda: engine.ops.attend(
            q, *engine_caches(engine), step, scale=0.1
        )
    for what, call in bad_attends.items():
        _refused(what, call)


def engine_caches(engine: _Engine):
    return engine.k_cache, engine.v_cache


@pytest.mark.parametrize(*kv_axis("case", CASES, [c.id for c in CASES]))
@conformance_check(rule=OPS)
def check_paged_ops(attnplug_backend_cls, attnplug_capabilities, attnplug_device, case: Case, kv_cache_dtype):
    """An engine-like world over caller-owned caches through the backend's op layer."""
    caps = attnplug_capabilities
    if case.window is not None:
        require(caps.sliding_window, "capabilities().sliding_window is False")
    if case.softcap is not None:
        require(caps.logit_softcap, "capabilities().logit_softcap is False")
    if case.sinks:
        require(caps.attention_sinks, "capabilities().attention_sinks is False")
    ops = attnplug_backend_cls.paged_ops(attnplug_device)
    if kv_cache_dtype is not None:  # the op layer's own declaration decides (it may differ from the backend's)
        served = tuple(getattr(ops, "fp8_kv_dtypes", ()))
        require(
            kv_cache_dtype in served,
            f"{attnplug_backend_cls.__name__}.paged_ops().fp8_kv_dtypes does not declare {dtype_name(kv_cache_dtype)} "
            f"(declared: {', '.join(dtype_name(d) for d in served) or 'nothing'})",
        )
    if case.half:
        half = [d for d in (torch.bfloat16, torch.float16) if d in caps.dtypes]
        require(bool(half), "capabilities().dtypes declares no half dtype")
        cfg = base_config(caps, dtype=half[0])
    elif kv_cache_dtype is not None:
        cfg = base_config(caps, dtype=fp8_model_dtype(ops.dtypes))
    else:
        cfg = base_config(caps)
    block_size = block_size_for(ops, case)
    kw = dict(kv_cache_dtype=kv_cache_dtype, block_size=block_size)
    engine = _Engine(ops, case, cfg.dtype, cfg.head_dim, attnplug_device, seed=7, **kw)
    if case.id == "bad_arguments":
        _bad_arguments(engine)
        return
    sinks = torch.randn(NUM_HEADS, generator=engine.gen) if case.sinks else None
    a, b, c, long = engine.add(), engine.add(), engine.add(), engine.add()
    steps = [
        ([a, b, long], [5, 17, 300], "prompts (one of 300 keys)"),
        ([a, b, c, long], [1, 1, 9, 1], "decodes beside a fresh prompt"),
        ([c, a, b], [20, 3, 1], "a chunk on a cached prefix beside a verify-like and a decode"),
        ([long, a, b, c], [1, 1, 1, 1], "decodes over 301 and fewer keys"),
    ]
    at = "" if block_size == case.block_size else f" (at block size {block_size}: the ops' native_block_sizes)"
    for reqs, new, what in steps:
        out, exact = engine.step(reqs, new, sinks=sinks)
        _compare(out, exact, cfg.dtype, cfg.head_dim, f"{case.id}{at}: {what}")
