"""``python -m attnplug_cuda.bench``: the benchmark runner, and the child-process side of
``run_benchmarks(isolate=True)`` (``--child NAME``: run one benchmark in this process and
save its rows to ``--rows-out``)."""

from __future__ import annotations

import argparse
import sys

from . import BENCHMARKS, DEFAULT_BUDGET_S, NeedsCudaDevice, _run_in_process, run_benchmarks
from .common import Ctx
from .timing import Deadline


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m attnplug_cuda.bench", description=__doc__)
    p.add_argument("--child", choices=list(BENCHMARKS), help=argparse.SUPPRESS)
    p.add_argument("--rows-out", help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true", help="fast smoke pass")
    p.add_argument("--only", nargs="+", choices=list(BENCHMARKS), help="run only these benchmarks")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--skip-cpp", action="store_true", help="do not build the CUDA C++ KV store")
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="wall-clock budget of the run")
    p.add_argument("--flex-budget-s", type=float, default=150.0, help="budget of the flex_attention compile + timing")
    p.add_argument("--no-isolate", action="store_true", help="run every benchmark in this process")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.child:
        ctx = Ctx(quick=args.quick, deadline=Deadline(args.budget_s), skip_cpp=args.skip_cpp,
                  flex_budget_s=args.flex_budget_s, rows_out=args.rows_out)
        rows = _run_in_process(args.child, ctx)
        return 1 if any(r.get("error") for r in rows) else 0
    try:
        run_benchmarks(args.only, args.quick, args.json, skip_cpp=args.skip_cpp, budget_s=args.budget_s,
                       flex_budget_s=args.flex_budget_s, isolate=not args.no_isolate,
                       argv=sys.argv if argv is None else ["-m", "attnplug_cuda.bench", *argv])
    except NeedsCudaDevice as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
