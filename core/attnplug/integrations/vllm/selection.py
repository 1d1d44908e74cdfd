"""Which attnplug backend serves vLLM in this process (a leaf: the backend class, the builder and
the impl all read it): ``ATTNPLUG_BACKEND``, else the highest-priority available backend that
serves vLLM's device (``attnplug.integrations.choice``, the rules of every integration)."""

from __future__ import annotations

import functools
from typing import Optional, Tuple, Type

import torch

from ...backend import AttentionBackend
from ...capabilities import Capabilities
from ..choice import backend_class

__all__ = ["attnplug_class"]


@functools.lru_cache(maxsize=None)
def _chosen(device_type: str) -> Tuple[Type[AttentionBackend], Capabilities]:
    cls = backend_class(None, torch.device(device_type))
    caps = cls.installed_capabilities()
    if caps is None:
        raise ValueError(f"the attnplug backend {cls.name!r} declares no capabilities: vLLM cannot validate it")
    return cls, caps


def attnplug_class(device_type: Optional[str] = None) -> Tuple[Type[AttentionBackend], Capabilities]:
    """The attnplug backend class that serves vLLM's device in this process, and its
    capabilities (``ATTNPLUG_BACKEND``, else the default for the device)."""
    if device_type is None:
        from vllm.platforms import current_platform

        device_type = current_platform.device_type or "cpu"
    return _chosen(device_type)
