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
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..batch import ForwardMode
from .context import Ctx
from .rows import row
from .timing import free_memory
from .world import INPUTS, HybridWorld, build_world, make_step

__all__ = ["StepShape", "StepVariant", "run_step_benchmark", "time_variant"]


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

    def describe(self) -> str:
        swa = sum(1 for layer in range(self.num_layers) if layer % 4 != 3)
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
) -> Tuple[float, torch.Tensor]:
    """(microseconds per step, the step's output ``[bs * q_len, H, D]`` as float32)."""
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

        def run_step() -> torch.Tensor:
            backend.init_forward_metadata(batch)
            return step(batch, inputs)

    out = run_step().float().clone()
    us = ctx.timer.wall_us(run_step, calls=steps, repeats=repeats, warmup=warmup)
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
) -> List[dict]:
    """Run the step benchmark described in the module docstring; appends to ``ctx.rows``.
    ``steps(bs)``: steps per timed sample; ``target_speedup``: the speedup over the
    baseline every non-baseline variant must reach (None: reported, not held);
    ``tolerance``: the largest allowed output difference from the baseline; ``warmup``:
    untimed steps before each variant's samples."""
    rows = ctx.rows
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
                try:
                    us, outs[v] = time_variant(
                        ctx, world, spec, backends[v], mode, bs, steps=n, repeats=repeats, warmup=warmup
                    )
                    times[v] = us
                    rows.append(
                        row(
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
                        )
                    )
                    ctx.log(f"  {label} {v}: {us:.1f} us/step")
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
            if baseline not in times:
                continue
            for v in variants:
                if v == baseline or v not in times:
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
    del backends, world
    free_memory(ctx.timer)
    return rows
