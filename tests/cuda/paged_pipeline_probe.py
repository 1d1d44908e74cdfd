"""``paged_attention``'s prefill launch (one request of 1,024 tokens, head dim 128 and 256),
recorded on CPU tensors and compiled for sm_90 through ``offline_compile`` with its plan's
pipeline stages and with one more; prints, per head dim and stages, the kernel's shared memory
and the bytes of one key block's K and V tiles (bfloat16). Run without ``TRITON_INTERPRET``."""

import json
import os

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
from offline_compile import compile_launch, record_launches, resources  # noqa: E402

from attnplug_cuda.kernels.common import AttentionInputs, KeyTable  # noqa: E402
from attnplug_cuda.kernels.paged_attention import paged_attention  # noqa: E402
from attnplug_cuda.planner import LaunchShape, plan_paged  # noqa: E402
from attnplug_cuda.tuning import CudaTuning  # noqa: E402


def _launch(head_dim, stages):
    t, hkv, g, slots = 1024, 2, 4, 2048
    i32 = dict(dtype=torch.int32)
    q = torch.zeros(t, hkv * g, head_dim, dtype=torch.bfloat16)
    cache = torch.zeros(slots, hkv, head_dim, dtype=torch.bfloat16)
    plan = plan_paged(LaunchShape(1, t, hkv, g, head_dim, t, t, None, 132), CudaTuning())
    if stages is not None:
        plan = plan._replace(num_stages=stages)
    keys = KeyTable.of(torch.arange(1, t + 1, **i32)[None], torch.zeros(1, **i32))
    inputs = AttentionInputs(torch.tensor([0, t], **i32), torch.full((1,), t, **i32), keys, t)
    with record_launches() as launches:
        paged_attention(q, cache, cache, torch.empty_like(q), inputs, plan)
    return launches[0]  # the attention kernel (a split plan's combine kernel follows)


def main() -> int:
    result = {}
    for head_dim in (128, 256):
        result[head_dim] = {}
        plan = _launch(head_dim, None).kwargs["PLAN"]
        for label, stages in (("plan", None), ("deeper", plan.num_stages + 1)):
            launch = _launch(head_dim, stages)
            result[head_dim][label] = dict(
                block_m=plan.BLOCK_M,
                slots_ahead=plan.SLOTS_AHEAD,
                stages=launch.kwargs["num_stages"],
                shared_bytes=resources(compile_launch(launch))["shared_bytes"],
                kv_block_bytes=2 * plan.BLOCK_N * head_dim * 2,
            )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
