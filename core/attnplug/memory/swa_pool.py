"""The hybrid KV cache: a full pool for full-attention layers and a smaller SWA pool for
sliding-window layers, plus the device mapping from full slots to SWA slots.

Every token gets a full-pool slot (``out_cache_loc``). While a token can still be attended
to by a sliding-window layer it also owns an SWA-pool slot, found through
``full_to_swa_index_mapping``; once it falls out of every future query's window the
allocator frees the SWA slot and sets the mapping entry to 0.

Slot values (both pools; ``P = page_size``, ``S`` = ``size`` or ``size_swa``):

* ``[P, S + P)``: usable slots, live only while the allocator has handed them out;
* ``0`` (page 0, ``[0, P)``): the padding sink. Never handed out; padded tokens of a captured
  graph write their KV there, so its content is unspecified and is never read as a key;
* ``-1``: "no slot". The token's KV is not kept. The mapping translates -1 to -1, and
  ``set_kv_buffer`` never writes it: on host tensors the token is skipped, on an accelerator
  (where skipping would need a host read) it is redirected to the sink. The allocator never
  hands out -1 and refuses it wherever a slot is expected (``free``, ``free_swa``);
  ``last_loc = -1`` means "empty prefix".
* anything else is out of range: refused with ``KVSlotError`` on host tensors; on an
  accelerator ``translate_loc_from_full_to_swa`` turns it into -1 and ``set_kv_buffer``
  redirects it to the sink, so no device op ever indexes outside a pool. Set
  ``ATTNPLUG_VALIDATE=1`` to have batches checked (with a host read) before they get here.

The KV dtype (``dtype``, what the buffers store) is float16, bfloat16, float32 or float64, or
an FP8 dtype (``float8_e4m3fn``, ``float8_e5m2``: ``attnplug.memory.fp8``). An FP8 pool keeps a
float32 scale per layer and KV head for K and for V (``k_scale`` / ``v_scale``, 1.0 until
``set_kv_scales``) and quantises what it is given (any floating k/v) by the one rule of
``fp8.quantize_kv``: saturating, round to nearest even. Integer, bool and complex pools are
refused.

This class owns the tensors only; ``SWATokenAllocator`` decides which slots are live.
Nothing here reads device values on the host.
"""

from __future__ import annotations

from typing import FrozenSet, Iterable, List, Optional, Tuple

import torch

from .args import first, host_int, index_dtype_problem
from .errors import KVSlotError
from .fp8 import FP8_KV_DTYPES, host_scales, is_fp8, quantize_kv

__all__ = ["SWAKVPool", "KV_DTYPES", "MODEL_DTYPES"]

#: the dtypes of the k / v a pool is given (an unquantised pool stores them as they are)
MODEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: the KV dtypes a pool accepts (a backend serves those its capabilities declare)
KV_DTYPES = MODEL_DTYPES + FP8_KV_DTYPES


def _values_on_host(t: torch.Tensor) -> bool:
    """Whether ``t``'s values can be read without a device sync (a CPU tensor)."""
    return t.device.type == "cpu"


