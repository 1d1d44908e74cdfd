"""Benchmark 1, ``kv_store``: the per-layer KV store of one decode step, in one CUDA graph.

61 layers (SWA layers: ``layer % 4 != 3``, the rest full), each with its own cache tensors
(16384 slots of ``[Hkv=8, D=128]`` bf16), 32 new tokens at scattered slots. The 61 store
launches of a step are replayed from a CUDA graph (``triton.testing.do_bench_cudagraph``
through ``ctx.timer.graph_us``); time per layer = median time of one step / 61.

Variants (same slots, same data):

* ``triton pdl`` / ``triton no-pdl``: the Triton store (``kernels.kv_store``) at the hoisted
  slots (SWA layers: the step's int32 ``swa_out_cache_loc``, translated once per step and
  measured in the ``step_metadata`` benchmark; full layers: the int64 ``out_cache_loc``);
* ``cpp pdl`` / ``cpp no-pdl``: the CUDA C++ store (``cpp_ext.kv_store``), if it builds;
* ``before``: per layer ``pool.full_to_swa_index_mapping[out_cache_loc]`` on SWA layers, then
  ``k_cache[loc] = k; v_cache[loc] = v`` (PyTorch index_put), no PDL.

Targets: <= 1.2 us/layer with PDL; PDL >= 1.15x faster than without; >= 8x faster than before.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

import torch

from attnplug.bench import Ctx, error_row, free_memory, row

NAME = "kv_store"
NUM_LAYERS = 61
NUM_TOKENS = 32
NUM_KV_HEADS = 8
HEAD_DIM = 128
SLOTS = 16384
TARGET_US = 1.2
TARGET_PDL_SPEEDUP = 1.15
TARGET_VS_BEFORE = 8.0


def run(ctx: Ctx) -> List[dict]:
    from attnplug import SWAKVPool, SWATokenAllocator

    from ..kernels import pdl_supported
    from ..kernels.kv_store import kv_store as triton_store

    dev = torch.device("cuda", torch.cuda.current_device())
    rows: List[dict] = ctx.rows
    swa_layers = [l for l in range(NUM_LAYERS) if l % 4 != 3]
    pool = SWAKVPool(SLOTS, SLOTS, NUM_LAYERS, swa_layers, NUM_KV_HEADS, HEAD_DIM, torch.bfloat16, dev)
    alloc = SWATokenAllocator(pool)
    gen = torch.Generator(device=dev).manual_seed(0)
    live = alloc.alloc(4096)  # scattered slots of a busy pool
    pick = torch.randperm(live.numel(), device=dev, generator=gen)[:NUM_TOKENS]
    out_cache_loc = live[pick].contiguous()  # int64
    swa_loc = pool.translate_loc_from_full_to_swa(out_cache_loc).contiguous()  # int32, hoisted once
    ks = torch.randn(NUM_LAYERS, NUM_TOKENS, NUM_KV_HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16, generator=gen)
    vs = torch.randn_like(ks)
    loc_of = [swa_loc if pool.is_swa_layer(l) else out_cache_loc for l in range(NUM_LAYERS)]

    pdl_ok, pdl_reason = pdl_supported(dev)
    ctx.log(f"  PDL: {pdl_ok} ({pdl_reason})")

    def triton_step(pdl: bool) -> Callable[[], None]:
        def fn():
            for l in range(NUM_LAYERS):
                triton_store(ks[l], vs[l], pool.k_buffer[l], pool.v_buffer[l], loc_of[l], pdl=pdl)

        return fn

    def cpp_step(pdl: bool) -> Callable[[], None]:
        from ..cpp_ext import kv_store as cpp_store

        def fn():
            for l in range(NUM_LAYERS):
                cpp_store(ks[l], vs[l], pool.k_buffer[l], pool.v_buffer[l], loc_of[l], pdl)

        return fn

    def before_step() -> None:
        for l in range(NUM_LAYERS):
            loc = pool.full_to_swa_index_mapping[out_cache_loc] if pool.is_swa_layer(l) else out_cache_loc
            pool.k_buffer[l][loc] = ks[l]
            pool.v_buffer[l][loc] = vs[l]

    variants: Dict[str, Optional[Callable[[], None]]] = {}
    reasons: Dict[str, str] = {}
    if pdl_ok:
        variants["triton pdl"] = triton_step(True)
    else:
        reasons["triton pdl"] = pdl_reason
    variants["triton no-pdl"] = triton_step(False)
    if ctx.options.get("skip_cpp"):
        cpp_ok, cpp_reason = False, "skipped (--set skip_cpp=1)"
    else:
        ctx.log("  building/loading the CUDA C++ KV store (first build: about a minute) ...")
        from ..cpp_ext import cpp_ext_status

        cpp_ok, cpp_reason = cpp_ext_status()
    ctx.log(f"  C++ KV store: {cpp_ok} ({cpp_reason.splitlines()[0] if cpp_reason else ''})")
    if cpp_ok and pdl_ok:
        variants["cpp pdl"] = cpp_step(True)
    elif not cpp_ok or not pdl_ok:
        reasons["cpp pdl"] = cpp_reason if not cpp_ok else pdl_reason
    if cpp_ok:
        variants["cpp no-pdl"] = cpp_step(False)
    else:
        reasons["cpp no-pdl"] = cpp_reason
    variants["before"] = before_step

    rep_ms = 20.0 if ctx.quick else 50.0
    per_layer: Dict[str, float] = {}
    for name, fn in variants.items():
        try:
            for buf in (*pool.k_buffer, *pool.v_buffer):
                buf.zero_()
            us = ctx.timer.graph_us(fn, rep_ms=rep_ms) / NUM_LAYERS
            ok = all(
                torch.equal(pool.k_buffer[l][loc_of[l]], ks[l]) and torch.equal(pool.v_buffer[l][loc_of[l]], vs[l])
                for l in (0, 3, NUM_LAYERS - 1)
            )
            per_layer[name] = us
            pdl = name.endswith(" pdl") and not name.endswith("no-pdl")
            rows.append(
                row(
                    NAME,
                    name,
                    "time per layer",
                    us,
                    "us",
                    target=f"<= {TARGET_US} us" if pdl else None,
                    met=(us <= TARGET_US) if pdl else None,
                    stored_correctly=ok,
                    key=True,
                    detail=f"{NUM_LAYERS} layers in one graph: {us * NUM_LAYERS:.1f} us"
                    if ok
                    else "STORED VALUES WRONG",
                )
            )
            ctx.log(f"  {name:14s} {us:8.3f} us/layer  (stored ok: {ok})")
        except Exception as exc:  # keep the other variants
            rows.append(error_row(NAME, name, "time per layer", "us", exc))
            ctx.log(f"  {name}: FAILED {type(exc).__name__}: {exc}")
        free_memory(ctx.timer)
    for name, why in reasons.items():
        lines = [l.strip() for l in (why or "").splitlines() if l.strip()]
        short = lines[0] if len(lines) <= 1 else f"{lines[-1]} (build failed; full log in the JSON)"
        rows.append(row(NAME, name, "time per layer", None, "us", notes=f"not run: {short}", reason=why, key=True))

    for impl in ("triton", "cpp"):
        on, off, before = per_layer.get(f"{impl} pdl"), per_layer.get(f"{impl} no-pdl"), per_layer.get("before")
        for case, slow, target in (
            (f"{impl}: pdl vs no-pdl", off, TARGET_PDL_SPEEDUP),
            (f"{impl} pdl vs before", before, TARGET_VS_BEFORE),
        ):
            if on and slow:
                s = slow / on
                detail = f"{slow:.3f} -> {on:.3f} us/layer"
                rows.append(row(NAME, case, "speedup", s, "x", target=f">= {target}x", met=s >= target, detail=detail))
    return rows
