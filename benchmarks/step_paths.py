#!/usr/bin/env python3
"""A whole hybrid step's layers through each layer path, at any batch size, in one PDL graph.

    python benchmarks/step_paths.py [--bs 16 32 64 128] [--mode decode|draft] [--context N]
                                    [--path 'LABEL PATH [KEY=INT full.KEY=INT swa.KEY=INT ...]' ...]
                                    [--profile] [--out DIR]

The world of ``hybrid_step`` (48 layers, 36 SWA with W 256 and 12 full, context 1024 or
``--context``, 32 q / 8 KV heads, D 128, bf16), one DECODE step (``--mode draft``:
DRAFT_EXTEND, 4 drafts) at each ``--bs``. Each ``--path`` captures the step's layers in one
CUDA graph (PDL on, the backend's prologue and release rules) through one of the backend's
layer paths:

* ``two``: ``paged_attention`` (and its split combine), storing the step's K/V in its launch
  for decode and draft steps (a KV store launch before it for longer steps, or ``paged_store=0``);
* ``one``: ``store_attend``, one launch that stores and attends (the small steps' path);
* ``store+one``: the KV store, then ``store_attend`` storing nothing (``loc=None``);
* ``backend``: whatever the backend chooses for the step.

``KEY=INT`` pairs override keys of the attention kernel's plan on every layer (``full.`` /
``swa.``: one kind of layer), as ``layer_timeline.py --variant`` does; ``prologue=0/1``,
``release_early=0/1`` and ``paged_store=0/1`` set the backend's ``pdl_prologue`` /
``pdl_release_early`` / ``paged_attention_stores`` instead (``two ... paged_store=0``: a KV
store launch before each ``paged_attention``). Every path's graph
replay is timed (CUDA events, median of 5 rounds), and the last layer's output compared with
the first path's. ``--profile`` adds, per path, each kind of layer's period inside one replay
(``torch.profiler``: from a layer's first kernel start to the next layer's) and the kernels'
mean durations. Without ``--path`` the four paths run with their plans. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Dict, List, Optional, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))
for sub in ("plugins/cuda", "core"):
    path = os.path.join(REPO, sub)
    if os.path.isdir(path) and path not in sys.path:
        sys.path.insert(0, path)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import torch  # noqa: E402
from layer_timeline import NUM_LAYERS, _replay_us, capture_step, parse_variant, world_step  # noqa: E402

PATHS = ("two", "one", "store+one", "backend")
DEFAULT_PATHS = ("backend backend", "two two", "one one", "store+one store+one")
#: ``KEY=0/1`` of a path that set the backend's PDL flags instead of a plan key
BACKEND_FLAGS = {
    "prologue": "pdl_prologue",
    "release_early": "pdl_release_early",
    "paged_store": "paged_attention_stores",
    "paged_prologue": "paged_pdl_prologue",
    "paged_release_early": "paged_pdl_release_early",
}
#: attention kernels of the backend's layer paths (one per layer)
ATTENTION_KERNELS = ("_paged_attention_kernel", "_store_attend_kernel", "staged_attend", "resident_attend")


def parse_path(text: str) -> Tuple[str, str, Tuple[dict, dict, dict]]:
    """``'LABEL PATH KEY=INT full.KEY=INT ...'`` -> ``(label, path, (every, full, swa))``."""
    words = text.split()
    if len(words) < 2 or words[1] not in PATHS or "=" in words[0]:
        raise ValueError(f"path {text!r}: expected 'LABEL PATH [KEY=INT ...]' with PATH one of {PATHS}")
    label, configs = parse_variant(" ".join([words[0], *words[2:]]))
    return label, words[1], configs


def route(backend, path: str, configs: Tuple[dict, dict, dict]) -> None:
    """Send ``backend``'s layers through ``path`` with the plan keys ``configs``."""
    every, full, swa = (dict(c) for c in configs)
    for key, flag in BACKEND_FLAGS.items():  # backend flags, not plan keys
        if key in every:
            setattr(backend, flag, bool(every.pop(key)))
    if path != "backend":
        backend._fused_eligible = lambda *args, one=path != "two": one
    if path == "store+one":
        backend.kv_store_impl = "triton-separate"  # the Triton store, then store_attend(loc=None)

    def through(kernel):
        def run(*args, **kwargs):
            cfg = dict(every, **(full if kwargs.get("window") is None else swa))
            return kernel(*args, config=cfg or None, **kwargs)

        return run

    backend._paged_attention = through(backend._paged_attention)
    backend._store_attend = through(backend._store_attend)


def capture(backend, batch, step):
    """The step's layers in one CUDA graph: ``(graph, the last layer's output)``."""
    backend.init_forward_metadata(batch)
    return capture_step(backend, batch, step)


