#!/usr/bin/env python3
"""Where a ``paged_attention`` layer's time goes, inside a captured PDL graph of a whole hybrid step.

    python benchmarks/paged_timeline.py [--bs 64 128] [--mode decode|draft] [--context N]
                                        [--config-swa KEY=INT ...] [--config-full KEY=INT ...]
                                        [--json FILE]

The world of ``hybrid_step`` (48 layers, 36 SWA with W 256 and 12 full, context 1024 or
``--context``, 32 q / 8 KV heads, D 128, bf16), one DECODE step (``--mode draft``:
DRAFT_EXTEND, 4 drafts) at each ``--bs``, every layer through ``paged_attention`` storing the
step's K/V in its launch (the backend's path past the one-launch steps), the 48 launches
captured in one CUDA graph with the backend's PDL flags. An instrumented copy of the kernel is
built from the plugin's source: each program writes ``%globaltimer`` at four points and the SM
it ran on,

    0 entry, 1 gdc_wait returned, 2 its key blocks done, 3 its output written, 4 %smid

and the script prints, per kind of layer (SWA, full; averaged over the layers of the step but
the first and last), in µs: ``entry_med`` (a program's entry against the previous layer's last
end; negative: resident before it ended), ``wait_first`` (the first program past its wait
against the previous layer's last end: the hand-off), ``blocks_med`` (a program's key blocks,
median), ``end_first`` / ``end_med`` / ``end_last`` (programs' ends against the layer's first
wait) and ``period`` (first wait to the next layer's first wait). It then prints, for the
first SWA layers, the quantiles of the programs' ends, their mean end by how many of the
layer's programs shared their SM, and how well the SMs' mean ends agree between two layers
(the correlation: near 0 when which SM lags changes from layer to layer). The timer ticks
coarsely (256 ns on an H200): read averages, not single stamps. The stamped step's replay is
timed too (CUDA events, median of 5 x 200 replays). Needs a CUDA GPU with PDL (sm_90).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Dict, List

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))
for sub in ("plugins/cuda", "core"):
    path = os.path.join(REPO, sub)
    if os.path.isdir(path) and path not in sys.path:
        sys.path.insert(0, path)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import torch  # noqa: E402
from layer_timeline import NUM_LAYERS, _parse, _replay_us, instrumented_copy, world_step  # noqa: E402
from step_paths import capture  # noqa: E402

#: stamps a program writes (4 timer reads and its SM), in int64 slots of its trace row
STAMPS = 8

_STAMP_FN = """
@triton.jit
def _stamp(Trace, idx, I: tl.constexpr, dep):
    # %globaltimer, read only once ``dep`` is ready (the read is predicated on it)
    t = tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.eq.f32 p, $1, 0f7F7FFFFF; @!p mov.u64 $0, %globaltimer; @p mov.u64 $0, 0; }",
        "=l,f", [dep], dtype=tl.int64, is_pure=False, pack=1)
    tl.store(Trace + idx * 8 + I, t)


@triton.jit
def _stamp_sm(Trace, idx):
    sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [idx], dtype=tl.int32, is_pure=False, pack=1)
    tl.store(Trace + idx * 8 + 4, sm.to(tl.int64))


