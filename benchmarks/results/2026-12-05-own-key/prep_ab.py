"""Replay preparation's host time at bs 128 decode (the hybrid_step world), with the step-metadata
launch repeated through this tree's ``Relaunch`` (captured tensors passed as addresses, launch
metadata only with a hook) and through the ``Relaunch`` of the file given as argv[1] (tensors
passed as tensors), alternating, in one process. Medians of 3,000 ``runner.prepare`` calls.

    python prep_ab.py OLD_RELAUNCH.py
"""

import importlib.util
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # benchmarks/
from layer_timeline import world_step  # noqa: E402

from attnplug import ForwardMode  # noqa: E402
from attnplug.bench.timing import Timer  # noqa: E402
from attnplug.bench.world import INPUTS  # noqa: E402
from attnplug.graphs.runner import GraphRunner  # noqa: E402

spec = importlib.util.spec_from_file_location("relaunch_before", sys.argv[1])
before = importlib.util.module_from_spec(spec)
spec.loader.exec_module(before)

bs = 128
world, batch, new_backend = world_step(bs, "decode")
backend, step = new_backend()
inputs = {"x": torch.zeros(bs, 1, dtype=INPUTS["x"][1], device="cuda")}
runner = GraphRunner(backend, step, max_bs=bs, inputs=INPUTS, bucket_sizes=[bs], modes=[ForwardMode.DECODE])
runner.capture(strict=True)
for _ in range(20):
    out_new = runner.run(batch, inputs).clone()
torch.cuda.synchronize()

static = runner._route(batch).batch
views = backend._graph_views(static)
key = (batch.req_pool_indices.dtype, batch.seq_lens.dtype, batch.positions is None)
dst, new = views.padded_launches[key]
old = before.Relaunch(new.jit_fn, new.grid, new.args, new.kwargs, per_step=new.per_step)
print(
    "tensor arguments to the launcher: before / now",
    *(sum(isinstance(a, torch.Tensor) for a in r._all) for r in (old, new)),
)


def use(launch):
    views.padded_launches[key] = (dst, launch)


timer = Timer("cuda", type(backend))


def med():
    return timer.host_us(lambda: runner.prepare(batch, inputs), iters=3000, warmup=100)


use(old)
out_old = runner.run(batch, inputs).clone()
torch.cuda.synchronize()
print("outputs equal (old / new launch):", torch.equal(out_old, out_new))
rows = {"tensors (before)": [], "addresses (now)": []}
for _ in range(4):
    use(old)
    rows["tensors (before)"].append(med())
    use(new)
    rows["addresses (now)"].append(med())
for name, vals in rows.items():
    print(f"PREP {name:18s} " + " ".join(f"{v:6.2f}" for v in vals) + f"   median {statistics.median(vals):6.2f} us")
