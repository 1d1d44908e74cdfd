"""check_accepts_seq_lens_cpu_none — a backend that declares ``needs_cpu_seq_lens = False``
works with ``seq_lens_cpu=None``.

``decide_needs_cpu_seq_lens`` lets an engine skip building the host mirror of ``seq_lens``
when no backend needs it; the backend then gets ``seq_lens_cpu=None`` in every mode, eagerly
and in graph replay, and must still match the reference. Also over each declared FP8 cache
(``kv_fp8_e4m3``, ``kv_fp8_e5m2``; ``kv_auto``: the model's dtype).
"""

from __future__ import annotations

import pytest

from attnplug import ForwardMode
from attnplug_conformance.support import (
    SEQ_LENS_CPU_NONE,
    Twins,
    base_config,
    conformance_check,
    graph_modes,
    kv_axis,
    new_tokens_of,
    require,
)

__all__ = ["check_accepts_seq_lens_cpu_none"]


@conformance_check(rule=SEQ_LENS_CPU_NONE)
@pytest.mark.parametrize(*kv_axis())
def check_accepts_seq_lens_cpu_none(kv_cache_dtype, attnplug_capabilities, attnplug_world, attnplug_reference_world):
    """Every mode, eager and replayed, with ``seq_lens_cpu=None``."""
    caps = attnplug_capabilities
    require(not caps.needs_cpu_seq_lens, "needs_cpu_seq_lens is True: the engine passes seq_lens_cpu")
    cfg = base_config(caps, kv_cache_dtype=kv_cache_dtype)
    spec = cfg.spec()
    twins = Twins(attnplug_world(spec, 61), attnplug_reference_world(spec, 61), rule=SEQ_LENS_CPU_NONE)
    a = twins.add(3)
    kw = dict(check_seq_lens_cpu_none=True)
    twins.step(ForwardMode.EXTEND, a, [5, 12, 9], **kw)
    twins.step(ForwardMode.EXTEND, a, [2, 1, 3], **kw)
    twins.step(ForwardMode.DECODE, a, **kw)
    for mode in ForwardMode.speculative():
        twins.step(mode, a, num_draft_tokens=new_tokens_of(mode, 3)[1], **kw)
    twins.step(ForwardMode.IDLE, **kw)
    for mode in graph_modes(caps.graphs):
        ndt = new_tokens_of(mode, 3)[1]
        runner = twins.world.graph_runner(max_bs=4, num_draft_tokens=ndt, bucket_sizes=[4], modes=[mode])
        twins.step(
            mode, a, num_draft_tokens=ndt, runner=runner, what=f"{mode.name} graph replay with seq_lens_cpu=None", **kw
        )
