"""Sampled worlds: one point of the shape space real models and engines live in, as plain data,
and how the suite runs it against float64 attention.

A ``SampledWorld`` is everything that decides one run: the heads (KV heads and query heads per
KV head), head dim, dtype, the KV cache's dtype (the model's, or an FP8 one), page size, window,
scaling, soft-cap, sinks, what the rows no request owns hold (``poison``), the requests of one
mixed EXTEND batch in batch order (cached prefix, new tokens) and the order their request-table
rows were taken in, and the speculative step (mode, drafts, drafts accepted per request). Its
``repr`` is valid Python: a failure message quotes it, and ``run_world(eval(text), make_world)``
replays that world alone.

``run_world`` builds a world of two layers (one SWA layer when the world has a window, one
full layer) and runs, each compared with ``exact.dense_attention``:

1. the cached prefixes, stored without attention (``World.store_kv``);
2. one EXTEND step of every request in batch order (fresh prompts and chunks on cached
   prefixes side by side);
3. a DECODE step;
4. the speculative step (TARGET_VERIFY or DRAFT_EXTEND, ``drafts`` tokens per request), after
   which each request keeps ``accepted[i]`` of them (the allocator's ``rollback`` gives back
   the rest) and leaves its window (eviction);
5. a DECODE step after the rollback.

Before each compared step (after its slots are planned), every KV row that holds no live token
— slot 0 (the padding sink), the slots past a request's end in its last page, freed, evicted
and rolled-back slots, the slots the step is about to write — is filled with ``poison``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Tuple

from attnplug import ForwardMode

from .config import SUITE_DTYPES, SUITE_FP8_KV_DTYPES, dtype_name, spec_sizes
from .exact import assert_matches_exact, dense_attention
from .harness import World, WorldSpec
from .instruments import POISONS, poison_free_rows
from .rules import WORLDS

__all__ = ["SampledWorld", "run_world", "world_spec", "DTYPES", "KV_CACHE_DTYPES", "DIMENSIONS"]

#: the dtypes a world names, by name (so that its repr stays valid Python): the suite's dtypes
DTYPES = {dtype_name(d): d for d in SUITE_DTYPES}
#: the FP8 cache dtypes a world names, by name
KV_CACHE_DTYPES = {dtype_name(d): d for d in SUITE_FP8_KV_DTYPES}
_SPECULATIVE = ("TARGET_VERIFY", "DRAFT_EXTEND")
#: the dimensions of the space the suite samples worlds from (``sampling`` draws each one)
DIMENSIONS = ("head_groups", "draft_widths", "poison", "half_magnitudes", "batch_composition", "page_edges")


@dataclass(frozen=True)
class SampledWorld:
    """One world of the sampled space (defaults: the suite's usual small world)."""

    num_kv_heads: int = 2
    #: query heads per KV head (``num_heads = num_kv_heads * group``; 1 with one KV head is MQA's opposite, MHA)
    group: int = 4
    head_dim: int = 64
    dtype: str = "float32"
    page_size: int = 1
    #: the SWA layer's window; None: both layers are full layers
    window: Optional[int] = 4
    #: the backend's ``scaling`` (None: the contract's default ``1 / sqrt(head_dim)``)
    scaling: Optional[float] = None
    softcap: Optional[float] = None
    sinks: bool = False
    #: what the rows no live token owns hold (``instruments.POISONS``)
    poison: str = "noise"
    #: per request, in batch order: (cached prefix, new tokens of the EXTEND step)
    requests: Tuple[Tuple[int, int], ...] = ((0, 5), (0, 12), (0, 9))
    #: the order the requests took their request-table rows in (a permutation of the batch
    #: indices; empty: batch order)
    row_order: Tuple[int, ...] = ()
    speculative: str = "TARGET_VERIFY"
    drafts: int = 3
    #: drafts kept per request after the speculative step (empty: all rejected)
    accepted: Tuple[int, ...] = ()
    seed: int = 0
    #: what the KV cache stores: None (``dtype``) or an FP8 dtype's name (``KV_CACHE_DTYPES``)
    kv_cache_dtype: Optional[str] = None

    def __post_init__(self) -> None:
        problems = []
        if self.num_kv_heads < 1 or self.group < 1:
            problems.append(f"num_kv_heads {self.num_kv_heads} and group {self.group} must be >= 1")
        if self.dtype not in DTYPES:
            problems.append(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.kv_cache_dtype is not None and self.kv_cache_dtype not in KV_CACHE_DTYPES:
            names = ", ".join(KV_CACHE_DTYPES)
            problems.append(f"kv_cache_dtype {self.kv_cache_dtype!r} is not None or one of {names}")
        if self.poison not in POISONS:
            problems.append(f"poison {self.poison!r} is not one of {', '.join(POISONS)}")
        if self.speculative not in _SPECULATIVE:
            problems.append(f"speculative {self.speculative!r} is not one of {', '.join(_SPECULATIVE)}")
        if not self.requests or any(p < 0 or n < 1 for p, n in self.requests):
            problems.append(f"requests {self.requests}: at least one, prefixes >= 0 and new tokens >= 1")
        if self.row_order and sorted(self.row_order) != list(range(len(self.requests))):
            problems.append(f"row_order {self.row_order} is not a permutation of the {len(self.requests)} requests")
        if self.drafts < 1 or any(not 0 <= a <= self.drafts for a in self.accepted):
            problems.append(f"drafts {self.drafts} must be >= 1 and accepted {self.accepted} within [0, drafts]")
        if self.accepted and len(self.accepted) != len(self.requests):
            problems.append(f"accepted has {len(self.accepted)} entries for {len(self.requests)} requests")
        if problems:
            raise ValueError("SampledWorld: " + "; ".join(problems))

    @property
    def num_heads(self) -> int:
        return self.num_kv_heads * self.group

    @property
    def longest(self) -> int:
        """The most tokens a request holds at once (prefix, chunk, a decode, the drafts, a decode)."""
        return max(p + n for p, n in self.requests) + self.drafts + 2


def world_spec(world: SampledWorld) -> WorldSpec:
    """The ``WorldSpec`` of ``world``: two layers (layer 0 SWA when the world has a window),
    pools large enough for every token of the run with pages to spare (the SWA pool half the
    full pool, its free list scrambled, so translation is never the identity), a request table
    one row larger than the batch."""
    ps, bs = world.page_size, len(world.requests)
    tokens = sum(p + n for p, n in world.requests) + bs * (world.drafts + 2)
    size, size_swa = spec_sizes(ps, min_swa=tokens + 2 * bs * ps)
    grain = max(ps, 16)
    return WorldSpec(
        num_layers=2,
        swa_layer_ids=(0,) if world.window is not None else (),
        num_heads=world.num_heads,
        num_kv_heads=world.num_kv_heads,
        head_dim=world.head_dim,
        dtype=DTYPES[world.dtype],
        sliding_window=world.window,
        page_size=ps,
        size=size,
        size_swa=size_swa,
        max_reqs=bs + 1,
        max_context_len=-(-world.longest // grain) * grain,
        scaling=world.scaling,
        logit_softcap=world.softcap,
        sinks=world.sinks,
        scramble_swa=True,
        kv_cache_dtype=KV_CACHE_DTYPES[world.kv_cache_dtype] if world.kv_cache_dtype is not None else None,
    )


def run_world(world: SampledWorld, make_world: Callable[[WorldSpec, int], World]) -> None:
    """Run ``world`` on the backend ``make_world(spec, seed)`` builds (see the module
    docstring); fail the running check, naming the step and quoting ``world``, at the first
    output out of ``exact.LONG_TOL`` against float64 attention or the first exception."""
    w = make_world(world_spec(world), world.seed)
    order = world.row_order or tuple(range(len(world.requests)))
    by_row = {i: w.new_request() for i in order}
    reqs = [by_row[i] for i in range(len(world.requests))]
    cached = [(r, p) for r, (p, _) in zip(reqs, world.requests) if p > 0]
    if cached:
        prefix = w.plan(ForwardMode.EXTEND, [r for r, _ in cached], [p for _, p in cached])
        w.store_kv(prefix)
        w.advance(prefix)
    spec_mode = ForwardMode[world.speculative]
    steps = [
        (ForwardMode.EXTEND, [n for _, n in world.requests]),
        (ForwardMode.DECODE, None),
        (spec_mode, world.drafts),
        (ForwardMode.DECODE, None),
    ]
    for k, (mode, arg) in enumerate(steps):
        before = [r.seq_len for r in reqs]
        new_tokens = arg if mode is ForwardMode.EXTEND else None
        step = w.plan(mode, reqs, new_tokens, num_draft_tokens=arg if mode.is_speculative else None)
        what = f"{mode.name} step ({k + 1} of {len(steps)}) of {world!r}"
        exact = dense_attention(w, step)
        poison_free_rows(w, seed=world.seed * 31 + k, fill=world.poison)
        try:
            out = w.run_eager(step)
            w.backend.synchronize(w.device)
        except Exception as exc:
            if str(exc).startswith(WORLDS):
                raise
            raise AssertionError(f"{WORLDS}: {what}: the backend raised {type(exc).__name__}: {exc}") from exc
        assert_matches_exact(out, exact, w, what, rule=WORLDS)
        w.commit(step)
        if mode.is_speculative:
            kept = world.accepted or (0,) * len(reqs)
            for r, b, a in zip(reqs, before, kept):
                w.rollback(r, b + a)
        for r in reqs:
            w.evict(r)
