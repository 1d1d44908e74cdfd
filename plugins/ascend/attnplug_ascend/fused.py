"""How the ascend backend and its op layer call torch_npu's fused operators, in one place.

Both ``AscendBackend`` (over attnplug's pools) and ``AscendOps`` (over caches an engine owns)
call the same two operators the same way; what they share lives here:

* the operators' limits (``FIA_DTYPES``, head and GQA bounds) and ``operator_problems``, which
  names each one a configuration breaks;
* ``compressed_mask``: the 2048 x 2048 bool mask ``sparse_mode`` 3 and 4 take;
* ``layer_kwargs``: one TND paged call's keywords for a full layer (``sparse_mode=3``, causal
  aligned to the last key) or a window of ``W`` keys (``sparse_mode=4``, the band
  ``pre_tokens = W - 1``, ``next_tokens = 0``);
* ``store_skipping``: ``npu_scatter_pa_kv_cache`` with the tokens that must not be stored
  writing slot 0's own value back (the operator takes slots in ``[0, blocks * block_size)``
  only: no ``-1``, and no host read may decide which tokens to drop);
* ``is_capturing``: whether an NPU graph capture is running on the current stream.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import torch

from .ops import INT32_MAX, NpuOps

__all__ = [
    "FIA_DTYPES",
    "FIA_BLOCK_SIZES",
    "MAX_HEADS",
    "MAX_HEAD_DIM",
    "MAX_GQA_RATIO",
    "MAX_KV_HIDDEN",
    "MASK_SIZE",
    "operator_problems",
    "compressed_mask",
    "layer_kwargs",
    "store_skipping",
    "is_capturing",
]

#: KV dtypes the fused attention takes (query, key and value: float16 or bfloat16)
FIA_DTYPES = (torch.float16, torch.bfloat16)
#: paged attention with more than one query token a request: block_size a multiple of 128 in [128, 512]
FIA_BLOCK_SIZES = (128, 256, 384, 512)
#: limits of the fused attention: query heads, head dim, query heads per KV head
MAX_HEADS, MAX_HEAD_DIM, MAX_GQA_RATIO = 256, 512, 64
#: a paged cache viewed (blocknum, blocksize, H): H = Hkv * D at most this
MAX_KV_HIDDEN = 65535
#: the compressed mask ``sparse_mode`` 3 and 4 take: 2048 x 2048, True above the diagonal
MASK_SIZE = 2048


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def operator_problems(dtype: torch.dtype, head_dim: int, num_heads: int, num_kv_heads: int) -> List[str]:
    """What the fused attention cannot serve of this shape, one phrase per limit (empty: it
    can): the KV dtype, the head dim (a multiple of 16, at most 512), the query heads (at most
    256) and the GQA ratio (at most 64 query heads per KV head)."""
    problems = []
    if dtype not in FIA_DTYPES:
        problems.append(f"the KV dtype {_name(dtype)} (it takes {', '.join(_name(d) for d in FIA_DTYPES)})")
    if head_dim % 16 or head_dim > MAX_HEAD_DIM:
        problems.append(f"head_dim={head_dim} (a multiple of 16, at most {MAX_HEAD_DIM})")
    if num_heads > MAX_HEADS:
        problems.append(f"num_heads={num_heads} (at most {MAX_HEADS})")
    if num_kv_heads > 0 and num_heads // num_kv_heads > MAX_GQA_RATIO:
        problems.append(f"num_heads / num_kv_heads = {num_heads // num_kv_heads} (GQA: at most {MAX_GQA_RATIO})")
    return problems


def compressed_mask(device) -> torch.Tensor:
    """The ``[2048, 2048]`` bool mask of ``sparse_mode`` 3 and 4 (True above the diagonal) on
    ``device``; a caller keeps one (a captured graph reads it by address)."""
    ones = torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.bool, device=device)
    return torch.triu(ones, diagonal=1)


def layer_kwargs(
    npu: NpuOps,
    *,
    window: Optional[int],
    q_cum: Sequence[int],
    kv_lens: Sequence[int],
    block_table: torch.Tensor,
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    scale: float,
    mask: torch.Tensor,
) -> Dict[str, Any]:
    """One TND paged call's keywords (``NpuOps.attention_kwargs``): ``q_cum`` the cumulative
    new tokens (host ints), ``kv_lens`` each request's KV length in ``block_table`` (``[B, M]``
    int32; host ints), the query of row ``i`` aligned to the last key. ``window`` None: a full
    layer (``sparse_mode=3``); ``W``: the band of ``W`` keys ending at the query's own
    (``sparse_mode=4``, ``pre_tokens = W - 1``, ``next_tokens = 0``). No sinks (a layer adds
    its own: ``NpuOps.with_sinks``)."""
    if window is None:
        sparse_mode, pre_tokens = 3, INT32_MAX
    else:
        sparse_mode, pre_tokens = 4, min(int(window) - 1, INT32_MAX)
    return npu.attention_kwargs(
        q_cum=q_cum,
        kv_lens=kv_lens,
        block_table=block_table,
        block_size=block_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        scale=scale,
        sparse_mode=sparse_mode,
        pre_tokens=pre_tokens,
        next_tokens=0,
        atten_mask=mask,
        sinks=None,
    )


def store_skipping(
    npu: NpuOps,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    loc: torch.Tensor,
    keep: torch.Tensor,
) -> None:
    """``npu_scatter_pa_kv_cache`` of ``key`` / ``value`` ``[T, Hkv, D]`` (the caches' dtype)
    into contiguous ``[blocks, block_size, Hkv, D]`` caches at ``loc`` ``[T]`` (int32/int64, in
    ``[0, blocks * block_size)``). A token whose ``keep`` ``[T]`` (bool) is False must have
    ``loc`` 0: it writes slot 0's own value back, so nothing changes (every such token writes
    the same bytes). Device ops only: a graph may capture it."""
    keep = keep[:, None, None]
    k = torch.where(keep, key, key_cache[0, 0]).contiguous()
    v = torch.where(keep, value, value_cache[0, 0]).contiguous()
    npu.store_kv(k, v, key_cache, value_cache, loc)


def is_capturing(npu: NpuOps) -> bool:
    """Whether a graph capture is running on the current stream (False where the runtime
    cannot say)."""
    check = getattr(npu.runtime, "is_current_stream_capturing", None)
    return bool(check()) if check is not None else False
