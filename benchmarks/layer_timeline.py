#!/usr/bin/env python3
"""Where a one-launch layer's time goes, inside a captured PDL graph of a whole hybrid step.

    python benchmarks/layer_timeline.py [--bs 1 8] [--mode decode|draft] [--context N] [--out DIR]
                                        [--kernel triton|staged|routed|swa]
                                        [--config KEY=VALUE ...] [--config-full KEY=VALUE ...]
                                        [--config-swa KEY=VALUE ...]
                                        [--variant 'LABEL KEY=VALUE ...' ...] [--stamps]

The world of ``hybrid_step`` (48 layers, 36 SWA with W 256 and 12 full, context 1024 or ``--context``,
32 q / 8 KV heads, D 128, bf16), one DECODE step (``--mode draft``: DRAFT_EXTEND, 4 drafts)
at each ``--bs``, its 48 ``store_attend``
launches captured in one CUDA graph (PDL on). An instrumented copy of ``store_attend`` is
built from the plugin's source: each program writes ``%globaltimer`` at six points

    0 entry, 1 its prologue loads done (before gdc_wait), 2 gdc_wait returned,
    3 its key blocks done, 4 its ticket taken, 5 the merge done (the merging program only)

and the script prints, for SWA and full layers (averaged over the layers of the step):
``period`` (from the first wait of a layer to the first wait of the next: what a layer
costs), ``pro`` (prologue), ``attn`` (2 -> 3, median over programs), ``ticket`` (3 -> 4),
``merge`` (4 -> 5), ``wait_spread`` (first to last program past its wait),
``end_to_next_wait`` (the last program's end to the next layer's first wait), all in ns.
The timer ticks coarsely (256 ns on an H200), so single stamps are rough; the averages over
many programs and layers are what to read. The step's graph replay is also timed (CUDA
events, median of 5 x 200 replays), with and without the stamps.

``--config`` overrides keys of the kernel's plan (``num_stages``, ``BLOCK_N``,
``num_splits``, ``num_warps``, ``maxnreg``) on every layer, ``--config-full`` /
``--config-swa`` on one kind; ``--out DIR`` also writes one per-layer table per batch size.

``--kernel staged`` times the CUDA C++ kernels (``attnplug_cuda.staged_attend``; plan keys
``resident``, ``splits``, ``capacity``) on every layer instead, ``--kernel routed`` on the
layers the backend gives them (``staged_attend.takes_layer``), ``--kernel swa`` on the SWA
layers (the resident kernel where the window fits), and the Triton kernel on the others: each row's
output difference is then taken from the Triton plan's output (the kernels' agreement), whose
step time is printed first. The staged kernel's stamps are the same points (4 is its output
written when a group has one split, no ticket).

``--variant 'LABEL KEY=INT full.KEY=INT swa.KEY=INT ...'`` (repeatable) times plan variants
in the same run, on the same world: the plan as ``--config*`` leaves it first (``plan``),
then each variant on top of it, each row with the step time and the largest difference of
the last layer's output from the plan's; ``--stamps`` adds each variant's phases. Needs a
CUDA GPU with PDL (sm_90).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import linecache
import os
import statistics
import sys
import tempfile
from typing import Dict, List, Optional, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for sub in ("plugins/cuda", "core"):
    path = os.path.join(REPO, sub)
    if os.path.isdir(path) and path not in sys.path:
        sys.path.insert(0, path)

import torch  # noqa: E402

NUM_LAYERS, CONTEXT, WINDOW = 48, 1024, 256

_STAMP_FN = """
@triton.jit
def _stamp(Trace, pid_g, pid_s, NUM_SPLITS: tl.constexpr, I: tl.constexpr, dep):
    # %globaltimer, read only once ``dep`` is ready (the read is predicated on it)
    t = tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.eq.f32 p, $1, 0f7F7FFFFF; @!p mov.u64 $0, %globaltimer; @p mov.u64 $0, 0; }",
        "=l,f", [dep], dtype=tl.int64, is_pure=False, pack=1)
    tl.store(Trace + (pid_g * NUM_SPLITS + pid_s) * 8 + I, t)


