"""Whole-step benchmarks: every layer of a hybrid model per step, per variant, per batch size.

``run_step_benchmark`` builds one ``HybridWorld`` (``world.py``) per KV cache dtype its
variants and peers ask for (the model's dtype, and an FP8 twin holding the same keys
quantised with ``world.bench_kv_scales``) and, for every mode, batch size and variant, runs the
step of the first ``bs`` requests many times:

* a ``graph`` variant runs through ``attnplug.GraphRunner`` (one bucket: the case's bs,
  captured with ``capture(strict=True)``: a capture that fails is an error, never a silent
  eager run), so each step is the runner's preparation plus a replay of the backend's graph;
* an eager variant (``graph=False``) prepares the metadata and runs every layer each step.

Time per step = wall clock of N back-to-back steps then one synchronisation, / N, median of
a few repeats (``Timer.wall_us``). Rows: ``time per step`` per variant (plot keys
``variant``, ``bs``, ``series`` = the mode), and per non-baseline variant the speedup
``baseline / variant`` with the largest output difference from the baseline; a last row
holds the largest difference over every case against ``tolerance``. Where a graph variant's
backend has no device graph (its ``new_graph()`` is the ``EagerGraph`` stand-in, e.g. on the
host) its rows and the speedups against it carry ``graphs="eager stand-in"`` and say so in
their detail: such a "speedup" is the noise of two eager runs.

Optional measurements around the same steps:

* floors (``StepVariant.floor``): the variant's time rows carry ``floor`` and
  ``pct_of_floor`` (``floors.StepFloor``: the launch floor from the plugin's ``LaunchFloor``,
  the bandwidth floor from ``floors.step_bytes`` at the copy bandwidth measured at the start);
* ``StepRatio``: two variants (e.g. PDL on / off, or a bf16 against an FP8 cache) compared:
  speedup row with the largest output difference, and whether every layer's output is
  bit-identical;
* ``StepPeer``: another implementation timed on the same world (e.g. attention only), with
  the ratio ``peer / variant``; a peer that is not installed leaves one row saying so;
* ``StepVariant.check_attention``: the variant's DECODE attention against float32 attention
  over its (dequantised) cache (``step_check``);
* ``PrepCheck``: host time of the graph runner's replay preparation (``replay_prep_us``).

A variant whose backend cannot be built over its pool (e.g. a backend that does not serve an
FP8 cache) leaves one error row saying why; the others run.

This module runs the cases and writes their time and speedup rows; what is measured is described
in ``step_spec``, one case is measured by ``step_measure``, the ratio and peer rows come from
``step_compare``.
"""

from __future__ import annotations

import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..batch import ForwardMode
from ..graphs import EagerGraph
from ..memory.fp8 import is_fp8
from .context import Ctx
from .floors import LaunchFloor, StepFloor
from .report import STAND_IN
from .rows import error_row, row
from .step_compare import attention_check_rows, peer_rows, ratio_rows
from .step_measure import layer_outputs, replay_prep_us, step_floor, time_variant
from .step_spec import PeerUnavailable, PrepCheck, StepPeer, StepRatio, StepShape, StepVariant
from .timing import copy_bandwidth, free_memory
from .world import HybridWorld, bench_kv_scales, build_world

__all__ = [
    "PeerUnavailable",
    "PrepCheck",
    "StepPeer",
    "StepRatio",
    "StepShape",
    "StepVariant",
    "layer_outputs",
    "replay_prep_us",
    "run_step_benchmark",
    "time_variant",
]


