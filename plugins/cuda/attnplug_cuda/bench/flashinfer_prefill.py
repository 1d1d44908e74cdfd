"""Peer ``flashinfer`` of ``prefill``: FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper`` on the
step's own cache, causal, attention only, the faster of its attention backends.

FlashInfer is optional: where ``import flashinfer`` fails the benchmark records one row saying
why (``PeerUnavailable``). For each case of ``prefill``:

* **the same cache**: the pool's one layer ``[S, Hkv, D]`` viewed as ``[S / P, P, Hkv, D]``, a
  paged ``NHD`` cache of the pool's page size ``P`` (no copy); the prompts' pages in position
  order (``attnplug.bench.prefill.request_pages``); q as attnplug gets it;
* **planned in set-up**: one wrapper per attention backend of ``BACKENDS`` (``fa3``, what
  FlashInfer picks on sm_90, and ``fa2``), ``causal=True``, planned once outside the timed
  region; FlashInfer's JIT compiles every module the benchmark's head dims need once per
  process, all at once (``compile_modules``);
* **timed**: ``wrapper.run(q, (k, v), out=out)`` eagerly, as attnplug's forward is
  (``Timer.device_us``); reported: the faster backend, named first in the row's detail and in
  its ``config`` field (``configs``: each backend's time or error). The benchmark checks the
  output it returns against float32 attention, as it checks attnplug's.
"""

from __future__ import annotations

import threading
from typing import Dict, Sequence, Tuple

import torch

from attnplug.bench import Ctx
from attnplug.bench.prefill import PrefillPeer, PrefillWorld, request_pages

from .flashinfer_peer import import_flashinfer, run_jobs

__all__ = ["NAME", "BACKENDS", "peer", "measure", "compile_modules"]

NAME = "flashinfer"
#: FlashInfer's attention backends tried, its own choice on sm_90 first (ties go to it)
BACKENDS = ("fa3", "fa2")
WORKSPACE_BYTES = 256 << 20

_compiled: Dict[tuple, float] = {}
_compile_lock = threading.Lock()


def peer(head_dims: Sequence[int], *, target: float = 1.0, rep_ms: float = 100.0) -> PrefillPeer:
    """The peer for a benchmark whose cases have ``head_dims`` (their modules are compiled at
    its first case); ``target``: ``flashinfer / attnplug`` held at every case."""

    def run(ctx: Ctx, world: PrefillWorld):
        return measure(ctx, world, head_dims=tuple(head_dims), rep_ms=rep_ms)

    return PrefillPeer(NAME, run, target=target, what="attention only (no KV store), planned before")


def compile_modules(fi, world: PrefillWorld, head_dims: Sequence[int]) -> Tuple[float, Dict[str, str]]:
    """Have FlashInfer JIT-compile (or load) the causal paged prefill module of every backend of
    ``BACKENDS`` and head dim of ``head_dims`` at once, each planned on a tiny problem in its own
    thread; once per process and shape. Returns ``(seconds, {module: error})``."""
    H, Hkv = world.num_heads, world.pool.num_kv_heads
    key = (world.dtype, world.pool.dtype, tuple(sorted(head_dims)))
    with _compile_lock:
        if key in _compiled:
            return 0.0, {}
        dev = world.pool.device
        jobs = {}
        for backend in BACKENDS:
            for d in head_dims:

                def job(backend=backend, d=d) -> None:
                    one = torch.arange(2, dtype=torch.int32, device=dev)
                    wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(
                        torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=dev), "NHD", backend=backend
                    )
                    wrapper.plan(
                        one,
                        one,
                        torch.zeros(1, dtype=torch.int32, device=dev),
                        torch.ones(1, dtype=torch.int32, device=dev),
                        H,
                        Hkv,
                        d,
                        1,
                        causal=True,
                        q_data_type=world.dtype,
                        kv_data_type=world.pool.dtype,
                    )

                jobs[f"{backend} D={d}"] = job
        seconds, failures = run_jobs(jobs)
        _compiled[key] = seconds
        return seconds, failures


def measure(ctx: Ctx, world: PrefillWorld, *, head_dims: Sequence[int], rep_ms: float = 100.0):
    """``(us, out [T, H, D], detail, fields)`` of FlashInfer's causal prefill of ``world``'s step
    in its faster backend (the module docstring)."""
    fi = import_flashinfer()
    compile_s, compile_failures = compile_modules(fi, world, head_dims)
    if compile_s:
        failed = f"; failed: {compile_failures}" if compile_failures else ""
        ctx.log(f"  {NAME}: FlashInfer's prefill modules compiled or loaded in {compile_s:.1f} s{failed}")
    pool, case = world.pool, world.case
    P = pool.page_size
    k_cache, v_cache = (buf.view(-1, P, *buf.shape[1:]) for buf in pool.get_kv_buffer(0))
    indptr, pages, last = request_pages(world)
    q_lens = torch.as_tensor(case.q_lens, dtype=torch.int32)
    qo_indptr = torch.cat([q_lens.new_zeros(1), q_lens.cumsum(0, dtype=torch.int32)]).to(pool.device)
    results: Dict[str, Tuple[float, torch.Tensor]] = {}
    errors: Dict[str, str] = {}
    for backend in BACKENDS:
        try:
            workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=pool.device)
            wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend=backend)
            wrapper.plan(
                qo_indptr,
                indptr,
                pages,
                last,
                world.num_heads,
                pool.num_kv_heads,
                case.head_dim,
                P,
                causal=True,
                sm_scale=world.scaling,
                q_data_type=world.dtype,
                kv_data_type=pool.dtype,
            )
            out = torch.empty_like(world.q)

            def call(wrapper=wrapper, out=out) -> torch.Tensor:
                return wrapper.run(world.q, (k_cache, v_cache), out=out)

            call()
            us = ctx.timer.device_us(call, rep_ms=rep_ms)
            results[backend] = (us, out)
        except Exception as exc:
            errors[backend] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
    if not results:
        raise RuntimeError(f"no FlashInfer prefill backend ran: {errors}")
    best = min(results, key=lambda b: (results[b][0], BACKENDS.index(b)))
    us, out = results[best]
    others = "; ".join(
        [f"{b} {results[b][0]:.1f} us" for b in BACKENDS if b in results and b != best]
        + [f"{b} failed: {e}" for b, e in errors.items()]
    )
    detail = (
        f"backend {best} (NHD, page {P}); flashinfer {getattr(fi, '__version__', '?')}, causal, the pool's cache"
        + (f"; {others}" if others else "")
    )
    fields = {
        "config": {"backend": best, "layout": "NHD", "page_size": P},
        "configs": [
            {"backend": b, "us": results[b][0] if b in results else None, "error": errors.get(b)} for b in BACKENDS
        ],
    }
    return us, out, detail, fields
