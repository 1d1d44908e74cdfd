"""The benchmark harness behind ``attnplug bench``: one runner for every backend's benchmarks.

A plugin ships its benchmarks as a ``Suite`` (``suite.py``) named ``SUITE`` in
``<its package>.bench``; a backend whose package ships none gets the portable suite
(``portable.py``: whole hybrid steps through ``GraphRunner`` against eager steps, on any
device, the host included). This module's ``SUITE`` is the portable one (it is the suite of
the ``reference`` backend).

==================  =====================================================================
module              job
==================  =====================================================================
``suite``           ``Benchmark``, ``Suite``, ``SuiteUnavailable``
``lookup``          ``suite_for(backend_cls)``: the suite a plugin ships, else the portable one
``runner``          ``run_suite``: budget, child-process isolation, JSON, plots, table
``context``         ``Ctx`` (what a benchmark gets), ``Deadline``
``timing``          ``Timer``: ``triton.testing`` where Triton drives the device, else the
                    backend's graph class, else wall clock; ``copy_bandwidth``
``rows``            ``row()`` (one result), ``summarize``
``report``          the rich table, the JSON file, the summary line
``history``         one JSON line per measured row appended to a ``.jsonl`` history
``plots``           PNGs: time vs batch size per variant, ratio vs the baseline
``world``           a hybrid full + SWA world of requests (its FP8 twin: ``kv_cache_dtype``)
                    and its step function
``step_case``       whole-step benchmarks over variants (``run_step_benchmark``), with
                    ``step_spec`` / ``step_measure`` / ``step_compare`` / ``step_check``
``floors``          a step's launch and bandwidth floors; ``attention_flops``
``prefill``         paged causal prefill through a backend's forward, against peers
``environment``     what a run was measured on
==================  =====================================================================

A benchmark is ``fn(ctx) -> rows``: it appends ``row(...)`` dicts to ``ctx.rows``, times
with ``ctx.timer``, logs progress with ``ctx.log`` and skips remaining cases when
``ctx.time_low()``. Nothing here touches a device at import time.
"""

from .context import Ctx, Deadline
from .lookup import suite_for
from .portable import SUITE
from .rows import bandwidth_row, error_row, row, summarize
from .runner import run_suite
from .suite import Benchmark, Suite, SuiteUnavailable
from .timing import Timer, copy_bandwidth, free_memory, median

__all__ = [
    "Benchmark",
    "Ctx",
    "Deadline",
    "SUITE",
    "Suite",
    "SuiteUnavailable",
    "Timer",
    "bandwidth_row",
    "copy_bandwidth",
    "error_row",
    "free_memory",
    "median",
    "row",
    "run_suite",
    "suite_for",
    "summarize",
]
