"""The shape space the suite samples worlds from (``worlds.SampledWorld``), one strategy per
dimension of real models and engines, drawn with hypothesis under a fixed profile.

Each dimension draws its own fields over their whole range and the other fields from a mild
neighbourhood of the suite's usual world, so that a world that fails points at its dimension;
every field shrinks towards the usual world, so the world a failure reports is the smallest
that still fails. What each dimension spans:

* ``head_groups``: 1 to 4 KV heads, 1 to 16 query heads per KV head (powers of two or not, MQA
  with one KV head), at most 64 query heads, every declared head dim of 64, 128, 256;
* ``draft_widths``: TARGET_VERIFY or DRAFT_EXTEND with 1 to 16 drafts per request, any number
  of them accepted per request (the rest rolled back);
* ``poison``: the rows no request owns hold NaN, ±Inf or a mix of NaN, ±Inf and noise;
* ``half_magnitudes``: a half dtype where declared, ``scaling`` 0.5 to 8 (logits of tens to
  hundreds: far past ``log(65504) = 11.1`` where ``exp`` of a float16 overflows), soft-cap
  (30 or 50) on or off and sinks where declared;
* ``batch_composition``: 2 to 13 requests, each a fresh prompt or a chunk on a cached prefix of
  up to 96 tokens, in any batch order, their request-table rows taken in any order;
* ``page_edges``: every declared page size above 1 (1 where it is the only one), requests whose lengths end one
  before, on and one after a page edge or a 32- / 64-key tile edge, one to three of them past
  the start.

Every dimension also draws a window (or none); the others use the base config's head dim (a
kernel compiles a variant per head dim: one dimension draws them all). The cache dtype is the
base config's (the FP8 axis: ``config.kv_axis``), never drawn: every dimension is sampled over
each declared FP8 cache as a case of its own.

``PROFILES`` says how many worlds a dimension samples: the default run, ``--attnplug-thorough``.
Sampling is derandomized (the same worlds on every run of a backend with the same
capabilities and hypothesis version) and keeps no example database, so a run writes nothing
and a failure reproduces by running the same case again.
"""

from __future__ import annotations

from typing import Callable, Dict

from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import strategies as st

from attnplug import Capabilities

from .config import SUITE_DTYPES, SUITE_HEAD_DIMS, TestConfig, dtype_name
from .worlds import DIMENSIONS, SampledWorld, run_world

__all__ = ["DIMENSIONS", "PROFILES", "world_strategy", "sample_worlds"]

#: worlds per dimension: the default run, ``--attnplug-thorough``
PROFILES: Dict[str, int] = {"default": 10, "thorough": 60}


def _mild_requests(draw) -> tuple:
    n = draw(st.integers(1, 4))
    return tuple((draw(st.sampled_from([0, 7, 16, 3])), draw(st.integers(1, 16))) for _ in range(n))


def _edge_length(draw, unit: int, least: int = 1) -> int:
    """A length on (half the time), one before or one after a multiple (1 to 3) of ``unit``."""
    return max(least, draw(st.integers(1, 3)) * unit + draw(st.sampled_from([0, -1, 0, 1])))


