"""The shapes of the small test worlds (``WorldSpec`` of attnplug_conformance.harness), so that a
test names only what it changes: ``small_spec(sliding_window=6)``.

* ``small_spec``: 4 layers (3 SWA, window 4, + 1 full), 8 query / 2 KV heads of 32, float32,
  contexts of 64 tokens: the CPU tests of attention against float64 and of the graph runner;
* ``tiny_spec``: 2 layers (both SWA, window 4), 4 query / 2 KV heads of 16, contexts of 32
  tokens: the cheapest world, for graph capture and replay bookkeeping;
* ``kernel_spec``: 2 layers (both SWA, window 6), 4 query / 2 KV heads of 64, float16, contexts
  of 48 tokens: the shape the CUDA kernels' tests (tests/cuda) run in the Triton interpreter
  (``swa_layer_ids=(0,)`` for one SWA layer and one full).

``drive_every_mode`` runs every mode (eager, or replayed through a graph runner) on a backend
class in a ``kernel_spec`` world: what the Triton backends' interpreter tests compare with the
reference backend.

``small_pool`` is the KV pool of the memory tests: 64 full and 32 SWA slots, layer 0 SWA and
layer 1 full, 2 KV heads of 8, float32, on the host.

``fp8_spec``: ``small_spec`` over an FP8 KV cache (float8_e4m3fn unless given) under a float16
model, the FP8 worlds of the conformance suite's axis (``attnplug_conformance.harness``: per-head
scales set at construction, part of the heads saturating).
"""

from __future__ import annotations

import torch

from attnplug.memory import SWAKVPool
from attnplug_conformance.harness import WorldSpec

#: the model of ``small_spec``: 4 layers, 8 query / 2 KV heads of 32, float32
SMALL_MODEL = dict(num_layers=4, num_heads=8, num_kv_heads=2, head_dim=32, dtype=torch.float32)
SMALL = dict(SMALL_MODEL, sliding_window=4, size=512, size_swa=256, max_reqs=8, max_context_len=64)
TINY = dict(SMALL, num_layers=2, num_heads=4, head_dim=16, size=256, size_swa=128, max_context_len=32)
KERNEL = dict(
    TINY, head_dim=64, dtype=torch.float16, sliding_window=6, size=512, size_swa=256, max_reqs=6, max_context_len=48
)


def small_spec(**overrides) -> WorldSpec:
    """``SMALL`` with ``overrides``."""
    return WorldSpec(**{**SMALL, **overrides})


def fp8_spec(kv_cache_dtype: torch.dtype = torch.float8_e4m3fn, **overrides) -> WorldSpec:
    """``SMALL`` over an FP8 cache of ``kv_cache_dtype``, float16 model, with ``overrides``."""
    return small_spec(**{"dtype": torch.float16, "kv_cache_dtype": kv_cache_dtype, **overrides})


def tiny_spec(**overrides) -> WorldSpec:
    """``TINY`` with ``overrides``."""
    return WorldSpec(**{**TINY, **overrides})


def kernel_spec(**overrides) -> WorldSpec:
    """``KERNEL`` with ``overrides``."""
    return WorldSpec(**{**KERNEL, **overrides})


def small_pool(**overrides) -> SWAKVPool:
    """An ``SWAKVPool`` of the memory tests' shape, with ``overrides`` (constructor arguments)."""
    args = dict(size=64, size_swa=32, num_layers=2, swa_layer_ids=[0], num_kv_heads=2, head_dim=8)
    args.update(dtype=torch.float32, device=torch.device("cpu"), page_size=1)
    args.update(overrides)
    return SWAKVPool(**args)


#: every mode, as ``drive_every_mode`` runs it: (mode, new tokens per request for EXTEND)
EVERY_MODE = [
    ("EXTEND", [5, 9, 13]),
    ("DECODE", None),
    ("TARGET_VERIFY", None),
    ("EXTEND", [2, 1, 4]),
    ("DRAFT_EXTEND", None),
    ("DECODE", None),
]


def drive_every_mode(cls, device, *, use_graphs: bool, world_hook=None):
    """``(outputs per step, every KV buffer after, the world)`` of three requests through
    ``EVERY_MODE`` (3 drafts) on ``cls`` in a ``kernel_spec()`` world (seed 5), eagerly or
    replayed through a graph runner (buckets 2 and 4); ``world_hook(world)`` runs first."""
    from attnplug import ForwardMode
    from attnplug_conformance.harness import World

    spec = kernel_spec()
    world = World(spec, cls, device, seed=5)
    if world_hook is not None:
        world_hook(world)
    reqs = [world.new_request() for _ in range(3)]
    runner = world.graph_runner(max_bs=4, num_draft_tokens=3, bucket_sizes=[2, 4]) if use_graphs else None
    outs = []
    for name, lens in EVERY_MODE:
        mode = ForwardMode[name]
        step = world.plan(mode, reqs, lens, num_draft_tokens=3 if mode.is_speculative else None)
        out = runner.run(step.batch, step.inputs) if runner else world.run_eager(step)
        outs.append(out.clone())
        world.commit(step)
        for r in reqs:
            world.evict(r)
    caches = [t.clone() for layer in range(spec.num_layers) for t in world.pool.get_kv_buffer(layer)]
    return outs, caches, world
