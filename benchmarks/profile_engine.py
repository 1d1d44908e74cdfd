#!/usr/bin/env python3
"""Where a decode step of ``Engine`` spends its time: host work against device work.

    python benchmarks/profile_engine.py [--bs 1 32] [--compile] [--new-tokens 64] [--quick] [--top 30]

For each batch size: the 1B-class Gemma3 text model of ``model_decode`` (``--quick``: its tiny
config, for the host), ``Engine`` with its default graph use, one warm-up ``generate``; then

* ``step``: wall-clock time of one decode step, ``(t(N) - t(1)) / (N - 1)`` with the device
  synchronised around each ``generate`` (the measure of ``model_decode``);
* ``device``: the device time of one step's kernels (``torch.profiler``, CUDA activity, summed
  over a run of steps and divided by the steps) and its share of ``step``;
* the host functions that take the most time inside ``generate`` (``cProfile``, own time).

On the host (no CUDA) only ``step`` and the host profile are printed.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for sub in ("plugins/cuda", "core"):
    path = os.path.join(REPO, sub)
    if os.path.isdir(path) and path not in sys.path:
        sys.path.insert(0, path)

import torch  # noqa: E402

from attnplug.memory.fp8 import KV_CACHE_DTYPE_NAMES  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(device, fn) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def profile(bs: int, compile_model: bool, new_tokens: int, quick: bool, top: int, kv_cache_dtype: str = "auto") -> None:
    from attnplug.bench.model_decode import GEMMA3_1B, QUICK_CONFIG, build_model
    from attnplug.integrations.transformers import Engine

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = QUICK_CONFIG if quick else GEMMA3_1B
    model, _ = build_model(device, config)
    vocab = config["vocab_size"]
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, vocab, (bs, 128 if not quick else 24), generator=gen).tolist()
    engine = Engine(
        model,
        None,
        max_batch_size=bs,
        max_context_len=512,
        progress=False,
        compile=compile_model,
        kv_cache_dtype=kv_cache_dtype,
    )
    t0 = time.perf_counter()
    engine.generate(prompts, new_tokens)  # warm-up: capture (and compile)
    warm = time.perf_counter() - t0
    t1 = min(_timed(device, lambda: engine.generate(prompts, 1)) for _ in range(3))
    tn = min(_timed(device, lambda: engine.generate(prompts, new_tokens)) for _ in range(3))
    step_us = (tn - t1) / (new_tokens - 1) * 1e6
    label = f"bs={bs} compile={compile_model} graphs={engine.graphs is not None}"
    print(
        f"\n=== {label}: warm-up {warm:.1f} s; step {step_us:.0f} us ({bs / step_us * 1e6:,.0f} tok/s); "
        f"graph steps {engine.last_run.get('graph_steps')}/{engine.last_run.get('steps')}"
    )
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as tprofile

        with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            engine.generate(prompts, new_tokens)
            _sync(device)
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        dev_total = sum(e.device_time for e in kernels)  # us
        # the prefill step's kernels are included; per-step: subtract a 1-token run's kernels
        with tprofile(activities=[ProfilerActivity.CUDA]) as prof1:
            engine.generate(prompts, 1)
            _sync(device)
        dev_one = sum(e.device_time for e in prof1.events() if e.device_type == torch.autograd.DeviceType.CUDA)
        dev_step = (dev_total - dev_one) / (new_tokens - 1)
        print(
            f"device time per decode step {dev_step:.0f} us = {dev_step / step_us:.0%} of the step; "
            f"{len(kernels) / new_tokens:.0f} kernels per generated token"
        )
        table = prof.key_averages().table(sort_by="device_time_total", row_limit=12)
        print(table)
    pr = cProfile.Profile()
    pr.enable()
    engine.generate(prompts, new_tokens)
    _sync(device)
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(top)
    print(s.getvalue())
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(top)
    print(s.getvalue())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bs", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--compile", action="store_true", help="Engine(compile=True)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="the tiny config (the host)")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=sorted(KV_CACHE_DTYPE_NAMES), help="the KV cache")
    args = parser.parse_args()
    for bs in args.bs:
        profile(bs, args.compile, args.new_tokens, args.quick, args.top, args.kv_cache_dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
