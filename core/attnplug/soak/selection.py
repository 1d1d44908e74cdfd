"""Which backend class a soak runs, and on which device.

A backend is named by its registry name (``reference``, ...) or as ``module:Class`` (a class
not registered, e.g. a plugin under development). The device is, in order: the one given,
the registry probe's device description when its first word is a torch device type (e.g.
``"xyz (2 visible)"`` -> ``xyz``), else the host.
"""

from __future__ import annotations

import importlib
from typing import Optional, Tuple, Type

import torch

from ..backend import AttentionBackend

__all__ = ["resolve_backend", "SoakSelectionError"]


class SoakSelectionError(LookupError):
    """The requested backend cannot be run; the message says why."""


def _device_from_text(text: Optional[str]) -> torch.device:
    if text:
        word = text.split()[0].strip("(),;:")
        try:
            return torch.device(word)
        except (RuntimeError, ValueError):
            pass
    return torch.device("cpu")


def _import_class(spec: str) -> Type[AttentionBackend]:
    module_name, _, qualname = spec.partition(":")
    try:
        obj = importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except Exception as exc:
        raise SoakSelectionError(f"cannot import backend class {spec!r}: {type(exc).__name__}: {exc}") from exc
    if not (isinstance(obj, type) and issubclass(obj, AttentionBackend)):
        raise SoakSelectionError(f"{spec!r} is {obj!r}, not a subclass of attnplug.AttentionBackend")
    return obj


def resolve_backend(spec: str, device: Optional[str] = None) -> Tuple[Type[AttentionBackend], torch.device]:
    """``(backend class, device)`` for ``spec``; raises ``SoakSelectionError``."""
    if ":" in spec:
        return _import_class(spec), torch.device(device or "cpu")
    from .. import registry

    try:
        cls = registry.get_backend(spec)
    except registry.RegistryError as exc:
        raise SoakSelectionError(str(exc)) from exc
    if device:
        return cls, torch.device(device)
    info = next((i for i in registry.available_backends() if i.name == spec), None)
    return cls, _device_from_text(info.device if info is not None else None)
