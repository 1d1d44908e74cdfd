"""Run every kernel of the CUDA plugin once on small shapes, PDL on, for compute-sanitizer.

``compute-sanitizer --tool memcheck python benchmarks/sanitize_kernels.py`` (and
``--tool racecheck``): the store (Triton and C++), the step-metadata launch, the one-launch
small decode and verify steps (store + split attention + atomic-ticket merge; decode steps
with the first key block laid out before the wait, the own key folded as a vector and the
release at entry, their full layers in paired plans), and paged attention for extend and,
with the one-launch path off (``CudaTuning(one_launch=False)``), for decode and verify
storing the step in its own launch (split KV + combine; the PDL prologue and early release),
on SWA and full layers, eager and in a captured graph; and the op layer engines call
(``CudaBackend.paged_ops``: the strided store and paged attention over the K/V halves of an
interleaved ``[blocks, 16, Hkv, 2 * D]`` cache, -1 padding, a split long request). Then the
same over FP8 KV caches (``float8_e4m3fn`` and ``float8_e5m2``, a bfloat16 model, per-head
scales): the stores quantising, the FP8 tiles read with the scales folded in, through the
one-launch and the paged paths, and the op layer with one scale a layer (a stride-0 view) and
per-head scales. Public API only: the backend, its tuning, its op layer and the conformance
harness's world.
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
SPEC = WorldSpec(**MODEL, sliding_window=16, size=4096, size_swa=2048, max_reqs=8, max_context_len=1024)


def _steps(backend_cls, kv_dtype=None) -> World:
    """A prefill, an eager decode, then a decode, a verify and a chunked-prefill (EXTEND, a
    token-count bucket of 64 with padding: the tile map) step replayed from graphs;
    ``kv_dtype``: an FP8 pool (the harness's per-head scales) under the bfloat16 model."""
    world = World(dataclasses.replace(SPEC, kv_cache_dtype=kv_dtype), backend_cls, "cuda", seed=0)
    reqs = [world.new_request() for _ in range(3)]
    # 1,000 tokens: the flash tiles' last key block and the slots read ahead of it reach the
    # key table's width (1,024)
    step = world.plan(ForwardMode.EXTEND, reqs, [40, 1000, 100])
    world.run_eager(step)
    world.commit(step)
    for r in reqs:
        world.evict(r)
    step = world.plan(ForwardMode.DECODE, reqs)
    world.run_eager(step)
    world.commit(step)
    runner = world.graph_runner(max_bs=4, num_draft_tokens=3, bucket_sizes=[4], extend_tokens=[64])
    for mode in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY):
        step = world.plan(mode, reqs, num_draft_tokens=3 if mode.is_speculative else None)
        runner.run(step.batch, step.inputs)
        world.commit(step)
    step = world.plan(ForwardMode.EXTEND, reqs, [7, 10, 1])
    runner.run(step.batch, step.inputs)
    world.commit(step)
    return world


def _engine_ops(backend_cls, kv_dtype=torch.bfloat16, scales=None) -> None:
    """The op layer over a cache laid out as vLLM lays it out: store (with -1 padding), plan,
    attend (a 700-key request splits the KV range; a window on the second call); ``kv_dtype``
    an FP8 dtype with ``scales`` = (k_scale, v_scale) float32 CUDA tensors."""
    ops = backend_cls.paged_ops(torch.device("cuda"))
    P, hkv, D, H = 16, 8, 128, 32
    scale_kw = {} if scales is None else dict(k_scale=scales[0], v_scale=scales[1])
    kv = torch.zeros(64, P, hkv, 2 * D, dtype=kv_dtype, device="cuda")
    kc, vc = kv[..., :D], kv[..., D:]
    seq = [700, 5]  # one new token of request 0, five of request 1
    table = torch.zeros(2, 48, dtype=torch.int32, device="cuda")
    table[0, :44] = torch.arange(1, 45, dtype=torch.int32)
    table[1, 0] = 50
    slots = [table[0, 699 // P].item() * P + 699 % P] + [50 * P + i for i in range(5)] + [-1, -1]
    k = torch.randn(8, hkv, D, dtype=torch.bfloat16, device="cuda")
    ops.store_kv(k, k, kc, vc, torch.tensor(slots, device="cuda"), **scale_kw)
    qsl = torch.tensor([0, 1, 6], dtype=torch.int32, device="cuda")
    step = ops.plan(qsl, torch.tensor(seq, device="cuda"), table, P, num_tokens=6, max_query_len=5, max_seq_len=700)
    q = torch.randn(6, H, D, dtype=torch.bfloat16, device="cuda")
    ops.attend(q, kc, vc, step, scale=0.09, **scale_kw)
    ops.attend(q, kc, vc, step, scale=0.09, window=64, **scale_kw)


def main() -> int:
    from attnplug_cuda.backend import CudaBackend
    from attnplug_cuda.tuning import CudaTuning

    paged = dataclasses.replace(CudaTuning.from_env(), one_launch=False)  # decode / verify: paged_attention storing
    world = _steps(CudaBackend)
    _steps(functools.partial(CudaBackend, tuning=paged))
    _engine_ops(CudaBackend)
    for kv_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):  # FP8 caches: quantising stores, scaled reads
        _steps(CudaBackend, kv_dtype)
        _steps(functools.partial(CudaBackend, tuning=paged), kv_dtype)
    one = torch.tensor([0.05], device="cuda")  # an engine's one scale a layer (a stride-0 view)
    _engine_ops(CudaBackend, torch.float8_e4m3fn, (one, one * 2))
    per_head = torch.linspace(0.01, 0.2, 8, device="cuda")
    _engine_ops(CudaBackend, torch.float8_e5m2, (per_head, per_head.flip(0)))
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
