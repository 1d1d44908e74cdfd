"""``attnplug soak``: the options (one per ``SoakConfig`` field) and the run.

Exit codes: 0 when every step passed, 1 when a check failed (the first failing step is
printed with the command that reproduces it), 2 when the run cannot start (unknown or
unavailable backend, a configuration the backend does not support).
"""

from __future__ import annotations

import argparse
import sys

from ..cli_errors import fail
from .config import DTYPES, SoakConfig

__all__ = ["add_arguments", "config_from_args", "run_command"]


def _buckets(text: str):
    try:
        sizes = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--buckets must be comma-separated ints, got {text!r}") from None
    if not sizes:
        raise argparse.ArgumentTypeError("--buckets is empty")
    return sizes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = SoakConfig()
    add = parser.add_argument
    add("--backend", default=d.backend, metavar="NAME", help=f"registry name or module:Class (default: {d.backend})")
    add("--steps", type=int, default=d.steps, metavar="N", help=f"steps to run (default: {d.steps})")
    add("--seed", type=int, default=d.seed, metavar="S", help="seed of the schedule and the data (default: 0)")
    add("--device", metavar="DEVICE", help="torch device (default: the backend's, from its registry probe)")
    add("--dtype", choices=sorted(DTYPES), help="KV dtype (default: float16 where supported)")
    add("--page-size", type=int, default=d.page_size, metavar="P", help="KV pool page size (default: 1)")
    add(
        "--graphs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="replay uniform steps through a GraphRunner (default: on when the backend can capture)",
    )
    add(
        "--buckets",
        type=_buckets,
        default=d.buckets,
        metavar="B1,B2,...",
        help=f"captured batch sizes (default: {','.join(map(str, d.buckets))})",
    )
    add(
        "--num-layers",
        type=int,
        default=d.num_layers,
        metavar="L",
        help=f"layers; every third and the last are full layers, the rest SWA (default: {d.num_layers})",
    )
    add("--num-heads", type=int, default=d.num_heads, metavar="H", help=f"query heads (default: {d.num_heads})")
    add(
        "--num-kv-heads",
        type=int,
        default=d.num_kv_heads,
        metavar="HKV",
        help=f"KV heads, GQA (default: {d.num_kv_heads})",
    )
    add("--head-dim", type=int, metavar="D", help="head dim (default: the smallest the backend supports)")
    add(
        "--sliding-window",
        type=int,
        default=d.sliding_window,
        metavar="W",
        help=f"window of the SWA layers (default: {d.sliding_window})",
    )
    add("--max-running", type=int, default=d.max_running, metavar="R", help=f"request rows (default: {d.max_running})")
    add("--max-prompt", type=int, default=d.max_prompt, metavar="N", help=f"longest prompt (default: {d.max_prompt})")
    add(
        "--max-chunk",
        type=int,
        default=d.max_chunk,
        metavar="N",
        help=f"largest prefill chunk per request (default: {d.max_chunk})",
    )
    add(
        "--max-context",
        type=int,
        default=d.max_context,
        metavar="N",
        help=f"longest request (default: {d.max_context})",
    )
    add(
        "--draft-tokens",
        type=int,
        default=d.draft_tokens,
        metavar="N",
        help=f"draft tokens per request, captured (default: {d.draft_tokens})",
    )
    add(
        "--alt-draft-tokens",
        type=int,
        default=d.alt_draft_tokens,
        metavar="N",
        help=f"draft tokens of the uncaptured verify steps (default: {d.alt_draft_tokens})",
    )
    add("--pool-size", type=int, metavar="SLOTS", help="full pool slots (default: 6 * max_context + 4 * page_size)")
    add(
        "--swa-pool-size",
        type=int,
        metavar="SLOTS",
        help="SWA pool slots (default: 6 * (window + max_chunk + draft_tokens + 3 * page_size))",
    )
    add(
        "--poison",
        choices=("nan", "none"),
        default=d.poison,
        help="fill free slots and the sink with NaN before every step (default: nan)",
    )
    add("--tolerance", type=float, metavar="REL", help="largest relative error (default: per dtype)")
    add(
        "--kv-check-every",
        type=int,
        default=d.kv_check_every,
        metavar="N",
        help="compare every live KV value with what was written every N steps (default: 1)",
    )
    add("--threads", type=int, default=d.threads, metavar="N", help="host threads for torch (default: 1)")
    add("--keep-going", action="store_true", help="continue after a failed step (default: stop at the first)")
    add(
        "--progress",
        type=float,
        default=d.progress_every,
        metavar="SECONDS",
        help=f"seconds between progress lines, 0 for none (default: {d.progress_every:g})",
    )
    add("--json", metavar="PATH", help="write the figures to PATH")


def config_from_args(args: argparse.Namespace) -> SoakConfig:
    return SoakConfig(
        backend=args.backend,
        steps=args.steps,
        seed=args.seed,
        device=args.device,
        dtype=DTYPES[args.dtype] if args.dtype else None,
        page_size=args.page_size,
        graphs=args.graphs,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        head_dim=args.head_dim,
        sliding_window=args.sliding_window,
        max_running=args.max_running,
        max_prompt=args.max_prompt,
        max_chunk=args.max_chunk,
        max_context=args.max_context,
        draft_tokens=args.draft_tokens,
        alt_draft_tokens=args.alt_draft_tokens,
        buckets=args.buckets,
        pool_size=args.pool_size,
        swa_pool_size=args.swa_pool_size,
        poison=args.poison,
        tolerance=args.tolerance,
        kv_check_every=args.kv_check_every,
        threads=args.threads,
        stop_on_failure=not args.keep_going,
        progress_every=args.progress,
    )


def run_command(args: argparse.Namespace) -> int:
    from rich.console import Console

    from ..selection import SelectionError
    from . import run_soak
    from .simulation import SoakSetupError

    config = config_from_args(args)
    try:
        config.check()
        report = run_soak(config, log=lambda line: print(line, flush=True))
    except (SelectionError, SoakSetupError, ValueError) as exc:
        return fail(str(exc))
    console = Console(width=140) if not sys.stdout.isatty() else Console()
    report.print_summary(console)
    if args.json:
        report.write_json(args.json)
        console.print(f"figures written to {args.json}")
    return 0 if report.ok else 1
