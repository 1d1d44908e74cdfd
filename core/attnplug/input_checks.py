"""The input checks of the backend contract, host-side unless validation is on
(``ATTNPLUG_VALIDATE=1``):

* construction: ``check_config`` (the pools, ``num_heads``, ``sliding_window``),
  ``check_kv_buffer_size`` (a layer buffer past ``2**31 - 1`` elements needs
  ``Capabilities.large_kv_buffers``) and ``check_positive_float`` (``scaling``,
  ``logit_softcap``), raising ``BackendConfigError``;
* each step: ``InputChecks``, the helpers every backend calls (a part of ``AttentionBackend``):
  ``check_batch`` against the pools, the batch ``forward`` gets against the one the last
  metadata call prepared, and one layer's q/k/v and ``sinks`` (``check_forward_inputs``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Optional

import torch

from .batch import BatchError, ForwardBatch

if TYPE_CHECKING:  # pragma: no cover
    from .capabilities import Capabilities
    from .memory import ReqToTokenPool, SWAKVPool

__all__ = [
    "BackendConfigError",
    "InputChecks",
    "INT32_MAX_ELEMENTS",
    "check_config",
    "check_kv_buffer_size",
    "check_kv_cache_dtype",
    "largest_kv_buffer_elements",
    "check_positive_float",
]

#: the most elements a layer KV buffer may have for a backend that does not declare
#: ``Capabilities.large_kv_buffers`` (offsets up to it fit a signed 32-bit integer)
INT32_MAX_ELEMENTS = 2**31 - 1


class BackendConfigError(ValueError):
    """A backend was constructed with arguments it cannot serve (names the argument)."""


def check_config(
    pool: "SWAKVPool", req_to_token_pool: "ReqToTokenPool", *, num_heads: Any, sliding_window: Any
) -> None:
    """The common constructor arguments fit each other and the pools, else ``BackendConfigError``."""
    if not isinstance(num_heads, int) or num_heads < 1:
        raise BackendConfigError(f"num_heads must be a positive int, got {num_heads!r}")
    if num_heads % pool.num_kv_heads:
        raise BackendConfigError(
            f"num_heads={num_heads} is not a multiple of the pool's num_kv_heads={pool.num_kv_heads} (GQA)"
        )
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise BackendConfigError(f"sliding_window must be None or an int >= 1, got {sliding_window!r}")
    if pool.swa_layer_ids and sliding_window is None:
        raise BackendConfigError(f"the pool has SWA layers {sorted(pool.swa_layer_ids)} but sliding_window is None")
    if not (isinstance(pool.dtype, torch.dtype) and pool.dtype.is_floating_point):
        raise BackendConfigError(f"the KV pool's dtype must be a floating dtype, got {pool.dtype}")
    if req_to_token_pool.req_to_token.device != pool.device:
        raise BackendConfigError(
            f"req_to_token_pool is on {req_to_token_pool.req_to_token.device}, the KV pool on {pool.device}"
        )


def largest_kv_buffer_elements(pool: "SWAKVPool") -> int:
    """Elements of the pool's largest layer KV buffer (host int, read from the pool's shapes, never
    its values): ``max over layers of num_slots(layer) * num_kv_heads * head_dim``."""
    rows = max((pool.num_slots(layer) for layer in range(pool.num_layers)), default=0)
    return rows * pool.num_kv_heads * pool.head_dim


def check_kv_buffer_size(pool: "SWAKVPool", declared: Optional["Capabilities"], backend: str) -> None:
    """A backend whose class does not declare ``large_kv_buffers`` (or declares nothing) refuses
    a pool whose largest layer buffer has more than ``INT32_MAX_ELEMENTS`` elements: its kernels
    may compute offsets in 32 bits, which wrap past it. Raises ``BackendConfigError`` naming the
    element count and the capability. Host arithmetic on the pool's shapes only."""
    if declared is not None and declared.large_kv_buffers:
        return
    elements = largest_kv_buffer_elements(pool)
    if elements > INT32_MAX_ELEMENTS:
        rows = elements // (pool.num_kv_heads * pool.head_dim)
        raise BackendConfigError(
            f"the pool's largest layer KV buffer has {elements} elements ({rows} slots x "
            f"{pool.num_kv_heads} KV heads x head_dim {pool.head_dim}), more than 2**31 - 1 = "
            f"{INT32_MAX_ELEMENTS}: the {backend} backend does not declare large_kv_buffers (64-bit "
            "offsets into a layer buffer); use a smaller pool or a backend that declares it"
        )


def check_kv_cache_dtype(pool: "SWAKVPool", declared: Optional["Capabilities"], backend: str) -> None:
    """An FP8 pool needs a backend class that lists its dtype in ``fp8_kv_dtypes``, else
    ``BackendConfigError`` naming the dtype and what the backend serves."""
    from .memory.fp8 import is_fp8

    if not is_fp8(pool.dtype):
        return
    served = tuple(declared.fp8_kv_dtypes) if declared is not None else ()
    if pool.dtype not in served:
        names = ", ".join(str(d).replace("torch.", "") for d in served) or "none"
        raise BackendConfigError(
            f"the KV pool stores {str(pool.dtype).replace('torch.', '')}: the {backend} backend does not serve "
            f"that FP8 KV cache (its capabilities declare fp8_kv_dtypes: {names})"
        )