def layer_periods(kernels: List[Tuple[str, float, float]], is_swa: List[bool]) -> Dict[str, dict]:
    """From one replay's kernels ``(name, start_us, duration_us)`` in launch order: per kind
    of layer, the mean period (a layer's first kernel start to the next layer's, the first
    and last layers left out) and each kernel's mean duration. A layer's kernels are its
    attention kernel and those launched before it since the previous one (its store), then
    what follows it before the next store (its split combine)."""
    layers: List[List[Tuple[str, float, float]]] = [[]]
    seen_attention = False
    for name, start, dur in kernels:
        attention = any(k in name for k in ATTENTION_KERNELS)
        if seen_attention and ("kv_store" in name or attention):  # a new layer begins
            layers.append([])
            seen_attention = False
        layers[-1].append((name, start, dur))
        seen_attention = seen_attention or attention
    if len(layers) != len(is_swa):
        raise RuntimeError(f"{len(layers)} layers in the profile, the step has {len(is_swa)}")
    result = {}
    for kind, want in (("swa", True), ("full", False)):
        ids = [i for i in range(1, len(layers) - 1) if is_swa[i] == want]
        if not ids:
            continue
        durations: Dict[str, List[float]] = {}
        for i in ids:
            for name, _, dur in layers[i]:
                durations.setdefault(name, []).append(dur)
        result[kind] = {
            "period_us": statistics.mean(layers[i + 1][0][1] - layers[i][0][1] for i in ids),
            "kernels_us": {name: statistics.mean(d) for name, d in durations.items()},
        }
    return result


def profile(graph) -> List[Tuple[str, float, float]]:
    """One replay of ``graph`` under ``torch.profiler``: its kernels in start order."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    graph.replay()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    events = [
        e
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
        and "memcpy" not in e.name.lower()
        and "memset" not in e.name.lower()
    ]
    events.sort(key=lambda e: e.time_range.start)
    return [(e.name, float(e.time_range.start), float(e.time_range.end - e.time_range.start)) for e in events]


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bs", type=int, nargs="+", default=[16, 32, 64, 128])
    parser.add_argument("--mode", choices=("decode", "draft"), default="decode")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--path", action="append", default=[], metavar="'LABEL PATH [KEY=INT ...]'")
    parser.add_argument("--profile", action="store_true", help="per-layer periods and kernel times (torch.profiler)")
    parser.add_argument("--out", help="directory for step_paths_<mode>.json")
    args = parser.parse_args(argv)
    try:
        paths = [parse_path(p) for p in (args.path or DEFAULT_PATHS)]
    except ValueError as exc:
        parser.error(str(exc))
    if not torch.cuda.is_available():
        print("step_paths needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = []
    for bs in args.bs:
        ref = None
        world, batch, new = world_step(bs, args.mode, args.context)
        is_swa = [world.pool.is_swa_layer(layer) for layer in range(NUM_LAYERS)]
        for label, path, configs in paths:
            backend, step = new()
            route(backend, path, configs)
            try:
                graph, out = capture(backend, batch, step)
            except Exception as exc:  # a plan that does not fit (resources, workspace) is a row, not the end
                print(f"{args.mode} bs={bs} {label} ({path}): failed: {type(exc).__name__}: {str(exc)[:200]}")
                rows.append(dict(mode=args.mode, bs=bs, label=label, path=path, error=str(exc)[:500]))
                continue
            us = _replay_us(graph, replays=max(20, 2000 // bs))
            if ref is None:
                ref, diff = out.float().clone(), 0.0
            else:
                diff = (out.float() - ref).abs().max().item()
            row = dict(mode=args.mode, bs=bs, label=label, path=path, configs=configs, step_us=us, diff=diff)
            line = f"{args.mode} bs={bs} {label} ({path}): step {us:.1f} us ({us / NUM_LAYERS:.2f} a layer)"
            line += f", diff {diff:.2e}"
            if args.profile:
                row["layers"] = layer_periods(profile(graph), is_swa)
                line += "; " + "; ".join(
                    f"{kind} period {v['period_us']:.2f}: "
                    + ", ".join(f"{k.strip('_')[:18]} {d:.2f}" for k, d in v["kernels_us"].items())
                    for kind, v in row["layers"].items()
                )
            print(line, flush=True)
            rows.append(row)
            del graph, out, backend, step
        del world, batch, new
        torch.cuda.empty_cache()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"step_paths_{args.mode}.json"), "w") as f:
            json.dump(rows, f, indent=1)
    print("\nmode   bs  label                      path        step us   /layer   diff")
    for r in rows:
        if "error" in r:
            print(f"{r['mode']:6s} {r['bs']:3d}  {r['label']:26s} {r['path']:10s}  failed")
        else:
            print(
                f"{r['mode']:6s} {r['bs']:3d}  {r['label']:26s} {r['path']:10s} {r['step_us']:8.1f} "
                f"{r['step_us'] / NUM_LAYERS:8.2f} {r['diff']:8.1e}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
