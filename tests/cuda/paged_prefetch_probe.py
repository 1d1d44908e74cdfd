"""``paged_attention``'s decode launch with the PDL prologue, recorded on CPU tensors and
compiled for sm_90 through ``attnplug_cuda.bench.offline_compile`` at several ``PREFETCH``
depths (and the plan's own); prints, per depth, the ``prefetch.global.L2`` instructions of
its PTX, how many of them come before ``griddepcontrol.wait``, and its registers. Run without
``TRITON_INTERPRET``."""

import json
import os

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402

from attnplug_cuda.bench.offline_compile import compile_launch, record_launches, resources  # noqa: E402
from attnplug_cuda.kernels.paged_attention import paged_attention  # noqa: E402


def _launch(config):
    bs, hkv, g, d, width, slots = 4, 2, 4, 128, 256, 2048
    i32 = dict(dtype=torch.int32)
    q = torch.zeros(bs, hkv * g, d, dtype=torch.bfloat16)
    cache = torch.zeros(slots, hkv, d, dtype=torch.bfloat16)
    new = torch.zeros(bs, hkv, d, dtype=torch.bfloat16)
    with record_launches() as launches:
        paged_attention(
            q, cache, cache, torch.empty_like(q), cu_q_lens=torch.arange(bs + 1, **i32),
            seq_lens=torch.full((bs,), 300, **i32), table=torch.ones(bs, width, **i32),
            table_rows=torch.arange(bs, **i32), table_start=torch.zeros(bs, **i32), max_q_len=1,
            max_kv_len=300, window=width, pdl=True, prologue=True, release_early=True, config=config,
            k=new, v=new, loc=torch.arange(1, bs + 1, **i32),
        )  # fmt: skip
    (launch,) = launches
    return launch


def main() -> int:
    result = {}
    for label, config in (("0", {"PREFETCH": 0}), ("1", {"PREFETCH": 1}), ("2", {"PREFETCH": 2}), ("plan", None)):
        launch = _launch(config)
        compiled = compile_launch(launch)
        ptx = compiled.asm["ptx"].splitlines()
        wait = next(i for i, line in enumerate(ptx) if "griddepcontrol.wait" in line)
        prefetches = [i for i, line in enumerate(ptx) if "prefetch.global.L2" in line]
        result[label] = dict(
            depth=dict(launch.kwargs).get("PREFETCH"),
            prefetches=len(prefetches),
            before_wait=sum(i < wait for i in prefetches),
            registers=resources(compiled)["registers"],
        )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
