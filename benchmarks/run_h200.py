#!/usr/bin/env python3
"""Run the CUDA plugin's benchmark suite (see benchmarks/README.md).

    python benchmarks/run_h200.py [--quick] [--only NAME ...] [--json PATH]

Works from a plain checkout (the repository's source folders are put first on sys.path) or
from an installed ``attnplug[cuda]``. Prints progress lines, then a compact table LAST, and
writes JSON (after every benchmark). Exit status: 0 when the run completed (targets missed
or cases failed are in the table and the JSON), 2 without a CUDA device.
"""

from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for sub in ("conformance", "plugins/cuda", "core"):
    path = os.path.join(REPO, sub)
    if os.path.isdir(path) and path not in sys.path:
        sys.path.insert(0, path)

from attnplug_cuda.bench import BENCHMARKS, DEFAULT_BUDGET_S, NeedsCudaDevice, run_benchmarks  # noqa: E402


def build_parser():
    import argparse

    p = argparse.ArgumentParser(description="attnplug CUDA benchmarks: the new hot path vs the before path.")
    p.add_argument("--quick", action="store_true", help="fast smoke pass: fewer sizes and iterations, no flex compile")
    p.add_argument("--only", nargs="+", choices=list(BENCHMARKS), metavar="NAME",
                   help=f"run only these benchmarks ({', '.join(BENCHMARKS)})")
    p.add_argument("--json", default="bench-h200.json", help="write the results here (default: %(default)s)")
    p.add_argument("--skip-cpp", action="store_true", help="do not build/time the CUDA C++ KV store")
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                   help="wall-clock budget of the whole run in seconds (default: %(default)s)")
    p.add_argument("--flex-budget-s", type=float, default=150.0,
                   help="seconds for compiling + timing flex_attention (default: %(default)s; 0 skips it)")
    p.add_argument("--no-isolate", action="store_true",
                   help="run every benchmark in this process (default: one child process each)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        run_benchmarks(
            args.only, args.quick, args.json, skip_cpp=args.skip_cpp, budget_s=args.budget_s,
            flex_budget_s=args.flex_budget_s, isolate=not args.no_isolate,
            argv=sys.argv if argv is None else [sys.argv[0], *argv],
        )
    except NeedsCudaDevice as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
