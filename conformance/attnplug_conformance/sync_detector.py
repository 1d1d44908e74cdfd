"""A device-neutral detector of host-device synchronisation, for rule 2.

Rule 2 (docs/contract.md): when a backend declares ``needs_cpu_seq_lens = False``, its graph-replay
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

A second layer, ``_DispatchLayer`` (a ``TorchDispatchMode``), watches the ATen ops every call
turns into, including those made inside torch's own code and C++ argument parsing: a scalar
read (``aten._local_scalar_dense``, what ``torch.arange(t.max())``, ``torch.zeros(t.max())``,
``full((t.max(),), v)``, ``x[:t.max()]``, ``narrow(d, 0, t)`` and ``int(t)`` all become),
ops whose output size depends on values (``nonzero``, ``masked_select``, ``unique``,
``bincount`` — with or without ``minlength`` —, ``repeat_interleave`` without
``output_size``, boolean-mask ``index``), ``equal``, and copies from the device to the host.
Both layers run inside ``SyncDetector``; the device runtime's own guard is a third.

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
from torch.utils._python_dispatch import TorchDispatchMode

from .rules import RULE_2

__all__ = ["HostSyncError", "SyncDetector", "RULE", "dispatch_offence"]

#: the rule this detector guards, as it appears in every message
RULE = RULE_2

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


# ATen ops (overload packet names) that read device values on the host or size their output
# from device values.
_ATEN_SYNC = {
    "_local_scalar_dense": "reads a device value on the host (a scalar read: .item(), int(), or a tensor used "
    "as a size, bound or index such as arange(t.max()), zeros(t.max()), x[:t.max()], "
    "narrow(d, 0, t))",
    "nonzero": "has a data-dependent output size",
    "argwhere": "has a data-dependent output size",
    "masked_select": "has a data-dependent output size (boolean mask)",
    "_unique": "has a data-dependent output size",
    "_unique2": "has a data-dependent output size",
    "unique_dim": "has a data-dependent output size",
    "unique_consecutive": "has a data-dependent output size",
    "unique_dim_consecutive": "has a data-dependent output size",
    "bincount": "has a data-dependent output size (max of the input, even with minlength)",
    "equal": "returns a Python bool computed from device values",
    "is_nonzero": "reads a device value to decide a Python branch",
}
_ATEN_BOOL_INDEX = {"index", "index_put", "index_put_", "_index_put_impl", "_index_put_impl_"}


def dispatch_offence(
    func: Any, args: Sequence[Any], kwargs: Dict[str, Any], device: Optional[torch.device] = None
) -> Optional[str]:
    """Why an ATen op (``torch.ops.aten.*`` overload) syncs, or None when it does not."""
    packet = getattr(func, "overloadpacket", None)
    name = getattr(packet, "__name__", "") or str(func).split(".")[1 if str(func).startswith("aten.") else 0]
    if name in _ATEN_SYNC:
        return _ATEN_SYNC[name]
    if name == "repeat_interleave" and str(getattr(func, "_overloadname", "")) == "Tensor":
        if kwargs.get("output_size") is None and not (len(args) > 2 and args[2] is not None):
            return "with tensor repeats and no output_size has a data-dependent output size"
    if name in _ATEN_BOOL_INDEX:
        indices = args[1] if len(args) > 1 else kwargs.get("indices")
        if _has_bool_tensor(indices):
            return "indexes with a boolean mask (data-dependent size)"
    if name in ("_to_copy", "copy_", "to"):
        src = args[1] if name == "copy_" and len(args) > 1 else (args[0] if args else None)
        dst_device = None
        if name == "copy_" and args and _is_tensor(args[0]):
            dst_device = args[0].device
        elif kwargs.get("device") is not None:
            dst_device = torch.device(kwargs["device"])
        if _is_tensor(src) and dst_device is not None and dst_device.type == "cpu" and src.device.type != "cpu":
            return "copies a device tensor to the host"
    return None


class _DispatchLayer(TorchDispatchMode):
    """The ATen-level layer of ``SyncDetector`` (reports through it)."""

    def __init__(self, owner: "SyncDetector"):
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        why = None if self.owner._reported else dispatch_offence(func, args, kwargs, self.owner.device)
        if why is not None:
            self.owner.report(f"aten.{getattr(getattr(func, 'overloadpacket', None), '__name__', func)}", why)
        return func(*args, **kwargs)


class SyncDetector(TorchFunctionMode):
    """Raise ``HostSyncError`` on any torch call that reads the device from the host or
    builds a tensor from Python data (see the module docstring for the list).

    ``where``: what is being checked, named in the message (e.g. the method name).
    ``device``: the device under test; ``Tensor.to(<host>)`` counts as a sync when the
    tensor or this device is not the host. ``raise_on_violation=False`` only records.
    Every violation is kept in ``violations`` (a backend that swallows the exception is
    still caught).
    """

    def __init__(
        self,
        where: str = "graph-replay metadata",
        *,
        device=None,
        raise_on_violation: bool = True,
        dispatch: bool = True,
    ):
        super().__init__()
        self.where = where
        self.device = torch.device(device) if device is not None else None
        self.raise_on_violation = raise_on_violation
        self.violations: List[str] = []
        self._dispatch = _DispatchLayer(self) if dispatch else None
        self._reported = 0

    def __enter__(self):
        result = super().__enter__()
        if self._dispatch is not None:
            self._dispatch.__enter__()
        return result

    def __exit__(self, *exc):
        if self._dispatch is not None:
            self._dispatch.__exit__(*exc)
        return super().__exit__(*exc)

    def report(self, op: str, why: str) -> None:
        """Record (and, unless ``raise_on_violation=False``, raise) one violation."""
        message = f"{RULE}: {op}() in {self.where}{_caller()} {why}"
        self.violations.append(message)
        if self.raise_on_violation:
            raise HostSyncError(message)

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
                return (
                    "builds a tensor from Python data (a host -> device copy); "
                    "use torch.full / torch.arange or device ops"
                )
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
        if why is None:
            return func(*args, **kwargs)
        self.report(_op_name(func), why)
        self._reported += 1  # the ATen ops of this call are the same violation: not reported twice
        try:
            return func(*args, **kwargs)
        finally:
            self._reported -= 1


def _caller() -> str:
    """`` at file:line (function)`` of the innermost frame outside torch and this module."""
    torch_dir = os.path.normcase(os.path.dirname(os.path.abspath(torch.__file__)))
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = os.path.normcase(os.path.abspath(frame.filename))
        if path == _THIS_FILE or path.startswith(torch_dir):
            continue
        return f" at {os.path.basename(frame.filename)}:{frame.lineno} ({frame.name})"
    return ""
