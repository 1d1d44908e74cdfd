"""Run every kernel of the CUDA plugin once on small shapes, PDL on, for compute-sanitizer.

``compute-sanitizer --tool memcheck python benchmarks/sanitize_kernels.py`` (and
``--tool racecheck``): the store (Triton and C++), the step-metadata launch, the one-launch
small decode and verify steps (store + split attention + atomic-ticket merge; decode steps
with the first key block laid out before the wait, the own key folded as a vector and the
release at entry, their full layers in paired plans), and paged attention for extend and,
with the one-launch path off (``CudaTuning(one_launch=False)``), for decode and verify
storing the step in its own launch (split KV + combine; the PDL prologue and early release),
on SWA and full layers, eager and in a captured graph. Public API only: the backend, its
tuning and the conformance harness's world.
Small on purpose: the sanitizer slows kernels by orders of magnitude. Run it once without the
sanitizer first, so that Triton's cache holds its kernels: on a machine whose cache was empty,
memcheck and racecheck had not reached a kernel after 150 seconds (most likely compiling under
the sanitizer), where after other runs had compiled the kernels each finished within 60.
"""

import dataclasses
import functools
import sys

import torch

from attnplug import ForwardMode
from attnplug_conformance.harness import World, WorldSpec

#: 8 kv heads: three requests' 24 groups fill a sixteenth of the SMs (decode steps release at
#: entry); a 1,024-key bound: the full layers' decode plans pair their programs
MODEL = dict(num_layers=2, swa_layer_ids=(0,), num_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
SPEC = WorldSpec(**MODEL, sliding_window=16, size=4096, size_swa=1024, max_reqs=8, max_context_len=1024)


def _steps(backend_cls) -> World:
    """A prefill, an eager decode, then a decode and a verify step replayed from graphs."""
    world = World(SPEC, backend_cls, "cuda", seed=0)
    reqs = [world.new_request() for _ in range(3)]
    step = world.plan(ForwardMode.EXTEND, reqs, [40, 700, 100])
    world.run_eager(step)
    world.commit(step)
    for r in reqs:
        world.evict(r)
    step = world.plan(ForwardMode.DECODE, reqs)
    world.run_eager(step)
    world.commit(step)
    runner = world.graph_runner(max_bs=4, num_draft_tokens=3, bucket_sizes=[4])
    for mode in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY):
        step = world.plan(mode, reqs, num_draft_tokens=3 if mode.is_speculative else None)
        runner.run(step.batch, step.inputs)
        world.commit(step)
    return world


def main() -> int:
    from attnplug_cuda.backend import CudaBackend
    from attnplug_cuda.tuning import CudaTuning

    paged = dataclasses.replace(CudaTuning.from_env(), one_launch=False)  # decode / verify: paged_attention storing
    world = _steps(CudaBackend)
    _steps(functools.partial(CudaBackend, tuning=paged))
    from attnplug_cuda.cpp_ext import cpp_ext_status, kv_store

    ok, reason = cpp_ext_status()
    if ok:
        k = torch.randn(5, 2, 128, dtype=torch.bfloat16, device="cuda")
        kc = torch.zeros(64, 2, 128, dtype=torch.bfloat16, device="cuda")
        vc = torch.zeros_like(kc)
        kv_store(k, k, kc, vc, torch.arange(1, 6, device="cuda", dtype=torch.int32), True)
    torch.cuda.synchronize()
    print(f"kernels ran (pdl={world.backend.pdl}, cpp store: {reason})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
