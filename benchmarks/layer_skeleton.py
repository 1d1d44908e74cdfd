#!/usr/bin/env python3
"""What a small step's attention layers cost without their arithmetic: 48 dependent launches in
one PDL graph, each doing only the memory traffic, the split merge and the hand-offs of a layer.

    python benchmarks/layer_skeleton.py [--bs 1 8] [--variant 'LABEL KIND SPLITS [KEY=INT ...]' ...]
                                        [--mix 'SWA_LABEL FULL_LABEL' ...] [--json FILE]

A layer of ``hybrid_step`` (32 q / 8 kv heads, D 128, bf16; an SWA layer reads a 256-key window
of each request, a full layer 1,024 keys) is here ``_layer_skeleton_kernel``: the structure of
``store_attend``'s one launch with its arithmetic taken out. Program ``(group, split)`` of a
``(request, kv head)`` group:

1. before ``gdc_wait``: reads its split's share of the group's table row, then the K and V
   rows of those slots (256-byte rows of the layer's own cache, random slots), in one shot;
2. after the wait: reads the group's q rows (written by the previous launch: here the previous
   layer's output), adds ``sum_keys(k * v)`` to them in float32 (every loaded byte is used);
3. one split: stores the output. Several: stores its partial, takes the group's ticket
   (``atomic_add``, ``acq_rel``, after a barrier), and the last program of the group reloads
   every partial (``.cg``), averages them into the output and zeroes the ticket;
4. releases its dependents at its end, right after its wait (``early=1``) or at its entry
   (``entry=1``).

No products, no softmax, no masks: a row shows what a structure (split count, release point)
costs in launches, round trips and the merge alone. It bounds a kernel of that structure only
where the kernel reads its keys the same way: each program loads its whole share at once, with
as many warps as that takes (4 to 16), where ``store_attend`` pipelines key blocks over
programs that share an SM, which can be faster (bs 8).

Each ``--variant`` is ``LABEL KIND SPLITS`` (``KIND``: ``swa``, ``full`` or ``none``, the last
reading no keys at all) with optional ``entry=0/1``, ``early=0/1``, ``warps=N``, ``pdl=0/1``,
``noq=1`` (a launch that only waits and releases). The script times a graph of 48 launches of
each variant (CUDA events, median of 5 x 200 replays) and prints the period a layer (the
graph's time / 48). Then, for each pair of an SWA and a full variant named in ``--mix``, and
the fastest of each kind, the graph of the ``hybrid_step`` pattern (layer ``l`` full when
``l % 4 == 3``: 36 SWA and 12 full) is timed. Each variant's one launch is first checked
against a PyTorch computation of the same sums. Needs a CUDA GPU with PDL (sm_90).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from layer_timeline import NUM_LAYERS, _replay_us  # noqa: E402

HKV, GROUP, HEAD_DIM = 8, 4, 128
KEYS = {"swa": 256, "full": 1024, "none": 0}
DEFAULT_VARIANTS = (
    "empty none 1 noq=1",
    "q none 1",
    "q_split8 none 8",
    "swa_s8 swa 8",
    "swa_s4 swa 4",
    "swa_s2 swa 2",
    "swa_s1 swa 1",
    "swa_s1_entry swa 1 entry=1",
    "swa_s2_entry swa 2 entry=1",
    "full_s16 full 16",
    "full_s8 full 8",
    "full_s4 full 4",
    "full_s8_entry full 8 entry=1",
    "swa_s8_early swa 8 early=1",
    "swa_s8_entry swa 8 entry=1",
    "full_s16_early full 16 early=1",
    "full_s16_entry full 16 entry=1",
)


@triton.jit
def _layer_skeleton_kernel(
    Q,
    Out,
    K,
    V,
    Table,
    Work,
    Tickets,
    table_width,
    HKV: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    SHARE: tl.constexpr,  # keys a program reads (0: none)
    SPLITS: tl.constexpr,
    LOAD_Q: tl.constexpr,
    PDL: tl.constexpr,
    ENTRY: tl.constexpr,
    EARLY: tl.constexpr,
):
    g = tl.program_id(0)
    s = tl.program_id(1)
    if PDL and ENTRY:
        tl.extra.cuda.gdc_launch_dependents()
    b = g // HKV
    hk = g % HKV
    offs_g = tl.arange(0, G)
    offs_d = tl.arange(0, D)
    if SHARE > 0:  # the split's table entries, then its K/V rows: data of earlier steps
        offs_n = s * SHARE + tl.arange(0, SHARE)
        slot = tl.load(Table + b * table_width + offs_n).to(tl.int64)
        kv_off = slot[:, None] * (HKV * D) + hk * D + offs_d[None, :]
        k = tl.load(K + kv_off)
        v = tl.load(V + kv_off)
    if PDL:
        tl.extra.cuda.gdc_wait()
        if EARLY and not ENTRY:
            tl.extra.cuda.gdc_launch_dependents()
    rows = (b * HKV + hk) * G + offs_g
    r_ptrs = rows[:, None] * D + offs_d[None, :]
    if LOAD_Q:
        x = tl.load(Q + r_ptrs).to(tl.float32)
        if SHARE > 0:
            x = x + tl.sum(k.to(tl.float32) * v.to(tl.float32), 0)[None, :]
        if SPLITS == 1:
            tl.store(Out + r_ptrs, x.to(Out.dtype.element_ty))
        else:
            w_ptrs = ((g * SPLITS + s) * G + offs_g)[:, None] * D + offs_d[None, :]
            tl.store(Work + w_ptrs, x.to(Work.dtype.element_ty))
            tl.debug_barrier()
            ticket = tl.atomic_add(Tickets + g, 1, sem="acq_rel")
            if ticket == SPLITS - 1:
                acc = tl.zeros([G, D], dtype=tl.float32)
                for i in tl.static_range(SPLITS):
                    p_ptrs = ((g * SPLITS + i) * G + offs_g)[:, None] * D + offs_d[None, :]
                    acc += tl.load(Work + p_ptrs, cache_modifier=".cg").to(tl.float32)
                tl.store(Out + r_ptrs, (acc / SPLITS).to(Out.dtype.element_ty))
                tl.atomic_xchg(Tickets + g, 0, sem="relaxed")
    if PDL and not ENTRY and not EARLY:
        tl.extra.cuda.gdc_launch_dependents()


def parse_variant(text: str) -> Tuple[str, str, int, Dict[str, int]]:
    """``'LABEL KIND SPLITS KEY=INT ...'`` -> ``(label, kind, splits, options)``."""
    words = text.split()
    if len(words) < 3 or words[1] not in KEYS:
        raise ValueError(f"a variant is 'LABEL KIND SPLITS [KEY=INT ...]' with KIND in {sorted(KEYS)}: {text!r}")
    label, kind = words[0], words[1]
    try:
        splits = int(words[2])
        opts = {w.split("=", 1)[0]: int(w.split("=", 1)[1]) for w in words[3:]}
    except (ValueError, IndexError):
        raise ValueError(f"SPLITS and each option are integers (KEY=INT): {text!r}") from None
    unknown = set(opts) - {"entry", "early", "warps", "pdl", "noq"}
    if unknown:
        raise ValueError(f"unknown option(s) {sorted(unknown)} in {text!r}: entry, early, warps, pdl, noq")
    if splits < 1 or splits & (splits - 1) or (KEYS[kind] and KEYS[kind] // splits < 16):
        raise ValueError(f"SPLITS is a power of two leaving a split at least 16 keys: {text!r}")
    return label, kind, splits, opts


class Layer:
    """One layer of ``kind`` at ``bs`` requests: its own K/V cache and table (random distinct
    slots, drawn by ``gen``, a generator of ``device``), q / output buffers given by the chain,
    a workspace and tickets."""

    def __init__(self, kind: str, bs: int, device, gen: torch.Generator) -> None:
        self.kind, self.bs = kind, bs
        keys = KEYS[kind]
        self.width = max(keys, 1)
        slots = bs * keys + 1
        shape = (slots, HKV, HEAD_DIM)
        self.k = (torch.randn(shape, generator=gen, device=device) * 0.1).to(torch.bfloat16)
        self.v = (torch.randn(shape, generator=gen, device=device) * 0.1).to(torch.bfloat16)
        perm = torch.randperm(max(slots - 1, 1), generator=gen, device=device)[: bs * keys] + 1
        self.table = (
            perm.reshape(bs, keys).to(torch.int32) if keys else torch.ones(bs, 1, dtype=torch.int32, device=device)
        )
        most_splits = KEYS["full"] // 16  # parse_variant leaves a split at least 16 keys
        self.work = torch.empty(bs * HKV * most_splits * GROUP * HEAD_DIM, dtype=torch.bfloat16, device=device)
        self.tickets = torch.zeros(bs * HKV, dtype=torch.int32, device=device)

    def launch(self, q: torch.Tensor, out: torch.Tensor, splits: int, opts: Dict[str, int], pdl: bool) -> None:
        share = KEYS[self.kind] // splits
        warps = opts.get("warps", min(16, max(4, share // 16)))
        extra = {"launch_pdl": True} if pdl else {}
        _layer_skeleton_kernel[(self.bs * HKV, splits)](
            q, out, self.k, self.v, self.table, self.work, self.tickets, self.width,
            HKV=HKV, G=GROUP, D=HEAD_DIM, SHARE=share, SPLITS=splits, LOAD_Q=not opts.get("noq", 0),
            PDL=pdl, ENTRY=bool(opts.get("entry", 0)) and pdl, EARLY=bool(opts.get("early", 0)) and pdl,
            num_warps=warps, **extra,
        )  # fmt: skip

    def reference(self, q: torch.Tensor, splits: int) -> torch.Tensor:
        """What one launch writes to ``out`` (float32), from the same bf16 inputs."""
        x = q.float().reshape(self.bs, HKV, GROUP, HEAD_DIM)
        if not KEYS[self.kind]:
            return x.reshape(q.shape)
        kk = self.k.float()[self.table.long()]  # [bs, keys, HKV, D]
        prod = (kk * self.v.float()[self.table.long()]).reshape(self.bs, splits, -1, HKV, HEAD_DIM).sum(2)
        parts = x[:, None] + prod[:, :, :, None, :]  # [bs, splits, HKV, G, D]
        if splits > 1:
            parts = parts.to(torch.bfloat16).float().mean(1)
        else:
            parts = parts[:, 0]
        return parts.reshape(q.shape)


def check(layer: Layer, splits: int, opts: Dict[str, int], device) -> float:
    """One eager launch (PDL off) against ``Layer.reference``: the largest difference; raises
    when it is off or a ticket is left non-zero."""
    q = (torch.randn(layer.bs * HKV * GROUP, HEAD_DIM, device=device) * 0.5).to(torch.bfloat16)
    out = torch.zeros_like(q)
    layer.launch(q, out, splits, opts, pdl=False)  # without PDL, entry / early release nothing
    if opts.get("noq", 0):
        return 0.0
    ref = layer.reference(q, splits)
    diff = (out.float() - ref).abs().max().item()
    if diff > 0.02 + 0.01 * ref.abs().max().item() or int(layer.tickets.abs().sum().item()) != 0:
        raise AssertionError(f"layer skeleton kernel off: max diff {diff:.3e}, tickets {layer.tickets.tolist()}")
    return diff


def chain_us(plan: List[Tuple[Layer, int, Dict[str, int]]], device) -> float:
    """The layers of ``plan`` (``(layer, splits, options)`` each) chained in one graph, each
    reading the previous one's output as its q: microseconds a replay."""
    bufs = [(torch.randn(plan[0][0].bs * HKV * GROUP, HEAD_DIM, device=device) * 0.5).to(torch.bfloat16)]
    bufs += [torch.empty_like(bufs[0]) for _ in plan]

    def run() -> None:
        for i, (layer, splits, opts) in enumerate(plan):
            layer.launch(bufs[i], bufs[i + 1], splits, opts, pdl=bool(opts.get("pdl", 1)))

    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    torch.cuda.synchronize()
    try:
        return _replay_us(graph)
    finally:
        del graph


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bs", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--variant", action="append", default=None, help="'LABEL KIND SPLITS [KEY=INT ...]'")
    ap.add_argument("--mix", action="append", default=None, help="'SWA_LABEL FULL_LABEL': one hybrid pattern")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        print("layer_skeleton.py needs a CUDA GPU with PDL (sm_90)", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    variants = [parse_variant(v) for v in (args.variant or DEFAULT_VARIANTS)]
    named = {v[0]: v for v in variants}
    for mix in args.mix or ():
        if [named[w][1] if w in named else None for w in mix.split()] != ["swa", "full"]:
            ap.error(f"--mix {mix!r}: the label of an swa variant, then of a full one (variants: {sorted(named)})")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    rows = []
    for bs in args.bs:
        gen = torch.Generator(device=device).manual_seed(bs)
        layers = {kind: [Layer(kind, bs, device, gen) for _ in range(NUM_LAYERS)] for kind in {v[1] for v in variants}}
        period: Dict[str, float] = {}
        for label, kind, splits, opts in variants:
            diff = check(layers[kind][0], splits, opts, device)
            us = chain_us([(layer, splits, opts) for layer in layers[kind]], device)
            period[label] = us / NUM_LAYERS
            rows.append(dict(bs=bs, label=label, kind=kind, splits=splits, opts=opts, chain_us=us, diff=diff))
            print(f"bs={bs} {label:<16} {kind:<4} splits={splits:<2} {opts}: 48 launches {us:7.1f} us, "
                  f"{us / NUM_LAYERS:5.2f} us a layer (check diff {diff:.1e})", flush=True)  # fmt: skip
        by_kind = {k: [v for v in variants if v[1] == k] for k in ("swa", "full")}
        mixes = [m.split() for m in args.mix or ()]
        if by_kind["swa"] and by_kind["full"]:
            best = [min(by_kind[k], key=lambda v: period[v[0]])[0] for k in ("swa", "full")]
            mixes += [best] if best not in mixes else []
        for swa_label, full_label in mixes:
            sv, fv = named[swa_label], named[full_label]
            plan = [
                (layers["full"][i], fv[2], fv[3]) if i % 4 == 3 else (layers["swa"][i], sv[2], sv[3])
                for i in range(NUM_LAYERS)
            ]
            us = chain_us(plan, device)
            rows.append(dict(bs=bs, label=f"mix {swa_label} + {full_label}", chain_us=us))
            print(f"bs={bs} MIX {swa_label} (36 SWA) + {full_label} (12 full): 48 launches {us:.1f} us "
                  f"(36 x {period[swa_label]:.2f} + 12 x {period[full_label]:.2f} = "
                  f"{36 * period[swa_label] + 12 * period[full_label]:.1f} us)", flush=True)  # fmt: skip
        del layers
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
