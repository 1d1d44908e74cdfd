"""``PagedOps``: store and attend over a paged KV cache the caller owns.

An engine that allocates its own KV memory (vLLM, SGLang, a new engine) needs the kernels
without attnplug's pools. Per step and cache group it calls ``plan`` once; per layer
``store_kv`` and ``attend``. Shapes (``T`` new tokens, ``B`` requests, ``H`` q heads, ``Hkv``
kv heads, ``D`` head dim, ``P`` block size, ``N`` blocks, ``S = N * P`` slots):

=================  ==========================  ============================================
tensor             shape / dtype               meaning
=================  ==========================  ============================================
key_cache,         [N, P, Hkv, D] or           slot ``s`` is block ``s // P``, offset
value_cache        [S, Hkv, D]; q's dtype,     ``s % P``; last dim contiguous, one slot
                   or an FP8 dtype
                                               stride, head stride free (the K and V
                                               halves of vLLM's interleaved cache)
slot_mapping       [>= T'] int32/int64         where new token ``t`` is stored: a slot in
                                               ``[1, S)``; anything else (vLLM's -1
                                               padding, 0) is skipped
query, out         [T, H, D]                   rows ``query_start_loc[b] ..
                                               query_start_loc[b + 1]`` are request ``b``'s
query_start_loc    [B + 1] int32               exclusive prefix sum of new tokens
seq_lens           [B] int32/int64             KV length of each request INCLUDING its new
                                               tokens
block_table        [B, M] int32/int64          request ``b``'s key ``j`` is in block
                                               ``block_table[b, j // P]``
=================  ==========================  ============================================

Semantics (the same as the pool-level backends, docs/contract.md): new token ``i`` of request
``b`` sits at position ``p = seq_lens[b] - q_len_b + i`` and attends to keys ``lo <= j <= p``,
``lo = max(0, p - W + 1)`` under a window ``W``, else 0; q head ``h`` uses kv head
``h // (H / Hkv)``; logits ``scale * q.k``, soft-capped to ``c * tanh(s / c)``; ``sinks``
(float32 ``[H]``) join each head's softmax denominator only. Slot 0 is never a key: an engine
keeps it (or its whole block 0, as vLLM's null block) out of every request, so a block table's
padding (0, or negative) reads nothing. A request with no key outputs zeros.

An FP8 cache (``float8_e4m3fn`` / ``float8_e5m2``, where the ops list it in
``fp8_kv_dtypes``) takes ``k_scale`` / ``v_scale`` on ``store_kv`` and ``attend``: float32
device tensors of one element (the layer's, vLLM's ``layer._k_scale``) or ``[Hkv]`` (per
head). ``store_kv`` quantises key / value (q's dtype) by ``attnplug.memory.fp8``'s rule
(saturating, round to nearest even); ``attend`` is attention over the dequantised cache. The
scales are read on the device only; an unquantised cache ignores them.

``plan`` does the per-step work once for every layer of the group, on the device and without
a host read: the slot of every key position (``slot_table``). Its host arguments
(``max_query_len``, ``max_seq_len``) are bounds an engine already has on the host.
"""

from __future__ import annotations

import abc
import math
import operator
from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["OpsInputError", "PagedOps", "PagedStep", "flat_cache"]


class OpsInputError(ValueError):
    """An op's argument does not fit the op layer's contract (names the argument and what it
    must be); raised before anything is written."""


