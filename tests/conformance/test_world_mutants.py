"""The mutants of ``tests/mutants/worlds.py`` (one kernel bug per dimension of the sampled
worlds, written before them) and the check that catches them, ``check_sampled_worlds``.

For every mutant:

1. its witness shows it is wrong in its corner: twin-free, the mutant runs the corner's steps
   in a world of its own and at least one step is out of bounds against attention computed in
   float64 from the tokens' history (``attnplug_conformance.exact.dense_attention``); the
   reference backend passes the same steps (the witness is fair);
2. its witness shows it is right elsewhere (the plausibility of the bug: the usual shapes of
   the suite's worlds pass);
3. (slow) ``check_sampled_worlds`` fails it in the case of its own dimension, naming the rule
   and quoting a smallest world (hypothesis shrinks it) that visits the corner.

The suite before the sampled worlds passed all six (commit 97958c0 recorded that as strict
xfails of the whole suite run with ``-x``). These mutants are not in ``mutants.SUBTLE``: the
first round (``--attnplug-quick``) does not catch them.
"""

from __future__ import annotations

import re

import pytest

import mutants
import suite_runs
from attnplug import ForwardMode
from attnplug.backends.reference import ReferenceBackend
from attnplug_conformance.exact import LONG_TOL, dense_attention, row_errors
from attnplug_conformance.harness import World, WorldSpec
from attnplug_conformance.instruments import poison_free_rows
from attnplug_conformance.rules import WORLDS
from attnplug_conformance.worlds import DIMENSIONS, SampledWorld
from mutants.worlds import WORLD_MUTANTS

IDS = [cls.__name__ for cls in WORLD_MUTANTS]


def _errors(cls, case) -> list:
    """Run ``case`` on ``cls``: per step ``(label, worst relative error, bound)`` against
    float64 attention (per token, layer and head; inf where the output is not finite)."""
    spec = WorldSpec(**case["spec"])
    world = World(spec, cls, "cpu", seed=3)
    bound = LONG_TOL[spec.dtype]
    reqs, results = {}, []
    for k, (mode_name, idx, arg) in enumerate(case["plan"]):
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
            poison_free_rows(world, seed=7 + k, fill=case["fill"])
        exact = dense_attention(world, step)
        err = row_errors(world.run_eager(step), exact)
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


def test_world_mutants_stay_out_of_the_quick_catalogue():
    """``test_conformance_mutants.py`` asserts every ``SUBTLE`` mutant is caught by the first
    round; these are caught later, by the sampled worlds."""
    assert not set(WORLD_MUTANTS) & set(mutants.SUBTLE)
    assert all(cls.CORNER and cls.NEEDS for cls in WORLD_MUTANTS)
    assert [cls.DIMENSION for cls in WORLD_MUTANTS] == list(DIMENSIONS), "one mutant per dimension, in order"


# ---------------------------------------------------------------------------- the sampled worlds catch each
@pytest.mark.slow  # hypothesis samples the dimension's worlds, then shrinks the failing one (15-60 s)
@pytest.mark.parametrize("cls", WORLD_MUTANTS, ids=IDS)
def test_sampled_worlds_catch_world_mutant(cls):
    keyword = f"check_sampled_worlds and {cls.DIMENSION} and {suite_runs.WITHOUT_FP8_AXIS}"  # the model's cache
    results, _ = suite_runs.run_suite(f"mutants.worlds:{cls.__name__}", keyword)
    [result] = results.values()
    assert result.outcome == "failed", f"check_sampled_worlds[{cls.DIMENSION}] passed {cls.__name__}"
    assert result.message.startswith(WORLDS), result.message
    quoted = re.search(r"of (SampledWorld\(.*?\)):", result.message)
    assert quoted, f"the failure quotes no world: {result.message}"
    world = eval(quoted.group(1), {"SampledWorld": SampledWorld})
    assert SHRUNK[cls.__name__](world), f"{cls.__name__}: the quoted world does not visit {cls.CORNER}: {world!r}"


def _fresh_before_cached(w: SampledWorld) -> bool:
    prefixes = [p for p, _ in w.requests]
    return any(p == 0 for p in prefixes[:-1]) and any(prefixes[prefixes.index(0) + 1 :])


def _lengths(w: SampledWorld, r: int) -> list:
    """The lengths request ``r`` of ``w`` reaches in ``run_world``'s steps."""
    extended = sum(w.requests[r])
    accepted = w.accepted[r] if w.accepted else 0
    return [extended, extended + 1, extended + 1 + w.drafts, extended + 2 + accepted]


#: what the quoted (shrunk) world of each mutant must hold: its corner, and little else
SHRUNK = {
    "GroupIndexByShift": lambda w: w.group & (w.group - 1) != 0 and w.num_kv_heads >= 2,
    "DraftMaskTable4x4": lambda w: w.drafts >= 5,
    "MaskedLoadMultiplies": lambda w: w.poison in ("nan", "inf", "mixed"),
    "HalfExpWithoutMax": lambda w: w.dtype in ("float16", "bfloat16") and w.scaling is not None,
    "PackedPrefixLengths": lambda w: _fresh_before_cached(w) and len(w.requests) == 2,
    "LastPageLenModulo": lambda w: (
        w.page_size > 1 and any(n > 32 and n % w.page_size == 0 for r in range(len(w.requests)) for n in _lengths(w, r))
    ),
}
