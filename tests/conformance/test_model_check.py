"""``check_matches_transformers`` has teeth and no false alarm.

* each mutant of ``tests/model_mutants.py`` (a plausible kernel bug a real model exposes)
  fails the check, in the model case expected, with a message naming the rule;
* the control mutant passes the cases those mutants fail in (the whole check on the
  reference backend runs in the suite's own control run,
  ``test_conformance_mutants.py::test_control_mutant_passes_the_whole_suite``);
* the check's driver really exercises what it claims (eviction, SWA slot reuse, rollback,
  every mode) and its architectures are the integration's;
* without transformers the check is skipped with that reason.
"""

from __future__ import annotations

import pytest

import model_mutants
import suite_runs
from attnplug_conformance import model_check
from attnplug_conformance.rules import MODEL

pytest.importorskip("transformers", reason="the model-level check needs transformers")

CHECK = "check_matches_transformers"
NAMES = [cls.__name__ for cls in model_mutants.MODEL_MUTANTS]


def _first_failure(target: str, keyword: str = CHECK):
    results, _ = suite_runs.run_suite(target, keyword, True)
    failed = [r for r in results.values() if r.outcome in ("failed", "error")]
    return (failed[0] if failed else None), results


@pytest.mark.parametrize("name", NAMES)
def test_model_check_fails_mutant(name):
    first, results = _first_failure(f"model_mutants:{name}")
    assert first is not None, f"check_matches_transformers passed {name}: {[r.outcome for r in results.values()]}"
    assert first.message.startswith(MODEL), first.message
    assert f"[model_mutants:{name}-{model_mutants.CAUGHT_IN[name]}]" in first.nodeid, (first.nodeid, first.message)


def test_control_passes_the_cases_the_mutants_fail_in():
    cases = sorted(set(model_mutants.CAUGHT_IN.values()))
    keyword = f"{CHECK} and ({' or '.join(cases)})"
    results, _ = suite_runs.run_suite("model_mutants:ModelControl", keyword, False)
    outcomes = {r.nodeid.split("[")[-1]: r.outcome for r in results.values()}
    assert len(outcomes) >= len(cases) and set(outcomes.values()) == {"passed"}, outcomes


def test_architectures_are_the_integrations():
    from attnplug.integrations.transformers import ARCHITECTURES

    assert model_check.MODEL_ARCHS == tuple(ARCHITECTURES)
    assert {c.arch for c in model_check.MODEL_CASES} == set(ARCHITECTURES)


def test_driver_exercises_the_scenario():
    """The reference run of one SWA model: every mode ran, drafts were rolled back, SWA slots
    were evicted and the SWA pool was smaller than the tokens allocated (slots reused), and
    every new token's logits were compared."""
    from attnplug.backends.reference import ReferenceBackend

    case = model_check.ModelCase("mistral", page_size=4)
    caps = ReferenceBackend.declared_capabilities()
    driver = model_check.run_model_case(case, ReferenceBackend, "cpu", caps)
    labels = " ".join(r.label for r in driver.records)
    for mode in ("EXTEND", "DECODE", "TARGET_VERIFY", "DRAFT_EXTEND"):
        assert mode in labels
    _, swa = model_check.scenario_pool_tokens(4)
    assert driver.evicted > 0 and driver.allocated > swa
    rolled_back = sum(len(r.context) for r in driver.records if r.context not in _prefixes(driver))
    assert rolled_back > 0, "no rejected draft was compared in its own context"
    assert sum(r.n for r in driver.records) == driver.allocated


def _prefixes(driver):
    finals = {**driver.finished, **{rid: tuple(r.tokens) for rid, r in driver.reqs.items()}}
    return {f[:n] for f in finals.values() for n in range(len(f) + 1)}


def test_skipped_without_transformers(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_transformers(name, *args, **kwargs):
        if name == "transformers" or name.startswith("transformers."):
            raise ImportError("No module named 'transformers'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_transformers)
    why = model_check.transformers_missing()
    assert why is not None and why.startswith("transformers is not installed")