def world_strategy(dimension: str, caps: Capabilities, cfg: TestConfig) -> st.SearchStrategy:
    """The worlds of ``dimension`` (one of ``DIMENSIONS``) for a backend of ``caps`` whose base
    config is ``cfg``: only declared dtypes, head dims and page sizes; soft-cap and sinks only
    where declared; a window only where SWA layers are supported."""
    if dimension not in DIMENSIONS:
        raise ValueError(f"unknown world dimension {dimension!r} (one of {', '.join(DIMENSIONS)})")
    head_dims = [d for d in SUITE_HEAD_DIMS if d in caps.head_dims] or [cfg.head_dim]
    paged = sorted(p for p in caps.page_sizes if p > 1) or sorted(caps.page_sizes)
    halves = [dtype_name(d) for d in SUITE_DTYPES if d in caps.dtypes and d.itemsize == 2]
    windows = [4, None, 8] if caps.sliding_window else [None]

    @st.composite
    def draw_world(draw) -> SampledWorld:
        fields = dict(
            head_dim=cfg.head_dim,
            dtype=dtype_name(cfg.dtype),
            kv_cache_dtype=dtype_name(cfg.kv_cache_dtype) if cfg.kv_cache_dtype is not None else None,
            page_size=cfg.page_size,
            window=draw(st.sampled_from(windows)),
            num_kv_heads=draw(st.sampled_from([2, 1])),
            group=draw(st.sampled_from([4, 1, 2, 8])),
            poison=draw(st.sampled_from(["noise", "mixed"])),
            requests=_mild_requests(draw),
            drafts=draw(st.sampled_from([3, 1, 2])),
            seed=draw(st.integers(0, 999)),
        )
        if dimension == "head_groups":
            hkv = draw(st.integers(1, 4))
            fields.update(num_kv_heads=hkv, group=draw(st.integers(1, min(16, 64 // hkv))))
            fields.update(head_dim=draw(st.sampled_from(head_dims)))
        elif dimension == "draft_widths":
            fields.update(speculative=draw(st.sampled_from(["TARGET_VERIFY", "DRAFT_EXTEND"])))
            fields.update(drafts=draw(st.integers(1, 16)))
        elif dimension == "poison":
            fields.update(poison=draw(st.sampled_from(["mixed", "nan", "inf"])))
        elif dimension == "half_magnitudes":
            if halves:
                fields.update(dtype=draw(st.sampled_from(halves)))
            fields.update(scaling=draw(st.integers(1, 16)) / 2)
            if caps.logit_softcap:
                fields.update(softcap=draw(st.sampled_from([None, 30.0, 50.0])))
            if caps.attention_sinks:
                fields.update(sinks=draw(st.booleans()))
        elif dimension == "batch_composition":
            n = draw(st.integers(2, 13))
            prefix = st.one_of(st.just(0), st.integers(1, 96))
            fields.update(requests=tuple((draw(prefix), draw(st.integers(1, 40))) for _ in range(n)))
            fields.update(row_order=tuple(draw(st.permutations(range(n)))))
        else:  # page_edges
            ps = draw(st.sampled_from(paged))
            units = sorted({ps, 32, 64, 128})
            requests = []
            for _ in range(draw(st.integers(2, 4))):
                total = _edge_length(draw, draw(st.sampled_from(units)), least=2)
                cached = draw(st.sampled_from(["none", "to_an_edge", "all_but_one"]))
                if cached == "none":
                    prefix = 0
                elif cached == "all_but_one":
                    prefix = total - 1
                else:
                    prefix = min(_edge_length(draw, ps), total - 1)
                requests.append((prefix, total - prefix))
            fields.update(page_size=ps, requests=tuple(requests))
        n = len(fields["requests"])
        drafts = fields["drafts"]
        fields.update(accepted=tuple(draw(st.integers(0, drafts)) for _ in range(n)))
        return SampledWorld(**fields)

    return draw_world()


def sample_worlds(dimension: str, caps: Capabilities, cfg: TestConfig, make_world: Callable, *, examples: int) -> None:
    """Run ``examples`` worlds of ``dimension`` through ``worlds.run_world``. The first failure
    is shrunk to the smallest world that still fails, and its failure (quoting that world) is
    raised."""
    profile = settings(
        max_examples=examples,
        derandomize=True,
        database=None,
        deadline=None,
        print_blob=False,
        verbosity=Verbosity.quiet,
        phases=(Phase.explicit, Phase.generate, Phase.shrink),
        suppress_health_check=list(HealthCheck),
    )

    @profile
    @given(world=world_strategy(dimension, caps, cfg))
    def worlds_of(world: SampledWorld) -> None:
        run_world(world, make_world)

    worlds_of()
