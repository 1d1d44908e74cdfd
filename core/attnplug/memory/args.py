"""Strict argument checks shared by the KV-memory classes.

A slot, a length or a row is an integer: Python ``bool`` (an ``int`` subclass), floats,
strings and ``None`` are refused rather than coerced, so ``free([s + 0.7])`` cannot free slot
``s`` and ``free(True)`` cannot free row 1. Every message names the argument and the value.
"""

from __future__ import annotations

import operator
from typing import Any, Optional, Sequence, Union

import torch

from .errors import KVSlotError

__all__ = ["HostInts", "host_int", "host_ints", "first"]

HostInts = Union[torch.Tensor, Sequence[int]]
_SHOWN = 8  # offending values named in an error message


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
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
        shown = first(tensor.detach().to("cpu"))
        raise KVSlotError(f"{name} must hold integers, got {tensor.dtype} values {shown}")
    return tensor.detach().to(device="cpu", dtype=torch.int64).reshape(-1)
