"""``paged_attention``'s head dim 128 prefill launch (one request of 1,024 tokens, 8 kv heads
of 4 q heads: a full layer and a 256-key window), recorded on CPU tensors and compiled for
sm_90 through ``offline_compile`` with its plan and with ``SETTLE`` off; prints, per variant,
whether the plan reads its slots ahead and settles, the "Potential Performance Loss" lines of
the ptxas Triton compiles sm_90 with (``-v``, on the kernel's PTX), and for each loop of the
SASS (a backward branch) with ``HGMMA`` in it, its instructions and its ``WARPGROUP.DEPBAR``
(each waits for a group of ``wgmma``: serialised products wait after every one). Run without
``TRITON_INTERPRET``."""

import json
import os
import re
import subprocess
import tempfile

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
from offline_compile import _cuobjdump, compile_launch, record_launches  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402

from attnplug_cuda.kernels.common import AttentionInputs, KeyTable  # noqa: E402
from attnplug_cuda.kernels.paged_attention import paged_attention  # noqa: E402
from attnplug_cuda.planner import LaunchShape, plan_paged  # noqa: E402
from attnplug_cuda.tuning import CudaTuning  # noqa: E402


def _launch(window, config):
    t, hkv, g, d = 1024, 8, 4, 128
    i32 = dict(dtype=torch.int32)
    q = torch.zeros(t, hkv * g, d, dtype=torch.bfloat16)
    cache = torch.zeros(t + 1, hkv, d, dtype=torch.bfloat16)
    plan = plan_paged(LaunchShape(1, t, hkv, g, d, t, t, window, 132), CudaTuning())._replace(**config)
    keys = KeyTable.of(torch.arange(1, t + 1, **i32)[None], torch.zeros(1, **i32))
    inputs = AttentionInputs(torch.tensor([0, t], **i32), torch.full((1,), t, **i32), keys, t, window=window)
    with record_launches() as launches:
        paged_attention(q, cache, cache, torch.empty_like(q), inputs, plan)
    return launches[0], plan


def _ptxas_losses(ptx: str):
    with tempfile.TemporaryDirectory() as tmp:
        src, out = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(src, "w") as f:
            f.write(ptx)
        proc = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name", "sm_90a", src, "-o", out],
                              capture_output=True, text=True, check=True)  # fmt: skip
    return [line for line in (proc.stdout + proc.stderr).splitlines() if "Performance Loss" in line]


def _loops(cubin: bytes):
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([_cuobjdump(), "--dump-sass", f.name], capture_output=True, text=True, check=True).stdout
    code = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", text)]
    loops = []
    for addr, ins in code:
        back = re.search(r"BRA (?:!?U?P\w+, )?0x([0-9a-f]+)", ins)
        if back and int(back.group(1), 16) < addr:
            body = [i for a, i in code if int(back.group(1), 16) <= a <= addr]
            if any("HGMMA" in i for i in body):
                loops.append(dict(instructions=len(body), depbar=sum("WARPGROUP.DEPBAR" in i for i in body)))
    return loops


def main() -> int:
    result = {}
    for window in (None, 256):
        for label, config in (("plan", {}), ("unsettled", {"SETTLE": False})):
            launch, plan = _launch(window, config)
            compiled = compile_launch(launch)
            result[f"{'full' if window is None else 'window'} {label}"] = dict(
                slots_ahead=plan.SLOTS_AHEAD,
                settle=plan.SETTLE,
                losses=_ptxas_losses(compiled.asm["ptx"]),
                loops=_loops(compiled.asm["cubin"]),
            )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