def check_positive_float(value: Any, name: str) -> None:
    """``value`` is a finite int or float > 0 (not a bool), else ``BackendConfigError``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise BackendConfigError(f"{name} must be None or a finite float > 0, got {value!r}")


class InputChecks:
    """The per-step input checks of ``AttentionBackend`` (its ``pool``, ``req_to_token_pool``,
    ``device``, ``num_heads``, ``num_kv_heads``, ``head_dim``; see the module docstring)."""

    _prepared_batch: Optional[ForwardBatch]  # set by AttentionBackend.__init__

    def check_batch(self, batch: ForwardBatch, *, read_device: Optional[bool] = None) -> None:
        """Refuse a batch that does not fit this backend's pools (``BatchError`` naming the
        request, field and value): device, slot ranges, live rows, ``seq_lens`` bounds, and the
        step's consistency with ``req_to_token`` and the pools (``batch_consistency``). Values on the
        host are always checked; device values only when ``read_device`` (default:
        ``validation_enabled()``), because reading them synchronises.
        Call it from the metadata methods; replay calls it only when validation is on."""
        from .batch_checks import check_batch_against_pools
        from .env import validation_enabled

        if read_device is None:
            read_device = validation_enabled()
        check_batch_against_pools(
            batch, self.pool, self.req_to_token_pool, read_device=read_device, window=self.sliding_window
        )

    def _note_prepared_batch(self, batch: ForwardBatch) -> None:
        """Record the batch the last metadata call prepared (``forward`` checks it)."""
        self._prepared_batch = batch

    def _check_prepared_batch(self, batch: ForwardBatch) -> None:
        """``batch`` must be the one the last metadata call prepared: the same object, or a
        batch over the very same tensors (e.g. a copy that only adds ``seq_lens_cpu``)."""
        prepared = self._prepared_batch
        if batch is prepared:
            return
        if prepared is None:
            raise RuntimeError("forward() before init_forward_metadata() for this step")
        if not isinstance(batch, ForwardBatch) or _batch_identity(batch) != _batch_identity(prepared):
            raise BatchError(
                "forward() got a batch other than the one prepared by the last metadata call "
                "(init_forward_metadata / init_forward_metadata_*_cuda_graph): call the metadata "
                "method for this batch first; the old metadata is never reused for another batch"
            )

    def check_forward_inputs(
        self, q, k, v, batch: ForwardBatch, save_kv_cache: bool = True, *, sinks: Optional[torch.Tensor] = None
    ) -> None:
        """Host-side checks of one layer's inputs: the prepared batch, q/k/v shapes, dtypes
        (q, k and v in the pool's dtype; over an FP8 pool, all three in one dtype the
        capabilities declare) and devices, and ``sinks`` (None, or a
        float32 ``[num_heads]`` tensor on the pool's device, only when the backend declares
        ``attention_sinks``). Raises ``ValueError`` / ``BatchError`` naming the argument.
        Reads no device value."""
        if sinks is not None:
            self._check_sinks(sinks)
        self._check_prepared_batch(batch)
        T = batch.num_tokens
        model_dtype = self.pool.dtype
        if self.pool.is_fp8 and isinstance(q, torch.Tensor):  # an FP8 pool: q's dtype, a declared one
            model_dtype = q.dtype
            served = getattr(self, "_model_dtypes", ())
            if model_dtype not in served:
                raise ValueError(
                    f"q is {str(q.dtype).replace('torch.', '')}: over an FP8 KV cache q, k and v must be one of "
                    f"the backend's dtypes ({', '.join(str(d).replace('torch.', '') for d in served)})"
                )
        expected = {"q": (T, self.num_heads, self.head_dim)}
        if save_kv_cache or k is not None or v is not None:
            expected["k"] = expected["v"] = (T, self.num_kv_heads, self.head_dim)
        for name, t in (("q", q), ("k", k), ("v", v)):
            if name not in expected:
                continue
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if tuple(t.shape) != expected[name]:
                raise ValueError(f"{name} must be {list(expected[name])}, got {tuple(t.shape)}")
            if t.dtype != model_dtype:
                held = str(self.pool.dtype).replace("torch.", "")
                raise ValueError(
                    f"{name} is {str(t.dtype).replace('torch.', '')}, "
                    + (
                        f"q is {str(model_dtype).replace('torch.', '')} "
                        f"(over the {held} KV cache q, k and v share a dtype)"
                        if model_dtype != self.pool.dtype
                        else f"the KV pool holds {held} (q, k and v must match it)"
                    )
                )
            if t.device != self.device:
                raise ValueError(f"{name} is on {t.device}, the KV pool on {self.device}")

    def _check_sinks(self, sinks) -> None:
        if not getattr(self, "_accepts_sinks", False):
            raise ValueError(
                f"sinks: the {type(self).name} backend does not support attention sinks (its capabilities "
                "declare attention_sinks=False); pass sinks=None"
            )
        if not isinstance(sinks, torch.Tensor):
            raise ValueError(f"sinks must be None or a torch.Tensor, got {type(sinks).__name__}")
        if tuple(sinks.shape) != (self.num_heads,):
            raise ValueError(f"sinks must be [{self.num_heads}] (one logit per q head), got {tuple(sinks.shape)}")
        if sinks.dtype != torch.float32:
            raise ValueError(f"sinks must be float32, got {str(sinks.dtype).replace('torch.', '')}")
        if sinks.device != self.device:
            raise ValueError(f"sinks is on {sinks.device}, the KV pool on {self.device}")


def _batch_identity(batch: ForwardBatch) -> tuple:
    """What a step's metadata was built from: the mode, the sizes and the tensors (by storage)."""
    return (
        batch.forward_mode,
        batch.batch_size,
        batch.num_tokens,
        batch.num_draft_tokens,
        *(
            (t.data_ptr(), t.shape[0]) if isinstance(t, torch.Tensor) else None
            for t in (batch.req_pool_indices, batch.seq_lens, batch.out_cache_loc, batch.extend_seq_lens)
        ),
    )
