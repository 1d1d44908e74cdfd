"""Compile every Triton launch the cuda backend makes for sm_90, on a machine without a GPU.

The Triton interpreter runs the kernels' Python semantics but not Triton's compiler: a kernel
can pass every interpreted test and still fail to compile on the GPU (for instance a name bound
to values of different types in the two branches of a runtime ``if``). This script drives the
cuda backend through the launches a serving loop makes (EXTEND, eager DECODE on the one-launch
small-step path, graph capture and replay of DECODE and TARGET_VERIFY, with and without
soft-capping and sinks, SWA and full layers), records each ``kernel[grid](...)`` launch instead
of running it, and compiles every distinct (kernel, argument types, constexprs, options) for
``GPUTarget("cuda", 90, 32)`` down to a cubin with the ptxas Triton ships, specialised as the
GPU's launch would be (``attnplug_cuda.bench.offline_compile``: pointer alignment and
divisibility by 16 read off the recorded arguments).

Run with ``TRITON_INTERPRET`` unset (the kernels must be real ``JITFunction``s):
``python tests/cuda/sm90_compile.py``; prints one line per compiled launch, exit code 1 when
any fails.
"""

from __future__ import annotations

import os
import sys
from typing import List

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402

from attnplug_cuda.bench.offline_compile import compile_launch, record_launches, signature_key  # noqa: E402


def drive() -> None:
    """The launches of a small serving loop on CPU tensors (nothing runs: launches are recorded)."""
    import attnplug_cuda.backend as cuda_backend
    import attnplug_cuda.kernels.paged_attention as paged_attention
    import attnplug_cuda.kernels.store_attend as store_attend
    from attnplug import ForwardMode
    from attnplug_conformance.harness import World, WorldSpec

    cuda_backend.interpreting = lambda: True  # accept a CPU pool: no kernel runs here anyway
    # the plans of a 132-SM H200 (splits, the one-launch small-step path), not the CPU stand-in
    paged_attention._num_sms = store_attend._num_sms = lambda device_type, index: 132
    for extra, release_early in (({}, False), ({"logit_softcap": 5.0, "sinks": True}, False), ({}, True)):
        cuda_backend.CudaBackend.pdl_release_early = release_early
        spec = WorldSpec(
            num_layers=2,
            num_heads=8,
            num_kv_heads=2,
            head_dim=128,
            dtype=torch.bfloat16,
            sliding_window=16,
            size=2048,
            size_swa=1024,
            max_reqs=8,
            max_context_len=1024,  # full layers split their KV range (the combine kernel)
            swa_layer_ids=(0,),
            **extra,
        )
        world = World(spec, cuda_backend.CudaBackend, "cpu", seed=0)
        world.backend.pdl = True  # the launches a Hopper GPU gets
        reqs = [world.new_request() for _ in range(3)]
        step = world.plan(ForwardMode.EXTEND, reqs, [40, 7, 100])
        world.run_eager(step)
        world.commit(step)
        step = world.plan(ForwardMode.DECODE, reqs)
        world.run_eager(step)
        world.commit(step)
        runner = world.graph_runner(max_bs=4, num_draft_tokens=3, bucket_sizes=[4])
        for mode in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND):
            step = world.plan(mode, reqs, num_draft_tokens=3 if mode.is_speculative else None)
            runner.run(step.batch, step.inputs)
            world.commit(step)


def main() -> int:
    with record_launches() as recorded:
        try:
            drive()
        except Exception as exc:  # the drive itself must not fail: it is what a serving loop does
            print(f"FAILED to drive the backend: {type(exc).__name__}: {exc}", flush=True)
            raise
    launches = {}
    for launch in recorded:
        launches.setdefault(signature_key(launch), launch)
    failures: List[str] = []
    for key, launch in launches.items():
        name, constexprs, _, options = key
        label = f"{name} {', '.join(f'{k}={v}' for k, v in constexprs)} {dict(options)}"
        try:
            compile_launch(launch)
            print(f"ok     {label}", flush=True)
        except Exception as exc:
            failures.append(label)
            print(f"FAILED {label}\n{type(exc).__name__}: {exc}", flush=True)
    kernels = sorted({key[0] for key in launches})
    print(f"{len(launches)} launches of {len(kernels)} kernels ({', '.join(kernels)}): {len(failures)} failed")
    return 1 if failures or not launches else 0


if __name__ == "__main__":
    sys.exit(main())
