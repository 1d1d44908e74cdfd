"""The conformance suite FAILS each deliberately broken backend (tests/broken_backends.py) in
the check that guards the broken rule, with every failure message naming it, and honours
declared expected failures. The suite runs in-process (``pytest.main`` with a collector
plugin), once per backend, limited with ``-k`` to the checks that matter; each run is shared
by the tests that look at it.

That the whole suite fails each of these backends with ``-x``, and passes a correct one (the
control mutant: the reference with a no-op override), is shown in
tests/conformance/test_conformance_mutants.py; tests/conformance/test_conformance_cli.py runs it on the reference
backend through ``attnplug conformance``."""

from __future__ import annotations

import pytest

import suite_runs

pytestmark = pytest.mark.slow  # each case runs the conformance suite on a broken backend


def run_suite(backend: str, keyword: str = ""):
    """Outcomes of the suite against ``backend``: ``{nodeid: TestResult}`` (cached)."""
    return suite_runs.run_suite(backend, keyword)[0]


def results_of(backend, check, keyword=""):
    return [r for r in run_suite(backend, keyword).values() if r.check == check]


def failing(backend, check, keyword=""):
    return [r for r in results_of(backend, check, keyword) if r.outcome in ("failed", "error")]


BROKEN = [
    # (class, -k, check that must fail, substrings every one of its failure messages contains)
    (
        "TranslatePerLayer",
        "check_translates_once",
        "check_translates_once_per_step",
        ["rule 1 (hoisted SWA writes): translated"],
    ),
    (
        "GatherPerLayer",
        "check_translates_once",
        "check_translates_once_per_step",
        ["rule 1 (hoisted SWA writes)", "translated AFTER the metadata call"],
    ),
    (
        "RenamedBuffer",
        "check_swa_buffer",
        "check_swa_buffer_contract",
        ["rule 1 (hoisted SWA writes)", "no tensor attribute cuda_graph_swa_out_cache_loc", "cuda_graph_swa_loc"],
    ),
    (
        "DirtyTail",
        "check_swa_buffer",
        "check_swa_buffer_contract",
        ["rule 1 (hoisted SWA writes)", "tail of cuda_graph_swa_out_cache_loc is not zero"],
    ),
    (
        "ReallocatingReplay",
        "check_swa_buffer",
        "check_swa_buffer_contract",
        ["rule 1 (hoisted SWA writes)", "replaced cuda_graph_swa_out_cache_loc"],
    ),
    (
        "ItemInReplay",
        "check_replay_metadata_sync_free",
        "check_replay_metadata_sync_free",
        ["rule 2 (no host-device sync in graph-replay metadata)", "Tensor.item()"],
    ),
    (
        "TensorFromListInReplay",
        "check_replay_metadata_sync_free",
        "check_replay_metadata_sync_free",
        ["rule 2 (no host-device sync in graph-replay metadata)", "torch.tensor()"],
    ),
    (
        "WindowOffByOne",
        "check_attention",
        "check_attention_matches_reference",
        ["contract (attention matches the reference)", "(SWA, window"],
    ),
    (
        "WrongSlot",
        "check_kv_written",
        "check_kv_written_only_at_step_slots",
        ["contract (KV written only at the step's slots)", "(SWA, window"],
    ),
    ("ReplayDiffers", "check_replay_equals", "check_replay_equals_eager", ["contract (graph replay equals eager)"]),
    (
        "PdlChangesResults",
        "check_pdl",
        "check_pdl_on_off_identical",
        ["rule 3 (PDL on/off identical)", "outputs with PDL differ"],
    ),
    (
        "PdlIgnoresEnv",
        "check_capabilities",
        "check_capabilities_honest",
        ["contract (capabilities are honest)", "ATTNPLUG_DISABLE_PDL=1"],
    ),
    (
        "NeedsSeqLensCpu",
        "check_accepts_seq_lens_cpu_none",
        "check_accepts_seq_lens_cpu_none",
        ["contract (accepts seq_lens_cpu=None)", "seq_lens_cpu=None"],
    ),
]


@pytest.mark.parametrize("cls,keyword,check,needles", BROKEN, ids=[b[0] for b in BROKEN])
def test_suite_fails_broken_backend_naming_the_rule(cls, keyword, check, needles):
    backend = f"broken_backends:{cls}"
    failures = failing(backend, check, keyword)
    assert failures, f"the suite did not fail {cls} in {check}: " + repr(
        [(r.nodeid, r.outcome) for r in results_of(backend, check, keyword)]
    )
    for r in failures:
        for needle in needles:
            assert needle in r.message, f"{r.nodeid}: {r.message!r} lacks {needle!r}"


def test_translate_per_layer_message_counts_the_translations():
    messages = [
        r.message
        for r in failing("broken_backends:TranslatePerLayer", "check_translates_once_per_step", "check_translates_once")
    ]
    assert any(
        "translated 4 times in one 4-layer eager DECODE step (1 in metadata, 3 in the layer loop)" in m
        for m in messages
    ), messages
    # replay: per-layer translation is caught already while the graphs are captured
    assert any("while capturing DECODE graphs" in m for m in messages), messages


def test_dirty_tail_fails_only_the_buffer_check_and_other_checks_still_pass():
    results = run_suite("broken_backends:DirtyTail", "check_swa_buffer or check_translates_once")
    by_check = {}
    for r in results.values():
        by_check.setdefault(r.check, set()).add(r.outcome)
    assert by_check["check_swa_buffer_contract"] == {"failed"}
    assert by_check["check_translates_once_per_step"] == {"passed"}


def test_a_correct_pdl_backend_passes_the_pdl_and_capability_checks():
    results = run_suite("broken_backends:HonestPdl", "check_pdl or check_capabilities")
    assert {r.outcome for r in results.values()} == {"passed"}
    assert any(r.check == "check_pdl_on_off_identical" for r in results.values())


def test_declared_expected_failures_are_strict_xfails():
    # DirtyTail declaring its failure: the check is xfailed, the run is green.
    results = results_of("broken_backends:DirtyTailDeclared", "check_swa_buffer_contract", "check_swa_buffer")
    assert results and {r.outcome for r in results} == {"xfailed"}
    assert all(
        "DirtyTailDeclared.conformance_xfail: the tail of the graph buffer is not zeroed yet" in r.message
        for r in results
    )
    # A correct backend declaring a failure for one parameter: that test passes unexpectedly -> fails.
    results = {
        r.nodeid.split("[")[-1]: r
        for r in results_of(
            "broken_backends:ReferenceDeclaresBogusXfail", "check_swa_buffer_contract", "check_swa_buffer"
        )
    }
    decode = results["broken_backends:ReferenceDeclaresBogusXfail-DECODE]"]
    assert decode.outcome == "failed" and "XPASS(strict)" in decode.message
    assert results["broken_backends:ReferenceDeclaresBogusXfail-TARGET_VERIFY]"].outcome == "passed"
