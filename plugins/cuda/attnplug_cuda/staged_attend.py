"""One launch per layer for small steps in CUDA C++, the keys taken before the PDL wait: the
kernels ``staged_attend_kernel`` (``csrc/staged_attend.cu``) and ``resident_attend_kernel``
(``csrc/resident_attend.cu``), their plan, routing rule and Python wrapper.

Both have the semantics of the Triton kernel ``store_attend`` (``kernels/store_attend.py``:
the step's K/V stored at ``loc``, attention over the paged cache with the same masks, softcap
and sinks) and take the same arguments, so the backend runs any of them for a one-launch
layer. What differs is where a layer's time goes at small batch: ``store_attend`` reads a
key block into registers before the PDL wait and moves it through shared memory into the
tensor cores after it, so the layout change of every key it holds lies on the chain of
dependent launches, and it splits a group's keys over CTAs whose last one merges them.

* The staged kernel copies each CTA's keys into shared memory (``cp.async``) before the wait,
  so after it a CTA only loads q and the step's own K/V, runs its tensor-core products and
  writes. One CTA stages up to ``max_capacity(head_dim)`` keys at once (384 at head dim 128:
  209 KB of shared memory); longer shares split, merged as ``store_attend`` does.
* The resident kernel (plan key ``resident``) runs one CTA a group whose cached keys, at most
  ``resident_capacity(head_dim)`` (256 at head dim 128: a 256-key window), it loads before the
  wait straight into the registers the tensor-core products read (the head dim and output dims
  taken in a permuted order, so every load is 16 bytes and no key passes through shared
  memory): no split, no merge, no workspace. The plan takes it wherever the host bounds say
  every request's cached keys fit.

What was measured (an H200, the ``hybrid_step`` world: 48 layers, W 256, context 1024, 32 q /
8 KV heads, D 128, bf16; ``benchmarks/layer_timeline.py``, the 48 launches in one PDL graph;
``docs/benchmarks.md`` has the tables):

* one SM gathers a window of 256-byte rows slowly: alone, a CTA's 128 KB took 3.2 us by
  ``cp.async``, 2.1 us by 16-byte loads into registers (1.5 us from L2) and 2.8 us by the
  bulk-copy engine (``benchmarks/sm_copy_rate``); inside the staged kernel its copies took 4
  to 5 us. At bs 1 decode, every layer through the staged kernel took 293 us against
  ``store_attend``'s 193 us;
* once a layer's CTAs cover the GPU every SM copies its share of the chip's bandwidth: bs 8
  full layers ran 15.1 us a layer against 18.2 with ``store_attend``'s 128-key blocks; against
  its current plan (256-key blocks) the 48 launches with full layers here ran 378.0 against
  379.4 us at bs 8 decode and 519.1 against 508.0 us for 4-draft steps;
* the resident kernel on the SWA layers (``store_attend`` on the full ones): bs 1 decode
  211.9 against 192.3 us, bs 4 292.1 against 279.0, bs 8 407.9 against 380.2; 4-draft steps
  at bs 1 / 4 / 8: 288.6 / 348.6 / 474.6 against 265.6 / 316.1 / 508.1 us. An SWA layer at bs
  1 then has a period of 4.2 us (3.97 with ``store_attend``): its CTAs take about 3.4 us from
  their start to issuing their keys' loads, past the previous layer's end.

So the backend runs these kernels only when asked (``ATTNPLUG_ONE_LAUNCH=cpp``), on the layers
``takes_layer`` names: the staged kernel where its grid covers ``FILL`` of the SMs, the
resident kernel for steps of several tokens a request whose groups cover half of that (the
one shape measured faster: 4-draft steps at bs 8).

Served: float16 / bfloat16, head dim 64 or 128, at most ``MAX_ROWS`` (token, q head) rows per
group (``serves``); the backend uses ``store_attend`` otherwise, and wherever the plugin's C++
extension is unavailable (``attnplug_cuda.cpp_ext``).

Shapes: those of ``store_attend`` (its module docstring); ``workspace`` (fp32) and ``tickets``
(int32, zero-filled once) are the same buffers, shared with the staged kernel (the resident
kernel needs neither).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

__all__ = [
    "FILL",
    "MAX_ROWS",
    "takes_layer",
    "resident_capacity",
    "serves",
    "serves_layers",
    "max_capacity",
    "plan_staged_attend",
    "workspace_numel",
    "staged_attend",
]

#: most (token, q head) rows of one (request, kv head) group: one MMA tile
MAX_ROWS = 16
#: capacities are whole multiples of this many keys (8 warps x 16-key score tiles)
CAPACITY_STEP = 128
_MAX_CAPACITY = {64: 512, 128: 384}
_RESIDENT_CAPACITY = {64: 512, 128: 256}
#: share of the SMs a layer's CTAs must cover for the backend to run it here, when asked
#: (``ATTNPLUG_ONE_LAUNCH=cpp``; module docstring)
FILL = 7 / 8


def serves_layers(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the kernel serves layers of this dtype and head dim."""
    return dtype in (torch.float16, torch.bfloat16) and head_dim in _MAX_CAPACITY


