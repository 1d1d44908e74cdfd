"""The hybrid KV cache: a full pool for full-attention layers and a smaller SWA pool for
sliding-window layers, plus the device mapping from full slots to SWA slots.

Every token gets a full-pool slot (``out_cache_loc``). While a token can still be attended
to by a sliding-window layer it also owns an SWA-pool slot, found through
``full_to_swa_index_mapping``; once it falls out of every future query's window the
allocator frees the SWA slot and sets the mapping entry to 0.

Slot 0 of both pools (page 0 when ``page_size > 1``) is never handed out: padded tokens
write their KV there. The mapping has one extra entry at the end holding -1, so that a
full slot of -1 (SGLang's "no slot") translates to -1.

This class owns the tensors only; ``SWATokenAllocator`` decides which slots are live.
Nothing here reads device values on the host.
"""

from __future__ import annotations

from typing import FrozenSet, Iterable, List, Optional, Tuple

import torch

__all__ = ["SWAKVPool"]


class SWAKVPool:
    """KV buffers of every layer and the full -> SWA slot mapping.

    Fields (host unless said otherwise):

    * ``size`` / ``size_swa``: usable slots of the full / SWA pool (multiples of
      ``page_size``); ``page_size``: slots per page.
    * ``num_layers``, ``swa_layer_ids`` (frozenset of layer ids using the SWA pool),
      ``num_kv_heads``, ``head_dim``, ``dtype``, ``device``.
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
        for name, value in (("page_size", page_size), ("num_layers", num_layers),
                            ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name, value in (("size", size), ("size_swa", size_swa)):
            if not isinstance(value, int) or value < 1 or value % page_size:
                raise ValueError(f"{name} must be a positive multiple of page_size={page_size}, got {value!r}")
        swa_layer_ids = frozenset(swa_layer_ids)
        bad = sorted(i for i in swa_layer_ids if not (isinstance(i, int) and 0 <= i < num_layers))
        if bad:
            raise ValueError(f"swa_layer_ids {bad} are not layer ids in [0, {num_layers})")
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"dtype must be a torch.dtype, got {dtype!r}")

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

    # ------------------------------------------------------------------ hot path
    def translate_loc_from_full_to_swa(self, loc: torch.Tensor) -> torch.Tensor:
        """SWA slots of the full slots ``loc`` (any shape, int32/int64, device): a device
        gather returning int32 of ``loc``'s shape; 0 where no SWA slot is live, -1 for -1.
        No host sync. Call it once per step (metadata preparation), never per layer."""
        return self.full_to_swa_index_mapping[loc]

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
        ``[n, num_kv_heads, head_dim]`` of the pool's dtype, device; ``swa_loc``: ``[n]`` SWA
        slots (int32/int64, device), REQUIRED on SWA layers — the step's hoisted
        ``swa_out_cache_loc``; full layers write at ``loc`` and ignore it. Shapes and dtypes
        are checked on the host; device values are never read.
        """
        is_swa = self.is_swa_layer(layer_id)
        if is_swa and swa_loc is None:
            raise ValueError(
                f"layer {layer_id} is an SWA layer: set_kv_buffer needs swa_loc, the step's hoisted "
                "swa_out_cache_loc (translated once per step); the pool never translates per layer"
            )
        n = k.shape[0]
        expected = (n, self.num_kv_heads, self.head_dim)
        for name, t in (("k", k), ("v", v)):
            if tuple(t.shape) != expected or t.dtype != self.dtype:
                raise ValueError(
                    f"layer {layer_id}: {name} must be {list(expected)} {self.dtype}, got {list(t.shape)} {t.dtype}"
                )
        index = swa_loc if is_swa else loc
        for name, t in (("loc", loc), ("swa_loc", swa_loc)):
            if t is not None and (t.dim() != 1 or t.shape[0] != n or t.dtype not in (torch.int32, torch.int64)):
                raise ValueError(
                    f"layer {layer_id}: {name} must be [{n}] int32/int64, got {list(t.shape)} {t.dtype}"
                )
        self.k_buffer[layer_id][index] = k
        self.v_buffer[layer_id][index] = v

    def _check_layer(self, layer_id: int) -> None:
        if not isinstance(layer_id, int) or not 0 <= layer_id < self.num_layers:
            raise ValueError(f"layer_id {layer_id!r} is outside [0, {self.num_layers})")
