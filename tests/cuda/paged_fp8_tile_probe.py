"""``paged_attention``'s decode launch over an FP8 cache (both FP8 dtypes), recorded on CPU
tensors and compiled for sm_90 through ``offline_compile`` with the plan's ``FP8_PTX`` and
without it, and with the plan's ``ONE_TOKEN`` and without it; prints, per variant, the shared
memory loads of its PTX by width (a byte: ``ld.shared.b8`` / ``.u8``), its ``ldmatrix`` loads
(transposed ones apart), its compares (``setp``) and its registers. Run without
``TRITON_INTERPRET``."""

import json
import os
import re

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
from offline_compile import compile_launch, resources  # noqa: E402
from paged_prefetch_probe import record_decode_launch  # noqa: E402


def main() -> int:
    result = {}
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        for label, config in (("plan", None), ("cast", {"FP8_PTX": False}), ("masked", {"ONE_TOKEN": False})):
            launch = record_decode_launch(config, cache_dtype=dtype)
            compiled = compile_launch(launch)
            ptx = compiled.asm["ptx"]
            result[f"{str(dtype)[6:]} {label}"] = dict(
                fp8_ptx=launch.kwargs["PLAN"].FP8_PTX,
                one_token=launch.kwargs["PLAN"].ONE_TOKEN,
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
