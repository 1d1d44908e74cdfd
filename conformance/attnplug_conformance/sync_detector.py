"""A device-neutral detector of host-device synchronisation, for rule 2.

Rule 2 (DESIGN.md): when a backend declares ``needs_cpu_seq_lens = False``, its graph-replay
metadata (``init_forward_metadata_replay_cuda_graph``) is built from device tensors with
device-side ops only. On an accelerator, reading a device value from the host (``.item()``,
``.tolist()``, ``.cpu()``, ``bool(tensor)``, ``nonzero``, boolean-mask indexing, ...) blocks
the host until the device catches up, and building a tensor from Python data
(``torch.tensor(list, device=...)``) is a host -> device copy of pageable memory. Both stall
the replay path that graphs exist to make fast.

``SyncDetector`` is a ``torch.overrides.TorchFunctionMode``: every torch call made while it is
active passes through it, whatever the device, so the same check runs on the host (where
nothing would actually stall) and on any accelerator. The runtime's own strict guard (for
example a "sync debug mode" of the device runtime) is supplied separately by the backend
class through ``AttentionBackend.sync_guard()``; the suite runs both.

It reports the op, the rule and the first caller outside torch (file:line):

    rule 2 (no host-device sync in graph-replay metadata): Tensor.item() in
    init_forward_metadata_replay_cuda_graph at my_backend.py:120 ...

Only calls made directly by the code under test are seen: torch runs a handler with the mode
disabled, so ops that torch's own Python code performs inside an allowed op are not reported.
"""

from __future__ import annotations

import os
import traceback
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["HostSyncError", "SyncDetector", "RULE"]

#: the rule this detector guards, as it appears in every message
RULE = "rule 2 (no host-device sync in graph-replay metadata)"

# Reads of device values into Python objects: always a sync on an accelerator.
_HOST_READS = {
    "item": "reads a device value into a Python number",
    "tolist": "copies a device tensor into a Python list",
    "cpu": "copies a tensor to the host",
    "numpy": "copies a tensor to a host numpy array",
    "__array__": "copies a tensor to a host numpy array",
    "__bool__": "reads a device value to decide a Python branch",
    "__int__": "reads a device value into a Python int",
    "__float__": "reads a device value into a Python float",
    "__complex__": "reads a device value into a Python complex",
    "__index__": "reads a device value to use it as a Python index",
    "__repr__": "formats a tensor on the host (reads its values)",
    "__str__": "formats a tensor on the host (reads its values)",
    "__format__": "formats a tensor on the host (reads its values)",
    "equal": "returns a Python bool computed from device values",
    "allclose": "returns a Python bool computed from device values",
}
# Ops whose output SIZE depends on device values: the host waits to learn it.
_DATA_DEPENDENT_SHAPE = {
    "nonzero": "has a data-dependent output size",
    "nonzero_static": None,  # fixed size: allowed
    "argwhere": "has a data-dependent output size",
    "masked_select": "has a data-dependent output size (boolean mask)",
    "unique": "has a data-dependent output size",
    "unique_consecutive": "has a data-dependent output size",
}
_FROM_PYTHON = {"tensor", "as_tensor", "asarray"}
_INDEXING = {"__getitem__", "__setitem__", "index_put", "index_put_", "_index_put_impl_"}
_THIS_FILE = os.path.normcase(os.path.abspath(__file__))


class HostSyncError(RuntimeError):
    """Raised by ``SyncDetector`` at the offending op; the message names the rule and the op."""


def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def _has_bool_tensor(index: Any) -> bool:
    if _is_tensor(index):
        return index.dtype in (torch.bool, torch.uint8)
    if isinstance(index, (tuple, list)):
        return any(_has_bool_tensor(i) for i in index)
    return False


def _device_arg(args: Sequence[Any], kwargs: Dict[str, Any]) -> Optional[torch.device]:
    """Target device of ``Tensor.to(...)`` (positional device/str/tensor or ``device=``)."""
    candidates = list(args[1:2]) + [kwargs.get("device"), kwargs.get("other")]
    for c in candidates:
        if isinstance(c, torch.device):
            return c
        if isinstance(c, str):
            try:
                return torch.device(c)
            except RuntimeError:
                return None
        if isinstance(c, int) and not isinstance(c, bool):
            return None  # a device ordinal: an accelerator, not the host
        if _is_tensor(c):
            return c.device
    return None


