"""The decode launches of ``store_attend`` and ``paged_attention`` over an FP8 cache (both FP8
dtypes), recorded on CPU tensors and compiled for sm_90 through ``offline_compile``:
``store_attend`` with its plan's ``FP8_PTX`` and without it, ``paged_attention`` with its
plan's ``ONE_TOKEN`` and without it;
prints, per variant, the shared memory loads of its PTX a byte wide (``ld.shared.b8`` /
``.u8``), its ``ldmatrix`` loads (transposed ones apart), its compares (``setp``) and its
registers. Run without ``TRITON_INTERPRET``."""

import json
import os
import re

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
from offline_compile import compile_launch, record_launches, resources  # noqa: E402
from paged_prefetch_probe import record_decode_launch  # noqa: E402

from attnplug_cuda.kernels.common import AttentionInputs, KeyTable, KVScales  # noqa: E402
from attnplug_cuda.kernels.pdl import PROLOGUE  # noqa: E402
from attnplug_cuda.kernels.store_attend import store_attend  # noqa: E402
from attnplug_cuda.planner import LaunchShape, one_launch_workspace_numel, plan_one_launch  # noqa: E402
from attnplug_cuda.tuning import CudaTuning  # noqa: E402


def record_store_attend_launch(config=None, cache_dtype=torch.float8_e4m3fn):
    """``store_attend``'s plan for a bs 1 decode step over a 1,024-key full layer (8 kv heads
    of 4 q heads, head dim 128) of ``cache_dtype`` with unit scales, storing the step, with the
    PDL prologue and ``config``'s plan fields: recorded, not run."""
    bs, hkv, group, d, width, slots = 1, 8, 4, 128, 1024, 2048
    i32 = dict(dtype=torch.int32)
    t = CudaTuning()
    plan = plan_one_launch(LaunchShape(bs, bs, hkv, group, d, 1, width, None, 132, True), t)._replace(**(config or {}))
    q = torch.zeros(bs, hkv * group, d, dtype=torch.bfloat16)
    new = torch.zeros(bs, hkv, d, dtype=torch.bfloat16)
    cache = torch.zeros(slots, hkv, d, dtype=cache_dtype)
    keys = KeyTable.of(torch.ones(bs, width, **i32), torch.arange(bs, **i32))
    inputs = AttentionInputs(torch.arange(bs + 1, **i32), torch.full((bs,), 900, **i32), keys, 1,
                             kv_scales=KVScales.of(torch.ones(hkv), torch.ones(hkv)))  # fmt: skip
    workspace = torch.empty(one_launch_workspace_numel(d, 132, t), dtype=torch.float32)
    with record_launches() as launches:
        store_attend(q, new, new, torch.ones(bs, dtype=torch.int64), cache, cache, torch.empty_like(q), inputs, plan,
                     workspace=workspace, tickets=torch.zeros(bs * hkv, **i32), pdl=PROLOGUE)  # fmt: skip
    (launch,) = launches
    return launch


def main() -> int:
    result = {}
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        for kernel, record, variants in (
            ("paged", record_decode_launch, (("plan", None), ("masked", {"ONE_TOKEN": False}))),
            ("store_attend", record_store_attend_launch, (("plan", None), ("cast", {"FP8_PTX": False}))),
        ):
            for label, config in variants:
                launch = record(config, cache_dtype=dtype)
                compiled = compile_launch(launch)
                ptx = compiled.asm["ptx"]
                plan = launch.kwargs["PLAN"]
                result[f"{kernel} {str(dtype)[6:]} {label}"] = dict(
                    fp8_ptx=getattr(plan, "FP8_PTX", None),
                    one_token=getattr(plan, "ONE_TOKEN", None),
                    byte_loads=len(re.findall(r"ld\.shared\.[bu]8", ptx)),
                    ldmatrix=ptx.count("ldmatrix"),
                    ldmatrix_trans=ptx.count("ldmatrix.sync.aligned.m8n8.x4.trans"),
                    compares=len(re.findall(r"\bsetp\.", ptx)),
                    registers=resources(compiled)["registers"],
                )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
