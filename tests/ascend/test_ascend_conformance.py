"""The WHOLE conformance suite, in-process, against the ascend backend with its torch_npu
operators EMULATED on the host (tests/ascend/emulated.py, tests/ascend/npu_standin.py).

Two targets:

* ``emulated:EmulatedAscendBackend``: the backend's real declaration (page sizes 128, 256, 512:
  the fused attention's block sizes). The suite's base configurations use page sizes 1 and 4,
  so most checks skip, each saying ``capabilities().page_sizes declares none of 1, 4``; what runs
  must pass.
* ``emulated:EmulatedAscendBackendSmallPages``: the same backend also declaring page sizes 1
  and 4, the stand-in's block-size rule relaxed, so that every check reaches the fused-operator
  path (stores, TND lengths, block tables, band windows, sinks, task updates at replay).

Either way the suite skips only from declared capabilities (and the thorough profile).
"""

from __future__ import annotations

import pytest

import suite_runs
from attnplug_conformance.model_check import transformers_missing

pytestmark = pytest.mark.slow  # each case runs the whole conformance suite

#: what a skip may say: a declared capability (the suite names the flag), the thorough profile
FROM_CAPABILITIES = (
    "capabilities()",
    "needs_cpu_seq_lens is True",
    "(supported: ",  # the model check: what the capabilities support
    "(capabilities: ",
    "--attnplug-thorough",
)


def _check(target: str):
    """(passed, skipped, seconds) of the suite without its FP8 axis: the backend declares no FP8
    cache (``check_capabilities_honest`` checks that it refuses one), so every axis case would
    skip naming that declaration."""
    results, seconds = suite_runs.run_suite(target, suite_runs.WITHOUT_FP8_AXIS)
    outcomes = [r.outcome for r in results.values()]
    bad = [f"{r.nodeid}: {r.message}" for r in results.values() if r.outcome not in ("passed", "skipped")]
    assert not bad, "\n".join(bad)
    missing = transformers_missing()
    for r in results.values():
        if r.outcome == "skipped":
            assert (
                r.message.startswith(FROM_CAPABILITIES)
                or any(s in r.message for s in FROM_CAPABILITIES)
                or (missing and missing in r.message)
            ), f"{r.nodeid} skipped for another reason than a declaration: {r.message}"
    return outcomes.count("passed"), outcomes.count("skipped"), seconds


def test_whole_suite_on_the_declared_page_sizes():
    passed, skipped, _ = _check("emulated:EmulatedAscendBackend")
    assert passed >= 2  # what the declared page sizes reach (see module docstring)


def test_whole_suite_through_the_fused_operator_path_at_every_base_page_size():
    passed, skipped, _ = _check("emulated:EmulatedAscendBackendSmallPages")
    assert passed > 100 and skipped < passed