def _op_name(func: Any) -> str:
    name = getattr(func, "__name__", None) or str(func)
    qual = getattr(func, "__qualname__", "") or ""
    owner = qual.split(".")[0] if "." in qual else ""
    if owner in ("TensorBase", "Tensor", "_TensorBase"):
        return f"Tensor.{name}"
    if name == "__get__":
        return "Tensor attribute"
    return f"torch.{name}"


class SyncDetector(TorchFunctionMode):
    """Raise ``HostSyncError`` on any torch call that reads the device from the host or
    builds a tensor from Python data (see the module docstring for the list).

    ``where``: what is being checked, named in the message (e.g. the method name).
    ``device``: the device under test; ``Tensor.to(<host>)`` counts as a sync when the
    tensor or this device is not the host. ``raise_on_violation=False`` only records.
    Every violation is kept in ``violations`` (a backend that swallows the exception is
    still caught).
    """

    def __init__(self, where: str = "graph-replay metadata", *, device=None, raise_on_violation: bool = True):
        super().__init__()
        self.where = where
        self.device = torch.device(device) if device is not None else None
        self.raise_on_violation = raise_on_violation
        self.violations: List[str] = []

    # ------------------------------------------------------------------ classification
    def offence(self, func: Any, args: Sequence[Any], kwargs: Dict[str, Any]) -> Optional[str]:
        """Why this call syncs (a phrase), or None when it is allowed."""
        name = getattr(func, "__name__", "")
        if name in _HOST_READS:
            return _HOST_READS[name]
        if name in _DATA_DEPENDENT_SHAPE:
            return _DATA_DEPENDENT_SHAPE[name]
        if name == "where" and len(args) + len(kwargs) == 1:
            return "with only a condition is nonzero (data-dependent output size)"
        if name == "repeat_interleave" and "output_size" not in kwargs:
            repeats = kwargs.get("repeats", args[1] if len(args) > 1 else None)
            if _is_tensor(repeats) or (len(args) == 1 and not kwargs and _is_tensor(args[0])):
                return "with tensor repeats and no output_size has a data-dependent output size"
        if name in _FROM_PYTHON:
            data = args[0] if args else kwargs.get("data", kwargs.get("obj"))
            if not _is_tensor(data):
                return "builds a tensor from Python data (a host -> device copy); use torch.full / torch.arange or device ops"
        if name in _INDEXING:
            index = args[1] if len(args) > 1 else kwargs.get("indices")
            if _has_bool_tensor(index):
                return "indexes with a boolean mask (data-dependent size)"
        if name == "to" and args and _is_tensor(args[0]):
            target = _device_arg(args, kwargs)
            if target is not None and target.type == "cpu":
                src = args[0].device
                if src.type != "cpu" or (self.device is not None and self.device.type != "cpu"):
                    return "copies a tensor to the host"
        if name == "copy_" and len(args) > 1 and _is_tensor(args[0]) and _is_tensor(args[1]):
            if args[0].device.type == "cpu" and args[1].device.type != "cpu":
                return "copies a device tensor into a host tensor"
        return None

    # ------------------------------------------------------------------ the mode
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        why = self.offence(func, args, kwargs)
        if why is not None:
            message = f"{RULE}: {_op_name(func)}() in {self.where}{_caller()} {why}"
            self.violations.append(message)
            if self.raise_on_violation:
                raise HostSyncError(message)
        return func(*args, **kwargs)


def _caller() -> str:
    """`` at file:line (function)`` of the innermost frame outside torch and this module."""
    torch_dir = os.path.normcase(os.path.dirname(os.path.abspath(torch.__file__)))
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = os.path.normcase(os.path.abspath(frame.filename))
        if path == _THIS_FILE or path.startswith(torch_dir):
            continue
        return f" at {os.path.basename(frame.filename)}:{frame.lineno} ({frame.name})"
    return ""
