"""Whole-step benchmarks: every layer of a hybrid model per step, per variant, per batch size.

``run_step_benchmark`` builds one ``HybridWorld`` (``world.py``) and, for every mode, batch
size and variant, runs the step of the first ``bs`` requests many times:

* a ``graph`` variant runs through ``attnplug.GraphRunner`` (one bucket: the case's bs,
  captured with ``capture(strict=True)``: a capture that fails is an error, never a silent
  eager run), so each step is the runner's preparation plus a replay of the backend's graph;
* an eager variant (``graph=False``) prepares the metadata and runs every layer each step.

Time per step = wall clock of N back-to-back steps then one synchronisation, / N, median of
a few repeats (``Timer.wall_us``). Rows: ``time per step`` per variant (plot keys
``variant``, ``bs``, ``series`` = the mode), and per non-baseline variant the speedup
``baseline / variant`` with the largest output difference from the baseline; a last row
holds the largest difference over every case against ``tolerance``.

Optional measurements around the same steps:

* floors (``StepVariant.floor``): the variant's time rows carry ``floor`` and
  ``pct_of_floor`` (``floors.StepFloor``: the launch floor from the plugin's ``LaunchFloor``,
  the bandwidth floor from ``floors.step_bytes`` at the copy bandwidth measured at the start);
* ``StepRatio``: two variants of one backend (e.g. PDL on / off) compared: speedup row, and
  whether every layer's output is bit-identical;
* ``StepPeer``: another implementation timed on the same world (e.g. attention only), with
  the ratio ``peer / variant``; a peer that is not installed leaves one row saying so;
* ``PrepCheck``: host time of the graph runner's replay preparation (``replay_prep_us``).
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..batch import ForwardMode
from .context import Ctx
from .floors import LaunchFloor, StepFloor, step_bytes
from .rows import row
from .timing import copy_bandwidth, free_memory
from .world import INPUTS, HybridWorld, build_world, make_step

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


@dataclass(frozen=True)
class StepShape:
    """The model and requests of a step benchmark (SWA layers: ``layer % 4 != 3``)."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    context: int
    window: int
    num_draft: int
    dtype: torch.dtype

    @property
    def swa_layers(self) -> int:
        return sum(1 for layer in range(self.num_layers) if layer % 4 != 3)

    def q_len(self, mode: ForwardMode) -> int:
        return 1 if mode is ForwardMode.DECODE else self.num_draft

    def step_bytes(self, mode: ForwardMode, bs: int) -> int:
        """``floors.step_bytes`` of one step of ``mode`` (the world's lengths, ``world.py``)."""
        q = self.q_len(mode)
        return step_bytes(
            num_layers=self.num_layers,
            swa_layers=self.swa_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
            bs=bs,
            q_len=q,
            seq_len=self.context - self.num_draft + q,
            window=self.window,
        )

    def describe(self) -> str:
        swa = self.swa_layers
        return (
            f"{self.num_layers} layers ({swa} SWA), {self.num_heads} q / {self.num_kv_heads} KV heads, "
            f"D={self.head_dim}, {str(self.dtype).replace('torch.', '')}, context {self.context}, "
            f"window {self.window}"
        )


@dataclass(frozen=True)
class StepVariant:
    """One implementation measured: ``make(pool, req_to_token_pool, num_heads, sliding_window)``
    returns its backend; ``graph``: through ``GraphRunner`` (else eager steps);
    ``with_cpu``: the batch carries ``seq_lens_cpu`` (backends that declare
    ``needs_cpu_seq_lens``)."""

    make: Callable[..., object]
    graph: bool = True
    with_cpu: bool = False
    #: run only at these batch sizes (None: every size of the benchmark)
    sizes: Optional[Tuple[int, ...]] = None
    #: compared with the baseline (a speedup row); False for variants that only feed a StepRatio
    vs_baseline: bool = True
    #: its time rows carry the step's floor and % of floor (graph variants)
    floor: bool = False


