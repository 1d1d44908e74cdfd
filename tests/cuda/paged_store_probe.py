"""``paged_attention``'s launches storing the step into an FP8 cache, recorded on CPU tensors
and compiled for sm_90 through ``offline_compile``: a decode step for groups of 4 and 8 q heads
a kv head, and a draft step of 4 tokens a request (group 4); prints, per launch, the tokens a
request, the plan's rows, the store's token tile, the threads and the IEEE divisions
(``div.rn.f32``: one a quantised value, ``common.quantize_kv``) of its PTX. Run without
``TRITON_INTERPRET``."""

import json
import os

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
from offline_compile import compile_launch  # noqa: E402
from paged_prefetch_probe import record_decode_launch  # noqa: E402


def main() -> int:
    result = {}
    for label, group, q_len in (("decode 4", 4, 1), ("decode 8", 8, 1), ("draft 4", 4, 4)):
        launch = record_decode_launch(group=group, cache_dtype=torch.float8_e4m3fn, q_len=q_len)
        ptx = compile_launch(launch).asm["ptx"]
        result[label] = dict(
            q_len=q_len,
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
