#!/usr/bin/env python3
"""Soak test of graph capture: many ``GraphRunner``s of random configurations in ONE process.

For each of ``--runners`` runners (default 200): a fresh world (KV pool, allocator, request
table, backend) of a random configuration — buckets within 1..8, page size 1..16, bf16 or
fp16, head_dim 64 or 128, window 1..40, a random set of graph modes and draft length — then
requests prefilled eagerly, every bucket captured, ``--steps`` random steps run through the
runner (replayed when a bucket covers them) and each compared with the same step run eagerly
(same inputs; it rewrites the same KV at the same slots). Then the runner and world are
dropped *into reference cycles* (the runner refers to itself, a dict cycle holds runner, world
and outputs, every 10th runner also leaves a lone captured graph in a cycle), so only the
cyclic collector can free their graphs; the collector runs often (``gc.set_threshold``).

One capture fails on purpose, in the middle (``--fail-at``): on the GPU the step calls
``torch.cuda.synchronize()`` inside the captured region of one bucket, which invalidates the
capture (the failure that used to leave the shared memory pool recording, so that every
later capture failed with ``already recording to mempool_id``); on the CPU the step raises.
That bucket must be recorded in ``capture_failures``, its runner's replays must still match
eager, and every later capture must succeed.

On the GPU it also watches the Triton JIT: no kernel may be compiled or loaded while a stream
is capturing (warm-up must have met every specialisation).

Replay vs eager: the same kernels on the same inputs, but a padded bucket may split the KV
range differently, so results are compared within a tolerance (relative to ``max(1,
max|eager|)``: 2e-2 for bf16, 4e-3 for fp16) and the share of bit-identical steps is reported.

Pass: every capture succeeds except the deliberate one (recorded, with its reason), every
step is within tolerance, nothing compiled or loaded inside a capture, the stream and capture
state are clean after every capture, and all runners ran. Exit status 0 on pass, 1 otherwise
(2: no CUDA device without ``--cpu``). A summary table prints last; JSON goes to ``--json``
or ``$OUT/graph_capture_soak.json`` when ``$OUT`` is set.

    python benchmarks/graph_capture_soak.py                    # one NVIDIA GPU, cuda backend
    python benchmarks/graph_capture_soak.py --cpu --runners 5  # smoke test: reference backend
    python benchmarks/graph_capture_soak.py --collect-in-capture --runners 40   # diagnostic

``--collect-in-capture`` is a diagnostic of what the collector pause prevents: inside the first
captured region of each runner, the step drops the previous runner's garbage cycle and runs
``gc.collect()`` (what the automatic collector could do if it were not paused), so the old
runner's graphs are destroyed inside the capture. Its failures (and the warnings raised during
capture) are reported, not judged. Every run counts the device graphs destroyed while a stream
was capturing; without the diagnostic that count must be 0.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
import traceback
import warnings
import weakref
from typing import List, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _sub in ("conformance", "plugins/cuda", "core"):
    _path = os.path.join(REPO, _sub)
    if os.path.isdir(_path) and _path not in sys.path:
        sys.path.insert(0, _path)

import torch  # noqa: E402

from attnplug import ForwardMode  # noqa: E402
from attnplug.graphs import stream_graph  # noqa: E402
from attnplug_conformance.harness import World, WorldSpec  # noqa: E402

TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 4e-3}
NUM_LAYERS, NUM_HEADS, NUM_KV_HEADS = 4, 8, 2  # layers 0-2 SWA, layer 3 full
MAX_PREFILL = 48


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runners", type=int, default=200)
    p.add_argument("--steps", type=int, default=4, help="steps per runner, each compared with eager")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fail-at", type=int, default=None, help="runner index of the deliberate failure (default: middle)")
    p.add_argument("--gc-threshold", type=int, default=100, help="gc.set_threshold(N, 2, 2) during the run")
    p.add_argument("--cpu", action="store_true", help="reference backend on the CPU (eager stand-in graphs)")
    p.add_argument(
        "--collect-in-capture",
        action="store_true",
        help="diagnostic: gc.collect() inside the first captured region of each runner",
    )
    p.add_argument("--budget-s", type=float, default=225.0, help="stop starting runners after this many seconds")
    p.add_argument("--json", default=None, help="JSON log path (default: $OUT/graph_capture_soak.json if $OUT is set)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    return p


# ---------------------------------------------------------------- configurations
def random_config(rng: random.Random, index: int, modes: List[ForwardMode]) -> dict:
    max_bs = rng.randint(1, 8)
    others = rng.sample(range(1, max_bs), k=min(max_bs - 1, rng.randint(0, 3)))
    chosen = rng.sample(modes, k=rng.randint(1, len(modes)))
    return {
        "index": index,
        "max_bs": max_bs,
        "buckets": sorted(set(others) | {max_bs}),
        "page_size": rng.randint(1, 16),
        "dtype": rng.choice(["bfloat16", "float16"]),
        "head_dim": rng.choice([64, 128]),
        "window": rng.randint(1, 40),
        "modes": [m.name for m in modes if m in chosen],
        "num_draft_tokens": rng.randint(2, 4),
        "seed": rng.randrange(1 << 30),
    }


def make_world(cfg: dict, backend_cls, device: str) -> World:
    ps, bs = cfg["page_size"], cfg["max_bs"]
    per_request = MAX_PREFILL + 4 * 8 + 2 * ps  # prefill + steps' tokens + partial pages
    size = -(-(bs * per_request + 64) // ps) * ps
    spec = WorldSpec(
        num_layers=NUM_LAYERS,
        num_heads=NUM_HEADS,
        num_kv_heads=NUM_KV_HEADS,
        head_dim=cfg["head_dim"],
        dtype=getattr(torch, cfg["dtype"]),
        sliding_window=cfg["window"],
        page_size=ps,
        size=size,
        size_swa=size,
        max_reqs=bs + 2,
        max_context_len=per_request + ps,
    )
    return World(spec, backend_cls, device, seed=cfg["seed"], keep_history=False)


def failing_step(step, mode: ForwardMode, bs: int, on_gpu: bool):
    """``step`` that fails once inside the capture of (mode, bs): on the GPU by a host sync
    on the capturing stream (the capture is invalidated), on the CPU by raising."""
    armed = [True]

    def wrapped(batch, inputs):
        if armed[0] and batch.forward_mode is mode and batch.batch_size == bs:
            if not on_gpu:
                armed[0] = False
                raise RuntimeError("deliberate failure inside capture")
            if torch.cuda.is_current_stream_capturing():
                armed[0] = False
                torch.cuda.synchronize()  # illegal while capturing
        return step(batch, inputs)

    return wrapped


def collecting_step(step, garbage: list):
    """``step`` that, inside the first captured region, drops ``garbage`` (the previous
    runner's cycle) and runs the cyclic collector."""
    done = [False]

    def wrapped(batch, inputs):
        if not done[0] and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            done[0] = True
            garbage.clear()
            gc.collect()
        return step(batch, inputs)

    return wrapped


#: device graph objects destroyed so far, and those destroyed while a stream was capturing
DESTROYED = {"total": 0, "in_capture": 0}


def _on_graph_destroyed() -> None:
    DESTROYED["total"] += 1
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        DESTROYED["in_capture"] += 1


def watch_destruction(graph) -> None:
    """Count when the device graph object inside ``graph`` (a ``DeviceGraph``) is destroyed."""
    inner = getattr(graph, "graph", None)
    if inner is not None:
        weakref.finalize(inner, _on_graph_destroyed)


# ---------------------------------------------------------------- watching the JIT
class JitWatch:
    """Counts Triton compilations and kernel loads, and those made while a stream captures."""

    def __init__(self, on_gpu: bool) -> None:
        self.compiles = self.loads = self.compiles_in_capture = self.loads_in_capture = 0
        self.in_capture: List[str] = []
        self._knobs = None
        if not on_gpu:
            return
        try:
            from triton import knobs
        except Exception:  # older Triton: no knobs, nothing watched
            return
        self._knobs = knobs
        self._prev_cache_hook = knobs.runtime.jit_cache_hook
        knobs.runtime.jit_cache_hook = self._on_compile
        knobs.runtime.kernel_load_start_hook.add(self._on_load)

    def _on_compile(self, *args, **kwargs):
        self.compiles += 1
        if torch.cuda.is_current_stream_capturing():
            self.compiles_in_capture += 1
            self.in_capture.append(f"compile {kwargs.get('repr', '?')[:120]}")
        return False  # compile as usual

    def _on_load(self, *args, **kwargs):
        self.loads += 1
        if torch.cuda.is_current_stream_capturing():
            self.loads_in_capture += 1
            self.in_capture.append(f"load {args[2] if len(args) > 2 else kwargs.get('name', '?')}")

    def close(self) -> None:
        if self._knobs is not None:
            self._knobs.runtime.jit_cache_hook = self._prev_cache_hook
            self._knobs.runtime.kernel_load_start_hook.remove(self._on_load)
            self._knobs = None


# ---------------------------------------------------------------- one runner
def soak_one(
    cfg: dict,
    backend_cls,
    device: str,
    on_gpu: bool,
    steps: int,
    deliberate: bool,
    garbage: list,
    collect_in_capture: bool = False,
) -> dict:
    rng = random.Random(cfg["seed"])
    world = make_world(cfg, backend_cls, device)
    ndt = cfg["num_draft_tokens"]
    modes = [ForwardMode[m] for m in cfg["modes"]]
    reqs = world.prefill([rng.randint(1, MAX_PREFILL) for _ in range(cfg["max_bs"])])
    runner = world.graph_runner(
        max_bs=cfg["max_bs"], num_draft_tokens=ndt, bucket_sizes=cfg["buckets"], modes=modes, capture=False
    )
    target = (modes[0], cfg["max_bs"]) if deliberate else None
    if target is not None:
        runner.step = failing_step(runner.step, *target, on_gpu=on_gpu)
    if collect_in_capture:
        runner.step = collecting_step(runner.step, garbage)
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        failures = runner.capture()
    capture_s = time.perf_counter() - t0
    for captured in runner.graphs.values():
        watch_destruction(captured.graph)
    clean = True
    if on_gpu:
        clean = (
            not torch.cuda.is_current_stream_capturing() and torch.cuda.current_stream() == torch.cuda.default_stream()
        )
    rec = {
        "cfg": cfg,
        "captured": len(runner.graphs),
        "failed": {f"{m.name}/bs={b}": r for (m, b), r in failures.items()},
        "deliberate": None,
        "capture_s": round(capture_s, 4),
        "clean_after_capture": clean,
        "capture_warnings": sorted({str(w.message).splitlines()[0][:160] for w in caught}),
        "replays": 0,
        "eager_steps": 0,
        "bit_equal": 0,
        "max_rel_diff": 0.0,
        "bad_steps": [],
    }
    if target is not None:
        rec["deliberate"] = f"{target[0].name}/bs={target[1]}"
    tol = TOLERANCE[getattr(torch, cfg["dtype"])]
    outputs = []
    for i in range(steps):
        mode = rng.choice(modes)
        n = rng.randint(1, cfg["max_bs"])
        step = world.plan(mode, rng.sample(reqs, n), num_draft_tokens=ndt if mode.is_speculative else None)
        replayed = runner.bucket_for(step.batch) is not None
        got = runner.run(step.batch, step.inputs).clone()
        want = world.run_eager(step)
        diff = (got.float() - want.float()).abs().max().item() / max(1.0, want.float().abs().max().item())
        rec["replays" if replayed else "eager_steps"] += 1
        rec["bit_equal"] += int(torch.equal(got, want))
        rec["max_rel_diff"] = max(rec["max_rel_diff"], diff)
        if not diff <= tol:  # also catches NaN
            rec["bad_steps"].append({"step": i, "mode": mode.name, "bs": n, "replayed": replayed, "rel_diff": diff})
        outputs.append(got)
        world.advance(step)
    # Leave everything to the cyclic collector.
    runner.__dict__["_self_cycle"] = runner
    cycle = {"runner": runner, "world": world, "outputs": outputs}
    cycle["cycle"] = cycle
    if cfg["index"] % 10 == 0:
        lone = world.backend.new_graph()
        x = torch.ones(4, device=device)
        lone.capture(lambda: x * 2)
        watch_destruction(lone)
        lone_cycle = [lone, x]
        lone_cycle.append(lone_cycle)
    if not collect_in_capture:  # (there the next runner's capture drops it)
        garbage.clear()  # only the last runner's garbage is reachable from here; the rest is cyclic garbage
    garbage.append(cycle)
    return rec


# ---------------------------------------------------------------- summary
def summarize(records: List[dict], args, wall_s: float, jit: JitWatch, stopped_early: bool) -> dict:
    captures_ok = sum(r["captured"] for r in records)
    failed = [(r["cfg"]["index"], k, v) for r in records for k, v in r["failed"].items()]
    deliberate = [r for r in records if r["deliberate"]]
    deliberate_ok = bool(deliberate) and all(set(r["failed"]) == {r["deliberate"]} for r in deliberate)
    unexpected = [
        (i, k, v) for i, k, v in failed if not any(r["cfg"]["index"] == i and r["deliberate"] == k for r in deliberate)
    ]
    bad_steps = sum(len(r["bad_steps"]) for r in records)
    steps = sum(r["replays"] + r["eager_steps"] for r in records)
    checks = {
        "all runners ran": not stopped_early and len(records) == args.runners,
        "no unexpected capture failure": not unexpected,
        "deliberate failure recorded and recovered": deliberate_ok or args.runners <= (args.fail_at or 0),
        "every step within tolerance": bad_steps == 0,
        "clean stream state after every capture": all(r["clean_after_capture"] for r in records),
        "nothing compiled or loaded inside a capture": jit.compiles_in_capture == 0 and jit.loads_in_capture == 0,
        "no graph destroyed inside a capture": DESTROYED["in_capture"] == 0,
    }
    return {
        "backend": "reference (cpu)" if args.cpu else "cuda",
        "device": "cpu" if args.cpu else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "diagnostic": args.collect_in_capture,
        "runners": len(records),
        "captures_ok": captures_ok,
        "captures_failed": len(failed),
        "unexpected_failures": [{"runner": i, "bucket": k, "reason": v} for i, k, v in unexpected],
        "deliberate": [
            {"runner": r["cfg"]["index"], "bucket": r["deliberate"], "recorded": r["failed"]} for r in deliberate
        ],
        "steps": steps,
        "replays": sum(r["replays"] for r in records),
        "eager_steps": sum(r["eager_steps"] for r in records),
        "bit_equal_steps": sum(r["bit_equal"] for r in records),
        "max_rel_diff": max((r["max_rel_diff"] for r in records), default=0.0),
        "bad_steps": bad_steps,
        "graphs_destroyed": DESTROYED["total"],
        "graphs_destroyed_in_capture": DESTROYED["in_capture"],
        "triton_compiles": jit.compiles,
        "triton_loads": jit.loads,
        "compiles_or_loads_in_capture": jit.in_capture[:20],
        "capture_warnings": sorted({w for r in records for w in r.get("capture_warnings", [])})[:20],
        "kept_failed_graph_objects": len(stream_graph._kept_failed),
        "wall_s": round(wall_s, 1),
        "checks": checks,
        "passed": all(checks.values()),
    }


def print_table(s: dict) -> None:
    rows = [
        ("backend / device", f"{s['backend']} / {s['device']} (torch {s['torch']})"),
        ("gc.collect() inside capture", "YES (diagnostic --collect-in-capture)" if s["diagnostic"] else "no"),
        ("runners", s["runners"]),
        (
            "captures ok / failed",
            f"{s['captures_ok']} / {s['captures_failed']}"
            f" (deliberate: {len(s['deliberate'])}, unexpected: {len(s['unexpected_failures'])})",
        ),
        ("steps: replayed / eager", f"{s['replays']} / {s['eager_steps']}"),
        ("bit-equal to eager", f"{s['bit_equal_steps']} / {s['steps']}"),
        ("max rel diff vs eager", f"{s['max_rel_diff']:.3g} (tol bf16 2e-2, fp16 4e-3); bad steps {s['bad_steps']}"),
        (
            "triton compiles / loads",
            f"{s['triton_compiles']} / {s['triton_loads']}; inside capture {len(s['compiles_or_loads_in_capture'])}",
        ),
        ("graphs destroyed / inside a capture", f"{s['graphs_destroyed']} / {s['graphs_destroyed_in_capture']}"),
        ("Python warnings during capture", len(s["capture_warnings"])),
        ("wall time", f"{s['wall_s']} s"),
    ]
    rows += [(name, "ok" if ok else "FAILED") for name, ok in s["checks"].items()]
    rows.append(("RESULT", "PASS" if s["passed"] else ("REPORTED (diagnostic)" if s["diagnostic"] else "FAIL")))
    width = max(len(r[0]) for r in rows)
    print("\n== graph capture soak " + "=" * 50)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


# ---------------------------------------------------------------- main
def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    on_gpu = not args.cpu
    if on_gpu and not torch.cuda.is_available():
        print("graph_capture_soak: needs a CUDA device (or --cpu)", file=sys.stderr)
        return 2
    if on_gpu:
        from attnplug_cuda.backend import CudaBackend as backend_cls

        device = "cuda"
    else:
        from attnplug.backends.reference import ReferenceBackend as backend_cls

        device = "cpu"
    if args.fail_at is None:
        args.fail_at = args.runners // 2
    json_path = args.json or (
        os.path.join(os.environ["OUT"], "graph_capture_soak.json") if os.environ.get("OUT") else None
    )
    rng = random.Random(args.seed)
    modes = [ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND]

    gc_enabled, gc_thresholds = gc.isenabled(), gc.get_threshold()
    jit = JitWatch(on_gpu)
    records: List[dict] = []
    garbage: list = []
    stopped_early = False
    t0 = time.perf_counter()
    try:
        gc.enable()
        gc.set_threshold(args.gc_threshold, 2, 2)
        for i in range(args.runners):
            if time.perf_counter() - t0 > args.budget_s:
                stopped_early = True
                print(f"budget of {args.budget_s:.0f} s spent: stopping after {i} runners", flush=True)
                break
            cfg = random_config(rng, i, modes)
            try:
                rec = soak_one(
                    cfg, backend_cls, device, on_gpu, args.steps, i == args.fail_at, garbage, args.collect_in_capture
                )
            except Exception as exc:  # a runner that breaks outside capture: report it, go on
                rec = {
                    "cfg": cfg,
                    "captured": 0,
                    "failed": {"runner": f"{type(exc).__name__}: {exc}"},
                    "deliberate": None,
                    "capture_s": 0.0,
                    "clean_after_capture": False,
                    "replays": 0,
                    "eager_steps": 0,
                    "bit_equal": 0,
                    "max_rel_diff": float("nan"),
                    "bad_steps": [],
                    "traceback": traceback.format_exc(),
                }
            records.append(rec)
            if rec["failed"] and not args.quiet:
                for key, reason in rec["failed"].items():
                    tag = "deliberate" if key == rec["deliberate"] else "UNEXPECTED"
                    print(f"  runner {i} {key}: capture failed ({tag}): {reason[:200]}", flush=True)
            if not args.quiet and ((i + 1) % 25 == 0 or i + 1 == args.runners):
                ok = sum(r["captured"] for r in records)
                bad = sum(len(r["failed"]) for r in records)
                print(
                    f"runner {i + 1}/{args.runners}: captures ok {ok}, failed {bad}, {time.perf_counter() - t0:.0f} s",
                    flush=True,
                )
        garbage.clear()
        gc.collect()
        if on_gpu:
            torch.cuda.synchronize()
    finally:
        jit.close()
        gc.set_threshold(*gc_thresholds)
        (gc.enable if gc_enabled else gc.disable)()
    summary = summarize(records, args, time.perf_counter() - t0, jit, stopped_early)
    if json_path:
        os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
        with open(json_path, "w") as f:
            json.dump({"summary": summary, "runners": records}, f, indent=1, default=str)
    print_table(summary)
    if json_path:
        print(f"JSON: {json_path}")
    return 0 if summary["passed"] or args.collect_in_capture else 1


if __name__ == "__main__":
    sys.exit(main())
