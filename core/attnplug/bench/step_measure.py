"""Measuring one case of a whole-step benchmark: the time per step of a variant
(``time_variant``, eager or through ``GraphRunner``), every layer's output of one eager step
(``layer_outputs``), the host time of the runner's replay preparation (``replay_prep_us``) and
the step's floor (``step_floor``).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ..batch import ForwardMode
from .context import Ctx
from .floors import LaunchFloor, StepFloor
from .step_spec import StepShape, StepVariant
from .world import INPUTS, HybridWorld, make_step

__all__ = ["layer_outputs", "replay_prep_us", "step_floor", "time_variant"]


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


def step_floor(
    ctx: Ctx,
    shape: StepShape,
    mode: ForwardMode,
    bs: int,
    run_step: Callable[[], torch.Tensor],
    backend,
    launch_floor: Optional[LaunchFloor],
    copy_tb_s: float,
    cache: Dict[Tuple[int, bool], float],
    kv_cache_dtype: Optional[torch.dtype] = None,
) -> StepFloor:
    """The floor of one step: its launches counted and an empty graph of as many replayed
    (once per launch count and PDL setting), its bytes at the copy bandwidth (the cache's
    elements of ``kv_cache_dtype``, None: the model's dtype)."""
    nbytes = shape.step_bytes(mode, bs, kv_cache_dtype)
    if launch_floor is None:
        return StepFloor(nbytes, copy_tb_s, launch_note="no launch floor for this device")
    launches, how = launch_floor.count(run_step)
    if launches is None:
        return StepFloor(nbytes, copy_tb_s, launch_note=how)
    pdl = bool(backend.capabilities().pdl)
    if (launches, pdl) not in cache:
        cache[(launches, pdl)] = launch_floor.empty_graph_us(launches, pdl)
    return StepFloor(nbytes, copy_tb_s, launches=launches, launch_us=cache[(launches, pdl)], launch_note=how)
