"""Compile every Triton launch the cuda backend makes for sm_90, on a machine without a GPU.

The Triton interpreter runs the kernels' Python semantics but not Triton's compiler: a kernel
can pass every interpreted test and still fail to compile on the GPU (for instance a name bound
to values of different types in the two branches of a runtime ``if``). This script drives the
cuda backend through the launches a serving loop makes (EXTEND, eager DECODE on the one-launch
small-step path, graph capture and replay of DECODE and TARGET_VERIFY, with and without
soft-capping and sinks, SWA and full layers; the paths a tuning selects; over bfloat16 and FP8
KV caches), records each
``kernel[grid](...)`` launch instead of running it, and compiles every distinct (kernel,
argument types, constexprs, options) for ``GPUTarget("cuda", 90, 32)`` down to a cubin with
the ptxas Triton ships (a decode or draft launch whose registers spill fails too, but for a
few bytes under a register cap; the large prefill tiles' spills are printed, not failed),
specialised as the GPU's launch would be (``offline_compile``: pointer alignment and
divisibility by 16 read off the recorded arguments).

Run with ``TRITON_INTERPRET`` unset (the kernels must be real ``JITFunction``s):
``python tests/cuda/sm90_compile.py``; prints one line per compiled launch, exit code 1 when
any fails.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
from typing import List

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
from offline_compile import compile_launch, record_launches, resources, signature_key  # noqa: E402

#: bytes a thread of a decode tile over an FP8 cache may spill (its K/V tiles are converted in
#: registers): ``paged_attention``'s under its register cap (``PagedPlan.max_registers``) with a
#: soft cap and sinks spill 8 (Triton 3.6) to 56 (Triton 3.9), ``store_attend``'s 128-key decode
#: tiles 8 to 80; every other decode launch must not spill
FP8_DECODE_SPILL_BYTES = 96


def drive() -> None:
    """The launches of a small serving loop on CPU tensors (nothing runs: launches are recorded)."""
    import attnplug_cuda.backend as cuda_backend
    import attnplug_cuda.kernels.common as common
    from attnplug import ForwardMode
    from attnplug_conformance.harness import World, WorldSpec
    from attnplug_cuda.tuning import CudaTuning

    # accept a CPU pool: no kernel runs here anyway
    cuda_backend.CudaBackend.device_part.serves = lambda device: True
    common.num_sms = lambda device: 132  # the plans of a 132-SM H100 / H200, not the CPU stand-in

    paged = functools.partial(cuda_backend.CudaBackend, tuning=dataclasses.replace(CudaTuning(), one_launch=False))
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    for extra, backend_cls, kv_heads, kv_dtype in (
        ({}, cuda_backend.CudaBackend, 2, None),
        ({"logit_softcap": 5.0, "sinks": True}, cuda_backend.CudaBackend, 2, None),
        ({}, paged, 2, None),  # decode and verify steps through paged_attention, storing the step
        # 24 groups: decode steps fold their own key, release at entry, pair
        ({}, cuda_backend.CudaBackend, 8, None),
        # FP8 caches: the stores quantise, the tiles are converted in registers (and store_attend's are smaller)
        ({}, cuda_backend.CudaBackend, 2, e4m3),
        ({"logit_softcap": 5.0, "sinks": True}, paged, 2, e5m2),
        ({}, cuda_backend.CudaBackend, 8, e4m3),
    ):
        model = dict(num_layers=2, swa_layer_ids=(0,), num_heads=4 * kv_heads, num_kv_heads=kv_heads, head_dim=128)
        # a 1,024-key bound: full layers split their KV range (the combine kernel)
        pools = dict(size=2048, size_swa=1024, max_reqs=8, max_context_len=1024)
        spec = WorldSpec(**model, **pools, dtype=torch.bfloat16, kv_cache_dtype=kv_dtype, sliding_window=16, **extra)
        world = World(spec, backend_cls, "cpu", seed=0)
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


def _fp8_cache(launch) -> bool:
    """Whether the recorded launch reads an FP8 cache (its ``K`` argument's dtype)."""
    from attnplug.memory.fp8 import is_fp8

    k = dict(zip(launch.fn.arg_names, launch.args)).get("K")
    return isinstance(k, torch.Tensor) and is_fp8(k.dtype)


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
    spills = 0
    for key, launch in launches.items():
        name, constexprs, _, options = key
        label = f"{name} {', '.join(f'{k}={v}' for k, v in constexprs)} {dict(options)}"
        try:
            r = resources(compile_launch(launch))
        except Exception as exc:
            failures.append(label)
            print(f"FAILED {label}\n{type(exc).__name__}: {exc}", flush=True)
            continue
        spilled = r["spill_bytes"] > 0
        spills += spilled
        plan = launch.kwargs.get("PLAN")
        if spilled and not (plan is not None and getattr(plan, "BLOCK_M", 0) > 16):
            # (the prefill tiles' spills are known: the prefill issue; a decode tile over an
            # FP8 cache trades a few spilled bytes for its blocks' keys or programs an SM)
            if not _fp8_cache(launch) or r["spill_bytes"] > FP8_DECODE_SPILL_BYTES:
                failures.append(label)
        print(
            f"{'spills' if spilled else 'ok':6} {label} registers={r['registers']} spill={r['spill_bytes']}", flush=True
        )
    kernels = sorted({key[0] for key in launches})
    names = ", ".join(kernels)
    print(f"{len(launches)} launches of {len(kernels)} kernels ({names}): {len(failures)} failed, {spills} spill")
    return 1 if failures or not launches else 0


if __name__ == "__main__":
    sys.exit(main())