@dataclass(frozen=True)
class PagedStep:
    """One step of one cache group, as ``PagedOps.plan`` built it (device tensors, host ints):
    ``query_start_loc`` [B + 1] int32, ``seq_lens`` [B] as given.

    ``slot_table`` [B, W] int32: the slot of key position ``j < W`` of request ``b`` (0 past
    ``seq_lens[b]`` and for a negative block); ``W`` covers ``max_seq_len``.
    ``token_req`` / ``token_idx`` [T] int64 (the request of each new token and its index among
    the request's tokens) and ``q_start`` [B] int64 (the position of each request's first new
    token) are filled by ops that need them (``PortableOps``), else None.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    slot_table: torch.Tensor
    num_tokens: int
    max_query_len: int
    max_seq_len: int
    token_req: Optional[torch.Tensor] = None
    token_idx: Optional[torch.Tensor] = None
    q_start: Optional[torch.Tensor] = None

    @property
    def num_reqs(self) -> int:
        return int(self.seq_lens.shape[0])


def _concrete(device: torch.device) -> torch.device:
    """``device`` as tensors on it report it: an accelerator without an index gets the current
    one (an engine may name ``"xyz"`` while its tensors say ``xyz:0``)."""
    if device.type == "cpu" or device.index is not None:
        return device
    return torch.empty(0, device=device).device


def _fail(message: str) -> None:
    raise OpsInputError(message)


def _check_int_tensor(t, name: str, dims: int, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        _fail(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dtype not in (torch.int32, torch.int64):
        _fail(f"{name} must be int32 or int64, got {t.dtype}")
    if t.dim() != dims:
        _fail(f"{name} must have {dims} dimension(s), got shape {tuple(t.shape)}")
    if t.device != device:
        _fail(f"{name} is on {t.device}, the step's tensors on {device}")


def _check_host_int(value, name: str, minimum: int) -> int:
    if isinstance(value, bool):
        _fail(f"{name} must be an integer, got {value!r}")
    try:
        value = operator.index(value)  # numpy integers are integers; floats are not
    except TypeError:
        _fail(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        _fail(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def flat_cache(cache, name: str) -> torch.Tensor:
    """``cache`` as a ``[S, Hkv, D]`` view with a contiguous last dim: ``[N, P, Hkv, D]``
    flattens its blocks, which needs one slot stride (``stride(0) == P * stride(1)``); slot and
    head strides are otherwise free (the K or V half of an interleaved cache)."""
    if not isinstance(cache, torch.Tensor):
        _fail(f"{name} must be a tensor, got {type(cache).__name__}")
    if cache.dim() == 4:
        if cache.shape[0] > 1 and cache.shape[1] > 1 and cache.stride(0) != cache.shape[1] * cache.stride(1):
            _fail(
                f"{name}'s blocks and offsets need one slot stride (stride(0) == block_size * stride(1)), got "
                f"shape {tuple(cache.shape)} strides {cache.stride()}"
            )
        cache = cache.flatten(0, 1)
    if cache.dim() != 3:
        _fail(f"{name} must be [num_blocks, block_size, Hkv, D] or [num_slots, Hkv, D], got {tuple(cache.shape)}")
    if cache.stride(2) != 1:
        _fail(f"{name} needs a contiguous last dim, got strides {cache.stride()}")
    return cache


class PagedOps(abc.ABC):
    """A backend's store and attend over caller-owned caches (module docstring).

    ``dtypes``: what q and the caches may be; a subclass sets it, and implements
    ``store_kv`` and ``attend`` (it may extend ``plan`` with what its kernels read per step).
    Every method refuses a bad argument with ``OpsInputError`` before writing anything.
    """

    #: the ops' name (the backend's registry name)
    name: str = "abstract"
    dtypes = (torch.float16, torch.bfloat16, torch.float32)
    #: the FP8 cache dtypes served (q, key and value then in one of ``dtypes``)
    fp8_kv_dtypes: tuple = ()

    def __init__(self, device) -> None:
        #: the ops' device, with its index (``"xyz"`` -> ``xyz:<current>``), as tensors report it
        self.device = _concrete(torch.device(device))

    # ------------------------------------------------------------------ per step
    def plan(
        self,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        block_size: int,
        *,
        num_tokens: int,
        max_query_len: int,
        max_seq_len: int,
    ) -> PagedStep:
        """The step of one cache group, for every layer of it: device ops only, no host read.

        ``num_tokens``: the step's new tokens (``query_start_loc[-1]``, known on the host);
        ``max_query_len`` / ``max_seq_len``: host bounds of a request's new tokens and keys.
        """
        dev = self.device
        _check_int_tensor(query_start_loc, "query_start_loc", 1, dev)
        _check_int_tensor(seq_lens, "seq_lens", 1, dev)
        _check_int_tensor(block_table, "block_table", 2, dev)
        block_size = _check_host_int(block_size, "block_size", 1)
        num_tokens = _check_host_int(num_tokens, "num_tokens", 0)
        max_query_len = _check_host_int(max_query_len, "max_query_len", 0)
        max_seq_len = _check_host_int(max_seq_len, "max_seq_len", 0)
        B = seq_lens.shape[0]
        if query_start_loc.shape[0] != B + 1:
            _fail(f"query_start_loc must be [{B + 1}] (seq_lens has {B} requests), got {tuple(query_start_loc.shape)}")
        if block_table.shape[0] < B:
            _fail(f"block_table has {block_table.shape[0]} rows for {B} requests")
        if max_query_len > max_seq_len:
            _fail(f"max_query_len={max_query_len} exceeds max_seq_len={max_seq_len}")
        width = min(block_table.shape[1] * block_size, max_seq_len)
        cols = torch.arange(width, device=dev)
        blocks = block_table[:B, cols // block_size].long()
        slots = blocks * block_size + cols % block_size
        live = (blocks >= 0) & (cols[None, :] < seq_lens[:, None])
        slot_table = torch.where(live, slots, 0).to(torch.int32)
        return PagedStep(
            query_start_loc=query_start_loc.to(torch.int32),  # once a step (a no-op when int32), not per layer
            seq_lens=seq_lens,
            slot_table=slot_table,
            num_tokens=num_tokens,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
        )

    # ------------------------------------------------------------------ per layer
    @abc.abstractmethod
    def store_kv(self, key, value, key_cache, value_cache, slot_mapping, *, k_scale=None, v_scale=None) -> None:
        """``key_cache[slot_mapping[t]] = key[t]`` and the same for values, for every
        ``t < len(slot_mapping)`` whose slot is in ``[1, S)``; ``key`` / ``value`` are
        ``[>= len(slot_mapping), Hkv, D]`` in the cache's dtype (an FP8 cache: in one of
        ``dtypes``, quantised with ``k_scale`` / ``v_scale``)."""

    @abc.abstractmethod
    def attend(
        self,
        query,
        key_cache,
        value_cache,
        step: PagedStep,
        *,
        scale: float,
        window: Optional[int] = None,
        softcap: Optional[float] = None,
        sinks: Optional[torch.Tensor] = None,
        out: Optional[torch.Tensor] = None,
        k_scale: Optional[torch.Tensor] = None,
        v_scale: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Attention of ``query`` ``[step.num_tokens, H, D]`` over the caches as ``step``
        describes them (an FP8 cache: dequantised with ``k_scale`` / ``v_scale``), written into
        ``out`` (allocated when None) and returned."""

    # ------------------------------------------------------------------ shared checks
    def check_scales(self, k_scale, v_scale, cache: torch.Tensor):
        """``(k_scale, v_scale)`` as float32 ``[Hkv]`` views (an FP8 ``cache``: both required,
        each float32 with 1 or ``Hkv`` elements on the cache's device; read on the device
        only), or ``(None, None)`` for an unquantised cache (whatever was given)."""
        from ..memory.fp8 import is_fp8

        if not is_fp8(cache.dtype):
            return None, None
        hkv = cache.shape[1]
        views = []
        for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
            if not isinstance(t, torch.Tensor):
                _fail(f"{name}: an FP8 cache ({cache.dtype}) needs a float32 scale tensor, got {type(t).__name__}")
            if t.dtype != torch.float32 or t.numel() not in (1, hkv):
                _fail(
                    f"{name} must be float32 with 1 or {hkv} (one per kv head) elements, got {t.dtype} {tuple(t.shape)}"
                )
            if t.device != cache.device:
                _fail(f"{name} is on {t.device}, the cache on {cache.device}")
            views.append(t.reshape(-1).expand(hkv))
        return views[0], views[1]

    def _check_cache_dtype(self, cache: torch.Tensor, model_dtype: torch.dtype, what: str) -> None:
        """The cache's dtype is served, and ``model_dtype`` (q's or key's) fits it."""
        if cache.dtype in self.fp8_kv_dtypes:
            if model_dtype not in self.dtypes:
                _fail(
                    f"{what} is {model_dtype}: over an FP8 cache it must be one of the {self.name} ops' "
                    f"dtypes {self.dtypes}"
                )
            return
        if cache.dtype not in self.dtypes:
            _fail(
                f"cache dtype {cache.dtype} is not one of the {self.name} ops' dtypes {self.dtypes}"
                + (f" or FP8 dtypes {self.fp8_kv_dtypes}" if self.fp8_kv_dtypes else "")
            )
        if model_dtype != cache.dtype:
            _fail(f"{what} is {model_dtype}, the cache is {cache.dtype}")

    def check_store(self, key, value, key_cache, value_cache, slot_mapping):
        """The checks of ``store_kv``; returns the flat caches and the token count."""
        kc, vc = flat_cache(key_cache, "key_cache"), flat_cache(value_cache, "value_cache")
        if kc.shape != vc.shape:
            _fail(f"value_cache {tuple(vc.shape)} differs from key_cache {tuple(kc.shape)}")
        _check_int_tensor(slot_mapping, "slot_mapping", 1, kc.device)
        n = slot_mapping.shape[0]
        for name, t in (("key", key), ("value", value)):
            if not isinstance(t, torch.Tensor) or t.dim() != 3 or t.shape[1:] != kc.shape[1:]:
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                _fail(f"{name} must be [T, {kc.shape[1]}, {kc.shape[2]}] like the cache's rows, got {shape}")
            if t.shape[0] < n:
                _fail(f"{name} has {t.shape[0]} rows for {n} slots in slot_mapping")
            self._check_cache_dtype(kc, t.dtype, name)
            if t.dtype != key.dtype:
                _fail(f"value is {t.dtype}, key is {key.dtype}")
            if t.device != kc.device:
                _fail(f"{name} is on {t.device}, the cache on {kc.device}")
        if vc.dtype != kc.dtype or vc.device != kc.device:
            _fail(f"value_cache ({vc.dtype}, {vc.device}) differs from key_cache ({kc.dtype}, {kc.device})")
        return kc, vc, n

    def check_attend(self, query, key_cache, value_cache, step, scale, window, softcap, sinks, out):
        """The checks of ``attend``; returns the flat caches and the output tensor."""
        kc, vc = flat_cache(key_cache, "key_cache"), flat_cache(value_cache, "value_cache")
        if kc.shape != vc.shape or kc.dtype != vc.dtype:
            _fail(f"value_cache {tuple(vc.shape)} {vc.dtype} differs from key_cache {tuple(kc.shape)} {kc.dtype}")
        if not isinstance(step, PagedStep):
            _fail(f"step must be the PagedStep plan() returned, got {type(step).__name__}")
        hkv, d = kc.shape[1], kc.shape[2]
        if not isinstance(query, torch.Tensor) or query.dim() != 3 or query.shape[2] != d:
            shape = tuple(query.shape) if isinstance(query, torch.Tensor) else type(query).__name__
            _fail(f"query must be [T, H, {d}], got {shape}")
        T, H = query.shape[0], query.shape[1]
        if T != step.num_tokens:
            _fail(f"query has {T} rows, the step {step.num_tokens} new tokens")
        if H % hkv:
            _fail(f"query heads ({H}) must be a multiple of the cache's kv heads ({hkv})")
        self._check_cache_dtype(kc, query.dtype, "query")
        for name, t in (("query", query), ("key_cache", kc), ("value_cache", vc), ("step.seq_lens", step.seq_lens)):
            if t.device != self.device:
                _fail(f"{name} is on {t.device}, the {self.name} ops on {self.device}")
        if query.stride(2) != 1:
            _fail(f"query must have a contiguous last dim, got strides {query.stride()}")
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
            _fail(f"scale must be a finite float > 0, got {scale!r}")
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            _fail(f"window must be None or an int >= 1, got {window!r}")
        if softcap is not None and (
            isinstance(softcap, bool)
            or not isinstance(softcap, (int, float))
            or not math.isfinite(softcap)
            or softcap <= 0
        ):
            _fail(f"softcap must be None or a finite float > 0, got {softcap!r}")
        if sinks is not None:
            if not isinstance(sinks, torch.Tensor) or sinks.shape != (H,) or sinks.dtype != torch.float32:
                _fail(f"sinks must be float32 [{H}], got {getattr(sinks, 'dtype', type(sinks).__name__)} "
                      f"{tuple(getattr(sinks, 'shape', ()))}")  # fmt: skip
            if sinks.device != self.device:
                _fail(f"sinks is on {sinks.device}, the {self.name} ops on {self.device}")
        if out is None:
            out = torch.empty_like(query)
        elif (
            not isinstance(out, torch.Tensor)
            or out.shape != query.shape
            or out.dtype != query.dtype
            or out.device != query.device
            or out.stride(2) != 1
        ):
            _fail(f"out must be like query ({tuple(query.shape)}, {query.dtype}, last dim contiguous)")
        return kc, vc, out
