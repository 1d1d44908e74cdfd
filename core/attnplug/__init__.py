"""attnplug: one attention-backend interface for hybrid full + sliding-window KV caches.

The contract (``AttentionBackend``, ``ForwardBatch``), the KV memory (``SWAKVPool``,
``SWATokenAllocator``, ``ReqToTokenPool``) and the graph runner are imported eagerly; the
registry (``get_backend``, ``available_backends``, ``hookimpl``) is resolved lazily, so
``import attnplug`` loads no plugin and touches no device.
"""

from importlib import import_module as _import_module

from .backend import AttentionBackend, BackendConfigError, Capabilities, GraphSupport, decide_needs_cpu_seq_lens
from .batch import BatchError, ForwardBatch, ForwardMode
from .graphs import DeviceGraph, EagerGraph, GraphRunner
from .memory import *  # noqa: F403 - the KV memory's whole API: pools, allocator, errors
from .memory import __all__ as _MEMORY_API

__version__ = "0.1.0"

_LAZY = {
    "get_backend": "attnplug.registry",
    "available_backends": "attnplug.registry",
    "PLUGIN_API_VERSION": "attnplug.registry",
    "hookimpl": "attnplug.registry",
    "load_errors": "attnplug.registry",
    "reset_registry": "attnplug.registry",
    "BackendInfo": "attnplug.registry",
    "ProbeResult": "attnplug.registry",
    "RegistryError": "attnplug.registry",
    "BackendNotFound": "attnplug.registry",
    "BackendUnavailable": "attnplug.registry",
    "AmbiguousBackend": "attnplug.registry",
}


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'attnplug' has no attribute {name!r}")
    return getattr(_import_module(module), name)


__all__ = [
    "AttentionBackend",
    "BackendConfigError",
    "BatchError",
    "Capabilities",
    "DeviceGraph",
    "EagerGraph",
    "ForwardBatch",
    "ForwardMode",
    "GraphRunner",
    "GraphSupport",
    "decide_needs_cpu_seq_lens",
    *_MEMORY_API,
    *_LAZY,
]