def run_step_benchmark(
    ctx: Ctx,
    *,
    name: str,
    shape: StepShape,
    variants: Dict[str, StepVariant],
    baseline: str,
    modes: Sequence[ForwardMode],
    sizes: Sequence[int],
    steps: Callable[[int], int],
    repeats: int,
    target_speedup: Optional[float] = None,
    tolerance: float = 1e-2,
    need_s: float = 30.0,
    warmup: int = 5,
    time_targets: Optional[Dict[Tuple[ForwardMode, int], float]] = None,
    launch_floor: Optional[LaunchFloor] = None,
    copy_bytes: int = 2 << 30,
    ratios: Sequence[StepRatio] = (),
    peers: Sequence[StepPeer] = (),
    prep: Optional[PrepCheck] = None,
) -> List[dict]:
    """Run the step benchmark described in the module docstring; appends to ``ctx.rows``.
    ``steps(bs)``: steps per timed sample; ``target_speedup``: the speedup over the
    baseline every non-baseline variant must reach (None: reported, not held);
    ``tolerance``: the largest allowed output difference from the baseline; ``warmup``:
    untimed steps before each variant's samples; ``time_targets``: ``(mode, bs) -> us`` the
    floor variants' time per step is held to; ``launch_floor``: the device's launch floor
    (None: bandwidth floor only); ``copy_bytes``: size of the copy that measures the
    bandwidth; ``ratios``, ``peers``, ``prep``: see the module docstring."""
    rows = ctx.rows
    floors_wanted = any(v.floor for v in variants.values())
    copy_tb_s = None
    if floors_wanted:
        bw = copy_bandwidth(ctx.timer, copy_bytes, rep_ms=30.0 if ctx.quick else 100.0)
        copy_tb_s = bw["tb_s"]
        rows.append(
            row(
                name,
                f"device-to-device copy ({bw['bytes'] / 2 / 2**20:.0f} MiB, read+write)",
                "bandwidth",
                copy_tb_s,
                "TB/s",
                us=bw["us"],
                bytes=bw["bytes"],
                key=True,
                detail="the bandwidth floor of every step below is its bytes at this rate",
            )
        )
        ctx.log(f"  copy bandwidth {copy_tb_s:.3f} TB/s")
    worlds: Dict[torch.dtype, HybridWorld] = {}
    for cache_dtype in [shape.dtype] + [
        d for d in (*(v.kv_cache_dtype for v in variants.values()), *(p.kv_cache_dtype for p in peers)) if d
    ]:
        if cache_dtype not in worlds:
            worlds[cache_dtype] = _world(shape, max(sizes), cache_dtype, ctx.device)
    ctx.timer.sync()
    for cache_dtype, w in worlds.items():
        held = str(cache_dtype).replace("torch.", "")
        ctx.log(f"  world: {shape.describe()}, KV cache {held}, max bs {max(sizes)} on {w.pool.device}")
    ctx.log(f"  timing: {ctx.timer.method}")
    world_of = {v: worlds[spec.kv_cache_dtype or shape.dtype] for v, spec in variants.items()}
    backends = {}
    for v, spec in variants.items():
        try:
            backends[v] = spec.make(
                world_of[v].pool, world_of[v].rows, num_heads=shape.num_heads, sliding_window=shape.window
            )
        except Exception as exc:
            rows.append(error_row(name, f"{v} (every case)", "time per step", "us", exc, variant=v))
            ctx.log(f"  {v}: cannot run: {type(exc).__name__}: {exc}")
    variants = {v: spec for v, spec in variants.items() if v in backends}
    # graph variants whose backend has no device graph: the eager stand-in, said in their rows
    stand_in = {v for v, spec in variants.items() if spec.graph and isinstance(backends[v].new_graph(), EagerGraph)}
    if stand_in:
        ctx.log(f"  {', '.join(sorted(stand_in))}: {STAND_IN} (no device graph here): speedups are noise")
    time_targets = time_targets or {}
    empty_graph: Dict[Tuple[int, bool], float] = {}
    unavailable: Dict[str, str] = {}
    diffs: List[float] = []
    for mode in modes:
        series = mode.name.lower()
        for bs in sizes:
            label = f"{series} bs={bs}"
            if ctx.time_low(need_s):
                rows.append(
                    row(
                        name,
                        label,
                        f"speedup ({baseline} / variant)",
                        None,
                        "x",
                        notes="skipped: time budget",
                        key=True,
                    )
                )
                ctx.log(f"  {label}: skipped (time budget)")
                continue
            times: Dict[str, float] = {}
            outs: Dict[str, torch.Tensor] = {}
            n = steps(bs)
            for v, spec in variants.items():
                if spec.sizes is not None and bs not in spec.sizes:
                    continue
                extra: Dict[str, Any] = {}

                def after(run_step, runner, batch, inputs, case=(v, mode, bs), spec=spec, extra=extra):
                    v_, mode_, bs_ = case
                    if spec.floor:
                        extra["floor"] = step_floor(
                            ctx,
                            shape,
                            mode_,
                            bs_,
                            run_step,
                            backends[v_],
                            launch_floor,
                            copy_tb_s,
                            empty_graph,
                            spec.kv_cache_dtype,
                        )
                    if prep is not None and runner is not None and case == (prep.variant, prep.mode, prep.bs):
                        extra["prep_us"] = replay_prep_us(ctx.timer, runner, batch, inputs, iters=prep.iters)

                try:
                    us, outs[v] = time_variant(
                        ctx,
                        world_of[v],
                        spec,
                        backends[v],
                        mode,
                        bs,
                        steps=n,
                        repeats=repeats,
                        warmup=warmup,
                        after=after,
                    )
                    times[v] = us
                    rows.append(
                        _time_row(
                            name,
                            label,
                            v,
                            us,
                            bs,
                            series,
                            n,
                            repeats,
                            time_targets.get((mode, bs)),
                            extra,
                            STAND_IN if v in stand_in else None,
                        )
                    )
                    ctx.log(
                        f"  {label} {v}: {us:.1f} us/step"
                        + (f"; {extra['floor'].describe()}" if "floor" in extra else "")
                    )
                    if "prep_us" in extra:
                        rows.append(_prep_row(name, label, v, extra["prep_us"], prep))
                        ctx.log(f"  {label} {v}: host replay preparation {extra['prep_us']:.1f} us")
                except Exception as exc:
                    rows.append(
                        row(
                            name,
                            f"{label} {v}",
                            "time per step",
                            None,
                            "us",
                            variant=v,
                            bs=bs,
                            series=series,
                            error=f"{type(exc).__name__}: {exc}",
                            traceback=traceback.format_exc(),
                        )
                    )
                    ctx.log(f"  {label} {v}: FAILED {type(exc).__name__}: {exc}")
                finally:
                    free_memory(ctx.timer)
                if spec.check_attention and mode is ForwardMode.DECODE and v in times:
                    rows.extend(
                        attention_check_rows(ctx, name, label, v, backends[v], world_of[v], bs, with_cpu=spec.with_cpu)
                    )
            for r in ratios:
                if r.slow in times and r.fast in times:
                    rows.extend(ratio_rows(ctx, name, label, r, times, outs, world_of, backends, variants, mode, bs))
            for peer in peers:
                if mode in peer.modes and peer.name not in unavailable:
                    peer_world = worlds[peer.kv_cache_dtype or shape.dtype]
                    rows.extend(peer_rows(ctx, name, label, peer, times, peer_world, mode, bs, series, unavailable))
            if baseline not in times:
                continue
            for v in variants:
                if v == baseline or v not in times or not variants[v].vs_baseline:
                    continue
                diff = (outs[v] - outs[baseline]).abs().max().item()
                diffs.append(diff)
                s = times[baseline] / times[v]
                held = target_speedup is not None
                metric = f"speedup ({baseline} / {v})"
                noise = v in stand_in or baseline in stand_in
                graphs = {"graphs": STAND_IN} if noise else {}
                rows.append(
                    row(
                        name,
                        label,
                        metric,
                        s,
                        "x",
                        target=f">= {target_speedup}x" if held else None,
                        met=(s >= target_speedup) if held else None,
                        key=True,
                        of_variant=v,
                        bs=bs,
                        series=series,
                        max_abs_out_diff=diff,
                        **{f"{v}_us": times[v], f"{baseline}_us": times[baseline]},
                        **graphs,
                        detail=(f"OUTPUTS DIFFER (max {diff:.3g}); " if diff > tolerance else "")
                        + (f"{STAND_IN}, no device graph: noise, not a speedup; " if noise else "")
                        + f"step: {v} {times[v]:.1f} us, {baseline} {times[baseline]:.1f} us",
                    )
                )
                ctx.log(
                    f"  {label:20s} {v} {times[v]:9.1f} us  {baseline} {times[baseline]:9.1f} us  "
                    f"speedup {s:5.2f}x  (max |out diff| {diff:.2e})"
                )
            del outs
    if diffs:
        rows.append(
            row(
                name,
                f"every case ({len(diffs)})",
                f"max |variant - {baseline}| output",
                max(diffs),
                "",
                target=f"<= {tolerance:g}",
                met=max(diffs) <= tolerance,
                detail="same attention, same KV: every variant must agree with the baseline",
            )
        )
    backends.clear()
    del world_of
    worlds.clear()
    free_memory(ctx.timer)
    return rows


