#!/usr/bin/env python3
"""Host time of the slot allocator's per-step calls, as an engine makes them every DECODE step.

    python benchmarks/allocator_host.py [--device cpu|cuda] [--steps 300] [--bs 1 8 32 128] [--page-size 1 16]

Per batch size and page size: ``bs`` requests of 64 positions each, then ``--steps`` DECODE
steps of ``alloc_decode(seq_lens, last_loc, host=True)`` (one new token per request) followed
by ``free_swa`` of the slot leaving a 32-position window (one page every ``page_size`` steps).
Prints the median of 5 repeats of the mean microseconds per call of each. The pool lives on
``--device`` (on CUDA the device-mapping writes are asynchronous copies, so this is host time).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "core"))

import torch  # noqa: E402

from attnplug.memory import SWAKVPool, SWATokenAllocator  # noqa: E402

WINDOW, PROMPT = 32, 64


def _run(bs: int, page_size: int, steps: int, device: str) -> tuple:
    size = bs * (PROMPT + steps + 2 * page_size)
    size = -(-size // page_size) * page_size
    pool = SWAKVPool(size, size, 2, [0], 1, 8, torch.float16, device, page_size=page_size)
    alloc = SWATokenAllocator(pool)
    slots = alloc.alloc_extend([0] * bs, [PROMPT] * bs, [-1] * bs, host=True).view(bs, PROMPT).tolist()
    seq = [PROMPT] * bs
    evicted = [0] * bs
    t_alloc = t_free = 0.0
    frees = 0
    for _ in range(steps):
        seq = [s + 1 for s in seq]
        start = time.perf_counter()
        new = alloc.alloc_decode(seq, [r[-1] for r in slots], host=True).tolist()
        t_alloc += time.perf_counter() - start
        gone = []
        for i, (row, s) in enumerate(zip(slots, seq)):
            row.append(new[i])
            limit = max(0, s - WINDOW + 1) // page_size * page_size
            if limit > evicted[i]:
                gone += row[evicted[i] : limit : page_size]
                evicted[i] = limit
        if gone:
            start = time.perf_counter()
            alloc.free_swa(torch.tensor(gone, dtype=torch.int64))
            t_free += time.perf_counter() - start
            frees += 1
    return t_alloc / steps * 1e6, (t_free / frees * 1e6 if frees else float("nan"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--bs", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--page-size", type=int, nargs="+", default=[1, 16])
    args = parser.parse_args()
    print(f"torch {torch.__version__}, device {args.device}, {args.steps} decode steps, median of 5")
    print(f"{'page_size':>9} {'bs':>5} {'alloc_decode us':>16} {'free_swa us':>12}")
    for ps in args.page_size:
        for bs in args.bs:
            runs = [_run(bs, ps, args.steps, args.device) for _ in range(5)]
            a = statistics.median(r[0] for r in runs)
            f = statistics.median(r[1] for r in runs)
            print(f"{ps:>9} {bs:>5} {a:>16.1f} {f:>12.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
