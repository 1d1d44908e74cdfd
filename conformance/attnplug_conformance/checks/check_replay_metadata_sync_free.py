"""check_replay_metadata_sync_free — rule 2 (no host-device sync in graph-replay metadata).

When a backend declares ``needs_cpu_seq_lens = False`` its
``init_forward_metadata_replay_cuda_graph`` must build everything from device tensors with
device-side ops. The call (made by ``attnplug.GraphRunner``, exact and padded buckets) runs
under two guards at once:

* the suite's device-neutral ``SyncDetector`` (a ``TorchFunctionMode``): ``.item()``,
  ``.tolist()``, ``.cpu()``, ``.numpy()``, ``bool()/int()/float()`` of a tensor, ``nonzero``,
  boolean-mask indexing, ``masked_select``, ``torch.tensor`` from Python data, ``.to(<host>)``
  and other host reads fail with the rule and the op;
* ``backend.sync_guard()``: the device runtime's own strict guard where the plugin has one.

Also over each declared FP8 cache (``...-kv_fp8_e4m3``): its scales are device tensors, never
read on the host in replay.
"""

from __future__ import annotations

import pytest

from attnplug import ForwardMode
from attnplug_conformance.support import (
    PREFIX,
    RULE_2,
    base_config,
    conformance_check,
    kv_axis,
    new_tokens_of,
    require,
    require_graph_mode,
)
from attnplug_conformance.sync_detector import HostSyncError, SyncDetector

__all__ = ["check_replay_metadata_sync_free"]

METHOD = "init_forward_metadata_replay_cuda_graph"


@conformance_check(rule=RULE_2)
@pytest.mark.parametrize(*kv_axis("mode", ForwardMode.uniform(), [m.name for m in ForwardMode.uniform()]))
def check_replay_metadata_sync_free(mode, kv_cache_dtype, attnplug_capabilities, attnplug_world):
    """Replay metadata makes no host read (suite detector + the device's sync guard)."""
    caps = attnplug_capabilities
    require(not caps.needs_cpu_seq_lens, "needs_cpu_seq_lens is True: replay metadata may use seq_lens_cpu")
    require_graph_mode(caps, mode)
    cfg = base_config(caps, kv_cache_dtype=kv_cache_dtype)
    world = attnplug_world(cfg.spec(), 71)
    backend = world.backend
    reqs = world.prefill(PREFIX[:4], backend=world.reference_backend)
    _, ndt = new_tokens_of(mode, 4)
    runner = world.graph_runner(max_bs=4, num_draft_tokens=ndt, bucket_sizes=[2, 4], modes=[mode])

    # One unguarded replay first: a failure here is not a sync problem.
    step = world.plan(mode, reqs, num_draft_tokens=ndt)
    runner.run(step.batch, step.inputs)
    backend.synchronize(world.device)
    world.advance(step)

    detector = SyncDetector(f"{METHOD} ({mode.name})", device=world.device)
    original = getattr(backend, METHOD)
    guard_name = f"{type(backend).__name__}.sync_guard()"

    def guarded(batch):
        with backend.sync_guard():
            with detector:
                try:
                    return original(batch)
                except HostSyncError:
                    raise
                except Exception as exc:
                    raise HostSyncError(
                        f"{RULE_2}: {METHOD} ({mode.name}) raised under {guard_name} after an "
                        f"unguarded replay had succeeded: {type(exc).__name__}: {exc}"
                    ) from exc

    setattr(backend, METHOD, guarded)
    try:
        for label, subset in (("exact bucket", reqs[:4]), ("padded bucket", reqs[:3])):
            step = world.plan(mode, subset, num_draft_tokens=ndt)
            try:
                runner.run(step.batch, step.inputs)
                backend.synchronize(world.device)
            except HostSyncError as exc:
                pytest.fail(f"{exc} [{label}]", pytrace=False)
            if detector.violations:  # raised inside the backend and swallowed there
                pytest.fail(f"{detector.violations[0]} [{label}; the backend caught the error]", pytrace=False)
            world.advance(step)
    finally:
        vars(backend).pop(METHOD, None)