@triton.jit
def _key_block"""

#: (anchor in the kernel's source, text that replaces it): the stamps and the trace argument
_EDITS = (
    ("from .interpret import", "from attnplug_cuda.kernels.interpret import"),
    ("from .paged_attention import", "from attnplug_cuda.kernels.paged_attention import"),
    ("@triton.jit\ndef _key_block", _STAMP_FN),
    ("    Sinks,  # [H]", "    Trace,\n    Sinks,  # [H]"),
    (
        "    RELEASE_ENTRY: tl.constexpr,  # with PDL and PROLOGUE: release the dependents at entry\n):",
        "    RELEASE_ENTRY: tl.constexpr,  # with PDL and PROLOGUE: release the dependents at entry\n"
        "    TRACE: tl.constexpr = False,\n):",
    ),
    (
        "    b = pid_g // num_kv_heads\n",
        "    b = pid_g // num_kv_heads\n"
        "    if TRACE:\n        _stamp(Trace, pid_g, pid_s, NUM_SPLITS, 0, pid_s.to(tl.float32))\n",
    ),
    (
        "    if PDL and PROLOGUE:\n        tl.extra.cuda.gdc_wait()\n",
        "    if TRACE:\n"
        "        _stamp(Trace, pid_g, pid_s, NUM_SPLITS, 1, tl.sum(tl.sum(k_old.to(tl.float32), 1), 0))\n"
        "    if PDL and PROLOGUE:\n        tl.extra.cuda.gdc_wait()\n"
        "    if TRACE:\n        _stamp(Trace, pid_g, pid_s, NUM_SPLITS, 2, pid_s.to(tl.float32))\n",
    ),
    (
        "    o_ptrs = Out + q_rows",
        "    if TRACE:\n        _stamp(Trace, pid_g, pid_s, NUM_SPLITS, 3, tl.sum(l_i, 0))\n    o_ptrs = Out + q_rows",
    ),
    (
        '        ticket = tl.atomic_add(Tickets + pid_g, 1, sem="acq_rel")\n',
        '        ticket = tl.atomic_add(Tickets + pid_g, 1, sem="acq_rel")\n'
        "        if TRACE:\n            _stamp(Trace, pid_g, pid_s, NUM_SPLITS, 4, ticket.to(tl.float32))\n",
    ),
    (
        '            tl.atomic_xchg(Tickets + pid_g, 0, sem="relaxed")  # ready for the next launch\n',
        '            tl.atomic_xchg(Tickets + pid_g, 0, sem="relaxed")  # ready for the next launch\n'
        "            if TRACE:\n                _stamp(Trace, pid_g, pid_s, NUM_SPLITS, 5, tl.sum(total, 0))\n",
    ),
    (
        "    config: Optional[dict] = None,\n) -> torch.Tensor:",
        "    config: Optional[dict] = None,\n    trace=None,\n) -> torch.Tensor:",
    ),
    (
        "        sinks if sinks is not None else workspace,\n",
        "        trace if trace is not None else workspace,\n        sinks if sinks is not None else workspace,\n",
    ),
    (
        "        RELEASE_EARLY=pdl and release_early and not entry,\n",
        "        RELEASE_EARLY=pdl and release_early and not entry,\n        TRACE=trace is not None,\n",
    ),
)


def instrumented_store_attend():
    """The plugin's ``store_attend`` module, rebuilt with the stamps (``store_attend(...,
    trace=int64 tensor)``); raises when the kernel's source no longer has an anchor."""
    from attnplug_cuda.kernels import store_attend as plugin

    return instrumented_copy(plugin, _EDITS)


