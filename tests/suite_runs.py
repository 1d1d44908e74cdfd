"""Runs of the conformance suite inside the test process, cached per (backend, -k, -x) so that
the tests that look at one run share it (tests/conformance/test_conformance_fails_broken.py,
tests/conformance/test_conformance_mutants.py)."""

from __future__ import annotations

import functools
import time

import pytest

from attnplug_conformance.plugin import CHECKS_DIR
from attnplug_conformance.runner import ResultCollector, pytest_plugin_args


@functools.lru_cache(maxsize=None)
def run_suite(backend: str, keyword: str = "", exitfirst: bool = False):
    """``(results {nodeid: TestResult}, seconds)`` of the suite against ``backend``
    (``-k keyword`` when given; ``-x`` when ``exitfirst``)."""
    collector = ResultCollector()
    # no:unraisableexception: its session cleanup runs gc.collect() five times (about half a
    # second per run with torch loaded); the outer session still reports unraisable exceptions.
    args = [
        str(CHECKS_DIR),
        "--attnplug-backend",
        backend,
        *pytest_plugin_args(),
        "-q",
        "--tb=no",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:unraisableexception",
        "-W",
        "ignore::pytest.PytestAssertRewriteWarning",
    ]
    if keyword:
        args += ["-k", keyword]
    if exitfirst:
        args += ["-x"]
    start = time.perf_counter()
    code = pytest.main(args, plugins=[collector])
    elapsed = time.perf_counter() - start
    assert code in (0, 1), f"pytest exited with {code} for {backend}: {collector.collect_errors}"
    assert collector.results, f"nothing ran for {backend}"
    return collector.results, elapsed


@functools.lru_cache(maxsize=None)
def quick_profile_size() -> int:
    """How many tests ``--attnplug-quick`` selects (the first round and every declared shape):
    the run order's leading tests."""
    collector = ResultCollector()
    code = pytest.main(
        [
            str(CHECKS_DIR),
            "--attnplug-backend",
            "reference",
            *pytest_plugin_args(),
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:unraisableexception",
            "--collect-only",
            "--attnplug-quick",
        ],
        plugins=[collector],
    )
    assert code == 0 and collector.results, f"collecting the quick profile exited with {code}"
    return len(collector.results)
