"""``python -m attnplug.bench ARGS`` is ``attnplug bench ARGS``; with ``--child NAME`` it is
the child-process side of an isolated run (one benchmark in this process, its rows saved to
``--rows-out``)."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import List, Optional

import torch


def _child(argv: List[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m attnplug.bench --child")
    p.add_argument("--child", required=True)
    p.add_argument("--suite", required=True)
    p.add_argument("--backend", default="")
    p.add_argument("--device", default="cpu")
    p.add_argument("--rows-out", required=True)
    p.add_argument("--budget-s", type=float, default=None)
    p.add_argument("--options", default="{}")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    from .context import Ctx, Deadline
    from .runner import run_benchmark

    suite = importlib.import_module(args.suite).SUITE
    backend_cls = None
    if args.backend:
        from ..selection import resolve_backend

        backend_cls = resolve_backend(args.backend, args.device).cls
    ctx = Ctx(
        backend_cls=backend_cls,
        device=torch.device(args.device),
        quick=args.quick,
        deadline=Deadline(args.budget_s),
        options=json.loads(args.options),
        rows_out=args.rows_out,
    )
    rows = run_benchmark(suite.get(args.child), ctx)
    return 1 if any(r.get("error") for r in rows) else 0


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--child" in argv:
        return _child(argv)
    from ..cli import main as cli_main

    return cli_main(["bench", *argv])


if __name__ == "__main__":
    sys.exit(main())
