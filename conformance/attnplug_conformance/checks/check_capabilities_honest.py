"""check_capabilities_honest — ``capabilities()`` is pure, typed data and every claim holds.

The suite skips checks only from what a backend declares, so the declaration itself is
checked: a frozen ``Capabilities`` with fields of the right types (``to_json()`` works);
``needs_cpu_seq_lens`` equal to the class attribute that ``decide_needs_cpu_seq_lens`` reads;
``device_type`` equal to the pool's device type; ``pdl`` False when the backend is built with
``ATTNPLUG_DISABLE_PDL=1``; and the declared ``graphs`` level really captures: every mode it
covers is captured and replayed by ``attnplug.GraphRunner``. (Declared dtypes, head dims and
page sizes are exercised by check_attention_matches_reference.)

FP8 KV caches (``Capabilities.fp8_kv_dtypes``): the field is a tuple of FP8 dtypes
(``attnplug.memory.fp8.FP8_KV_DTYPES``); ``kv_cache_dtypes`` builds the backend over a pool of
each FP8 dtype: a declared one must construct (and its instance still declare it), an
undeclared one must be refused with ``BackendConfigError`` naming the dtype, leaving the pool
as it was. The other aspects also run over each declared FP8 cache (``...-kv_fp8_e4m3``).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from attnplug import BackendConfigError, Capabilities, GraphSupport, ReqToTokenPool, SWAKVPool
from attnplug.memory.fp8 import FP8_KV_DTYPES
from attnplug_conformance.support import (
    CAPABILITIES,
    DISABLE_PDL_ENV,
    PREFIX,
    base_config,
    changed_rows,
    conformance_check,
    dtype_name,
    fp8_model_dtype,
    graph_modes,
    kv_axis,
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
    fp8 = caps.fp8_kv_dtypes
    if not isinstance(fp8, tuple) or not all(isinstance(d, torch.dtype) and d in FP8_KV_DTYPES for d in fp8):
        pytest.fail(
            f"{CAPABILITIES}: capabilities().fp8_kv_dtypes must be a tuple of FP8 dtypes "
            f"({', '.join(dtype_name(d) for d in FP8_KV_DTYPES)}), got {fp8!r}"
        )
    if len(set(fp8)) != len(fp8):
        pytest.fail(f"{CAPABILITIES}: capabilities().fp8_kv_dtypes lists a dtype twice: {fp8!r}")
    try:
        json.dumps(caps.to_json())
    except Exception as exc:
        pytest.fail(f"{CAPABILITIES}: capabilities().to_json() is not JSON-serialisable: {type(exc).__name__}: {exc}")


def _kv_cache_dtypes(caps, cfg, backend_cls, device) -> None:
    """Every FP8 dtype: a declared one constructs, an undeclared one is refused (pools untouched;
    nothing to refuse where the device cannot hold such a pool, which a declared dtype must)."""
    spec = cfg.spec()
    for kv in FP8_KV_DTYPES:
        try:
            pool = SWAKVPool(
                spec.size,
                spec.size_swa,
                spec.num_layers,
                spec.swa_layers(),
                spec.num_kv_heads,
                spec.head_dim,
                kv,
                device,
                page_size=spec.page_size,
            )
        except (RuntimeError, TypeError) as exc:  # the device holds no such tensor
            if kv in caps.fp8_kv_dtypes:
                pytest.fail(
                    f"{CAPABILITIES}: capabilities().fp8_kv_dtypes declares {dtype_name(kv)} but a {dtype_name(kv)} "
                    f"KV pool cannot be built on {device}: {type(exc).__name__}: {exc}"
                )
            continue  # undeclared, and no such pool exists here: nothing to refuse
        rows = ReqToTokenPool(spec.max_reqs, spec.max_context_len, pool.device)
        before = [b.clone() for layer in range(spec.num_layers) for b in pool.get_kv_buffer(layer)]
        scales = (pool.k_scale.clone(), pool.v_scale.clone(), pool.full_to_swa_index_mapping.clone())
        what = f"a {dtype_name(kv)} KV pool"
        try:
            backend = backend_cls(pool, rows, num_heads=spec.num_heads, sliding_window=spec.sliding_window)
        except BackendConfigError as exc:
            if kv in caps.fp8_kv_dtypes:
                pytest.fail(
                    f"{CAPABILITIES}: capabilities().fp8_kv_dtypes declares {dtype_name(kv)} but the constructor "
                    f"refused {what}: {exc}"
                )
            if dtype_name(kv) not in str(exc):
                pytest.fail(f"{CAPABILITIES}: the BackendConfigError refusing {what} does not name its dtype: {exc}")
        except Exception as exc:
            pytest.fail(
                f"{CAPABILITIES}: constructing the backend over {what} raised {type(exc).__name__}: {exc}; "
                + (
                    "the dtype is declared: it must construct"
                    if kv in caps.fp8_kv_dtypes
                    else "an undeclared FP8 dtype is refused with BackendConfigError naming it"
                )
            )
        else:
            if kv not in caps.fp8_kv_dtypes:
                pytest.fail(
                    f"{CAPABILITIES}: capabilities().fp8_kv_dtypes does not declare {dtype_name(kv)} but the backend "
                    f"accepted {what} (the constructor must raise BackendConfigError naming the dtype, as "
                    "AttentionBackend.__init__ does)"
                )
            got = backend.capabilities().fp8_kv_dtypes
            if kv not in got:
                pytest.fail(
                    f"{CAPABILITIES}: a backend built over {what} reports capabilities().fp8_kv_dtypes={got!r}, "
                    f"without the dtype it serves"
                )
            continue
        backend_cls.synchronize(pool.device)
        after = [b for layer in range(spec.num_layers) for b in pool.get_kv_buffer(layer)]
        if any(changed_rows(a, b).numel() for a, b in zip(before, after)):
            pytest.fail(f"{CAPABILITIES}: refusing {what}, the constructor wrote into its KV buffers")
        now = (pool.k_scale, pool.v_scale, pool.full_to_swa_index_mapping)
        if not all(torch.equal(a, b) for a, b in zip(scales, now)):
            pytest.fail(f"{CAPABILITIES}: refusing {what}, the constructor changed its scales or full -> SWA mapping")


_ASPECTS = ["types", "flags", "pdl_env", "kv_cache_dtypes", "graph_level"]


@conformance_check(rule=CAPABILITIES)
@pytest.mark.parametrize(*kv_axis("aspect", _ASPECTS, _ASPECTS, fp8=lambda aspect: aspect != "kv_cache_dtypes"))
def check_capabilities_honest(
    aspect, kv_cache_dtype, attnplug_capabilities, attnplug_world, attnplug_backend_cls, attnplug_device
):
    """One aspect of the declaration per test."""
    caps = attnplug_capabilities
    cfg = base_config(caps, kv_cache_dtype=kv_cache_dtype)
    if aspect == "kv_cache_dtypes":
        cfg = base_config(caps, dtype=fp8_model_dtype(caps.dtypes))
        _kv_cache_dtypes(caps, cfg, attnplug_backend_cls, attnplug_device)
    elif aspect == "types":
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
