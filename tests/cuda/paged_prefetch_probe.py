"""``paged_attention``'s decode launch with the PDL prologue, recorded on CPU tensors and
compiled for sm_90 through ``offline_compile`` at several ``PREFETCH``
depths (and the plan's own); prints, per depth, the ``prefetch.global.L2`` instructions of
its PTX, how many of them come before ``griddepcontrol.wait``, and its registers. Run without
``TRITON_INTERPRET``."""

import json
import os

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
from offline_compile import compile_launch, record_launches, resources  # noqa: E402

from attnplug.memory.fp8 import is_fp8  # noqa: E402
from attnplug_cuda.kernels.common import AttentionInputs, KeyTable, KVScales, NewRows  # noqa: E402
from attnplug_cuda.kernels.paged_attention import paged_attention  # noqa: E402
from attnplug_cuda.kernels.pdl import PROLOGUE  # noqa: E402
from attnplug_cuda.planner import LaunchShape, plan_paged  # noqa: E402
from attnplug_cuda.tuning import CudaTuning  # noqa: E402


def record_decode_launch(config=None, group=4, cache_dtype=torch.bfloat16, q_len=1):
    """The plan's decode launch (``q_len`` > 1: a draft step of ``q_len`` tokens a request)
    over a 256-key window of ``cache_dtype`` (an FP8 dtype: with unit scales), storing the
    step, with the PDL prologue and ``config``'s plan fields: recorded, not run."""
    bs, hkv, d, width, slots = 4, 2, 128, 256, 2048
    i32 = dict(dtype=torch.int32)
    q = torch.zeros(bs * q_len, hkv * group, d, dtype=torch.bfloat16)
    cache = torch.zeros(slots, hkv, d, dtype=cache_dtype)
    new = torch.zeros(bs * q_len, hkv, d, dtype=torch.bfloat16)
    fp8 = is_fp8(cache_dtype)
    shape = LaunchShape(bs, bs * q_len, hkv, group, d, q_len, 300, width, 132, fp8)
    plan = plan_paged(shape, CudaTuning())._replace(**(config or {}))
    keys = KeyTable.of(torch.ones(bs, width, **i32), torch.arange(bs, **i32), torch.zeros(bs, **i32))
    scales = KVScales.of(torch.ones(hkv), torch.ones(hkv)) if fp8 else None
    inputs = AttentionInputs(torch.arange(0, bs * q_len + 1, q_len, **i32), torch.full((bs,), 300, **i32), keys, q_len,
                             window=width, kv_scales=scales)  # fmt: skip
    with record_launches() as launches:
        new_rows = NewRows.of(new, new, torch.arange(1, bs * q_len + 1, **i32))
        paged_attention(q, cache, cache, torch.empty_like(q), inputs, plan, new=new_rows, pdl=PROLOGUE)
    (launch,) = launches
    return launch


def main() -> int:
    result = {}
    for label, config in (("0", {"PREFETCH": 0}), ("1", {"PREFETCH": 1}), ("2", {"PREFETCH": 2}), ("plan", None)):
        launch = record_decode_launch(config)
        compiled = compile_launch(launch)
        ptx = compiled.asm["ptx"].splitlines()
        wait = next(i for i, line in enumerate(ptx) if "griddepcontrol.wait" in line)
        prefetches = [i for i, line in enumerate(ptx) if "prefetch.global.L2" in line]
        result[label] = dict(
            depth=launch.kwargs["PLAN"].PREFETCH,
            prefetches=len(prefetches),
            before_wait=sum(i < wait for i in prefetches),
            registers=resources(compiled)["registers"],
        )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
