"""What the soft-cap / sinks tests run against every backend class (reference, portable and,
under the Triton interpreter, cuda): steps compared with float64 attention, and the bad
inputs that must be refused naming the argument, with the KV cache left as it was."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from attnplug import BackendConfigError, ForwardMode
from attnplug_conformance.exact import dense_attention, row_errors
from attnplug_conformance.harness import World, WorldSpec

#: relative error per (token, layer, head) against float64 (floor: 1e-3 * sqrt(head_dim))
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.2e-2}

PLAN = [
    (ForwardMode.EXTEND, [5, 12, 9]),
    (ForwardMode.DECODE, None),
    (ForwardMode.EXTEND, [3, 1, 6]),
    (ForwardMode.TARGET_VERIFY, 3),
    (ForwardMode.DRAFT_EXTEND, 2),
]


def errors_against_float64(spec: WorldSpec, cls, device, *, runner_modes=()) -> list:
    """Run ``PLAN`` (plus, for each of ``runner_modes``, two replayed steps) and return the
    worst relative error of each step against float64 attention."""
    world = World(spec, cls, device, seed=9)
    reqs = [world.new_request() for _ in range(3)]
    worst = []

    def run(step, runner=None):
        exact = dense_attention(world, step)
        out = runner.run(step.batch, step.inputs).clone() if runner is not None else world.run_eager(step)
        worst.append(float(row_errors(out, exact).max()))
        world.advance(step)

    for mode, arg in PLAN:
        run(world.plan(mode, reqs, arg if mode is ForwardMode.EXTEND else None, num_draft_tokens=arg))
    for mode in runner_modes:
        ndt = 3 if mode.is_speculative else None
        runner = world.graph_runner(max_bs=4, num_draft_tokens=ndt, bucket_sizes=[4], modes=[mode])
        for _ in range(2):
            run(world.plan(mode, reqs, num_draft_tokens=ndt), runner)
    return worst


def check_matches_float64(spec: WorldSpec, cls, device, *, runner_modes=()) -> None:
    """Soft-cap and sinks match float64, and they matter: the same steps without them are far off."""
    worst = errors_against_float64(spec, cls, device, runner_modes=runner_modes)
    assert max(worst) <= TOL[spec.dtype], worst
    plain = dataclasses.replace(spec, logit_softcap=None, sinks=False)
    # the plain backend's outputs against the featured float64: the features change the result
    world_f = World(spec, cls, device, seed=9)
    world_p = World(plain, cls, device, seed=9)
    reqs_f = [world_f.new_request() for _ in range(3)]
    reqs_p = [world_p.new_request() for _ in range(3)]
    step_f = world_f.plan(ForwardMode.EXTEND, reqs_f, [5, 12, 9])
    step_p = world_p.plan(ForwardMode.EXTEND, reqs_p, [5, 12, 9])
    exact = dense_attention(world_f, step_f)
    out = world_p.run_eager(step_p).detach().to("cpu", torch.float64)
    assert float(((out - exact).norm() / exact.norm())) > 50 * TOL[spec.dtype]


def bad_construction(cls, spec: WorldSpec, device) -> None:
    """Bad ``logit_softcap`` values: BackendConfigError naming the argument and the value."""
    for bad in (0, -1.0, float("nan"), float("inf"), True, "2.0"):
        with pytest.raises(BackendConfigError, match=r"logit_softcap.*" + ("'2.0'" if bad == "2.0" else "")) as info:
            World(dataclasses.replace(spec, logit_softcap=bad), cls, device)
        assert repr(bad) in str(info.value)


def bad_sinks(cls, spec: WorldSpec, device) -> None:
    """Sinks of the wrong shape, dtype or device, or not a tensor: an error naming ``sinks``
    before anything is stored (the KV cache and the allocator are unchanged)."""
    world = World(spec, cls, device, seed=4)
    reqs = [world.new_request() for _ in range(2)]
    step = world.plan(ForwardMode.EXTEND, reqs, [5, 9])
    world.backend.init_forward_metadata(step.batch)
    H = spec.num_heads
    cases = {
        "shape": torch.zeros(H + 1, dtype=torch.float32, device=device),
        "2-d": torch.zeros(1, H, dtype=torch.float32, device=device),
        "dtype": torch.zeros(H, dtype=torch.float16, device=device),
        "device": torch.zeros(H, dtype=torch.float32, device="meta"),
        "type": [0.0] * H,
    }
    before = world.snapshot_kv()
    free = (world.alloc.full_available_size(), world.alloc.swa_available_size())
    q, k, v = (step.inputs[n][:, 0] for n in "qkv")
    for what, sinks in cases.items():
        with pytest.raises(ValueError, match="sinks") as info:
            world.backend.forward(q, k, v, 0, step.batch, sinks=sinks)
        assert "sinks" in str(info.value), what
    for (k0, v0), (k1, v1) in zip(before, world.snapshot_kv()):
        assert torch.equal(k0, k1) and torch.equal(v0, v1), "a refused forward wrote the KV cache"
    assert (world.alloc.full_available_size(), world.alloc.swa_available_size()) == free


def undeclared_refused(cls, spec: WorldSpec, device) -> None:
    """A subclass declaring both features False refuses them: the constructor for
    ``logit_softcap``, ``forward`` for ``sinks`` (nothing stored)."""

    class Lacking(cls):
        @classmethod
        def declared_capabilities(cls_):
            return dataclasses.replace(super().declared_capabilities(), logit_softcap=False, attention_sinks=False)

    with pytest.raises(BackendConfigError, match=r"logit_softcap=2\.0: .* logit_softcap=False"):
        World(dataclasses.replace(spec, logit_softcap=2.0), Lacking, device)
    world = World(spec, Lacking, device, seed=4)
    assert not world.backend.capabilities().attention_sinks and not world.backend.capabilities().logit_softcap
    reqs = [world.new_request() for _ in range(2)]
    step = world.plan(ForwardMode.EXTEND, reqs, [5, 9])
    world.backend.init_forward_metadata(step.batch)
    before = world.snapshot_kv()
    sinks = torch.zeros(spec.num_heads, dtype=torch.float32, device=device)
    q, k, v = (step.inputs[n][:, 0] for n in "qkv")
    with pytest.raises(ValueError, match="sinks: .* attention_sinks=False"):
        world.backend.forward(q, k, v, 0, step.batch, sinks=sinks)
    for (k0, v0), (k1, v1) in zip(before, world.snapshot_kv()):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    world.backend.forward(q, k, v, 0, step.batch)  # without sinks it runs