class SWAKVPool:
    """KV buffers of every layer and the full -> SWA slot mapping.

    Fields (host unless said otherwise):

    * ``size`` / ``size_swa``: usable slots of the full / SWA pool (multiples of
      ``page_size``); ``page_size``: slots per page.
    * ``num_layers``, ``swa_layer_ids`` (frozenset of layer ids using the SWA pool),
      ``num_kv_heads``, ``head_dim``, ``dtype`` (what the buffers store), ``device``.
    * ``k_scale`` / ``v_scale``: FP8 pools only (else None): float32
      ``[num_layers, num_kv_heads]``, device; row ``layer_id`` holds that layer's per-head
      scales (``set_kv_scales``; 1.0 until then).
    * ``k_buffer[layer_id]`` / ``v_buffer[layer_id]``: device tensors of ``dtype``,
      ``[size + page_size, num_kv_heads, head_dim]`` for full layers and
      ``[size_swa + page_size, num_kv_heads, head_dim]`` for SWA layers (page 0 reserved).
    * ``full_to_swa_index_mapping``: ``[size + page_size + 1]`` int32, device; entry ``f``
      is the SWA slot of full slot ``f`` (0 = none), the last entry is -1.
    """

    def __init__(
        self,
        size: int,
        size_swa: int,
        num_layers: int,
        swa_layer_ids: Iterable[int],
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device,
        page_size: int = 1,
    ) -> None:
        page_size, num_layers, num_kv_heads, head_dim = (
            host_int(value, name, lo=1, error=ValueError)
            for name, value in (
                ("page_size", page_size),
                ("num_layers", num_layers),
                ("num_kv_heads", num_kv_heads),
                ("head_dim", head_dim),
            )
        )
        size, size_swa = (host_int(v, name, error=ValueError) for name, v in (("size", size), ("size_swa", size_swa)))
        for name, value in (("size", size), ("size_swa", size_swa)):
            if value < 1 or value % page_size:
                raise ValueError(f"{name} must be a positive multiple of page_size={page_size}, got {value!r}")
        swa_layer_ids = list(swa_layer_ids)
        ok = []
        for i in swa_layer_ids:
            try:
                ok.append(host_int(i, "swa_layer_ids entry", lo=0, hi=num_layers - 1, error=ValueError))
            except ValueError:
                raise ValueError(
                    f"swa_layer_ids {swa_layer_ids} are not layer ids (ints in [0, {num_layers}))"
                ) from None
        swa_layer_ids = frozenset(ok)
        if dtype not in KV_DTYPES:
            raise ValueError(f"dtype must be one of {[str(d) for d in KV_DTYPES]} (a floating KV dtype), got {dtype!r}")

        self.size = size
        self.size_swa = size_swa
        self.page_size = page_size
        self.num_layers = num_layers
        self.swa_layer_ids: FrozenSet[int] = swa_layer_ids
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)

        self.k_buffer: List[torch.Tensor] = []
        self.v_buffer: List[torch.Tensor] = []
        for layer_id in range(num_layers):
            shape = (self.num_slots(layer_id), num_kv_heads, head_dim)
            self.k_buffer.append(torch.zeros(shape, dtype=dtype, device=self.device))
            self.v_buffer.append(torch.zeros(shape, dtype=dtype, device=self.device))

        #: FP8 pools: the per-layer, per-head K / V scales (float32 [num_layers, num_kv_heads])
        self.k_scale: Optional[torch.Tensor] = None
        self.v_scale: Optional[torch.Tensor] = None
        if is_fp8(dtype):
            self.k_scale = torch.ones(num_layers, num_kv_heads, dtype=torch.float32, device=self.device)
            self.v_scale = torch.ones(num_layers, num_kv_heads, dtype=torch.float32, device=self.device)

        self.full_to_swa_index_mapping = torch.zeros(size + page_size + 1, dtype=torch.int32, device=self.device)
        self.full_to_swa_index_mapping[-1] = -1
        # The concrete device the tensors live on ("cuda" becomes "cuda:0"), so that device
        # comparisons between the pools and with tensors are exact.
        self.device = self.full_to_swa_index_mapping.device

    # ------------------------------------------------------------------ layers
    def is_swa_layer(self, layer_id: int) -> bool:
        """Whether ``layer_id`` keeps its KV in the SWA pool."""
        self._check_layer(layer_id)
        return layer_id in self.swa_layer_ids

    def num_slots(self, layer_id: int) -> int:
        """Rows of ``layer_id``'s KV buffers: usable slots + the reserved page 0."""
        pool_size = self.size_swa if self.is_swa_layer(layer_id) else self.size
        return pool_size + self.page_size

    def get_kv_buffer(self, layer_id: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(k, v)`` of ``layer_id``, each ``[num_slots(layer_id), num_kv_heads, head_dim]``."""
        self._check_layer(layer_id)
        return self.k_buffer[layer_id], self.v_buffer[layer_id]

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        """k of ``layer_id``: ``[num_slots(layer_id), num_kv_heads, head_dim]``, device."""
        return self.get_kv_buffer(layer_id)[0]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        """v of ``layer_id``: ``[num_slots(layer_id), num_kv_heads, head_dim]``, device."""
        return self.get_kv_buffer(layer_id)[1]

    # ------------------------------------------------------------------ FP8
    @property
    def is_fp8(self) -> bool:
        """Whether the buffers store an FP8 dtype (k / v are quantised when stored)."""
        return self.k_scale is not None

    def set_kv_scales(self, layer_id: int, k_scale, v_scale) -> None:
        """Set ``layer_id``'s K and V scales (FP8 pools): each one positive float for every head,
        or ``num_kv_heads`` of them (a sequence or a tensor, read on the host: call it at setup,
        before the layer's first store; ``fp8.host_scales`` says what is refused). Raises
        ``ValueError`` on an unquantised pool or a bad value, changing nothing."""
        self._check_layer(layer_id)
        if not self.is_fp8:
            raise ValueError(f"set_kv_scales: the pool stores {self.dtype}, not an FP8 dtype (no scales)")
        k = host_scales(k_scale, self.num_kv_heads, "k_scale")
        v = host_scales(v_scale, self.num_kv_heads, "v_scale")
        self.k_scale[layer_id].copy_(k)
        self.v_scale[layer_id].copy_(v)

    def quantize(self, layer_id: int, k: torch.Tensor, v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """What ``layer_id``'s buffers would hold for ``k`` / ``v`` ``[n, num_kv_heads, head_dim]``:
        an FP8 pool quantises them with the layer's scales (``fp8.quantize_kv``; already FP8:
        as given); an unquantised pool returns them as they are. Device ops only."""
        if not self.is_fp8 or (k.dtype == self.dtype and v.dtype == self.dtype):
            return k, v
        return (
            quantize_kv(k, self.k_scale[layer_id], self.dtype),
            quantize_kv(v, self.v_scale[layer_id], self.dtype),
        )

    def kv_scales(self, layer_id: int) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """``(k_scale, v_scale)`` of ``layer_id``: float32 ``[num_kv_heads]`` device views (FP8
        pools), ``(None, None)`` otherwise."""
        self._check_layer(layer_id)
        if not self.is_fp8:
            return None, None
        return self.k_scale[layer_id], self.v_scale[layer_id]

    # ------------------------------------------------------------------ hot path
    def translate_loc_from_full_to_swa(self, loc: torch.Tensor) -> torch.Tensor:
        """SWA slots of the full slots ``loc`` (any shape, int32/int64, device): a device
        gather returning int32 of ``loc``'s shape; 0 where no SWA slot is live, -1 for -1 and
        for any value outside ``[-1, size + page_size)`` (never an out-of-bounds read).
        No host sync. Call it once per step (metadata preparation), never per layer.
        ``loc`` on another device, a meta tensor or another dtype raises ``KVSlotError``."""
        mapping = self.full_to_swa_index_mapping
        self._check_index_tensor(loc, "loc", "translate_loc_from_full_to_swa")
        safe = torch.where((loc >= -1) & (loc < mapping.shape[0] - 1), loc, -1)
        return mapping[safe]

    def set_kv_buffer(
        self,
        layer_id: int,
        loc: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        swa_loc: Optional[torch.Tensor] = None,
    ) -> None:
        """Store the KV of ``n`` new tokens of ``layer_id``.

        ``loc``: ``[n]`` full slots (int32/int64, device); ``k``, ``v``:
        ``[n, num_kv_heads, head_dim]`` of the pool's dtype, device (an FP8 pool also takes one of
        ``MODEL_DTYPES``, both the same, and quantises them with the layer's scales:
        ``quantize``);
        ``swa_loc``: ``[n]`` SWA
        slots (int32/int64, device), REQUIRED on SWA layers — the step's hoisted
        ``swa_out_cache_loc``; full layers write at ``loc`` and ignore it.

        Slot values (see the module docstring): ``-1`` ("no slot") is never written; any value
        outside ``[-1, num_slots(layer_id))`` is refused. Shapes and dtypes are always checked
        on the host (``KVSlotError`` naming the argument, nothing written). Slot VALUES are
        checked only where they already are on the host (CPU tensors: out-of-range values are
        refused, -1 entries skipped); device values are never read: -1 and out-of-range
        entries are redirected to the padding sink by a device ``where``, so nothing outside
        the layer's buffer or in a live slot other than the given ones is written.
        """
        is_swa = self.is_swa_layer(layer_id)
        if is_swa and swa_loc is None:
            raise KVSlotError(
                f"layer {layer_id} is an SWA layer: set_kv_buffer needs swa_loc, the step's hoisted "
                "swa_out_cache_loc (translated once per step); the pool never translates per layer"
            )
        for name, t in (("k", k), ("v", v), ("loc", loc), ("swa_loc", swa_loc)):
            if t is not None and not isinstance(t, torch.Tensor):
                raise KVSlotError(f"layer {layer_id}: {name} must be a tensor, got {type(t).__name__} {t!r}")
            if t is not None and t.device != self.device:
                raise KVSlotError(f"layer {layer_id}: {name} is on {t.device}, the pool on {self.device}")
        n = k.shape[0]
        expected = (n, self.num_kv_heads, self.head_dim)
        given = self.dtype
        if self.is_fp8 and k.dtype in MODEL_DTYPES:
            given = k.dtype
        for name, t in (("k", k), ("v", v)):
            if tuple(t.shape) != expected or t.dtype != given:
                what = str(self.dtype)
                if self.is_fp8:
                    what += f" or one of {[str(d) for d in MODEL_DTYPES]} (k and v the same)"
                raise KVSlotError(
                    f"layer {layer_id}: {name} must be {list(expected)} {what}, got {list(t.shape)} {t.dtype}"
                )
        for name, t in (("loc", loc), ("swa_loc", swa_loc)):
            if t is None:
                continue
            self._check_index_tensor(t, name, f"layer {layer_id}")
            if t.dim() != 1 or t.shape[0] != n:
                raise KVSlotError(f"layer {layer_id}: {name} must be [{n}] int32/int64, got {list(t.shape)} {t.dtype}")
        num_slots = self.num_slots(layer_id)
        checked = [("loc", loc, self.size + self.page_size)]
        if is_swa:
            checked.append(("swa_loc", swa_loc, num_slots))
        for name, t, limit in checked:
            if _values_on_host(t):
                bad = t[(t < -1) | (t >= limit)]
                if bad.numel():
                    raise KVSlotError(
                        f"layer {layer_id}: {name} holds slots {first(bad)} outside [-1, {limit}) "
                        "(-1 = no slot, never written; 0 = the padding sink)"
                    )
        index = swa_loc if is_swa else loc
        if _values_on_host(index):
            keep = index != -1
            if not bool(keep.all()):
                index, k, v = index[keep], k[keep], v[keep]
        else:
            index = torch.where((index >= 0) & (index < num_slots), index, 0)
        if self.is_fp8:  # written as bytes: every device indexes uint8, not every one float8
            k, v = (t.view(torch.uint8) for t in self.quantize(layer_id, k, v))
            self.k_buffer[layer_id].view(torch.uint8)[index] = k
            self.v_buffer[layer_id].view(torch.uint8)[index] = v
            return
        self.k_buffer[layer_id][index] = k
        self.v_buffer[layer_id][index] = v

    def _check_index_tensor(self, t, name: str, where: str) -> None:
        """``t`` is an int32/int64 tensor on the pool's device (host metadata only)."""
        if not isinstance(t, torch.Tensor):
            raise KVSlotError(f"{where}: {name} must be a tensor, got {type(t).__name__} {t!r}")
        problem = index_dtype_problem(t)
        if problem:
            raise KVSlotError(f"{where}: {name} {problem}")
        if t.device != self.device:
            raise KVSlotError(f"{where}: {name} is on {t.device}, the pool on {self.device}")

    def _check_layer(self, layer_id: int) -> None:
        host_int(layer_id, "layer_id", lo=0, hi=self.num_layers - 1)