def instrumented_copy(plugin, edits):
    """A new module from ``plugin``'s source with each ``(anchor, text)`` of ``edits``
    replaced once; raises, naming the file, when an anchor is no longer in the source."""
    name = os.path.basename(plugin.__file__)
    src = open(plugin.__file__).read()
    for anchor, text in edits:
        if anchor not in src:
            raise RuntimeError(f"{name} changed: no {anchor.strip()[:60]!r} to instrument")
        src = src.replace(anchor, text, 1)
    # Triton reads a kernel's source from its file when it is defined: the copy lives in one
    stem = name[: -len(".py")] + "_stamped"
    fd, path = tempfile.mkstemp(prefix=stem + "_", suffix=".py")
    with os.fdopen(fd, "w") as f:
        f.write(src)
    try:
        spec = importlib.util.spec_from_file_location(stem, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        os.unlink(path)
    # the source stays readable (inspect, the interpreter) without the file
    linecache.cache[path] = (len(src), None, src.splitlines(True), path)
    return module


def world_step(bs: int, mode: str, context: int = CONTEXT):
    """The ``hybrid_step`` world of ``bs`` requests and its step: ``(world, batch, new)``,
    ``new()`` a fresh cuda backend and its step function (the same q/k/v every time)."""
    from attnplug import ForwardMode
    from attnplug.bench.world import build_world, make_step
    from attnplug_cuda.backend import CudaBackend

    world = build_world(num_layers=NUM_LAYERS, max_bs=bs, context=context, window=WINDOW, device="cuda")
    batch = world.batch(ForwardMode.DECODE if mode == "decode" else ForwardMode.DRAFT_EXTEND, bs, with_cpu=False)

    def new():
        backend = CudaBackend(world.pool, world.rows, num_heads=world.num_heads, sliding_window=WINDOW)
        return backend, make_step(backend, world, batch.num_tokens)

    return world, batch, new


def _world(bs: int, mode: str, context: int = CONTEXT):
    world, batch, new = world_step(bs, mode, context)
    backend, step = new()
    return world, backend, batch, step


def _staged_kernel(triton_kernel, routed: bool):
    """The staged C++ kernel in ``store_attend``'s calling convention, whose stamps are those
    of the instrumented Triton kernel (``csrc/staged_attend.h``: 4 is its output written when
    a group has one split): on every layer, or (``routed``) as the backend's ``staged`` kernel,
    on the layers it gives it (``staged_attend.takes_layer``), the others through
    ``triton_kernel``. Plan keys go to the kernel that runs the layer."""
    import types

    from attnplug_cuda.kernels.store_attend import num_sms
    from attnplug_cuda.staged_attend import staged_attend

    return types.SimpleNamespace(
        store_attend=triton_kernel.store_attend if routed else staged_attend,
        staged=staged_attend if routed else None,
        num_sms=num_sms,
        max_split_programs=lambda sms: 4 * max(sms, 32),
    )


def _graph(backend, batch, step, kernel, trace, config, config_full, config_swa):
    """The step's 48 layers in one CUDA graph through ``kernel.store_attend`` (and, where the
    backend routes a layer to it, ``kernel.staged``): ``(graph, the last layer's output)``."""
    calls = [0]

    def through(attend):
        def run(*args, **kwargs):
            layer = calls[0] % NUM_LAYERS
            calls[0] += 1
            cfg = dict(config, **(config_full if kwargs.get("window") is None else config_swa))
            return attend(*args, trace=None if trace is None else trace[layer], config=cfg or None, **kwargs)

        return run

    staged = getattr(kernel, "staged", None)
    backend._store_attend = through(kernel.store_attend)
    backend._staged_attend = None if staged is None else through(staged)
    backend.init_forward_metadata(batch)
    if not backend.forward_metadata.fused:
        raise RuntimeError("this step does not take the one-launch path (store_attend)")
    return capture_step(backend, batch, step)


def capture_step(backend, batch, step):
    """The step's layers (metadata already built) in one CUDA graph, after two eager runs
    (compile, warm): ``(graph, the last layer's output)``."""
    for _ in range(2):
        backend._after_metadata = True
        step(batch, {})
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    backend._after_metadata = True
    with torch.cuda.graph(graph):
        out = step(batch, {})
    torch.cuda.synchronize()
    return graph, out


def _replay_us(graph, replays: int = 200, repeats: int = 5) -> float:
    for _ in range(10):
        graph.replay()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) * 1000 / replays)
    return statistics.median(samples)


