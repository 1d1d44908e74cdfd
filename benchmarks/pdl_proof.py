"""Proof that PDL changes timing, never results, and that captured graphs carry PDL edges.

1. Twin worlds (same seeds, same steps) with the ``cuda`` backend, one built with
   ``ATTNPLUG_DISABLE_PDL=1``, run ``--steps`` random steps (decode, target-verify,
   draft-extend and prefills through the graph runner, the prefills in token-count buckets of
   256 and 512 or eagerly past them; eviction between steps; requests finishing and
   arriving). Every output and, at the end, every KV cache must be
   bit-identical.
2. A decode step captured into a CUDA graph: its kernel nodes and the types of the edges
   between them, read back through the CUDA runtime (``cudaGraphGetEdges`` with edge data);
   programmatic edges must be present when PDL is on and absent when it is off.

Usage: ``python benchmarks/pdl_proof.py [--steps 1000] [--json PATH]`` on a GPU of compute
capability >= 9.0.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch

from attnplug import ForwardMode
from attnplug_conformance.harness import World, WorldSpec

MODEL = dict(num_layers=4, num_heads=16, num_kv_heads=4, head_dim=128, dtype=torch.bfloat16, sliding_window=64)
SPEC = WorldSpec(**MODEL, size=65536, size_swa=16384, max_reqs=64, max_context_len=1024)
NDT = 4


def _backend_cls():
    from attnplug_cuda.backend import CudaBackend

    return CudaBackend


def _world(pdl: bool, seed: int) -> World:
    old = os.environ.pop("ATTNPLUG_DISABLE_PDL", None)
    if not pdl:
        os.environ["ATTNPLUG_DISABLE_PDL"] = "1"
    try:
        world = World(SPEC, _backend_cls(), "cuda", seed=seed, keep_history=False)
    finally:
        os.environ.pop("ATTNPLUG_DISABLE_PDL", None)
        if old is not None:
            os.environ["ATTNPLUG_DISABLE_PDL"] = old
    assert world.backend.pdl == pdl, (world.backend.pdl, world.backend.pdl_reason)
    return world


def twin_steps(steps: int, seed: int = 0) -> dict:
    worlds = [_world(True, seed), _world(False, seed)]
    runners = [
        w.graph_runner(max_bs=16, num_draft_tokens=NDT, bucket_sizes=[4, 16], extend_tokens=[256, 512]) for w in worlds
    ]
    rng = random.Random(seed)
    counts, mismatches, replayed = {}, [], 0
    t0 = time.time()
    for i in range(steps):
        live = [r.row for r in worlds[0].requests if r.seq_len]
        long = [r.row for r in worlds[0].requests if r.seq_len > SPEC.max_context_len - 300]
        c = rng.random()
        if long:
            plan = ("finish", long[0])
        elif len(live) < 2 or (c < 0.08 and len(worlds[0].requests) < 24):
            n_new = rng.randint(1, 3)
            lens = [rng.randint(1, 200) for _ in range(n_new)]
            plan = ("prefill", lens)
        elif c < 0.12:
            plan = ("finish", rng.choice(live))
        else:
            mode = rng.choice(
                [ForwardMode.DECODE, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND]
            )
            rows = rng.sample(live, min(len(live), rng.randint(1, 20)))
            plan = (mode, rows)
        outs = []
        for w, runner in zip(worlds, runners):
            by_row = {r.row: r for r in w.requests}
            if plan[0] == "finish":
                w.finish(by_row[plan[1]])
                continue
            if plan[0] == "prefill":
                reqs = [w.new_request() for _ in plan[1]]
                step = w.plan(ForwardMode.EXTEND, reqs, plan[1])
            else:
                mode, rows = plan
                step = w.plan(mode, [by_row[r] for r in rows], num_draft_tokens=NDT if mode.is_speculative else None)
            out = runner.run(step.batch, step.inputs)
            outs.append(out.clone())
            w.commit(step)
            for r in w.requests:
                w.evict(r)
        if outs:
            key = plan[0] if isinstance(plan[0], str) else plan[0].name
            counts[key] = counts.get(key, 0) + 1
            replayed += runners[0].bucket_for(step.batch) is not None
            if not torch.equal(outs[0], outs[1]):
                mismatches.append((i, key, float((outs[0].float() - outs[1].float()).abs().max())))
    torch.cuda.synchronize()
    caches_equal = all(
        torch.equal(a, b)
        for layer in range(SPEC.num_layers)
        for a, b in zip(worlds[0].pool.get_kv_buffer(layer), worlds[1].pool.get_kv_buffer(layer))
    )
    return {
        "steps": steps,
        "by_kind": counts,
        "graph_replays": replayed,
        "output_mismatches": mismatches[:10],
        "num_mismatches": len(mismatches),
        "kv_caches_bit_identical": caches_equal,
        "seconds": round(time.time() - t0, 1),
        "pass": not mismatches and caches_equal,
    }


def _edge_types(graph: "torch.cuda.CUDAGraph") -> dict:
    """Kernel nodes and dependency-edge types of a captured graph, via cuda-bindings."""
    from cuda.bindings import runtime as rt

    handle = graph.raw_cuda_graph()
    err, _, num_nodes = rt.cudaGraphGetNodes(handle, 0)
    err, nodes, num_nodes = rt.cudaGraphGetNodes(handle, num_nodes)
    kinds = {}
    for n in nodes:
        err, t = rt.cudaGraphNodeGetType(n)
        kinds[str(t).split(".")[-1]] = kinds.get(str(t).split(".")[-1], 0) + 1
    res = rt.cudaGraphGetEdges(handle, 0)
    num_edges = res[-1]
    res = rt.cudaGraphGetEdges(handle, num_edges)
    edge_data = res[3] if len(res) == 5 else None
    types = {}
    if edge_data is not None:
        for e in edge_data:
            types[int(e.type)] = types.get(int(e.type), 0) + 1
    return {
        "nodes": kinds,
        "edges": int(num_edges),
        "edge_types": types,
        "programmatic_edges": types.get(int(rt.cudaGraphDependencyType.cudaGraphDependencyTypeProgrammatic), 0),
    }


def graph_edges(pdl: bool) -> dict:
    world = _world(pdl, seed=1)
    reqs = [world.new_request() for _ in range(4)]
    step = world.plan(ForwardMode.EXTEND, reqs, [50, 60, 70, 80])
    world.run_eager(step)
    world.commit(step)
    step = world.plan(ForwardMode.DECODE, reqs)
    world.backend.init_forward_metadata(step.batch)
    fn = lambda: world.step_fn(step.batch, step.inputs)  # noqa: E731
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(g):
        fn()
    try:
        return {"pdl": pdl, **_edge_types(g)}
    except Exception as exc:  # report, do not hide
        return {"pdl": pdl, "error": f"{type(exc).__name__}: {exc}"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    result = {"twin": twin_steps(args.steps)}
    print("twin PDL on/off:", json.dumps(result["twin"]), flush=True)
    result["graph_pdl_on"] = graph_edges(True)
    result["graph_pdl_off"] = graph_edges(False)
    print("graph PDL on :", json.dumps(result["graph_pdl_on"]), flush=True)
    print("graph PDL off:", json.dumps(result["graph_pdl_off"]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    ok = (
        result["twin"]["pass"]
        and result["graph_pdl_on"].get("programmatic_edges", 0) > 0
        and result["graph_pdl_off"].get("programmatic_edges", 1) == 0
    )
    print("PDL proof:", "PASS" if ok else "FAIL", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