def serves(dtype: torch.dtype, head_dim: int, max_q_len: int, group: int) -> bool:
    """Whether the kernel serves a step of these layers with up to ``max_q_len`` new tokens
    per request and ``group`` q heads per kv head."""
    return serves_layers(dtype, head_dim) and 1 <= max_q_len * group <= MAX_ROWS


def max_capacity(head_dim: int) -> int:
    """Most keys one CTA stages at once (the kernel's ``Limits<D>::kMaxCapacity``)."""
    return _MAX_CAPACITY[head_dim]


def resident_capacity(head_dim: int) -> int:
    """Most cached keys (positions before a request's first new token) the resident kernel
    holds in one CTA's registers (``attnplug_resident_attend_capacity``)."""
    return _RESIDENT_CAPACITY[head_dim]


@functools.lru_cache(maxsize=4096)
def _plan(num_reqs, num_kv_heads, head_dim, max_q_len, max_kv_len, window, num_sms) -> tuple:
    # the resident kernel: every request's cached keys fit one CTA's registers
    cached = max(1, max_kv_len) - 1
    if window is not None:
        cached = min(cached, window - 1)
    if cached <= resident_capacity(head_dim):
        return (("splits", 1), ("capacity", resident_capacity(head_dim)), ("resident", 1))
    span = max(1, max_kv_len)
    if window is not None:
        span = min(span, max(1, max_q_len) + window - 1)
    groups = max(1, num_reqs * num_kv_heads)
    most = max_capacity(head_dim)
    # as few splits as hold the span in one pass each, while the grid stays one CTA per SM
    splits = max(1, min(-(-span // most), num_sms // groups))
    share = -(-span // splits)
    share = -(-share // 16) * 16  # the kernel cuts splits in whole 16-key steps
    capacity = min(most, -(-share // CAPACITY_STEP) * CAPACITY_STEP)
    return (("splits", splits), ("capacity", capacity), ("resident", 0))


def plan_staged_attend(
    *,
    num_reqs: int,
    num_kv_heads: int,
    head_dim: int,
    max_q_len: int,
    max_kv_len: int,
    window: Optional[int],
    num_sms: int,
) -> dict:
    """The launch's plan from host ints only: the resident kernel (``resident`` 1, one CTA a
    group, ``capacity`` its register capacity) wherever every request's cached keys fit by the
    host bounds; else the staged kernel's KV splits per group and the keys a CTA stages at once
    (``capacity``): as few splits as let one CTA stage its whole share in one pass, within one
    CTA per SM; a share beyond the capacity runs in several passes."""
    return dict(_plan(num_reqs, num_kv_heads, head_dim, max_q_len, max_kv_len, window, num_sms))


def takes_layer(
    *,
    num_reqs: int,
    num_kv_heads: int,
    head_dim: int,
    max_q_len: int,
    max_kv_len: int,
    window: Optional[int],
    num_sms: int,
) -> bool:
    """Whether the backend runs a layer of this shape here with ``ATTNPLUG_ONE_LAUNCH=cpp``
    (module docstring): a layer the plan gives the resident kernel when the step has several
    new tokens a request and its groups cover half of ``FILL`` of ``num_sms``; any other
    layer when its CTAs (groups x splits) cover ``FILL`` of ``num_sms``."""
    plan = dict(_plan(num_reqs, num_kv_heads, head_dim, max_q_len, max_kv_len, window, num_sms))
    groups = num_reqs * num_kv_heads
    if plan["resident"]:
        return max_q_len > 1 and groups >= FILL * num_sms / 2
    return groups * plan["splits"] >= FILL * num_sms


def workspace_numel(programs: int, head_dim: int) -> int:
    """fp32 elements of the split workspace for ``programs`` CTAs (groups x splits): per CTA
    and row, m and l in fp32 and the partial output in 16 bits."""
    return programs * MAX_ROWS * (2 + head_dim // 2)


def staged_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    loc: Optional[torch.Tensor],
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    *,
    cu_q_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    table: torch.Tensor,
    table_rows: torch.Tensor,
    table_start: Optional[torch.Tensor] = None,
    max_q_len: int,
    max_kv_len: int,
    sm_scale: Optional[float] = None,
    window: Optional[int] = None,
    workspace: torch.Tensor,
    tickets: torch.Tensor,
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
    pdl: bool = False,
    prologue: bool = False,
    release_early: bool = False,
    config: Optional[dict] = None,
    trace: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Store ``k``/``v`` at ``loc`` (None: store nothing), attend ``q`` over the paged cache
    into ``out`` and return ``out``, in one launch; the arguments are ``store_attend``'s
    (``serves`` must hold). ``config`` overrides keys of the plan (``splits``, ``capacity``:
    tests, benchmarks). ``trace`` (int64, 8 per CTA) receives each CTA's phase stamps
    (``%globaltimer``; ``csrc/staged_attend.h`` names them), for ``benchmarks/layer_timeline.py``.
    Builds the plugin's C++ extension on first use (``cpp_ext.load_ext``, which raises
    ``CppExtensionUnavailable`` naming why it cannot)."""
    from .cpp_ext import load_ext
    from .kernels.paged_attention import check_attention_args, log2_scales
    from .kernels.store_attend import num_sms

    T, H, D, hkv, G, bs = check_attention_args(
        q,
        k_cache,
        v_cache,
        out,
        cu_q_lens=cu_q_lens,
        seq_lens=seq_lens,
        table=table,
        table_rows=table_rows,
        table_start=table_start,
        max_q_len=max_q_len,
        max_kv_len=max_kv_len,
        window=window,
        softcap=softcap,
        sinks=sinks,
    )
    assert serves(q.dtype, D, max_q_len, G), (
        f"staged_attend serves float16/bfloat16, head_dim 64/128 and max_q_len x group <= {MAX_ROWS}; "
        f"got {q.dtype}, head_dim {D}, max_q_len {max_q_len} x group {G}"
    )
    if T == 0 or bs == 0:
        return out
    qk_scale, softcap_log2 = log2_scales(sm_scale, softcap, D)
    plan = plan_staged_attend(
        num_reqs=bs,
        num_kv_heads=hkv,
        head_dim=D,
        max_q_len=max_q_len,
        max_kv_len=max_kv_len,
        window=window,
        num_sms=num_sms(q.device),
    )
    if config:
        plan.update(config)
    load_ext().staged_attend(
        q,
        k,
        v,
        loc,
        k_cache,
        v_cache,
        out,
        workspace,
        tickets,
        cu_q_lens,
        seq_lens,
        table,
        table_rows,
        table_start,
        sinks,
        qk_scale,
        softcap_log2,
        window if window is not None else 0,
        max_q_len,
        int(plan["splits"]),
        int(plan["capacity"]),
        pdl,
        pdl and prologue,
        pdl and release_early,
        bool(plan.get("resident", 0)),
        trace,
    )
    return out
