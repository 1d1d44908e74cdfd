"""Bit-exact snapshots of every piece of KV-memory state, for "a refused call changes nothing".

``snapshot(*objects)`` walks the instance attributes of the given objects (an
``SWATokenAllocator``, its ``SWAKVPool``, a ``ReqToTokenPool``, ...) and of the objects they
hold (the allocator's free lists), copying every tensor as raw bytes (so NaN compares equal to
NaN and -0.0 differs from 0.0) and every list / int / tuple by value. New fields are picked up
automatically: nothing is listed by hand. ``assert_same(before, after)`` names the first
field that differs.
"""

from __future__ import annotations

from typing import Any, Dict, Set

import torch

_ATOMS = (int, float, bool, str, type(None), torch.dtype, torch.device)


def _freeze(value: Any, seen: Set[int]) -> Any:
    if isinstance(value, torch.Tensor):
        host = value.detach().to("cpu").contiguous().reshape(-1)
        return ("tensor", value.dtype, tuple(value.shape), host.view(torch.uint8).clone() if host.numel() else None)
    if isinstance(value, _ATOMS):
        return value
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [_freeze(v, seen) for v in value])
    if isinstance(value, (set, frozenset)):
        return ("set", sorted(value, key=repr))
    if isinstance(value, dict):
        return ("dict", {k: _freeze(v, seen) for k, v in value.items()})
    if hasattr(value, "__dict__"):
        if id(value) in seen:  # a back reference (the allocator's pool): snapshotted once
            return ("ref", type(value).__name__)
        seen.add(id(value))
        return ("object", type(value).__name__, {k: _freeze(v, seen) for k, v in sorted(vars(value).items())})
    raise TypeError(f"snapshot cannot copy a {type(value).__name__}")


def snapshot(*objects: Any) -> Dict[str, Any]:
    """Deep, bit-exact copy of the state of ``objects`` (see the module docstring)."""
    seen: Set[int] = set()
    return {f"{i}:{type(o).__name__}": _freeze(o, seen) for i, o in enumerate(objects)}


def _diff(a: Any, b: Any, path: str) -> str:
    if isinstance(a, tuple) and isinstance(b, tuple) and a and b and a[0] == b[0] == "tensor":
        if a[1:3] != b[1:3]:
            return f"{path}: {a[1]} {list(a[2])} became {b[1]} {list(b[2])}"
        if (a[3] is None) != (b[3] is None) or (a[3] is not None and not torch.equal(a[3], b[3])):
            return f"{path}: tensor values changed"
        return ""
    if isinstance(a, tuple) and isinstance(b, tuple) and a and b and a[0] == b[0] == "object":
        for key in sorted(set(a[2]) | set(b[2])):
            if key not in a[2] or key not in b[2]:
                return f"{path}.{key}: field appeared or vanished"
            found = _diff(a[2][key], b[2][key], f"{path}.{key}")
            if found:
                return found
        return ""
    if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b) == 2 and a[0] == b[0] in ("list", "tuple"):
        if len(a[1]) != len(b[1]):
            return f"{path}: length {len(a[1])} became {len(b[1])}"
        for i, (x, y) in enumerate(zip(a[1], b[1])):
            found = _diff(x, y, f"{path}[{i}]")
            if found:
                return found
        return ""
    return "" if a == b else f"{path}: {a!r} became {b!r}"


def assert_same(before: Dict[str, Any], after: Dict[str, Any]) -> None:
    """Raise ``AssertionError`` naming the first field whose value differs."""
    for key in before:
        found = _diff(before[key], after[key], key)
        assert not found, f"state changed: {found}"
