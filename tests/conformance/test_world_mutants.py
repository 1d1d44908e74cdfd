"""Issue 40, first step: the mutants of ``tests/mutants/worlds.py`` (one kernel bug per dimension
the issue's property-based worlds must span), written before those worlds.

For every mutant:

1. its witness shows it is wrong in its corner: twin-free, the mutant runs the corner's steps
   in a world of its own and at least one step is out of bounds against attention computed in
   float64 from the tokens' history (``attnplug.oracle.exact_attention``); the reference
   backend passes the same steps (the witness is fair);
2. its witness shows it is right elsewhere (the plausibility of the bug: the usual shapes of
   the suite's worlds pass);
3. (slow) today's suite, run in-process with ``-x`` as ``test_conformance_mutants.py`` runs it,
   PASSES it: recorded as a strict xfail of a test asserting that the suite catches it. The day
   a new world visits the corner, the xfail turns into a failure and forces the marker's
   removal (then the mutant can join the catalogue's ``SUBTLE`` list).

These mutants are not in ``mutants.SUBTLE``: ``test_conformance_mutants.py`` asserts that every
mutant of that list is caught.
"""

from __future__ import annotations

import math

import pytest
import torch

import mutants
import suite_runs
from attnplug import ForwardMode
from attnplug.backends.reference import ReferenceBackend
from attnplug_conformance.harness import World, WorldSpec
from attnplug_conformance.long_context import LONG_TOL, dense_attention
from mutants.worlds import WORLD_MUTANTS

IDS = [cls.__name__ for cls in WORLD_MUTANTS]


def _fill_free_rows(world: World, fill: str, gen: torch.Generator) -> None:
    """Every KV row of every layer holding no live token (slot 0 included) set to ``fill``."""
    pool = world.pool
    live_full = world.live_full_slots().to(pool.device)
    live_swa = pool.translate_loc_from_full_to_swa(live_full).to(torch.int64) if pool.swa_layer_ids else None
    for layer in range(pool.num_layers):
        kb, vb = pool.get_kv_buffer(layer)
        keep = torch.zeros(kb.shape[0], dtype=torch.bool, device=kb.device)
        keep[live_swa[live_swa > 0] if pool.is_swa_layer(layer) else live_full] = True
        for buf in (kb, vb):
            if fill == "noise":
                value = torch.randn(buf.shape, generator=gen).to(buf.device, buf.dtype)
            else:
                value = torch.full_like(buf, {"nan": math.nan, "inf": math.inf}[fill])
                if fill == "inf":
                    value[..., 1::2] = -math.inf
            buf.copy_(torch.where(keep[:, None, None], buf, value))


def _errors(cls, case) -> list:
    """Run ``case`` on ``cls``: per step ``(label, worst relative error, bound)`` against
    float64 attention (per token, layer and head; inf where the output is not finite)."""
    spec = WorldSpec(**case["spec"])
    world = World(spec, cls, "cpu", seed=3)
    bound = LONG_TOL[spec.dtype]
    floor = 1e-3 * spec.head_dim**0.5
    gen = torch.Generator().manual_seed(7)
    reqs, results = {}, []
    for mode_name, idx, arg in case["plan"]:
        for i in idx:
            if i not in reqs:
                reqs[i] = world.new_request()
        mode = ForwardMode[mode_name]
        step = world.plan(
            mode,
            [reqs[i] for i in idx],
            arg if mode is ForwardMode.EXTEND else None,
            num_draft_tokens=arg if mode.is_speculative else None,
        )
        if case["fill"] is not None:
            _fill_free_rows(world, case["fill"], gen)
        exact = dense_attention(world, step)
        out = world.run_eager(step).detach().to("cpu", torch.float64)
        err = (out - exact).norm(dim=-1) / exact.norm(dim=-1).clamp_min(floor)
        err = torch.where(torch.isfinite(out).all(-1), err, torch.full_like(err, math.inf))
        results.append((f"{mode_name} {list(idx)} {arg}", float(err.max()), bound))
        world.advance(step)
    return results


def _describe(case) -> str:
    spec = {k: v for k, v in case["spec"].items() if v != mutants.worlds._BASE.get(k)}
    return f"spec {spec}, fill {case['fill']}"


# ---------------------------------------------------------------------------- the witnesses
@pytest.mark.parametrize("cls", WORLD_MUTANTS, ids=IDS)
def test_mutant_is_wrong_in_its_corner(cls):
    _, corner, _ = cls.WITNESS
    for case in corner:
        steps = _errors(cls, case)
        assert any(err > bound for _, err, bound in steps), (
            f"{cls.__name__} is within bounds in its corner ({_describe(case)}): {steps}"
        )


@pytest.mark.parametrize("cls", WORLD_MUTANTS, ids=IDS)
def test_mutant_is_right_elsewhere(cls):
    _, _, elsewhere = cls.WITNESS
    for case in elsewhere:
        for label, err, bound in _errors(cls, case):
            assert err <= bound, f"{cls.__name__}: {label} ({_describe(case)}): relative error {err:.3g} > {bound:g}"


@pytest.mark.parametrize("cls", WORLD_MUTANTS, ids=IDS)
def test_reference_passes_the_corners(cls):
    """The corners are fair: the reference backend is within bounds there."""
    _, corner, _ = cls.WITNESS
    for case in corner:
        for label, err, bound in _errors(ReferenceBackend, case):
            assert err <= bound, f"reference: {label} ({_describe(case)}): relative error {err:.3g} > {bound:g}"


def test_world_mutants_stay_out_of_the_catalogue():
    """``test_conformance_mutants.py`` asserts every ``SUBTLE`` mutant is caught: these are not (yet)."""
    assert not set(WORLD_MUTANTS) & set(mutants.SUBTLE)
    assert all(cls.CORNER and cls.NEEDS for cls in WORLD_MUTANTS)


# ---------------------------------------------------------------------------- today's suite misses each
def _suite_catches(cls):
    """The whole suite with ``-x`` against ``mutants.worlds:<cls>``: ``(first failure or None, results, seconds)``."""
    results, elapsed = suite_runs.run_suite(f"mutants.worlds:{cls.__name__}", "", True)
    failed = [r for r in results.values() if r.outcome in ("failed", "error", "xpassed")]
    return (failed[0] if failed else None), results, elapsed


class SuiteMissed(AssertionError):
    """The whole suite passed a mutant (the only failure the strict xfails below expect: an
    error running the suite fails the test)."""


def _missed_today(cls):
    return pytest.mark.xfail(
        strict=True, raises=SuiteMissed, reason=f"issue 40: today's worlds never visit {cls.CORNER}"
    )


@pytest.mark.slow  # each case runs the whole conformance suite on a mutant (minutes)
@pytest.mark.parametrize("cls", [pytest.param(cls, marks=_missed_today(cls)) for cls in WORLD_MUTANTS], ids=IDS)
def test_suite_catches_world_mutant(cls):
    first, results, elapsed = _suite_catches(cls)
    if first is None:
        outcomes = sorted(r.outcome for r in results.values())
        counts = {o: outcomes.count(o) for o in set(outcomes)}
        print(f"{cls.__name__}: the suite passed it: {counts} in {elapsed:.0f} s")
        raise SuiteMissed(f"the suite passed {cls.__name__} ({counts} in {elapsed:.0f} s); it needs {cls.NEEDS}")