@dataclass(frozen=True)
class StepRatio:
    """``slow`` against ``fast`` (two variants) at every case where both ran: a row
    ``speedup (slow / fast)`` held to ``target`` (None: reported), and with ``identical`` a
    row saying whether every layer's output of one eager step is bit-identical."""

    slow: str
    fast: str
    target: Optional[float] = None
    identical: bool = False


class PeerUnavailable(RuntimeError):
    """A peer cannot run here (not installed, unsupported device): the message says why."""


@dataclass(frozen=True)
class StepPeer:
    """Another implementation timed on the same world. ``measure(ctx, world, mode, bs)``
    returns ``(microseconds per step, detail)``, appends any check rows of its own to
    ``ctx.rows``, and raises ``PeerUnavailable`` when it cannot run here (asked once per run).
    ``against``: the variant it is compared with (row ``speedup (name / against)``);
    ``target(mode, bs)``: the speedup held (None: reported); ``what``: what the peer's time
    covers (e.g. ``attention only``)."""

    name: str
    measure: Callable[[Ctx, HybridWorld, ForwardMode, int], Tuple[float, str]]
    against: str
    modes: Tuple[ForwardMode, ...] = (ForwardMode.DECODE,)
    target: Callable[[ForwardMode, int], Optional[float]] = lambda mode, bs: None
    what: str = ""


@dataclass(frozen=True)
class PrepCheck:
    """Host time of ``variant``'s replay preparation through the graph runner at ``bs`` in
    ``mode`` (``replay_prep_us``), held to ``target_us``."""

    variant: str
    bs: int
    target_us: float
    mode: ForwardMode = ForwardMode.DECODE
    iters: int = 2000


def replay_prep_us(timer, runner, batch, inputs, *, iters: int = 2000) -> float:
    """Median host time of ``runner.prepare(batch, inputs)``: all host work of one replay (the
    runner's static copies and the backend's replay metadata), without the replay. The batch
    must be one a captured graph serves (``ValueError`` naming why not)."""
    if not runner.prepare(batch, inputs):
        raise ValueError(f"replay_prep_us: no captured graph serves this batch: {runner.why_eager(batch)}")
    return timer.host_us(lambda: runner.prepare(batch, inputs), iters=iters)


def layer_outputs(
    backend, world: HybridWorld, mode: ForwardMode, bs: int, *, with_cpu: bool = False
) -> List[torch.Tensor]:
    """Every layer's output of one eager step of the first ``bs`` requests (``make_step``'s
    tensors, metadata built by ``init_forward_metadata``)."""
    batch = world.batch(mode, bs, with_cpu=with_cpu)
    step = make_step(backend, world, batch.num_tokens, record=True)
    backend.init_forward_metadata(batch)
    step(batch, {})
    return [o.clone() for o in step.recorded]


