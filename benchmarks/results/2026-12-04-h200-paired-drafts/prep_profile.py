"""Where replay preparation's host time goes at bs 128 decode (hybrid_step world)."""

import cProfile
import io
import pstats
import statistics
import time

import torch

from attnplug import ForwardMode
from attnplug.bench.world import INPUTS, build_world, make_step
from attnplug.graphs.runner import GraphRunner
from attnplug_cuda.backend import CudaBackend

bs = 128
world = build_world(
    num_layers=48,
    max_bs=bs,
    context=1024,
    window=256,
    num_draft=4,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    dtype=torch.bfloat16,
    device=torch.device("cuda"),
)
backend = CudaBackend(world.pool, world.rows, num_heads=32, sliding_window=256)
step = make_step(backend, world, bs)
batch = world.batch(ForwardMode.DECODE, bs, with_cpu=False)
inputs = {"x": torch.zeros(bs, 1, dtype=INPUTS["x"][1], device="cuda")}
runner = GraphRunner(backend, step, max_bs=bs, inputs=INPUTS, bucket_sizes=[bs], modes=[ForwardMode.DECODE])
runner.capture(strict=True)
for _ in range(20):
    runner.run(batch, inputs)
torch.cuda.synchronize()


def med(fn, iters=3000):
    for _ in range(100):
        fn()
    torch.cuda.synchronize()
    s = []
    c = time.perf_counter_ns
    for i in range(iters):
        t0 = c()
        fn()
        s.append((c() - t0) / 1e3)
        if (i + 1) % 100 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return statistics.median(s)


res = {}
res["prepare"] = med(lambda: runner.prepare(batch, inputs))
res["route"] = med(lambda: runner._route(batch))
res["copy_inputs"] = med(lambda: runner._copy_inputs(inputs, bs))
x = inputs["x"]
dst = runner.inputs["x"][:bs]
res["x copy_"] = med(lambda: dst.copy_(x))
static = runner._route(batch).batch


def meta():
    backend.set_replay_source(batch, static)
    backend.init_forward_metadata_replay_cuda_graph(static)


res["set_source+metadata"] = med(meta)
t = backend._graph_views(static)
key = (batch.req_pool_indices.dtype, batch.seq_lens.dtype, batch.positions is None)
launch = t.padded_launches[key][1]
args = backend._per_step_args(batch.req_pool_indices, batch.seq_lens, batch.out_cache_loc, batch.positions)
res["per_step_args"] = med(
    lambda: backend._per_step_args(batch.req_pool_indices, batch.seq_lens, batch.out_cache_loc, batch.positions)
)
res["relaunch(*args)"] = med(lambda: launch(*args))
res["relaunch()"] = med(lambda: launch())
ck = launch._compiled
active = launch._driver.active
res["get_current_stream"] = med(lambda: active.get_current_stream(active.get_current_device()))
stream = active.get_current_stream(active.get_current_device())
all_args = args + launch._rest
res["launch_metadata"] = med(lambda: ck.launch_metadata(launch.grid, stream, *all_args))
res["torch.cuda.current_stream"] = med(lambda: torch.cuda.current_stream())
res["graph_views"] = med(lambda: backend._graph_views(static))
print("n args", len(all_args), "tensors", sum(isinstance(a, torch.Tensor) for a in all_args))
pr = cProfile.Profile()
pr.enable()
for _ in range(2000):
    runner.prepare(batch, inputs)
    if _ % 100 == 99:
        torch.cuda.synchronize()
pr.disable()
sio = io.StringIO()
pstats.Stats(pr, stream=sio).sort_stats("tottime").print_stats(25)
print(sio.getvalue())
for k, v in res.items():
    print(f"PREP {k:28s} {v:8.2f} us")
