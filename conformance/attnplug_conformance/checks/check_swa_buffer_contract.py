"""check_swa_buffer_contract — rule 1 (hoisted SWA writes), the graph buffer.

In graph mode the step's translation lives in ONE buffer allocated by
``init_cuda_graph_state``, named exactly ``cuda_graph_swa_out_cache_loc`` in every backend:
int32, length ``max_num_tokens``, on the pool's device. Each replay fills ``[:n]`` with
``translate(out_cache_loc)`` and zeroes ``[n:]`` (slot 0 is the padding sink), in place: the
same storage across replays (captured graphs read it by address). The check runs a big batch
and then a small one, so a tail left over from the big one is caught; also over each declared
FP8 cache (``...-kv_fp8_e4m3``: a backend may keep other graph state for one).
"""

from __future__ import annotations

import pytest
import torch

from attnplug import ForwardMode, GraphSupport
from attnplug_conformance.support import (
    PREFIX,
    RULE_1,
    base_config,
    conformance_check,
    kv_axis,
    new_tokens_of,
    require,
    require_graph_mode,
)

__all__ = ["check_swa_buffer_contract"]

NAME = "cuda_graph_swa_out_cache_loc"
_MODES = [ForwardMode.DECODE, ForwardMode.TARGET_VERIFY]


def _similar(backend) -> str:
    found = []
    for attr, value in sorted(vars(backend).items()):
        if attr != NAME and isinstance(value, torch.Tensor) and "swa" in attr.lower():
            found.append(f"{attr} ({str(value.dtype).replace('torch.', '')}, {list(value.shape)})")
    return f"; tensors with 'swa' in their name: {', '.join(found)}" if found else ""


@conformance_check(rule=RULE_1)
@pytest.mark.parametrize(*kv_axis("mode", _MODES, [m.name for m in _MODES]))
def check_swa_buffer_contract(mode, kv_cache_dtype, attnplug_capabilities, attnplug_world):
    """The buffer exists under its contract name, is static, and holds translate(loc) + zeros."""
    caps = attnplug_capabilities
    require(caps.graphs > GraphSupport.NEVER, "capabilities().graphs is NEVER: no graph state")
    require_graph_mode(caps, mode)
    cfg = base_config(caps, kv_cache_dtype=kv_cache_dtype)
    world = attnplug_world(cfg.spec(), 31)
    backend = world.backend
    reqs = world.prefill(PREFIX[:4], backend=world.reference_backend)
    _, ndt = new_tokens_of(mode, 4)
    runner = world.graph_runner(max_bs=4, num_draft_tokens=ndt, bucket_sizes=[2, 4], modes=[mode], capture=False)

    buf = getattr(backend, NAME, None)
    if not isinstance(buf, torch.Tensor):
        pytest.fail(
            f"{RULE_1}: after init_cuda_graph_state the backend has no tensor attribute {NAME} "
            f"(found {type(buf).__name__}); every backend on every device keeps the step's translated SWA "
            f"slots in a buffer of exactly this name{_similar(backend)}"
        )
    want = (runner.max_num_tokens,)
    if buf.dtype != torch.int32 or tuple(buf.shape) != want or buf.device != world.pool.device:
        pytest.fail(
            f"{RULE_1}: {NAME} must be int32 of shape {list(want)} (max_num_tokens) on {world.pool.device}, "
            f"got {str(buf.dtype).replace('torch.', '')} {list(buf.shape)} on {buf.device}"
        )
    ptr = buf.data_ptr()
    runner.capture()

    for label, subset in (
        ("big batch (4 requests, bucket 4)", reqs[:4]),
        ("small batch after the big one (1 request, bucket 2)", reqs[:1]),
    ):
        step = world.plan(mode, subset, num_draft_tokens=ndt)
        n = step.batch.num_tokens
        runner.run(step.batch, step.inputs)
        backend.synchronize(world.device)
        now = getattr(backend, NAME, None)
        if not isinstance(now, torch.Tensor) or now.data_ptr() != ptr:
            pytest.fail(
                f"{RULE_1}: {mode.name} replay of the {label} replaced {NAME} (its storage changed from "
                f"{ptr:#x}, allocated by init_cuda_graph_state, to "
                f"{'%#x' % now.data_ptr() if isinstance(now, torch.Tensor) else repr(now)}); capture and replay "
                "must write that buffer in place"
            )
        if cfg.sliding_window:
            expected = world.pool.translate_loc_from_full_to_swa(step.batch.out_cache_loc).to("cpu", torch.int64)
            host = now.to("cpu", torch.int64)
            if not torch.equal(host[:n], expected):
                pytest.fail(
                    f"{RULE_1}: after the {mode.name} replay of the {label}, {NAME}[:{n}] = "
                    f"{host[:n].tolist()[:12]}, expected translate(out_cache_loc) = {expected.tolist()[:12]}"
                )
            tail = torch.nonzero(host[n:]).flatten() + n
            if tail.numel():
                pytest.fail(
                    f"{RULE_1}: after the {mode.name} replay of the {label}, the tail of {NAME} is not zero: "
                    f"entries {tail.tolist()[:12]} hold {host[tail].tolist()[:12]} (the step fills [:{n}] and "
                    f"must zero [{n}:]; slot 0 is the padding sink)"
                )
        world.advance(step)