def _layers(trace: torch.Tensor) -> List[dict]:
    """Per layer, from ``trace [L, programs, 8]`` (ns; rows of programs that ran are non-zero)."""
    out = []
    for x in trace.cpu().double():
        x = x[x[:, 0] > 0]
        merges = x[x[:, 5] > 0]
        out.append(
            dict(
                start=x[:, 0].min().item(),
                pro=(x[:, 1] - x[:, 0]).median().item(),
                wait=x[:, 2].min().item(),
                wait_spread=(x[:, 2].max() - x[:, 2].min()).item(),
                attn=(x[:, 3] - x[:, 2]).median().item(),
                ticket=(x[:, 4] - x[:, 3]).median().item(),
                merge=(merges[:, 5] - merges[:, 4]).median().item() if len(merges) else 0.0,
                staged=(x[:, 6] - x[:, 2]).median().item() if bool((x[:, 6] > 0).all()) else 0.0,
                end=max(x[:, 4].max().item(), merges[:, 5].max().item() if len(merges) else 0.0),
                programs=int(x.shape[0]),
            )
        )
    return out


def summary(layers: List[dict], is_swa: List[bool]) -> Dict[str, dict]:
    """Average phases of the SWA and the full layers (the first and last layer left out)."""
    result = {}
    for name, kind in (("swa", True), ("full", False)):
        ids = [i for i in range(1, len(layers) - 1) if is_swa[i] == kind]
        if not ids:
            continue

        def mean(f, ids=ids):
            return sum(f(i) for i in ids) / len(ids)

        result[name] = {
            "programs": layers[ids[0]]["programs"],
            "period": mean(lambda i: layers[i + 1]["wait"] - layers[i]["wait"]),
            **{
                k: mean(lambda i, k=k: layers[i][k])
                for k in ("pro", "wait_spread", "attn", "ticket", "merge", "staged")
            },
            "end_to_next_wait": mean(lambda i: layers[i + 1]["wait"] - layers[i]["end"]),
        }
    return result


def _table(layers: List[dict], is_swa: List[bool]) -> str:
    base = layers[0]["start"]
    lines = ["layer swa  start(ns)  pro  wait(ns)  attn ticket merge  end(ns)"]
    for i, r in enumerate(layers):
        lines.append(
            f"{i:5d} {int(is_swa[i]):3d} {r['start'] - base:10.0f} {r['pro']:4.0f} {r['wait'] - base:9.0f} "
            f"{r['attn']:5.0f} {r['ticket']:6.0f} {r['merge']:5.0f} {r['end'] - base:8.0f}"
        )
    return "\n".join(lines) + "\n"


def _parse(pairs: Optional[List[str]]) -> dict:
    out = {}
    for pair in pairs or []:
        key, eq, value = pair.partition("=")
        try:
            out[key] = int(value)
        except ValueError:
            raise ValueError(f"plan key {pair!r}: expected KEY=INT") from None
        if not eq or not key:
            raise ValueError(f"plan key {pair!r}: expected KEY=INT")
    return out


def parse_variant(text: str) -> Tuple[str, Tuple[dict, dict, dict]]:
    """``'LABEL KEY=INT full.KEY=INT swa.KEY=INT ...'`` -> ``(label, (every layer, full
    layers, SWA layers))``."""
    label, *pairs = text.split()
    if "=" in label:
        raise ValueError(f"variant {text!r}: starts with a label, then KEY=INT pairs")
    scoped: Dict[str, List[str]] = {"": [], "full": [], "swa": []}
    for pair in pairs:
        scope, dot, rest = pair.partition(".")
        if dot and scope in ("full", "swa"):
            scoped[scope].append(rest)
        else:
            scoped[""].append(pair)
    return label, (_parse(scoped[""]), _parse(scoped["full"]), _parse(scoped["swa"]))


def _stacked(base: Tuple[dict, dict, dict], extra: Tuple[dict, dict, dict]) -> Tuple[dict, dict, dict]:
    return tuple(dict(b, **e) for b, e in zip(base, extra))


