"""How the suite is handed to pytest: its plugin loaded once, and the tests run in this
process or spread over pytest-xdist worker processes (``attnplug conformance --jobs``)."""

from __future__ import annotations

import importlib.metadata
import os
from typing import List, Union

__all__ = ["pytest_plugin_args", "worker_count", "AUTO_JOBS_MAX"]

_ENTRY_POINT = "attnplug_conformance"


def pytest_plugin_args(jobs: int = 1) -> List[str]:
    """Arguments of a suite run: ``-p`` loading the suite's pytest plugin exactly once (by its
    entry-point name when pytest autoloads installed plugins, ``-p attnplug_conformance``:
    naming the module as well would register it twice; else by module); the ``addopts`` of
    whatever pytest configuration lies above the checks dropped; and the tests kept in this
    process (pytest-xdist blocked: a project that runs its own tests with ``-n`` would
    otherwise spread the suite) or, with ``jobs`` > 1, spread over ``jobs`` pytest-xdist
    workers that take them in the suite's run order (``--dist load``)."""
    autoload = not os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD")
    if jobs > 1:
        where = ["-o", "addopts=", *([] if autoload else ["-p", "xdist.plugin"]), "-n", str(jobs), "--dist", "load"]
    else:
        where = ["-o", "addopts=", "-p", "no:xdist"]
    try:
        eps = importlib.metadata.entry_points(group="pytest11", name=_ENTRY_POINT)
    except Exception:
        eps = ()
    if autoload and any(ep.value == "attnplug_conformance.plugin" for ep in eps):
        return [*where, "-p", _ENTRY_POINT]
    return [*where, "-p", "attnplug_conformance.plugin"]


#: ``worker_count("auto")``'s ceiling: every worker process holds its own device context and
#: worlds on the one device under test
AUTO_JOBS_MAX = 4


def worker_count(jobs: Union[int, str]) -> int:
    """The worker processes of a suite run for ``jobs`` (``--jobs``): a positive number as it
    is, ``"auto"`` half the host's CPU cores, at most :data:`AUTO_JOBS_MAX`. On a cold
    kernel cache a run is mostly the backend compiling kernels on the host, one test at a
    time in one process; workers compile side by side. ``"auto"`` is 1 (this process) on a
    host of fewer than 4 cores or without pytest-xdist; a number above 1 without pytest-xdist
    is a :class:`ValueError`."""
    try:
        import xdist  # noqa: F401

        have_xdist = True
    except ImportError:
        have_xdist = False
    if jobs == "auto":
        return max(1, min(AUTO_JOBS_MAX, (os.cpu_count() or 1) // 2)) if have_xdist else 1
    try:
        count = int(jobs)
    except (TypeError, ValueError):
        raise ValueError(f"--jobs {jobs!r}: expected a positive number or 'auto'") from None
    if count < 1:
        raise ValueError(f"--jobs {jobs!r}: expected a positive number or 'auto'")
    if count > 1 and not have_xdist:
        raise ValueError(f"--jobs {count}: worker processes need pytest-xdist (pip install pytest-xdist)")
    return count
