"""check_capabilities_honest — ``capabilities()`` is pure, typed data and every claim holds.

The suite skips checks only from what a backend declares, so the declaration itself is
checked: a frozen ``Capabilities`` with fields of the right types (``to_json()`` works);
``needs_cpu_seq_lens`` equal to the class attribute that ``decide_needs_cpu_seq_lens`` reads;
``device_type`` equal to the pool's device type; ``pdl`` False when the backend is built with
``ATTNPLUG_DISABLE_PDL=1``; and the declared ``graphs`` level really captures: every mode it
covers is captured and replayed by ``attnplug.GraphRunner``. (Declared dtypes, head dims and
page sizes are exercised by check_attention_matches_reference.)
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from attnplug import Capabilities, GraphSupport
from attnplug_conformance.support import (
    CAPABILITIES,
    DISABLE_PDL_ENV,
    PREFIX,
    base_config,
    conformance_check,
    graph_modes,
    new_tokens_of,
    require,
)

__all__ = ["check_capabilities_honest"]

_FIELDS = {
    "device_type": str,
    "needs_cpu_seq_lens": bool,
    "pdl": bool,
    "graphs": GraphSupport,
    "sliding_window": bool,
    "logit_softcap": bool,
    "attention_sinks": bool,
    "large_kv_buffers": bool,
}


def _types(caps) -> None:
    if not isinstance(caps, Capabilities):
        pytest.fail(f"{CAPABILITIES}: capabilities() returned {type(caps).__name__}, not attnplug.Capabilities")
    params = getattr(type(caps), "__dataclass_params__", None)
    if params is None or not params.frozen:
        pytest.fail(f"{CAPABILITIES}: capabilities() must return a frozen dataclass")
    for name, kind in _FIELDS.items():
        value = getattr(caps, name)
        if not isinstance(value, kind):
            pytest.fail(
                f"{CAPABILITIES}: capabilities().{name} is {value!r} ({type(value).__name__}), expected {kind.__name__}"
            )
    for name, kind in (("dtypes", torch.dtype), ("head_dims", int), ("page_sizes", int)):
        value = getattr(caps, name)
        if (
            not isinstance(value, tuple)
            or not value
            or not all(isinstance(v, kind) and not isinstance(v, bool) for v in value)
        ):
            pytest.fail(
                f"{CAPABILITIES}: capabilities().{name} must be a non-empty tuple of {kind.__name__}, got {value!r}"
            )
        if kind is int and any(v < 1 for v in value):
            pytest.fail(f"{CAPABILITIES}: capabilities().{name} must hold positive ints, got {value!r}")
    try:
        json.dumps(caps.to_json())
    except Exception as exc:
        pytest.fail(f"{CAPABILITIES}: capabilities().to_json() is not JSON-serialisable: {type(exc).__name__}: {exc}")


@conformance_check(rule=CAPABILITIES)
@pytest.mark.parametrize("aspect", ["types", "flags", "pdl_env", "graph_level"])
def check_capabilities_honest(aspect, attnplug_capabilities, attnplug_world):
    """One aspect of the declaration per test."""
    caps = attnplug_capabilities
    cfg = base_config(caps)
    if aspect == "types":
        world = attnplug_world(cfg.spec(), 91)
        got = world.backend.capabilities()
        _types(got)
        if world.backend.capabilities() != got:
            pytest.fail(f"{CAPABILITIES}: two calls of capabilities() on one instance differ")
        with pytest.raises(dataclasses.FrozenInstanceError):
            got.pdl = not got.pdl  # type: ignore[misc]
    elif aspect == "flags":
        world = attnplug_world(cfg.spec(), 91)
        got = world.backend.capabilities()
        declared = type(world.backend).needs_cpu_seq_lens
        if got.needs_cpu_seq_lens != declared:
            pytest.fail(
                f"{CAPABILITIES}: capabilities().needs_cpu_seq_lens={got.needs_cpu_seq_lens} but the class "
                f"attribute (read by decide_needs_cpu_seq_lens) is {declared}"
            )
        if got.device_type != world.pool.device.type:
            pytest.fail(
                f"{CAPABILITIES}: capabilities().device_type={got.device_type!r} but the pool is on "
                f"{world.pool.device} (type {world.pool.device.type!r})"
            )
    elif aspect == "pdl_env":
        world = attnplug_world(cfg.spec(), 91, env={DISABLE_PDL_ENV: "1"})
        if world.backend.capabilities().pdl:
            pytest.fail(f"{CAPABILITIES}: a backend built with {DISABLE_PDL_ENV}=1 reports capabilities().pdl=True")
    else:
        modes = graph_modes(caps.graphs)
        require(bool(modes), "capabilities().graphs is NEVER: no graph level to prove")
        world = attnplug_world(cfg.spec(), 91)
        reqs = world.prefill(PREFIX[:2], backend=world.reference_backend)
        ndt = max(new_tokens_of(m, 2)[1] or 1 for m in modes)
        ndt = ndt if ndt > 1 else None
        try:
            runner = world.graph_runner(max_bs=2, num_draft_tokens=ndt, bucket_sizes=[2])
        except Exception as exc:
            pytest.fail(
                f"{CAPABILITIES}: capabilities().graphs={caps.graphs.name} but capturing "
                f"{[m.name for m in modes]} failed: {type(exc).__name__}: {exc}"
            )
        for mode in modes:
            step = world.plan(mode, reqs, num_draft_tokens=ndt if mode.is_speculative else None)
            if runner.bucket_for(step.batch) is None:
                pytest.fail(
                    f"{CAPABILITIES}: capabilities().graphs={caps.graphs.name} but no {mode.name} graph was captured"
                )
            try:
                out = runner.run(step.batch, step.inputs)
                world.backend.synchronize(world.device)
            except Exception as exc:
                pytest.fail(
                    f"{CAPABILITIES}: capabilities().graphs={caps.graphs.name} but replaying a {mode.name} "
                    f"step failed: {type(exc).__name__}: {exc}"
                )
            if not torch.isfinite(out.float()).all():
                pytest.fail(f"{CAPABILITIES}: replaying a {mode.name} step gave non-finite values")
            world.advance(step)