def _world(shape: StepShape, max_bs: int, cache_dtype: torch.dtype, device) -> HybridWorld:
    """The world of ``shape`` whose pool stores ``cache_dtype``: the model's dtype, or an FP8
    dtype with ``bench_kv_scales`` (the same seed: the same keys, quantised)."""
    return build_world(
        num_layers=shape.num_layers,
        max_bs=max_bs,
        context=shape.context,
        window=shape.window,
        num_draft=shape.num_draft,
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        dtype=shape.dtype,
        device=device,
        kv_cache_dtype=cache_dtype,
        kv_scales=bench_kv_scales(shape.num_layers) if is_fp8(cache_dtype) else None,
    )


def _time_row(name, label, v, us, bs, series, n, repeats, target_us, extra, graphs=None) -> dict:
    floor: Optional[StepFloor] = extra.get("floor")
    marks = {"graphs": graphs} if graphs else {}
    if floor is None:
        return row(
            name,
            f"{label} {v}",
            "time per step",
            us,
            "us",
            variant=v,
            bs=bs,
            series=series,
            steps=n,
            repeats=repeats,
            **marks,
        )
    return row(
        name,
        f"{label} {v}",
        "time per step",
        us,
        "us",
        target=None if target_us is None else f"<= {target_us:g} us",
        met=None if target_us is None else us <= target_us,
        key=True,
        floor=floor.floor_us,
        variant=v,
        bs=bs,
        series=series,
        steps=n,
        repeats=repeats,
        launches_how=floor.launch_note,
        detail=(f"{STAND_IN}; " if graphs else "") + floor.describe(),
        **floor.fields(),
        **marks,
    )


def _prep_row(name, label, v, us, prep: PrepCheck) -> dict:
    return row(
        name,
        f"{label} {v}",
        "host replay preparation",
        us,
        "us",
        target=f"<= {prep.target_us:g} us",
        met=us <= prep.target_us,
        key=True,
        detail="GraphRunner.run with the replay skipped: static input copies + the backend's replay metadata",
    )
