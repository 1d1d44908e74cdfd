"""Run every kernel of the CUDA plugin once on small shapes, PDL on, for compute-sanitizer.

``compute-sanitizer --tool memcheck python benchmarks/sanitize_kernels.py`` (and
``--tool racecheck``): the store (Triton and C++), the step-metadata launch, the one-launch
small decode (store + split attention + atomic-ticket merge; once more with the first key
block laid out before the wait, the own key folded as a vector and the release at entry, as
decode steps of up to one group an SM run it, and once in two splits of 4-warp programs with
128-key blocks, as decode steps' paired plans run it), and paged attention for extend and,
with the one-launch path off, for decode and verify storing the step in its own launch
(split KV + combine; its PDL prologue and early release on), on SWA and full layers, eager
and in a captured graph.
Small on purpose: the sanitizer slows kernels by orders of magnitude. Run it once without the
sanitizer first, so that Triton's cache holds its kernels: on a machine whose cache was empty,
memcheck and racecheck had not reached a kernel after 150 seconds (most likely compiling under
the sanitizer), where after other runs had compiled the kernels each finished within 60.
"""

import functools
import sys

import torch

from attnplug import ForwardMode
from attnplug_conformance.harness import World, WorldSpec

SPEC = WorldSpec(
    num_layers=2,
    num_heads=8,
    num_kv_heads=2,
    head_dim=128,
    dtype=torch.bfloat16,
    sliding_window=16,
    size=2048,
    size_swa=1024,
    max_reqs=8,
    max_context_len=256,
    swa_layer_ids=(0,),
)


def _steps(backend_cls) -> World:
    """A prefill, an eager decode, then a decode and a verify step replayed from graphs."""
    world = World(SPEC, backend_cls, "cuda", seed=0)
    reqs = [world.new_request() for _ in range(3)]
    step = world.plan(ForwardMode.EXTEND, reqs, [40, 7, 100])
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

    class PagedSteps(CudaBackend):  # decode and verify through paged_attention, storing the step
        one_launch_small_steps = False

    class EarlyLayout(CudaBackend):  # the plan keys of small decode steps (own key, release at entry)
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._store_attend = functools.partial(self._store_attend, config={"own_block": 1, "release_entry": 1})

    class PairedLayout(CudaBackend):  # paired plans (decode and draft steps): two splits of 4-warp, 128-key programs
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            config = {"num_splits": 2, "BLOCK_N": 128, "num_warps": 4, "num_stages": 1}
            self._store_attend = functools.partial(self._store_attend, config=config)

    world = _steps(CudaBackend)
    _steps(PagedSteps)
    _steps(EarlyLayout)
    _steps(PairedLayout)
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
