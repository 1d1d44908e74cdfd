"""Runs of pytest with the conformance plugin inside the test process: the conformance suite,
cached per (backend, -k, -x) so that the tests that look at one run share it
(tests/conformance/test_conformance_fails_broken.py, tests/conformance/test_conformance_mutants.py),
its collection, and pytest on a scratch directory (tests/conformance/test_conformance_plugin.py)."""

from __future__ import annotations

import functools
import time
from typing import List, Tuple

import pytest

from attnplug_conformance.plugin import CHECKS_DIR
from attnplug_conformance.pytest_args import pytest_plugin_args
from attnplug_conformance.runner import ResultCollector


def run_pytest(*args: str) -> Tuple[int, ResultCollector]:
    """``pytest ARGS`` in this process with the conformance plugin, quiet and without a cache:
    ``(exit code, the collector of its results)``."""
    collector = ResultCollector()
    common = ["-q", "-p", "no:cacheprovider", "-W", "ignore::pytest.PytestAssertRewriteWarning"]
    code = pytest.main([*args, *pytest_plugin_args(), *common], plugins=[collector])
    return int(code), collector


def _suite(backend: str, *args: str) -> Tuple[int, ResultCollector]:
    # no:unraisableexception: its session cleanup runs gc.collect() five times (about half a
    # second per run with torch loaded); the outer session still reports unraisable exceptions.
    return run_pytest(str(CHECKS_DIR), "--attnplug-backend", backend, "-p", "no:unraisableexception", *args)


#: ``-k`` of a run without FP8 KV caches: the axis' test ids end in ``-kv_fp8_e4m3`` /
#: ``-kv_fp8_e5m2`` (``attnplug_conformance.config.kv_id``), the model check's FP8 cases in
#: ``-kv_fp8_e4m3`` / ``-kv_fp8_e5m2`` (``attnplug_conformance.model_check.ModelCase.id``)
WITHOUT_FP8_AXIS = "not kv_fp8"

#: the one case of the suite that builds a layer buffer past 2**31 elements (about 8.7 GB
#: where the machine has the memory; its FP8 variants ``past_2_31-kv_fp8_*`` 4.4 GB, matched by
#: the same keyword): a whole-suite run of these tests leaves it out, so that
#: test workers never build it side by side; ``tests/conformance/test_scale_mutant.py`` runs it,
#: its tests one after another on one worker
LARGE_BUFFERS_CASE = "past_2_31"


@functools.lru_cache(maxsize=None)
def run_suite(backend: str, keyword: str = "", exitfirst: bool = False, large_buffers: bool = False):
    """``(results {nodeid: TestResult}, seconds)`` of the suite against ``backend``
    (``-k keyword`` when given; ``-x`` when ``exitfirst``; ``LARGE_BUFFERS_CASE`` only with
    ``large_buffers``)."""
    args = ["--tb=no"]
    if not large_buffers:
        keyword = f"({keyword}) and not {LARGE_BUFFERS_CASE}" if keyword else f"not {LARGE_BUFFERS_CASE}"
    if keyword:
        args += ["-k", keyword]
    if exitfirst:
        args += ["-x"]
    start = time.perf_counter()
    code, collector = _suite(backend, *args)
    elapsed = time.perf_counter() - start
    assert code in (0, 1), f"pytest exited with {code} for {backend}: {collector.collect_errors}"
    assert collector.results, f"nothing ran for {backend}"
    return collector.results, elapsed


def collect_suite(*args: str) -> Tuple[int, List[str]]:
    """``(exit code, node ids in run order)`` of the suite collected against the reference backend."""
    code, collector = _suite("reference", "--collect-only", *args)
    return code, list(collector.results)


@functools.lru_cache(maxsize=None)
def quick_profile_size() -> int:
    """How many tests ``--attnplug-quick`` selects (the first round and every declared shape):
    the run order's leading tests."""
    code, nodeids = collect_suite("--attnplug-quick")
    assert code == 0 and nodeids, f"collecting the quick profile exited with {code}"
    return len(nodeids)