def time_variant(
    ctx: Ctx,
    world: HybridWorld,
    variant: StepVariant,
    backend,
    mode: ForwardMode,
    bs: int,
    *,
    steps: int,
    repeats: int,
    warmup: int = 5,
    after: Optional[Callable[[Callable[[], torch.Tensor], Any, Any, Dict[str, torch.Tensor]], None]] = None,
) -> Tuple[float, torch.Tensor]:
    """(microseconds per step, the step's output ``[bs * q_len, H, D]`` as float32).
    ``after(run_step, runner, batch, inputs)``: called once the samples are taken, while the
    step is still live (``runner`` is None for an eager variant)."""
    from ..graphs.runner import GraphRunner

    q = 1 if mode is ForwardMode.DECODE else world.num_draft
    T = bs * q
    step = make_step(backend, world, T)
    batch = world.batch(mode, bs, with_cpu=variant.with_cpu)
    inputs = {"x": torch.zeros(T, 1, dtype=INPUTS["x"][1], device=world.pool.device)}
    if variant.graph:
        runner = GraphRunner(
            backend,
            step,
            max_bs=bs,
            inputs=INPUTS,
            num_draft_tokens=world.num_draft if q > 1 else None,
            bucket_sizes=[bs],
            modes=[mode],
        )
        runner.capture(strict=True)

        def run_step() -> torch.Tensor:
            return runner.run(batch, inputs)
    else:
        runner = None

        def run_step() -> torch.Tensor:
            backend.init_forward_metadata(batch)
            return step(batch, inputs)

    out = run_step().float().clone()
    us = ctx.timer.wall_us(run_step, calls=steps, repeats=repeats, warmup=warmup)
    if after is not None:
        after(run_step, runner, batch, inputs)
    return us, out


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
    world = build_world(
        num_layers=shape.num_layers,
        max_bs=max(sizes),
        context=shape.context,
        window=shape.window,
        num_draft=shape.num_draft,
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        dtype=shape.dtype,
        device=ctx.device,
    )
    ctx.timer.sync()
    ctx.log(f"  world: {shape.describe()}, max bs {max(sizes)} on {world.pool.device}; timing: {ctx.timer.method}")
    backends = {
        v: spec.make(world.pool, world.rows, num_heads=shape.num_heads, sliding_window=shape.window)
        for v, spec in variants.items()
    }
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
                        extra["floor"] = _step_floor(
                            ctx, shape, mode_, bs_, run_step, backends[v_], launch_floor, copy_tb_s, empty_graph
                        )
                    if prep is not None and runner is not None and case == (prep.variant, prep.mode, prep.bs):
                        extra["prep_us"] = replay_prep_us(ctx.timer, runner, batch, inputs, iters=prep.iters)

                try:
                    us, outs[v] = time_variant(
                        ctx, world, spec, backends[v], mode, bs, steps=n, repeats=repeats, warmup=warmup, after=after
                    )
                    times[v] = us
                    rows.append(
                        _time_row(name, label, v, us, bs, series, n, repeats, time_targets.get((mode, bs)), extra)
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
            for r in ratios:
                if r.slow in times and r.fast in times:
                    rows.extend(_ratio_rows(ctx, name, label, r, times, outs, world, backends, variants, mode, bs))
            for peer in peers:
                if mode in peer.modes and peer.name not in unavailable:
                    rows.extend(_peer_rows(ctx, name, label, peer, times, world, mode, bs, series, unavailable))
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
                        detail=(f"OUTPUTS DIFFER (max {diff:.3g}); " if diff > tolerance else "")
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
    del world
    free_memory(ctx.timer)
    return rows


def _step_floor(
    ctx: Ctx,
    shape: StepShape,
    mode: ForwardMode,
    bs: int,
    run_step: Callable[[], torch.Tensor],
    backend,
    launch_floor: Optional[LaunchFloor],
    copy_tb_s: float,
    cache: Dict[Tuple[int, bool], float],
) -> StepFloor:
    """The floor of one step: its launches counted and an empty graph of as many replayed
    (once per launch count and PDL setting), its bytes at the copy bandwidth."""
    nbytes = shape.step_bytes(mode, bs)
    if launch_floor is None:
        return StepFloor(nbytes, copy_tb_s, launch_note="no launch floor for this device")
    launches, how = launch_floor.count(run_step)
    if launches is None:
        return StepFloor(nbytes, copy_tb_s, launch_note=how)
    pdl = bool(backend.capabilities().pdl)
    if (launches, pdl) not in cache:
        cache[(launches, pdl)] = launch_floor.empty_graph_us(launches, pdl)
    return StepFloor(nbytes, copy_tb_s, launches=launches, launch_us=cache[(launches, pdl)], launch_note=how)


def _time_row(name, label, v, us, bs, series, n, repeats, target_us, extra) -> dict:
    floor: Optional[StepFloor] = extra.get("floor")
    if floor is None:
        return row(
            name, f"{label} {v}", "time per step", us, "us", variant=v, bs=bs, series=series, steps=n, repeats=repeats
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
        detail=floor.describe(),
        **floor.fields(),
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


def _ratio_rows(ctx, name, label, r: StepRatio, times, outs, world, backends, variants, mode, bs) -> List[dict]:
    ts, tf = times[r.slow], times[r.fast]
    s = ts / tf
    out: List[dict] = []
    same = None
    if r.identical:
        try:
            a = layer_outputs(backends[r.slow], world, mode, bs, with_cpu=variants[r.slow].with_cpu)
            b = layer_outputs(backends[r.fast], world, mode, bs, with_cpu=variants[r.fast].with_cpu)
            differ = [i for i, (x, y) in enumerate(zip(a, b)) if not torch.equal(x, y)]
            same = not differ and bool(torch.equal(outs[r.slow], outs[r.fast]))
            out.append(
                row(
                    name,
                    label,
                    f"{r.slow} vs {r.fast}: outputs",
                    0 if same else len(differ) or 1,
                    "layers differ",
                    target="bit-identical",
                    met=same,
                    key=True,
                    layers_differing=differ,
                    detail="every layer of an eager step and the replayed step's output, compared bit for bit",
                )
            )
        except Exception as exc:
            out.append(
                row(name, label, f"{r.slow} vs {r.fast}: outputs", None, "", error=f"{type(exc).__name__}: {exc}")
            )
        finally:
            free_memory(ctx.timer)
    held = r.target is not None
    out.append(
        row(
            name,
            label,
            f"speedup ({r.slow} / {r.fast})",
            s,
            "x",
            target=f">= {r.target:g}x" if held else None,
            met=(s >= r.target) if held else None,
            key=True,
            bs=bs,
            **{f"{r.slow}_us": ts, f"{r.fast}_us": tf},
            detail=f"step: {r.fast} {tf:.1f} us, {r.slow} {ts:.1f} us"
            + ("" if same is None else ("; outputs bit-identical" if same else "; OUTPUTS DIFFER")),
        )
    )
    ctx.log(f"  {label:20s} {r.fast} {tf:9.1f} us  {r.slow} {ts:9.1f} us  ratio {s:5.2f}x  identical: {same}")
    return out


def _peer_rows(ctx, name, label, peer: StepPeer, times, world, mode, bs, series, unavailable) -> List[dict]:
    try:
        us, detail = peer.measure(ctx, world, mode, bs)
    except PeerUnavailable as exc:
        unavailable[peer.name] = str(exc)
        ctx.log(f"  peer {peer.name}: {exc}")
        return [row(name, f"peer: {peer.name}", "time per step", None, "us", notes=str(exc), key=True)]
    except Exception as exc:
        ctx.log(f"  {label} {peer.name}: FAILED {type(exc).__name__}: {exc}")
        return [
            row(
                name,
                f"{label} {peer.name}",
                "time per step",
                None,
                "us",
                error=f"{type(exc).__name__}: {exc}",
                traceback=traceback.format_exc(),
            )
        ]
    finally:
        free_memory(ctx.timer)
    out = [
        row(
            name,
            f"{label} {peer.name}",
            "time per step",
            us,
            "us",
            variant=peer.name,
            bs=bs,
            series=series,
            detail=detail,
        )
    ]
    ctx.log(f"  {label} {peer.name}: {us:.1f} us/step ({peer.what})")
    if peer.against in times:
        t = times[peer.against]
        s = us / t
        target = peer.target(mode, bs)
        out.append(
            row(
                name,
                label,
                f"speedup ({peer.name} / {peer.against})",
                s,
                "x",
                target=None if target is None else f">= {target:g}x",
                met=None if target is None else s >= target,
                key=True,
                bs=bs,
                series=series,
                **{f"{peer.name}_us": us, f"{peer.against}_us": t},
                detail=f"{peer.against} {t:.1f} us (whole step), {peer.name} {us:.1f} us"
                + (f" ({peer.what})" if peer.what else ""),
            )
        )
    return out
