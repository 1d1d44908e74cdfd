"""A copy kernel launched on 16-byte aligned and on misaligned bf16 rows, recorded and compiled
for sm_90 through ``offline_compile``; prints, per launch, the 16-byte
global loads of its SASS and its resources. Run without ``TRITON_INTERPRET``."""

import json
import os
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from offline_compile import _cuobjdump, compile_launch, record_launches, resources  # noqa: E402


@triton.jit
def _probe_copy_kernel(X, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + offs, tl.load(X + offs, mask=offs < n), mask=offs < n)


def _wide_loads(compiled) -> int:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        sass = subprocess.run([_cuobjdump(), "--dump-sass", f.name], capture_output=True, text=True, check=True).stdout
    return sass.count("LDG.E.128")


def main() -> int:
    buf = torch.zeros(4096 + 8, dtype=torch.bfloat16)
    out = torch.zeros(4096 + 8, dtype=torch.bfloat16)
    with record_launches() as launches:
        _probe_copy_kernel[(4,)](buf[:4096], out[:4096], 4096, BLOCK=1024, num_warps=4)
        _probe_copy_kernel[(4,)](buf[1:4097], out[1:4097], 4095, BLOCK=1024, num_warps=4)
    result = {}
    for label, launch in zip(("aligned", "misaligned"), launches):
        compiled = compile_launch(launch)
        result[label] = dict(wide_loads=_wide_loads(compiled), **resources(compiled))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
