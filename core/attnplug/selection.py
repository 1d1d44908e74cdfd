"""Which backend class a command runs (``attnplug conformance``, ``soak``, ``bench``), and on
which device.

A backend is named either by its registry name (``reference``, ...: resolved with
``attnplug.registry``, so an unknown or unavailable name is an error that carries the reason
and the alternatives) or as ``module:Class`` for a class that is not registered yet (a plugin
under development). The device comes from, in order: an explicit device (``--attnplug-device``
/ ``attnplug conformance --device``), the registry probe's device description (its first word
when that is a torch device type, e.g. ``"xyz (2 visible)"`` -> ``xyz``), else the host.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Optional, Type

import torch

from .backend import AttentionBackend

__all__ = ["ResolvedBackend", "SelectionError", "resolve_backend", "device_from_text"]


class SelectionError(LookupError):
    """A requested backend cannot be run; the message names the reason and alternatives."""


@dataclass(frozen=True)
class ResolvedBackend:
    """A backend to run: ``spec`` as given, its class, the device, and where it came from."""

    spec: str
    cls: Type[AttentionBackend]
    device: torch.device
    target: str  # "module:Class"
    source: str  # "registry" or "class"
    distribution: Optional[str] = None
    version: Optional[str] = None
    probe_device: Optional[str] = None  # the registry probe's device description


def device_from_text(text: Optional[str]) -> torch.device:
    """A torch device from a probe's device description, else the host."""
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
        raise SelectionError(f"cannot import backend class {spec!r}: {type(exc).__name__}: {exc}") from exc
    if not (isinstance(obj, type) and issubclass(obj, AttentionBackend)):
        raise SelectionError(f"{spec!r} is {obj!r}, not a subclass of attnplug.backend.AttentionBackend")
    if inspect.isabstract(obj):
        missing = ", ".join(sorted(getattr(obj, "__abstractmethods__", ())))
        raise SelectionError(f"{spec!r} is abstract (does not implement: {missing})")
    return obj


def concrete_device(device) -> torch.device:
    """``device`` with its index filled in (``"xyz"`` -> ``xyz:0``, the current one), as
    tensors report it: the device the pools will live on, named as reports name it."""
    device = torch.device(device)
    if device.type != "cpu" and device.index is None:
        try:
            return torch.empty(0, device=device).device
        except Exception:  # unknown to this torch: let the pool raise its own error
            return device
    return device


def resolve_backend(spec: str, device=None) -> ResolvedBackend:
    """Resolve ``spec`` (registry name or ``module:Class``); raises ``SelectionError``."""
    if ":" in spec:
        cls = _import_class(spec)
        dev = concrete_device(device) if device else torch.device("cpu")
        return ResolvedBackend(spec, cls, dev, spec, "class")

    from . import registry

    reg = registry.get_registry()
    try:
        cls = reg.get_backend(spec)
    except registry.RegistryError as exc:
        raise SelectionError(str(exc)) from exc
    record = next(r for r in reg.records if r.name == spec)
    probe = reg.probe(spec)
    dev = concrete_device(device if device else device_from_text(probe.device))
    return ResolvedBackend(spec, cls, dev, record.target, "registry", record.distribution, record.version, probe.device)
