"""The sampled worlds' parts on their own: ``SampledWorld`` refuses worlds that cannot run,
``run_world`` runs a world (paged rollback included) and fails naming the step and quoting the
world, ``poison_free_rows`` poisons exactly the rows no live token owns, and the strategies
draw only what a backend declares."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings

from attnplug import Capabilities, ForwardMode, GraphSupport
from attnplug.backends.reference import ReferenceBackend
from attnplug_conformance.config import base_config
from attnplug_conformance.harness import World
from attnplug_conformance.instruments import poison_free_rows
from attnplug_conformance.rules import WORLDS
from attnplug_conformance.sampling import world_strategy
from attnplug_conformance.worlds import DIMENSIONS, SampledWorld, run_world, world_spec
from mutants.worlds import DraftMaskTable4x4
from worlds import small_spec


def _make(cls):
    return lambda spec, seed: World(spec, cls, "cpu", seed=seed)


@pytest.mark.parametrize(
    "fields, named",
    [
        (dict(dtype="float64"), "dtype 'float64'"),
        (dict(poison="zeros"), "poison 'zeros'"),
        (dict(speculative="DECODE"), "speculative 'DECODE'"),
        (dict(requests=()), "requests ()"),
        (dict(requests=((0, 0),)), "new tokens >= 1"),
        (dict(requests=((-1, 3),)), "prefixes >= 0"),
        (dict(row_order=(0, 0, 1)), "row_order (0, 0, 1)"),
        (dict(drafts=0), "drafts 0"),
        (dict(accepted=(4, 0, 0)), "accepted (4, 0, 0)"),
        (dict(accepted=(0,)), "accepted has 1 entries for 3 requests"),
        (dict(group=0), "group 0"),
    ],
)
def test_sampled_world_refuses_what_cannot_run(fields, named):
    with pytest.raises(ValueError, match="SampledWorld: ") as info:
        SampledWorld(**fields)
    assert named in str(info.value)


def test_the_repr_is_the_reproduction():
    world = SampledWorld(group=3, page_size=4, requests=((0, 5), (9, 2)), accepted=(1, 3), poison="mixed")
    assert eval(repr(world), {"SampledWorld": SampledWorld}) == world
    spec = world_spec(world)
    assert (spec.num_heads, spec.num_kv_heads, spec.page_size, spec.swa_layers()) == (6, 2, 4, (0,))
    assert spec.max_context_len % 16 == 0 and spec.max_context_len >= world.longest


@pytest.mark.parametrize(
    "world",
    [
        SampledWorld(),
        SampledWorld(page_size=4, requests=((0, 7), (13, 3), (0, 1)), accepted=(2, 0, 3), poison="nan"),
        SampledWorld(window=None, group=1, num_kv_heads=3, speculative="DRAFT_EXTEND", drafts=7, accepted=(7, 0, 5)),
        SampledWorld(dtype="bfloat16", scaling=6.0, softcap=30.0, sinks=True, poison="inf"),
        SampledWorld(requests=((0, 3), (20, 2), (0, 4), (5, 1)), row_order=(2, 0, 3, 1), poison="mixed"),
    ],
    ids=["usual", "paged_rollback_nan", "no_window_mha_draft_extend", "bf16_large_softcap_sinks", "rows_shuffled"],
)
def test_reference_passes_worlds(world):
    run_world(world, _make(ReferenceBackend))


def test_a_failure_names_the_step_and_quotes_the_world():
    world = SampledWorld(drafts=6, requests=((0, 2),), accepted=(0,))
    with pytest.raises(BaseException) as info:  # pytest.fail's Failed
        run_world(world, _make(DraftMaskTable4x4))
    text = str(info.value)
    assert text.startswith(f"{WORLDS}: TARGET_VERIFY step (3 of 4) of {world!r}: relative error"), text


def test_a_backend_exception_is_reported_with_the_world():
    class Raises(ReferenceBackend):
        def init_forward_metadata(self, batch):
            if batch.forward_mode is ForwardMode.DECODE:
                raise IndexError("slot 9 out of range")
            super().init_forward_metadata(batch)

    with pytest.raises(AssertionError) as info:
        run_world(SampledWorld(), _make(Raises))
    assert str(info.value).startswith(f"{WORLDS}: DECODE step (2 of 4) of SampledWorld(")
    assert "the backend raised IndexError: slot 9 out of range" in str(info.value)


@pytest.mark.parametrize("fill", ["nan", "inf", "mixed", "noise"])
def test_poison_reaches_every_unowned_row_and_no_live_one(fill):
    world = World(small_spec(page_size=4, sliding_window=4), ReferenceBackend, "cpu", seed=2)
    reqs = [world.new_request() for _ in range(2)]
    step = world.plan(ForwardMode.EXTEND, reqs, [6, 9])
    world.run_eager(step)
    world.advance(step)
    before = world.snapshot_kv()
    poison_free_rows(world, seed=5, fill=fill)
    live_full = world.live_full_slots()
    live_swa = world.pool.translate_loc_from_full_to_swa(live_full).to(torch.int64)
    for layer, (k_old, _) in enumerate(before):
        k_new = world.pool.get_kv_buffer(layer)[0]
        live = live_swa[live_swa > 0] if world.pool.is_swa_layer(layer) else live_full
        owned = torch.zeros(k_new.shape[0], dtype=torch.bool)
        owned[live] = True
        assert torch.equal(k_new[owned], k_old[owned]), f"layer {layer}: a live row changed"
        unowned = k_new[~owned].float()
        assert owned.sum() < k_new.shape[0] and not owned[0], "slot 0 is never live"
        if fill == "noise":
            assert torch.isfinite(unowned).all()
        elif fill == "mixed":
            assert torch.isnan(unowned).any() and torch.isinf(unowned).any() and torch.isfinite(unowned).any()
        else:
            assert not torch.isfinite(unowned).any()


def test_poison_refuses_an_unknown_fill():
    world = World(small_spec(), ReferenceBackend, "cpu")
    with pytest.raises(ValueError, match="fill must be one of noise, nan, inf, mixed, not 'zero'"):
        poison_free_rows(world, seed=0, fill="zero")


_NARROW = Capabilities(
    device_type="cpu",
    needs_cpu_seq_lens=False,
    pdl=False,
    graphs=GraphSupport.NEVER,
    dtypes=(torch.bfloat16,),
    head_dims=(128, 256),
    page_sizes=(4, 16),
    sliding_window=False,
)


@pytest.mark.parametrize("dimension", DIMENSIONS)
def test_strategies_draw_only_what_is_declared(dimension):
    strategy = world_strategy(dimension, _NARROW, base_config(_NARROW))

    @settings(max_examples=30, derandomize=True, database=None, deadline=None)
    @given(world=strategy)
    def drawn(world):
        assert world.dtype == "bfloat16" and world.head_dim in (128, 256) and world.page_size in (4, 16)
        assert world.window is None and world.softcap is None and not world.sinks
        assert world.num_heads <= 64 and 1 <= world.drafts <= 16

    drawn()


_WIDE = Capabilities(
    "cpu",
    False,
    False,
    GraphSupport.NEVER,
    (torch.float32, torch.float16, torch.bfloat16),
    (64,),
    (1, 4),
    True,
    logit_softcap=True,
    attention_sinks=True,
)
#: the corner of each dimension (what the world mutants need)
_CORNERS = {
    "head_groups": lambda w: w.group & (w.group - 1) != 0,
    "draft_widths": lambda w: w.drafts >= 5,
    "poison": lambda w: w.poison != "noise",
    "half_magnitudes": lambda w: w.dtype != "float32" and w.scaling * math.sqrt(w.head_dim) > 11.1,
    "batch_composition": lambda w: len({p > 0 for p, _ in w.requests}) == 2,
    "page_edges": lambda w: w.page_size == 4 and any(sum(r) % 4 == 0 and sum(r) > 32 for r in w.requests),
}


@pytest.mark.parametrize("dimension", DIMENSIONS)
def test_strategies_span_their_dimension(dimension):
    """At least a third of the worlds visit the dimension's corner (about half or more of them
    by design: at 10 worlds a case, a corner is all but certain to be visited)."""
    seen = []

    @settings(max_examples=40, derandomize=True, database=None, deadline=None)
    @given(world=world_strategy(dimension, _WIDE, base_config(_WIDE)))
    def drawn(world):
        seen.append(_CORNERS[dimension](world))

    drawn()
    assert sum(seen) >= len(seen) / 3, f"{dimension}: {sum(seen)} of {len(seen)} worlds visit its corner"


def test_unknown_dimension_is_refused():
    with pytest.raises(ValueError, match="unknown world dimension 'heads'"):
        world_strategy("heads", _NARROW, base_config(_NARROW))


def test_the_check_skips_without_hypothesis(monkeypatch):
    from attnplug_conformance.checks import check_sampled_worlds as module

    monkeypatch.setitem(__import__("sys").modules, "attnplug_conformance.sampling", None)
    with pytest.raises(pytest.skip.Exception, match="sampled worlds need hypothesis"):
        module.check_sampled_worlds.__wrapped__("poison", None, _NARROW, None, False)


def test_base_config_takes_the_smallest_page_of_a_backend_without_pages_1_or_4():
    """An operator whose blocks are 128 or more (Ascend's fused attention) still gets a base
    config: every check would otherwise skip."""
    import dataclasses

    big = dataclasses.replace(_NARROW, page_sizes=(256, 128, 512))
    assert base_config(big).page_size == 128
    assert base_config(_NARROW).page_size == 4  # 1 or 4 first, where declared
