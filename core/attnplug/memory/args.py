"""Strict argument checks shared by the KV-memory classes.

A slot, a length or a row is an integer: Python ``bool`` (an ``int`` subclass), floats,
strings and ``None`` are refused rather than coerced, so ``free([s + 0.7])`` cannot free slot
``s`` and ``free(True)`` cannot free row 1. Index tensors are int32 or int64: a uint8 or bool
tensor indexes as a mask in PyTorch and narrow integers wrap (slot 300 as uint8 is 44), so
they are refused, as are meta tensors (no values). Every message names the argument and the
value.
"""

from __future__ import annotations

import operator
from typing import Any, Optional, Sequence, Union

import torch

from .errors import KVSlotError

__all__ = ["HostInts", "INDEX_DTYPES", "host_int", "host_ints", "first", "index_dtype_problem"]

HostInts = Union[torch.Tensor, Sequence[int]]
_SHOWN = 8  # offending values named in an error message

#: the dtypes of slot, row and length tensors
INDEX_DTYPES = (torch.int32, torch.int64)


def index_dtype_problem(t: torch.Tensor) -> Optional[str]:
    """Why ``t`` cannot be a tensor of slots / rows / lengths (None: it can): a meta tensor,
    or a dtype other than int32 / int64. Reads no value."""
    if t.device.type == "meta":
        return "is a meta tensor (it has no values)"
    if t.dtype not in INDEX_DTYPES:
        if t.dtype in (torch.bool, torch.uint8):
            kind = "a mask when used as an index"
        elif t.dtype.is_floating_point or t.dtype.is_complex:
            kind = "not integers"
        else:
            kind = "a narrow integer type: values wrap"
        return f"must be int32 or int64, got {str(t.dtype).replace('torch.', '')} ({kind})"
    return None


def first(values: torch.Tensor) -> str:
    """The first few entries of a host tensor, for error messages."""
    flat = values.reshape(-1)
    shown = flat[:_SHOWN].tolist()
    more = f" (+{flat.numel() - _SHOWN} more)" if flat.numel() > _SHOWN else ""
    return f"{shown}{more}"


def host_int(
    value: Any, name: str, *, lo: Optional[int] = None, hi: Optional[int] = None, error: type = KVSlotError
) -> int:
    """``value`` as a Python int in ``[lo, hi]`` (bounds optional, inclusive), else ``error``
    naming ``name`` and the value. Accepts ints and integer scalars (``operator.index``), never
    ``bool``."""
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        raise error(f"{name} must be an int, got the bool {value!r}")
    if isinstance(value, torch.Tensor) and value.device.type == "meta":
        raise error(f"{name} must be an int, got a meta tensor (it has no value)")
    try:
        result = operator.index(value)
    except TypeError:
        raise error(f"{name} must be an int, got {value!r}") from None
    if (lo is not None and result < lo) or (hi is not None and result > hi):
        if hi is None:
            what = "a positive int" if lo == 1 else f"an int >= {lo}"
        else:
            what = f"an int in [{lo if lo is not None else '-inf'}, {hi}]"
        raise error(f"{name} must be {what}, got {result}")
    return result


def host_ints(values: HostInts, name: str) -> torch.Tensor:
    """``values`` (a tensor of any shape and device, a sequence, or a scalar int) as a flat
    int64 CPU tensor. A device tensor is copied to the host (a sync: call this between steps,
    never in graph replay). Raises ``KVSlotError`` naming ``name`` for bools, floats, complex
    numbers or anything that is not integers."""
    if isinstance(values, torch.Tensor):
        tensor = values
    else:
        if isinstance(values, bool) or (isinstance(values, (list, tuple)) and any(isinstance(v, bool) for v in values)):
            raise KVSlotError(f"{name} must hold integers, got a bool in {values!r}")
        try:
            tensor = torch.as_tensor(values)
        except (TypeError, ValueError, RuntimeError):
            raise KVSlotError(f"{name} must be integers (a sequence or a tensor), got {values!r}") from None
        if tensor.numel() == 0:
            return torch.zeros(0, dtype=torch.int64)
    if tensor.dtype == torch.bool:
        raise KVSlotError(f"{name} must hold integers, got a bool tensor")
    if tensor.device.type != "meta" and (tensor.dtype.is_floating_point or tensor.dtype.is_complex):
        shown = first(tensor.detach().to("cpu"))
        raise KVSlotError(f"{name} must hold integers, got {tensor.dtype} values {shown}")
    problem = index_dtype_problem(tensor)
    if problem:
        raise KVSlotError(f"{name} {problem}")
    return tensor.detach().to(device="cpu", dtype=torch.int64).reshape(-1)
