"""Paged causal prefill: one full-attention layer's EXTEND step, through a backend's ``forward``
over a pool, against peers on the same cache.

A case (``PrefillCase``) is a head dim, the prompt lengths of the step's requests (one prompt
of ``T`` tokens, or a batch such as 8 x 1,024) and the pool's page size; the q / KV heads and
the model dtype are the benchmark's. ``build_prefill_world`` makes a one-layer pool (no SWA
layer) of that page size, allocates every prompt's slots with
``SWATokenAllocator.alloc_extend`` (whole pages, a prompt's pages in the allocator's order),
writes them into ``req_to_token``, draws q / k / v from N(0, 1) and stores k / v into the pool
(``SWAKVPool.set_kv_buffer``) before anything is timed, so every implementation reads the same
cache whatever ran before it.

* **Time** (``ctx.timer.device_us``: ``triton.testing.do_bench`` where Triton drives the
  device): one ``backend.forward(q, k, v, 0, batch)`` of the EXTEND step, eagerly, no graphs:
  the KV store and the paged attention, the step's metadata (``init_forward_metadata``) built
  once before; a peer's own call (e.g. attention only, planned before).
* **Work** (``floors.attention_flops``): causal prefill without a prefix,
  ``2 * 2 * H * D * sum over requests of T (T + 1) / 2`` (the query at position ``p``
  attends ``p + 1`` keys; q.k and p.v, a multiply and an add per element); TFLOP/s = work /
  time.
* **Check**: the first and the last ``CHECK_QUERIES`` queries of every prompt against float32
  causal attention over the keys read back from the cache (``causal_reference``), held to
  ``tolerance``; a peer's output the same way.

Rows per case (label ``D=128 1x16384 page 16``): the backend's time (``tflop_s``, target
``tflops_target(case)`` TFLOP/s where given), its check, and per peer its time, its check and
``speedup (peer / backend)`` held to ``PrefillPeer.target``. A peer that is not installed
leaves one row saying so and is not asked again. Cases are skipped, with a row, when the
budget runs low.

``run_portable`` is the portable suite's ``prefill`` (``attnplug bench --backend NAME --only
prefill``): small cases for any backend, the host included, no peers.
"""

from __future__ import annotations

import math
import traceback
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from ..batch import ForwardBatch, ForwardMode
from ..memory import ReqToTokenPool, SWAKVPool, SWATokenAllocator
from ..memory.fp8 import dequantize_kv
from .context import Ctx
from .floors import attention_flops
from .rows import error_row, row
from .step_spec import PeerUnavailable
from .timing import free_memory

__all__ = [
    "PrefillCase",
    "PrefillWorld",
    "PrefillPeer",
    "build_prefill_world",
    "request_pages",
    "causal_reference",
    "run_prefill_benchmark",
    "run_portable",
    "CHECK_QUERIES",
]

#: queries checked at each end of every prompt
CHECK_QUERIES = 256


@dataclass(frozen=True)
class PrefillCase:
    """One prefill step: ``head_dim``, the prompts' lengths ``q_lens`` (tokens, one request
    each), the pool's ``page_size``."""

    head_dim: int
    q_lens: Tuple[int, ...]
    page_size: int

    @property
    def tokens(self) -> int:
        return sum(self.q_lens)

    def describe(self) -> str:
        """``D=128 1x16384 page 16`` (equal prompts), ``D=64 3 prompts (1024 tokens) page 1``."""
        if len(set(self.q_lens)) == 1:
            prompts = f"{len(self.q_lens)}x{self.q_lens[0]}"
        else:
            prompts = f"{len(self.q_lens)} prompts ({self.tokens} tokens)"
        return f"D={self.head_dim} {prompts} page {self.page_size}"

    def flops(self, num_heads: int) -> int:
        """``floors.attention_flops`` of the step (causal, no prefix)."""
        return attention_flops(num_heads, self.head_dim, self.q_lens, self.q_lens)


@dataclass
class PrefillWorld:
    """A case's pool and step (``build_prefill_world``): ``q`` ``[T, H, D]``, ``k`` / ``v``
    ``[T, Hkv, D]`` of ``dtype`` (request by request, position order), ``batch`` the EXTEND
    step, ``req_rows`` the requests' rows of ``rows.req_to_token``."""

    case: PrefillCase
    pool: SWAKVPool
    rows: ReqToTokenPool
    alloc: SWATokenAllocator
    batch: ForwardBatch
    req_rows: List[int]
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    num_heads: int
    dtype: torch.dtype

    @property
    def scaling(self) -> float:
        return 1.0 / math.sqrt(self.case.head_dim)


