"""``attnplug soak``: the options (one per ``SoakConfig`` field) and the run.

Exit codes: 0 when every step passed, 1 when a check failed (the first failing step is
printed with the command that reproduces it), 2 when the run cannot start (unknown or
unavailable backend, an unusable ``--device``, an unwritable ``--json``, a configuration the
backend does not support), 130 / 143 when SIGINT / SIGTERM stopped it (the figures of the
steps that ran are printed and written, marked ``interrupted``).
"""

from __future__ import annotations

import argparse
import signal
import sys

from ..cli_errors import fail, interrupts_deferred, signal_exit_code, signal_name
from .config import DTYPES, SoakConfig

__all__ = ["add_arguments", "config_from_args", "run_command"]


def _sizes(flag: str):
    """A parser of ``flag``'s comma-separated ints, naming ``flag`` in its errors."""

    def parse(text: str):
        try:
            sizes = tuple(int(part) for part in text.split(",") if part.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be comma-separated ints, got {text!r}") from None
        if not sizes:
            raise argparse.ArgumentTypeError(f"{flag} is empty")
        return sizes

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = SoakConfig()
    add = parser.add_argument

    def count(flag: str, metavar: str, what: str) -> None:
        """An int option whose default, said in its help, is the ``SoakConfig`` field of the flag's name."""
        default = getattr(d, flag[2:].replace("-", "_"))
        add(flag, type=int, default=default, metavar=metavar, help=f"{what} (default: {default})")

    add("--backend", default=d.backend, metavar="NAME", help=f"registry name or module:Class (default: {d.backend})")
    count("--steps", "N", "steps to run")
    count("--seed", "S", "seed of the schedule and the data")
    add("--device", metavar="DEVICE", help="torch device (default: the backend's, from its registry probe)")
    add("--dtype", choices=sorted(DTYPES), help="KV dtype (default: float16 where supported)")
    count("--page-size", "P", "KV pool page size")
    add(
        "--graphs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="replay uniform steps through a GraphRunner (default: on when the backend can capture)",
    )
    add(
        "--buckets",
        type=_sizes("--buckets"),
        default=d.buckets,
        metavar="B1,B2,...",
        help=f"captured batch sizes (default: {','.join(map(str, d.buckets))})",
    )
    add(
        "--extend-tokens",
        type=_sizes("--extend-tokens"),
        default=d.extend_tokens,
        metavar="T1,T2,...",
        help="captured token counts of prefill chunks, where the backend captures EXTEND steps "
        f"(default: {','.join(map(str, d.extend_tokens))})",
    )
    count("--num-layers", "L", "layers; every third and the last are full layers, the rest SWA")
    count("--num-heads", "H", "query heads")
    count("--num-kv-heads", "HKV", "KV heads, GQA")
    add("--head-dim", type=int, metavar="D", help="head dim (default: the smallest the backend supports)")
    count("--sliding-window", "W", "window of the SWA layers")
    count("--max-running", "R", "request rows")
    count("--max-prompt", "N", "longest prompt")
    count("--max-chunk", "N", "largest prefill chunk per request")
    count("--max-context", "N", "longest request")
    count("--draft-tokens", "N", "draft tokens per request, captured")
    count("--alt-draft-tokens", "N", "draft tokens of the uncaptured verify steps")
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
    count("--kv-check-every", "N", "compare every live KV value with what was written every N steps")
    count("--threads", "N", "host threads for torch")
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
        extend_tokens=args.extend_tokens,
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
    """Run the soak of ``args``; print the summary and write ``--json``. A run stopped by
    SIGINT / SIGTERM (under ``cli_errors.interrupts_raise``, as ``attnplug`` runs it) prints and
    writes the figures of the steps that ran, marked ``interrupted``, and returns 130 / 143."""
    from rich.console import Console

    from ..registry import RegistryError
    from ..selection import SelectionError
    from . import run_soak
    from .simulation import SoakSetupError

    config = config_from_args(args)
    try:
        config.check()
        report = run_soak(config, log=lambda line: print(line, flush=True))
    except (SelectionError, SoakSetupError, RegistryError, ValueError) as exc:
        return fail(f"soak: {exc}")
    except KeyboardInterrupt as exc:  # before the first step: nothing to keep
        return fail(f"soak: interrupted by {signal_name(exc)} before the first step", signal_exit_code(exc))
    with interrupts_deferred() as arrived:  # the figures are written whole, even on a second Ctrl-C
        console = Console(width=140) if not sys.stdout.isatty() else Console()
        report.print_summary(console)
        if args.json:
            try:
                report.write_json(args.json)
            except OSError as exc:
                return fail(f"soak: --json {args.json!r}: {exc.strerror or exc}")
            console.print(f"figures written to {args.json}" + (" (interrupted run)" if report.interrupted else ""))
    if report.interrupted:
        return signal_exit_code(signum=signal.Signals[report.interrupted])
    if arrived:
        return signal_exit_code(signum=arrived[0])
    return 0 if report.ok else 1
