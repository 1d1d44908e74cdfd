"""check_pdl_on_off_identical — rule 3 (PDL where the hardware has it).

Programmatic Dependent Launch only changes WHEN dependent kernels start, never what they
compute: a kernel waits (``gdc_wait``) before reading anything its predecessor wrote. Twin
backends, one built with PDL (as ``capabilities().pdl`` says) and one built with
``ATTNPLUG_DISABLE_PDL=1``, run the same steps eagerly and in graph replay; outputs and KV
caches must be bit-identical. A missing wait shows up as a race: different values.
Runs only for backends that declare ``pdl``; also over each declared FP8 cache
(``kv_fp8_e4m3``; ``kv_auto``: the model's dtype), whose bytes must be identical too.
"""

from __future__ import annotations

import pytest

from attnplug import ForwardMode
from attnplug_conformance.support import (
    DISABLE_PDL_ENV,
    RULE_3,
    base_config,
    conformance_check,
    graph_modes,
    kv_axis,
    new_tokens_of,
    require,
    same_bits,
)

__all__ = ["check_pdl_on_off_identical"]


@conformance_check(rule=RULE_3)
@pytest.mark.parametrize(*kv_axis())
def check_pdl_on_off_identical(kv_cache_dtype, attnplug_capabilities, attnplug_world):
    """PDL on and off give bit-identical outputs and caches, eager and replayed."""
    caps = attnplug_capabilities
    require(caps.pdl, "capabilities().pdl is False: no PDL launches to compare")
    cfg = base_config(caps, kv_cache_dtype=kv_cache_dtype)
    spec = cfg.spec()
    on = attnplug_world(spec, 81, env={DISABLE_PDL_ENV: None})
    off = attnplug_world(spec, 81, env={DISABLE_PDL_ENV: "1"})
    if not on.backend.capabilities().pdl:
        pytest.skip("PDL is not used by a backend built without ATTNPLUG_DISABLE_PDL in this process")
    if off.backend.capabilities().pdl:
        pytest.fail(f"{RULE_3}: a backend built with {DISABLE_PDL_ENV}=1 still reports capabilities().pdl=True")
    worlds = (on, off)
    reqs = [[w.new_request() for _ in range(3)] for w in worlds]
    runners = {}

    def compare(what: str, outs) -> None:
        for w in worlds:
            w.backend.synchronize(w.device)
        if not same_bits(outs[0], outs[1]):
            diff = (outs[0].double() - outs[1].double()).abs().max().item()
            pytest.fail(
                f"{RULE_3}: {what}: outputs with PDL differ from outputs without (max |diff| {diff:.3g}); "
                "a kernel reads its predecessor's output before its grid-dependency wait (gdc_wait)"
            )
        for layer in range(spec.num_layers):
            for name, a, b in zip("kv", on.pool.get_kv_buffer(layer), off.pool.get_kv_buffer(layer)):
                if not same_bits(a, b):
                    pytest.fail(f"{RULE_3}: {what}: layer {layer} {name} cache differs between PDL on and off")

    steps = [
        (ForwardMode.EXTEND, "eager", [5, 12, 9]),
        (ForwardMode.DECODE, "eager", None),
        (ForwardMode.EXTEND, "eager", [4, 1, 7]),
        (ForwardMode.TARGET_VERIFY, "eager", None),
        (ForwardMode.DRAFT_EXTEND, "eager", None),
    ]
    steps += [(m, "replay", None) for m in graph_modes(caps.graphs)]
    for mode, path, new in steps:
        ndt = new_tokens_of(mode, 3)[1]
        outs, planned = [], []
        for i, (w, rs) in enumerate(zip(worlds, reqs)):
            step = w.plan(mode, rs, new, num_draft_tokens=ndt)
            if path == "replay":
                if mode not in runners:
                    runners[mode] = [
                        x.graph_runner(max_bs=4, num_draft_tokens=ndt, bucket_sizes=[4], modes=[mode]) for x in worlds
                    ]
                out = runners[mode][i].run(step.batch, step.inputs).clone()
            else:
                out = w.run_eager(step)
            outs.append(out)
            planned.append(step)
        compare(f"{path} {mode.name} step", outs)
        for w, s in zip(worlds, planned):
            w.advance(s)