@dataclass(frozen=True)
class PrefillPeer:
    """Another implementation of the step's attention on the same cache.
    ``measure(ctx, world)`` returns ``(microseconds per call, output [T, H, D], detail,
    fields)`` (``fields``: more JSON of its time row, e.g. the configuration it ran) and raises
    ``PeerUnavailable`` when it cannot run here; ``target``: ``peer time / backend time`` held
    at every case (None: reported); ``what``: what its time covers."""

    name: str
    measure: Callable[[Ctx, PrefillWorld], Tuple[float, torch.Tensor, str, dict]]
    target: Optional[float] = None
    what: str = ""


def build_prefill_world(
    case: PrefillCase,
    *,
    num_heads: int,
    num_kv_heads: int,
    dtype: torch.dtype,
    device,
    seed: int = 0,
) -> PrefillWorld:
    """The pool, requests, step and inputs of ``case`` (module docstring), on ``device``."""
    P, lens = case.page_size, list(case.q_lens)
    if not lens or min(lens) < 1:
        raise ValueError(f"a prefill case needs prompts of >= 1 token, got {case.q_lens}")
    size = (sum(-(-t // P) for t in lens) + 1) * P
    pool = SWAKVPool(size, size, 1, [], num_kv_heads, case.head_dim, dtype, device, page_size=P)
    alloc = SWATokenAllocator(pool)
    rows = ReqToTokenPool(len(lens) + 1, max(lens) + P, device)
    req_rows = [rows.alloc() for _ in lens]
    loc = alloc.alloc_extend([0] * len(lens), lens, [-1] * len(lens))
    offset = 0
    for r, t in zip(req_rows, lens):
        rows.req_to_token[r, :t] = loc[offset : offset + t].to(torch.int32)
        offset += t
    dev = pool.device
    batch = ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=len(lens),
        req_pool_indices=torch.tensor(req_rows, dtype=torch.int64).to(dev),
        seq_lens=torch.tensor(lens, dtype=torch.int64).to(dev),
        out_cache_loc=loc,
        positions=torch.cat([torch.arange(t, dtype=torch.int64) for t in lens]).to(dev),
        seq_lens_cpu=list(lens),
        extend_seq_lens=torch.tensor(lens, dtype=torch.int64).to(dev),
        extend_seq_lens_cpu=list(lens),
    )
    gen = torch.Generator(device=dev).manual_seed(seed)
    T, D = case.tokens, case.head_dim
    q = torch.randn(T, num_heads, D, generator=gen, device=dev).to(dtype)
    k = torch.randn(T, num_kv_heads, D, generator=gen, device=dev).to(dtype)
    v = torch.randn(T, num_kv_heads, D, generator=gen, device=dev).to(dtype)
    pool.set_kv_buffer(0, loc, k, v)
    return PrefillWorld(case, pool, rows, alloc, batch, req_rows, q, k, v, num_heads, dtype)


def request_pages(world: PrefillWorld) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The prompts' pages in position order, as paged-attention libraries take them:
    ``indptr [bs + 1]``, ``indices [pages]`` (page ``i`` is slots ``i * P .. i * P + P - 1``)
    and ``last_page_len [bs]`` (tokens in each prompt's last page), int32, device. Reads the
    request table on the host (set-up). Raises ``ValueError`` when a prompt's slots are not
    whole pages in order (a page's tokens at their offsets)."""
    P = world.pool.page_size
    indptr, pages, last = [0], [], []
    for r, t in zip(world.req_rows, world.case.q_lens):
        slots = world.rows.req_to_token[r, :t].to("cpu", torch.int64)
        first = slots[::P] // P
        expected = first.repeat_interleave(P)[:t] * P + torch.arange(t) % P
        if not torch.equal(slots, expected):
            raise ValueError(f"request_pages: the {t} slots of request row {r} are not whole pages of {P} in order")
        pages.append(first)
        indptr.append(indptr[-1] + first.numel())
        last.append(t - (first.numel() - 1) * P)
    dev = world.pool.device
    as32 = lambda x: torch.as_tensor(x, dtype=torch.int32).to(dev)  # noqa: E731
    return as32(indptr), as32(torch.cat(pages)), as32(last)


def checked_queries(t: int) -> torch.Tensor:
    """Positions of a ``t``-token prompt that are checked: the first and the last
    ``CHECK_QUERIES`` (all of them for a short prompt), int64, sorted, host."""
    n = min(CHECK_QUERIES, t)
    return torch.unique(torch.cat([torch.arange(n), torch.arange(t - n, t)]))


def causal_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float
) -> torch.Tensor:
    """float32 causal attention of the queries ``q [n, H, D]`` at positions ``q_pos [n]``
    (int64, same device) of one prompt over its keys ``k`` / ``v [t, Hkv, D]`` (float32, in
    position order): the query at ``p`` attends keys ``0 .. p`` (grouped-query: head ``h``
    reads KV head ``h // (H // Hkv)``). Returns ``[n, H, D]`` float32."""
    n, H, D = q.shape
    t, Hkv = k.shape[0], k.shape[1]
    qg = q.float().view(n, Hkv, H // Hkv, D)
    s = torch.einsum("nkgd,tkd->kgnt", qg, k) * scale
    keep = torch.arange(t, device=q.device)[None, :] <= q_pos[:, None]  # [n, t]
    s = s.masked_fill(~keep, float("-inf"))
    return torch.einsum("kgnt,tkd->nkgd", torch.softmax(s, dim=-1), v).reshape(n, H, D)


def max_error(world: PrefillWorld, out: torch.Tensor) -> float:
    """``max |out - causal_reference|`` over every prompt's ``checked_queries``, the keys read
    back from the cache (dequantised where it is FP8)."""
    k_cache, v_cache = world.pool.get_kv_buffer(0)
    k_scale, v_scale = world.pool.kv_scales(0)
    worst, offset = 0.0, 0
    for r, t in zip(world.req_rows, world.case.q_lens):
        slots = world.rows.req_to_token[r, :t].long()
        k, v = k_cache[slots], v_cache[slots]
        k = dequantize_kv(k, k_scale) if k_scale is not None else k.float()
        v = dequantize_kv(v, v_scale) if v_scale is not None else v.float()
        pos = checked_queries(t).to(out.device)
        ref = causal_reference(world.q[offset + pos], k, v, pos, world.scaling)
        worst = max(worst, (out[offset + pos].float() - ref).abs().max().item())
        offset += t
    return worst


def run_prefill_benchmark(
    ctx: Ctx,
    *,
    name: str,
    make: Callable[..., object],
    cases: Sequence[PrefillCase],
    num_heads: int,
    num_kv_heads: int,
    dtype: torch.dtype,
    peers: Sequence[PrefillPeer] = (),
    tflops_target: Callable[[PrefillCase], Optional[float]] = lambda case: None,
    tolerance: float = 2e-2,
    rep_ms: float = 100.0,
    iters: int = 10,
    need_s: float = 20.0,
) -> List[dict]:
    """The benchmark of the module docstring; appends to ``ctx.rows``. ``make(pool,
    req_to_token_pool, num_heads=...)``: the backend measured (its registry ``name`` labels its
    rows); ``rep_ms`` / ``iters``: ``Timer.device_us``'s repetitions (Triton) or samples
    (elsewhere); ``need_s``: seconds a case needs (fewer left: skipped)."""
    who = str(getattr(make, "name", None) or getattr(make, "__name__", "backend"))
    unavailable: dict = {}
    for case in cases:
        label = case.describe()
        if ctx.time_low(need_s):
            ctx.rows.append(row(name, f"{label} {who}", "time", None, "us", notes="skipped: time budget", key=True))
            ctx.log(f"  {label}: skipped (time budget)")
            continue
        try:
            world = build_prefill_world(
                case, num_heads=num_heads, num_kv_heads=num_kv_heads, dtype=dtype, device=ctx.device
            )
        except Exception as exc:
            ctx.rows.append(error_row(name, f"{label} {who}", "time", "us", exc))
            ctx.log(f"  {label}: FAILED to build: {type(exc).__name__}: {exc}")
            continue
        flops = case.flops(num_heads)
        own_us = _measure_backend(
            ctx, name, label, who, make, world, flops, tflops_target(case), tolerance, rep_ms, iters
        )
        for peer in peers:
            if peer.name not in unavailable:
                _measure_peer(ctx, name, label, who, peer, world, flops, own_us, tolerance, unavailable)
        del world
        free_memory(ctx.timer)
    return ctx.rows


def _tflops(flops: int, us: float) -> float:
    return flops / (us * 1e-6) / 1e12


def _measure_backend(ctx, name, label, who, make, world, flops, target, tolerance, rep_ms, iters) -> Optional[float]:
    """Time and check the backend's forward; its rows appended; its microseconds (None: failed)."""
    try:
        backend = make(world.pool, world.rows, num_heads=world.num_heads)
        backend.init_forward_metadata(world.batch)

        def forward() -> torch.Tensor:
            return backend.forward(world.q, world.k, world.v, 0, world.batch)

        err = max_error(world, forward())
        us = ctx.timer.device_us(forward, rep_ms=rep_ms, iters=iters)
    except Exception as exc:
        ctx.rows.append(error_row(name, f"{label} {who}", "time", "us", exc))
        ctx.log(f"  {label} {who}: FAILED {type(exc).__name__}: {exc}")
        return None
    finally:
        free_memory(ctx.timer)
    rate = _tflops(flops, us)
    ctx.rows.append(
        row(
            name,
            f"{label} {who}",
            "time",
            us,
            "us",
            target=None if target is None else f">= {target:g} TFLOP/s",
            met=None if target is None else rate >= target,
            key=True,
            tflop_s=rate,
            flops=flops,
            tokens=world.case.tokens,
            head_dim=world.case.head_dim,
            page_size=world.case.page_size,
            detail=f"{rate:.3g} TFLOP/s; KV store + paged attention (forward over the pool, eager)",
        )
    )
    ctx.rows.append(_check_row(name, label, who, err, tolerance))
    ctx.log(f"  {label} {who}: {us:.1f} us, {rate:.1f} TFLOP/s, max |out diff| {err:.2e}")
    return us


def _check_row(name, label, who, err, tolerance) -> dict:
    return row(
        name,
        f"{label} {who} vs float32 torch (checked queries)",
        "max |out diff|",
        err,
        "",
        target=f"<= {tolerance:g}",
        met=err <= tolerance,
        detail=f"the first and last {CHECK_QUERIES} queries of each prompt, keys read back from the cache",
    )


def _measure_peer(ctx, name, label, who, peer: PrefillPeer, world, flops, own_us, tolerance, unavailable) -> None:
    try:
        us, out, detail, fields = peer.measure(ctx, world)
        err = max_error(world, out)
    except PeerUnavailable as exc:
        unavailable[peer.name] = str(exc)
        ctx.rows.append(row(name, f"peer: {peer.name}", "time", None, "us", notes=str(exc), key=True))
        ctx.log(f"  peer {peer.name}: {exc}")
        return
    except Exception as exc:
        ctx.rows.append(
            row(
                name,
                f"{label} {peer.name}",
                "time",
                None,
                "us",
                error=f"{type(exc).__name__}: {exc}",
                traceback=traceback.format_exc(),
            )
        )
        ctx.log(f"  {label} {peer.name}: FAILED {type(exc).__name__}: {exc}")
        return
    finally:
        free_memory(ctx.timer)
    rate = _tflops(flops, us)
    ctx.rows.append(
        row(
            name, f"{label} {peer.name}", "time", us, "us", key=True, tflop_s=rate, flops=flops, detail=detail, **fields
        )
    )
    ctx.rows.append(_check_row(name, label, peer.name, err, tolerance))
    ctx.log(f"  {label} {peer.name}: {us:.1f} us, {rate:.1f} TFLOP/s, max |out diff| {err:.2e} ({detail})")
    if own_us is None:
        return
    s = us / own_us
    ctx.rows.append(
        row(
            name,
            label,
            f"speedup ({peer.name} / {who})",
            s,
            "x",
            target=None if peer.target is None else f">= {peer.target:g}x",
            met=None if peer.target is None else s >= peer.target,
            key=True,
            **{f"{peer.name}_us": us, f"{who}_us": own_us},
            detail=f"{who} {own_us:.1f} us ({_tflops(flops, own_us):.0f} TFLOP/s), {peer.name} {us:.1f} us "
            f"({rate:.0f} TFLOP/s)" + (f", {peer.what}" if peer.what else ""),
        )
    )


#: the portable suite's cases: (head dim, prompts, page size); ``--quick``: the first two
PORTABLE_CASES = (
    PrefillCase(16, (48,), 4),
    PrefillCase(16, (16, 16), 1),
    PrefillCase(64, (256,), 1),
    PrefillCase(64, (256,), 16),
    PrefillCase(64, (64,) * 4, 16),
)


def run_portable(ctx: Ctx) -> List[dict]:
    """The portable suite's ``prefill`` for ``ctx.backend_cls``: ``PORTABLE_CASES`` (``--quick``:
    the first two), 4 q / 2 KV heads, the suite's ``dtype`` option, no peers."""
    from .portable import suite_dtype

    if ctx.backend_cls is None:
        raise ValueError("the portable prefill benchmark needs a backend (ctx.backend_cls is None)")
    cases = PORTABLE_CASES[:2] if ctx.quick else PORTABLE_CASES
    dtype = suite_dtype(ctx)
    return run_prefill_benchmark(
        ctx,
        name="prefill",
        make=ctx.backend_cls,
        cases=cases,
        num_heads=4,
        num_kv_heads=2,
        dtype=dtype,
        tolerance=1e-4 if dtype == torch.float32 else 2e-2,
        rep_ms=20.0 if ctx.quick else 50.0,
        iters=2 if ctx.quick else 5,
        need_s=2.0,
    )
