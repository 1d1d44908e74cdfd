"""Which backend class runs a model in an engine integration (transformers, vLLM, SGLang): a
class, a registry name, or the default — the same rules in every integration.

``backend=None`` takes the registry's default (``ATTNPLUG_BACKEND``, else the
highest-priority available backend: ``attnplug.registry``); when that backend serves another
device type than the model's, the highest-priority available backend that serves the model's
device is taken instead, so the same code runs a model on the host or on an accelerator.
A name (or ``module:Class``) is resolved by ``attnplug.selection.resolve_backend``.
"""

from __future__ import annotations

import inspect
from typing import Type, Union

import torch

from ..backend import AttentionBackend
from ..selection import SelectionError, resolve_backend

__all__ = ["BackendArg", "BackendChoiceError", "backend_class"]


class BackendChoiceError(ValueError):
    """No backend can run the model as asked; the message says why and what to do."""


BackendArg = Union[None, str, Type[AttentionBackend]]


def _device_type(cls: Type[AttentionBackend]) -> str:
    return getattr(cls.device_part, "device_type", "any")


def _serves(cls: Type[AttentionBackend], device: torch.device) -> bool:
    return cls.device_part.serves(device)


def _default_for(device: torch.device, error) -> Type[AttentionBackend]:
    from .. import registry as reg

    registry = reg.get_registry()
    _name, cls = registry.select()
    if _serves(cls, device):
        return cls
    infos = sorted((i for i in registry.available_backends() if i.available), key=lambda i: (-i.priority, i.name))
    for info in infos:
        candidate = registry.get_backend(info.name)
        if _serves(candidate, device):
            return candidate
    raise error(
        f"the default backend {cls.name!r} runs on {_device_type(cls)} and no available backend runs on "
        f"{device.type}, the model's device: move the model (model.to(...)) or name a backend"
    )


def backend_class(
    backend: BackendArg, device: torch.device, error: Type[Exception] = BackendChoiceError
) -> Type[AttentionBackend]:
    """The backend class for a model on ``device``; raises ``error`` (an integration's own
    error class) naming the reason (unknown or unavailable name, a class that is not a backend,
    another device)."""
    if backend is None:
        cls = _default_for(device, error)
    elif isinstance(backend, str):
        try:
            cls = resolve_backend(backend, device).cls
        except SelectionError as exc:
            raise error(f"backend {backend!r}: {exc}") from exc
    elif isinstance(backend, type) and issubclass(backend, AttentionBackend) and not inspect.isabstract(backend):
        cls = backend
    else:
        raise error(f"backend must be None, a registry name or a concrete AttentionBackend subclass, got {backend!r}")
    if not _serves(cls, device):
        raise error(
            f"backend {cls.name!r} runs on {_device_type(cls)}, the model is on {device}: move the model "
            "(model.to(...)) or choose another backend"
        )
    return cls
