"""``paged_attention``'s decode launch storing the step into an FP8 cache, recorded on CPU
tensors and compiled for sm_90 through ``offline_compile`` for groups of 4 and 8 q heads a kv
head; prints, per group, the plan's rows, the store's token tile, the threads and the IEEE
divisions (``div.rn.f32``: one a quantised value, ``common.quantize_kv``) of its PTX. Run
without ``TRITON_INTERPRET``."""

import json
import os

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
from offline_compile import compile_launch, record_launches  # noqa: E402

from attnplug_cuda.kernels.common import AttentionInputs, KeyTable, KVScales, NewRows  # noqa: E402
from attnplug_cuda.kernels.paged_attention import paged_attention  # noqa: E402
from attnplug_cuda.kernels.pdl import PROLOGUE  # noqa: E402
from attnplug_cuda.planner import LaunchShape, plan_paged  # noqa: E402
from attnplug_cuda.tuning import CudaTuning  # noqa: E402


def _launch(group):
    bs, hkv, d, width, slots = 4, 2, 128, 256, 2048
    i32 = dict(dtype=torch.int32)
    q = torch.zeros(bs, hkv * group, d, dtype=torch.bfloat16)
    cache = torch.zeros(slots, hkv, d, dtype=torch.float8_e4m3fn)
    new = torch.zeros(bs, hkv, d, dtype=torch.bfloat16)
    plan = plan_paged(LaunchShape(bs, bs, hkv, group, d, 1, 300, width, 132, True), CudaTuning())
    keys = KeyTable.of(torch.ones(bs, width, **i32), torch.arange(bs, **i32), torch.zeros(bs, **i32))
    scales = KVScales.of(torch.ones(hkv), torch.ones(hkv))
    inputs = AttentionInputs(torch.arange(bs + 1, **i32), torch.full((bs,), 300, **i32), keys, 1, window=width,
                             kv_scales=scales)  # fmt: skip
    with record_launches() as launches:
        new_rows = NewRows.of(new, new, torch.arange(1, bs + 1, **i32))
        paged_attention(q, cache, cache, torch.empty_like(q), inputs, plan, new=new_rows, pdl=PROLOGUE)
    (launch,) = launches
    return launch


def main() -> int:
    result = {}
    for group in (4, 8):
        launch = _launch(group)
        ptx = compile_launch(launch).asm["ptx"]
        result[str(group)] = dict(
            rows=launch.kwargs["PLAN"].BLOCK_M,
            tokens=launch.kwargs["NEW_TOKENS"],
            head_dim=launch.kwargs["HEAD_DIM"],
            threads=32 * launch.kwargs["num_warps"],
            divisions=ptx.count("div.rn.f32"),
        )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
