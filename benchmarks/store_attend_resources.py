#!/usr/bin/env python3
"""Registers, spills and shared memory of the one-launch layers' kernel, compiled for sm_90
on any machine (no GPU).

    python benchmarks/store_attend_resources.py [--bs 1 8] [--mode decode draft]
                                                [--variant 'LABEL KEY=INT full.KEY=INT swa.KEY=INT ...' ...]

The world of ``hybrid_step`` (SWA layers with W 256 and full layers, context 1024, 32 q /
8 KV heads, D 128, bf16) on the CPU: the cuda backend plans each step as on a 132-SM H200
and its ``store_attend`` launches are recorded, not run; each distinct launch is compiled
for ``GPUTarget("cuda", 90, 32)`` with the specialisation a GPU launch gets
(``attnplug_cuda.bench.offline_compile``). One row per (mode, bs, layer kind, variant): the
plan's key block, warps, stages and splits, the programs of the grid, registers per thread,
spill stack bytes per thread, shared memory per program, and how many programs one SM holds
(by registers, shared memory and threads together: with 2 or more, the next layer's programs
can start beside this layer's under PDL). ``--variant`` (the syntax of
``layer_timeline.py``) compiles plan variants too. The counts come from the Triton found
here; the GPU's Triton may allocate differently.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, List, Optional, Tuple

os.environ.pop("TRITON_INTERPRET", None)  # real JITFunctions: the launches are compiled, not interpreted

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
for sub in ("plugins/cuda", "core", "benchmarks"):
    path = os.path.join(REPO, sub)
    if os.path.isdir(path) and path not in sys.path:
        sys.path.insert(0, path)

CONTEXT, WINDOW, NUM_SMS = 1024, 256, 132
LAYERS = 4  # layers 0-2 SWA, 3 full (the world's pattern); layer 0 waits first (no prologue)


def _launches(bs: int, mode: str, configs: Tuple[dict, dict, dict]) -> List[Tuple[str, object]]:
    """``(layer kind, Launch)`` of one step's ``store_attend`` launches after the first."""
    import attnplug_cuda.backend as cuda_backend
    import attnplug_cuda.kernels.paged_attention as paged_attention
    import attnplug_cuda.kernels.store_attend as store_attend
    from attnplug import ForwardMode
    from attnplug.bench.world import build_world, make_step
    from attnplug_cuda.bench.offline_compile import record_launches

    cuda_backend.interpreting = lambda: True  # a CPU pool: nothing runs, launches are recorded
    paged_attention._num_sms = store_attend._num_sms = lambda device_type, index: NUM_SMS
    world = build_world(num_layers=LAYERS, max_bs=bs, context=CONTEXT, window=WINDOW, device="cpu")
    backend = cuda_backend.CudaBackend(world.pool, world.rows, num_heads=world.num_heads, sliding_window=WINDOW)
    backend.pdl = True  # the launches a Hopper GPU gets
    every, full, swa = configs
    kinds: List[str] = []

    def with_config(*args, **kwargs):
        kind = "full" if kwargs.get("window") is None else "swa"
        kinds.append(kind)
        cfg = dict(every, **(full if kind == "full" else swa))
        return store_attend.store_attend(*args, config=cfg or None, **kwargs)

    backend._store_attend = with_config
    batch = world.batch(ForwardMode.DECODE if mode == "decode" else ForwardMode.DRAFT_EXTEND, bs, with_cpu=False)
    step = make_step(backend, world, batch.num_tokens)
    with record_launches() as recorded:
        backend.init_forward_metadata(batch)
        if not backend.forward_metadata.fused:
            raise RuntimeError(f"{mode} bs {bs} does not take the one-launch path (store_attend)")
        step(batch, {})
    attends = [launch for launch in recorded if launch.name == "_store_attend_kernel"]
    # the step's first layer waits before its prologue; the rows describe the layers after it
    return [(kind, launch) for kind, launch in zip(kinds, attends)][1:]


def rows(bs_list, modes, variants) -> List[Dict[str, object]]:
    from attnplug_cuda.bench.offline_compile import compile_launch, resources, signature_key

    out: List[Dict[str, object]] = []
    for mode in modes:
        for bs in bs_list:
            for label, configs in variants:
                seen = set()
                for kind, launch in _launches(bs, mode, configs):
                    key = signature_key(launch)
                    if (kind, key) in seen:
                        continue
                    seen.add((kind, key))
                    c = dict(key[1])  # the constexprs
                    grid = launch.grid
                    out.append(
                        dict(
                            mode=mode,
                            bs=bs,
                            layer=kind,
                            variant=label,
                            BLOCK_N=c["BLOCK_N"],
                            warps=launch.kwargs["num_warps"],
                            stages=launch.kwargs["num_stages"],
                            splits=c["NUM_SPLITS"],
                            programs=grid[0] * grid[1],
                            **resources(compile_launch(launch)),
                        )
                    )
    return out


def table(result: List[Dict[str, object]]) -> str:
    cols = ("mode", "bs", "layer", "variant", "BLOCK_N", "warps", "stages", "splits", "programs", "registers")
    cols += ("spill_bytes", "shared_bytes", "programs_per_sm")
    widths = [max(len(c), *(len(str(r[c])) for r in result)) for c in cols]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(str(r[c]).rjust(w) for c, w in zip(cols, widths)) for r in result]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    from layer_timeline import parse_variant

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bs", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--mode", nargs="+", choices=("decode", "draft"), default=["decode", "draft"])
    parser.add_argument("--variant", action="append", default=[], metavar="'LABEL KEY=INT ...'")
    args = parser.parse_args(argv)
    try:
        variants = [("plan", ({}, {}, {}))] + [parse_variant(v) for v in args.variant]
    except ValueError as exc:
        parser.error(str(exc))
    print(table(rows(args.bs, args.mode, variants)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