@triton.jit
def _paged_attention_kernel("""

#: (anchor in the kernel's source, text that replaces it): the stamps and the trace argument
_EDITS = (
    ("from .interpret import", "from attnplug_cuda.kernels.interpret import"),
    ("@triton.jit\ndef _paged_attention_kernel(", _STAMP_FN),
    ("    G: tl.constexpr,\n", "    Trace,\n    G: tl.constexpr,\n"),
    (
        "    LINE_ELEMS: tl.constexpr,  # elements of a 128-byte line\n):",
        "    LINE_ELEMS: tl.constexpr,  # elements of a 128-byte line\n    TRACE: tl.constexpr = False,\n):",
    ),
    (
        "    hk = pid_bh % num_kv_heads\n",
        "    hk = pid_bh % num_kv_heads\n"
        "    idx = pid_bh * NUM_SPLITS + pid_s\n"
        "    if TRACE:\n        _stamp(Trace, idx, 0, pid_s.to(tl.float32))\n        _stamp_sm(Trace, idx)\n",
    ),
    (
        "    if PDL and PROLOGUE:\n        tl.extra.cuda.gdc_wait()\n",
        "    if PDL and PROLOGUE:\n        tl.extra.cuda.gdc_wait()\n"
        "    if TRACE:\n        _stamp(Trace, idx, 1, pid_s.to(tl.float32))\n",
    ),
    (
        "    if NUM_SPLITS == 1:\n        if HAS_SINKS:",
        "    if TRACE:\n        _stamp(Trace, idx, 2, tl.sum(l_i, 0))\n    if NUM_SPLITS == 1:\n        if HAS_SINKS:",
    ),
    (
        "    if PDL and not RELEASE_EARLY:\n        tl.extra.cuda.gdc_launch_dependents()\n\n\n@triton.jit\n"
        "def _split_combine_kernel",
        "    if TRACE:\n        _stamp(Trace, idx, 3, tl.sum(l_i, 0))\n"
        "    if PDL and not RELEASE_EARLY:\n        tl.extra.cuda.gdc_launch_dependents()\n\n\n@triton.jit\n"
        "def _split_combine_kernel",
    ),
    (
        "    release_early: bool = False,\n) -> torch.Tensor:",
        "    release_early: bool = False,\n    trace=None,\n) -> torch.Tensor:",
    ),
    (
        "        LINE_ELEMS=128 // q.element_size(),\n",
        "        LINE_ELEMS=128 // q.element_size(),\n"
        "        Trace=trace if trace is not None else part_m,\n        TRACE=trace is not None,\n",
    ),
)


def instrumented_paged_attention():
    """The plugin's ``paged_attention`` module, rebuilt with the stamps (``paged_attention(...,
    trace=int64 tensor [programs, STAMPS])``); raises when the source no longer has an anchor."""
    from attnplug_cuda.kernels import paged_attention as plugin

    return instrumented_copy(plugin, _EDITS)


def _programs(trace: torch.Tensor) -> List[torch.Tensor]:
    """Per layer, the rows of ``trace [L, programs, STAMPS]`` of programs that ran (ns), as float64."""
    return [x[x[:, 0] > 0] for x in trace.cpu().double()]


def summary(trace: torch.Tensor, is_swa: List[bool]) -> Dict[str, dict]:
    """Per kind of layer, the phase means of the module docstring (µs), over every layer but
    the first and the last."""
    lay = _programs(trace)
    rows: Dict[str, List[dict]] = {"swa": [], "full": []}
    for i in range(1, len(lay) - 1):
        x, prev, nxt = lay[i], lay[i - 1], lay[i + 1]
        prev_end, wait0 = prev[:, 3].max(), x[:, 1].min()
        rows["swa" if is_swa[i] else "full"].append(
            dict(
                entry_med=(x[:, 0].median() - prev_end).item(),
                wait_first=(wait0 - prev_end).item(),
                blocks_med=(x[:, 2] - x[:, 1]).median().item(),
                end_first=(x[:, 3].min() - wait0).item(),
                end_med=(x[:, 3].median() - wait0).item(),
                end_last=(x[:, 3].max() - wait0).item(),
                period=(nxt[:, 1].min() - wait0).item(),
            )
        )
    return {
        kind: {"layers": len(rs), **{k: statistics.mean(r[k] for r in rs) / 1000 for k in rs[0]}}
        for kind, rs in rows.items()
        if rs
    }


def end_spread(trace: torch.Tensor, layers: List[int], num_sms: int) -> dict:
    """For the given layers: the quantiles of the programs' ends (µs from the layer's first
    wait), their mean end by how many of the layer's programs shared their SM, and the
    correlation of the SMs' mean ends between the first two layers."""
    lay = _programs(trace)
    result: dict = {"layers": {}}
    sm_means = []
    for i in layers:
        x = lay[i]
        end = (x[:, 3] - x[:, 1].min()) / 1000
        sm = x[:, 4].long()
        count = torch.bincount(sm, minlength=num_sms)
        shared = count[sm]
        by_count = {
            int(c): dict(programs=int((shared == c).sum()), mean_end=end[shared == c].mean().item())
            for c in sorted(set(shared.tolist()))
        }
        qs = torch.quantile(end, torch.tensor([0.0, 0.1, 0.5, 0.9, 1.0], dtype=end.dtype))
        result["layers"][i] = dict(end_quantiles=[round(v, 2) for v in qs.tolist()], by_programs_an_sm=by_count)
        sm_means.append(torch.zeros(num_sms, dtype=end.dtype).index_add_(0, sm, end) / count.clamp_min(1))
    if len(sm_means) >= 2:
        used = (sm_means[0] > 0) & (sm_means[1] > 0)
        pair = torch.stack([sm_means[0][used], sm_means[1][used]])
        result["sm_mean_end_correlation"] = torch.corrcoef(pair)[0, 1].item()
    return result