def _phases(backend, batch, step, kernel, world, bs, mode, label, configs, out_dir) -> None:
    """One stamped replay of the step under ``configs``: the phase averages printed, the
    per-layer table written to ``out_dir``."""
    is_swa = [world.pool.is_swa_layer(layer) for layer in range(NUM_LAYERS)]
    programs = kernel.max_split_programs(kernel.num_sms(torch.device("cuda")))
    trace = torch.zeros(NUM_LAYERS, programs, 8, dtype=torch.int64, device="cuda")
    graph, _ = _graph(backend, batch, step, kernel, trace, *configs)
    stamped = _replay_us(graph)
    trace.zero_()
    graph.replay()
    torch.cuda.synchronize()
    layers = _layers(trace)
    print(f"{mode} bs={bs} {label}: with stamps {stamped:.1f} us")
    for kind, phases in summary(layers, is_swa).items():
        print(f"{mode} bs={bs} {label} {kind:4s} " + json.dumps({k: round(v) for k, v in phases.items()}))
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        name = f"timeline_{mode}_bs{bs}.txt" if label == "plan" else f"timeline_{mode}_bs{bs}_{label}.txt"
        with open(os.path.join(out_dir, name), "w") as f:
            f.write(_table(layers, is_swa))


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bs", type=int, nargs="+", default=[1, 8])
    parser.add_argument(
        "--mode", choices=("decode", "draft"), default="decode", help="DECODE or DRAFT_EXTEND (4 drafts)"
    )
    parser.add_argument("--context", type=int, default=CONTEXT, help=f"keys of each request (default {CONTEXT})")
    parser.add_argument("--config", nargs="*", help="plan keys for every layer, KEY=INT")
    parser.add_argument("--config-full", nargs="*", help="plan keys for full layers, KEY=INT")
    parser.add_argument("--config-swa", nargs="*", help="plan keys for SWA layers, KEY=INT")
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="'LABEL KEY=INT ...'",
        help="a plan variant timed in the same run (KEY, full.KEY, swa.KEY; repeatable)",
    )
    parser.add_argument("--stamps", action="store_true", help="with --variant: every variant's phases too")
    parser.add_argument(
        "--kernel",
        choices=("triton", "staged", "routed", "swa"),
        default="triton",
        help="the one-launch kernel timed: triton (default), staged, routed as the backend does, "
        "or swa (staged on the SWA layers, triton on the full ones)",
    )
    parser.add_argument("--out", help="directory for the per-layer tables")
    args = parser.parse_args(argv)
    try:
        base = (_parse(args.config), _parse(args.config_full), _parse(args.config_swa))
        variants = [parse_variant(v) for v in args.variant]
    except ValueError as exc:
        parser.error(str(exc))
    if not torch.cuda.is_available():
        print("layer_timeline needs a CUDA GPU", file=sys.stderr)
        return 2
    triton_kernel = instrumented_store_attend()
    kernel = (
        triton_kernel if args.kernel == "triton" else _staged_kernel(triton_kernel, args.kernel in ("routed", "swa"))
    )
    for bs in args.bs:
        world, backend, batch, step = _world(bs, args.mode, args.context)
        if args.kernel == "swa":
            backend._staged_layers = lambda bs, max_q_len, b=backend: (False, b._staged_attend is not None)
        if args.kernel != "triton":
            graph, ref = _graph(backend, batch, step, triton_kernel, None, {}, {}, {})
            triton_us = _replay_us(graph)
            ref = ref.clone()
            del graph
            print(f"{args.mode} bs={bs} triton plan: step {triton_us:.1f} us")
        graph, out = _graph(backend, batch, step, kernel, None, *base)
        plain = _replay_us(graph)
        line = f"{args.mode} bs={bs}: step {plain:.1f} us ({plain / NUM_LAYERS:.2f} us a layer)"
        if args.kernel != "triton":
            line += f"; output diff from the Triton plan {(out.float() - ref.float()).abs().max().item():.2e}"
        else:
            ref = out.clone()
        print(line)
        if not variants or args.stamps:
            _phases(backend, batch, step, kernel, world, bs, args.mode, "plan", base, args.out)
        del graph
        for label, extra in variants:
            configs = _stacked(base, extra)
            graph, out = _graph(backend, batch, step, kernel, None, *configs)
            us = _replay_us(graph)
            diff = (out.float() - ref.float()).abs().max().item()
            print(f"{args.mode} bs={bs} {label}: step {us:.1f} us ({plain / us:.3f}x the plan); output diff {diff:.2e}")
            del graph
            if args.stamps:
                _phases(backend, batch, step, kernel, world, bs, args.mode, label, configs, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
