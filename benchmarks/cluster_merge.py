#!/usr/bin/env python3
"""A cluster merge for the one-launch small-step layers, measured against ``store_attend``.

    python benchmarks/cluster_merge.py [--out DIR] [--sm-clock-mhz 1980]

``store_attend`` (the plugin's one-launch layer) merges a (request, kv head) group's KV
splits through global memory: each program writes its partial, takes an atomic ticket, and
the last one reads every partial back. The alternative measured here,
``benchmarks/cluster_merge/cluster_attend.cu``, makes the splits of a group the CTAs of one
thread-block cluster (sm_90): each CTA folds its keys with tensor-core MMAs into a partial in
its shared memory, and after a cluster barrier each CTA merges its share of the outputs from
its peers' shared memory, then a second barrier keeps that memory alive until every peer has
read it. Same semantics (KV store, table lookup, window, softcap, sinks, PDL prologue and
early release), fp16 / bf16, head dim 64 / 128, up to 8 (token, q head) rows a group.

On the world of ``hybrid_step`` (48 layers, 36 SWA with W 256 and 12 full, context 1024,
32 q / 8 kv heads, D 128, bf16) the script builds the kernel (``torch.utils.cpp_extension``:
nvcc and ninja needed), then prints:

1. **check**: every layer's output against ``store_attend``'s (largest difference), the
   stored K/V rows, and PDL on against off (bit-identical);
2. **steps**: the 48 launches in one CUDA graph with PDL, prologue and early release (as the
   backend runs them), ``store_attend`` against the cluster kernel, bs 1 / 8 / 16, 1 and 2
   new tokens a request;
3. **layers**: one layer launched 20 times in a graph without PDL, ``store_attend`` against
   the cluster kernel at 1 to 16 CTAs a cluster;
4. **phases**: the kernel rebuilt with ``CLUSTER_ATTEND_STAMPS``: mean time of each phase
   of a CTA (``clock64`` cycles at ``--sm-clock-mhz``), one layer launched alone;
5. **launch**: a graph of 48 launches of a kernel that does almost nothing (8 or 64 groups x
   1 to 16 CTAs), plain or as clusters with two cluster barriers, PDL off and on.

``--out DIR`` writes ``cluster_merge.json``. Needs a CUDA GPU of compute capability 9.0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Optional

import torch

HERE = Path(__file__).resolve().parent
SRC = HERE / "cluster_merge"
CSRC_DIR = HERE.parent / "plugins" / "cuda" / "attnplug_cuda" / "csrc"  # the plugin's device helpers
H, HKV, D, W, CTX, LAYERS = 32, 8, 128, 256, 1024, 48
MAX_SPLITS, MIN_KEYS_PER_SPLIT, CTAS_PER_SM = 16, 32, 2
PHASES = ("metadata", "table+issue", "kv_in_smem", "keys_folded", "cta_merge", "barrier_1", "merge+store", "barrier_2")


def build(stamps: bool):
    from torch.utils.cpp_extension import load

    from attnplug import env

    name = "attnplug_cluster_merge" + ("_stamps" if stamps else "")
    build_dir = env.cache_dir() / "cluster_merge" / name
    build_dir.mkdir(parents=True, exist_ok=True)
    switch = ["-DCLUSTER_ATTEND_STAMPS"] if stamps else []
    return load(
        name=name,
        sources=[str(SRC / "cluster_attend.cu"), str(SRC / "cluster_attend_binding.cpp")],
        extra_cflags=["-O3", *switch],
        extra_cuda_cflags=["-gencode=arch=compute_90,code=sm_90", "-O3", "-lineinfo", *switch],
        extra_include_paths=[str(SRC), str(CSRC_DIR)],  # the plugin's attention_device.cuh
        build_directory=str(build_dir),
        verbose=False,
    )


def plan_splits(num_reqs: int, max_q_len: int, max_kv_len: int, window: Optional[int], num_sms: int) -> int:
    """CTAs a cluster: double while the grid stays within CTAS_PER_SM a SM and a split keeps
    >= MIN_KEYS_PER_SPLIT keys (the rule of store_attend's plan, with its own constants)."""
    span = max(1, max_kv_len)
    if window is not None:
        span = min(span, max(1, max_q_len) + window - 1)
    groups, splits = max(1, num_reqs * HKV), 1
    while (
        splits * 2 <= MAX_SPLITS
        and groups * splits * 2 <= CTAS_PER_SM * num_sms
        and span >= splits * 2 * MIN_KEYS_PER_SPLIT
    ):
        splits *= 2
    return splits


def cluster_attend(mod, q, k, v, loc, k_cache, v_cache, out, *, splits=None, **kw):
    """The cluster kernel with ``store_attend``'s keyword arguments (workspace / tickets
    ignored); ``splits`` overrides the plan."""
    from attnplug_cuda.kernels.paged_attention import check_attention_args, log2_scales

    kw.pop("workspace", None)
    kw.pop("tickets", None)
    _, _, dim, hkv, group, bs = check_attention_args(
        q,
        k_cache,
        v_cache,
        out,
        **{n: kw[n] for n in ("cu_q_lens", "seq_lens", "table", "table_rows", "max_q_len", "max_kv_len")},
        table_start=kw.get("table_start"),
        window=kw.get("window"),
        softcap=None,
        sinks=None,
    )
    rows = kw["max_q_len"] * group
    assert rows <= 8, f"{rows} rows: the cluster kernel takes at most 8"
    if splits is None:
        splits = plan_splits(
            bs,
            kw["max_q_len"],
            kw["max_kv_len"],
            kw.get("window"),
            torch.cuda.get_device_properties(q.device).multi_processor_count,
        )
    qk_scale, cap = log2_scales(kw.get("sm_scale"), None, dim)
    pdl = bool(kw.get("pdl"))
    mod.cluster_attend(
        q, k, v, loc, k_cache, v_cache, out, kw["cu_q_lens"], kw["seq_lens"], kw["table"], kw["table_rows"],
        kw.get("table_start"), None, qk_scale, cap, kw.get("window") or 0, rows, splits, pdl,
        pdl and bool(kw.get("prologue")), pdl and bool(kw.get("release_early")),
    )  # fmt: skip
    return out


class World:
    """One step of the hybrid_step shapes: per-layer caches, full and window tables, q/k/v."""

    def __init__(self, bs: int, q_len: int, seed: int = 0):
        dev = torch.device("cuda")
        g = torch.Generator().manual_seed(seed)
        slots = bs * CTX + 64
        self.q_len = q_len
        rand = lambda: torch.randn(slots, HKV, D, generator=g).bfloat16().to(dev)  # noqa: E731
        self.caches = [(rand(), rand()) for _ in range(LAYERS)]
        self.full = (torch.randperm(slots - 1, generator=g)[: bs * CTX] + 1).view(bs, CTX).int().to(dev)
        width = W + q_len - 1
        self.swa = self.full[:, CTX - width :].contiguous()
        self.start = torch.full((bs,), CTX - width, dtype=torch.int32, device=dev)
        self.seq = torch.full((bs,), CTX, dtype=torch.int32, device=dev)
        self.loc = self.full[:, CTX - q_len :].reshape(-1).contiguous()
        n = bs * q_len
        qkv = torch.randn(n, H + 2 * HKV, D, generator=g).bfloat16().to(dev)
        self.q, self.k, self.v = qkv[:, :H], qkv[:, H : H + HKV], qkv[:, H + HKV :]
        self.cu = torch.arange(0, n + 1, q_len, dtype=torch.int32, device=dev)
        self.rows = torch.arange(bs, dtype=torch.int32, device=dev)

    def layer_args(self, i: int) -> dict:
        common = dict(cu_q_lens=self.cu, seq_lens=self.seq, max_q_len=self.q_len, sm_scale=D**-0.5)
        if i % 4 != 3:  # SWA
            return dict(
                common,
                table=self.swa,
                table_rows=self.rows,
                table_start=self.start,
                max_kv_len=self.swa.shape[1],
                window=W,
            )
        return dict(common, table=self.full, table_rows=self.rows, table_start=None, max_kv_len=CTX, window=None)

    def step(self, attend, *, pdl=True) -> list:
        outs = []
        for i in range(LAYERS):
            out = torch.empty_like(self.q)
            kc, vc = self.caches[i]
            args = dict(self.layer_args(i), pdl=pdl, prologue=pdl and i > 0, release_early=pdl)
            attend(self.q, self.k, self.v, self.loc, kc, vc, out, **args)
            outs.append(out)
        return outs


def graph_us(fn, per_replay: int = 1, n: int = 200, repeats: int = 5) -> float:
    """Median over ``repeats`` of the mean replay time of a graph of ``fn`` (microseconds)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(n):
            graph.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1000 / n / per_replay)
    return sorted(times)[repeats // 2]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--sm-clock-mhz", type=float, default=1980.0, help="SM clock that converts clock64 cycles to us")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        print("needs a CUDA GPU of compute capability 9.0 or newer (thread-block clusters)", file=sys.stderr)
        return 2
    from attnplug_cuda.kernels.store_attend import store_attend, store_attend_workspace_numel

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    workspace = torch.empty(store_attend_workspace_numel(D, sms), dtype=torch.float32, device=dev)
    tickets = torch.zeros(64 * HKV, dtype=torch.int32, device=dev)
    triton_attend = lambda *a, **kw: store_attend(*a, workspace=workspace, tickets=tickets, **kw)  # noqa: E731
    mod = build(stamps=False)
    clus = lambda *a, **kw: cluster_attend(mod, *a, **kw)  # noqa: E731
    report: dict = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__}

    print("1. check: cluster kernel against store_attend (every layer), stored rows, PDL on vs off", flush=True)
    report["check"] = []
    for q_len in (1, 2):
        for bs in (1, 8):
            w = World(bs, q_len, seed=bs + q_len)
            ref = [o.float() for o in w.step(triton_attend)]
            for kc, vc in w.caches:  # the store wrote the step's rows: undo, so the cluster kernel stores them again
                kc[w.loc.long()] = 0
                vc[w.loc.long()] = 0
            got = w.step(clus)
            torch.cuda.synchronize()
            stored = all(
                torch.equal(kc[w.loc.long()], w.k) and torch.equal(vc[w.loc.long()], w.v) for kc, vc in w.caches
            )
            diff = max((a - b.float()).abs().max().item() for a, b in zip(ref, got))
            off = w.step(clus, pdl=False)
            same = all(torch.equal(a, b) for a, b in zip(got, off))
            row = dict(q_len=q_len, bs=bs, max_diff=diff, stored=stored, pdl_identical=same)
            report["check"].append(row)
            print(
                f"   q_len {q_len} bs {bs}: max |cluster - store_attend| {diff:.2e}, rows stored {stored}, "
                f"PDL on == off {same}",
                flush=True,
            )
            if diff > 2e-2 or not stored or not same:
                print("   FAILED", flush=True)
                return 1

    print("2. steps: 48 launches in one graph (PDL, prologue, early release), us per step", flush=True)
    report["steps"] = []
    for q_len in (1, 2):
        for bs in (1, 8, 16):
            w = World(bs, q_len)
            t_triton = graph_us(lambda w=w: w.step(triton_attend))
            t_cluster = graph_us(lambda w=w: w.step(clus))
            report["steps"].append(dict(q_len=q_len, bs=bs, store_attend_us=t_triton, cluster_us=t_cluster))
            print(
                f"   q_len {q_len} bs {bs:2d}: store_attend {t_triton:7.1f}  cluster {t_cluster:7.1f}  "
                f"store_attend / cluster {t_triton / t_cluster:.2f}x",
                flush=True,
            )

    print("3. layers: one layer x 20 in a graph, no PDL, us per launch (cluster: CTAs a cluster)", flush=True)
    report["layers"] = []
    for bs in (1, 8):
        w = World(bs, 1)
        for i, kind in ((0, "swa"), (3, "full")):
            kc, vc = w.caches[i]
            out = torch.empty_like(w.q)

            def run(attend, i=i, kc=kc, vc=vc, out=out, w=w, **extra):
                return lambda: [
                    attend(w.q, w.k, w.v, w.loc, kc, vc, out, **w.layer_args(i), **extra) for _ in range(20)
                ]

            row = dict(bs=bs, layer=kind, store_attend_us=graph_us(run(triton_attend), per_replay=20))
            for splits in (1, 2, 4, 8, 16):
                row[f"cluster_{splits}_us"] = graph_us(run(clus, splits=splits), per_replay=20)
            report["layers"].append(row)
            print(
                f"   bs {bs} {kind:4s}: store_attend {row['store_attend_us']:5.2f} | "
                + "  ".join(f"{s}: {row[f'cluster_{s}_us']:5.2f}" for s in (1, 2, 4, 8, 16)),
                flush=True,
            )

    print(
        f"4. phases: mean us of each phase of a CTA (clock64 at {args.sm_clock_mhz:.0f} MHz), one launch alone",
        flush=True,
    )
    stamped = build(stamps=True)
    report["phases"] = []
    for bs in (1, 8):
        w = World(bs, 1)
        for i, kind, splits in ((0, "swa", 8), (0, "swa", 4), (3, "full", 16), (3, "full", 8), (3, "full", 4)):
            if bs * HKV * splits > 2 * sms:
                continue
            kc, vc = w.caches[i]
            out = torch.empty_like(w.q)
            total = None
            ctas = bs * HKV * splits
            for it in range(30):
                cluster_attend(stamped, w.q, w.k, w.v, w.loc, kc, vc, out, splits=splits, **w.layer_args(i))
                torch.cuda.synchronize()
                if it >= 5:
                    st = stamped.stamps(ctas * 9).view(ctas, 9).double()
                    total = st if total is None else total + st
            st = total / 25
            phases = ((st[:, 1:] - st[:, :-1]).mean(0) / args.sm_clock_mhz).tolist()
            whole = ((st[:, 8] - st[:, 0]).mean() / args.sm_clock_mhz).item()
            report["phases"].append(dict(bs=bs, layer=kind, splits=splits, total_us=whole, **dict(zip(PHASES, phases))))
            print(
                f"   bs {bs} {kind:4s} {splits:2d} CTAs: {whole:5.2f} us = "
                + " + ".join(f"{n} {x:.2f}" for n, x in zip(PHASES, phases)),
                flush=True,
            )

    print("5. launch: 48 launches of a kernel doing almost nothing, in one graph, us per graph", flush=True)
    report["launch"] = []
    probe_out = torch.zeros(1024, device=dev)
    for groups in (8, 64):
        for splits in (1, 2, 4, 8, 16):
            row = dict(groups=groups, splits=splits)
            for cluster in (False, True):
                for pdl in (False, True):
                    key = f"{'cluster' if cluster else 'plain'}{'_pdl' if pdl else ''}_us"
                    row[key] = graph_us(
                        lambda c=cluster, p=pdl, g=groups, s=splits: [
                            mod.launch_probe(probe_out, g, s, c, p) for _ in range(LAYERS)
                        ]
                    )
            report["launch"].append(row)
            cells = "  ".join(
                f"{k[:-3]} {row[k]:5.1f}" for k in ("plain_us", "plain_pdl_us", "cluster_us", "cluster_pdl_us")
            )
            print(f"   {groups:2d} groups x {splits:2d}: {cells}", flush=True)

    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "cluster_merge.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent / "core"))
    sys.path.insert(0, str(HERE.parent / "plugins" / "cuda"))
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