def _traced(kernel, trace: torch.Tensor, swa_cfg: dict, full_cfg: dict):
    """``kernel`` (the stamped ``paged_attention``) with each call of a step writing the next
    layer's rows of ``trace`` and taking the plan keys of its kind of layer."""
    calls = [0]

    def run(*args, **kwargs):
        layer = calls[0] % trace.shape[0]
        calls[0] += 1
        cfg = swa_cfg if kwargs.get("window") is not None else full_cfg
        return kernel(*args, trace=trace[layer], config=dict(cfg) or None, **kwargs)

    return run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bs", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--mode", choices=("decode", "draft"), default="decode")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--config-swa", nargs="*", default=[], metavar="KEY=INT")
    ap.add_argument("--config-full", nargs="*", default=[], metavar="KEY=INT")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    swa_cfg, full_cfg = _parse(args.config_swa), _parse(args.config_full)
    if not torch.cuda.is_available():
        print("paged_timeline needs a CUDA GPU", file=sys.stderr)
        return 2
    stamped = instrumented_paged_attention()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    report = {}
    for bs in args.bs:
        world, batch, new = world_step(bs, args.mode, args.context)
        backend, step = new()
        # a plan splits only while its grid is below PROGRAMS_PER_SM programs an SM: fewer
        # than twice that, or the unsplit grid (one row block: decode and 4-draft tiles)
        rows = 2 * max(stamped.PROGRAMS_PER_SM * num_sms, bs * world.num_kv_heads)
        trace = torch.zeros(NUM_LAYERS, rows, STAMPS, dtype=torch.int64, device="cuda")
        backend._paged_attention = _traced(stamped.paged_attention, trace, swa_cfg, full_cfg)
        backend._fused_eligible = lambda *a: False  # every layer through paged_attention
        graph, _ = capture(backend, batch, step)
        us = _replay_us(graph)
        trace.zero_()
        graph.replay()
        torch.cuda.synchronize()
        is_swa = [world.pool.is_swa_layer(layer) for layer in range(NUM_LAYERS)]
        phases = summary(trace, is_swa)
        swa_layers = [i for i in range(2, NUM_LAYERS - 1) if is_swa[i]][:3]
        spread = end_spread(trace, swa_layers, num_sms)
        report[f"{args.mode}_bs{bs}"] = dict(step_us=us, phases=phases, swa_end_spread=spread)
        print(f"{args.mode} bs={bs}: stamped step {us:.1f} us")
        for kind, p in phases.items():
            print(f"  {kind:4s} " + " ".join(f"{k}={v:.2f}" for k, v in p.items() if k != "layers"))
        for i, s in spread["layers"].items():
            means = ", ".join(f"{c}: {d['programs']} at {d['mean_end']:.2f}" for c, d in s["by_programs_an_sm"].items())
            print(f"  layer {i} ends (0/10/50/90/100 %): {s['end_quantiles']}; by programs an SM: {means}")
        if "sm_mean_end_correlation" in spread:
            corr = spread["sm_mean_end_correlation"]
            print(f"  SMs' mean ends, correlation between layers {swa_layers[:2]}: {corr:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
