"""Plugin registry: discovery through the entry-point group ``attnplug.backends``, loading by
pluggy (project name ``attnplug``, one hook ``attnplug_register_backends``), and backend
selection. Importing this package discovers nothing; the registry is built on first use.

Public API (also reachable lazily from ``attnplug``):

* ``available_backends() -> list[BackendInfo]``, ``get_backend(name=None) -> type``,
  ``load_errors() -> list[PluginError]``;
* ``hookimpl`` (for plugin authors), ``PLUGIN_API_VERSION``, ``ProbeResult``;
* errors ``RegistryError`` > ``BackendNotFound`` / ``BackendUnavailable`` / ``AmbiguousBackend``;
* for tests and tools: ``load_registry(...)``, ``get_registry()``, ``reset_registry()``.

Plugin code cannot break selection (``containment``): failures are recorded; every piece of
plugin code (import, hook, probe, backend class import, ``describe()``) runs under
``$ATTNPLUG_PROBE_TIMEOUT`` seconds; the probes, trial class imports and ``describe()`` of
third-party plugins run in a child process (``sandbox``), so none can end, hang or reconfigure
the selecting process; what plugin code changed is undone or ignored and listed
(``PluginNote``); registry calls from plugin code raise ``RegistryError``. The attnplug
distribution's own backend names cannot be taken by another distribution (``discovery``).
"""

from ..env import DEFAULT_PROBE_TIMEOUT
from .hookspecs import AttnplugHookspecs, hookimpl, hookspec
from .records import (
    AmbiguousBackend,
    BackendInfo,
    BackendNotFound,
    BackendRecord,
    BackendUnavailable,
    PluginError,
    PluginNote,
    ProbeResult,
    RegistryError,
)
from .registry import (
    ENTRY_POINT_GROUP,
    PLUGIN_API_VERSION,
    Registry,
    available_backends,
    discover_entry_points,
    get_backend,
    get_registry,
    load_errors,
    load_registry,
    reset_registry,
)

__all__ = [
    "AmbiguousBackend",
    "AttnplugHookspecs",
    "BackendInfo",
    "BackendNotFound",
    "BackendRecord",
    "BackendUnavailable",
    "DEFAULT_PROBE_TIMEOUT",
    "ENTRY_POINT_GROUP",
    "PLUGIN_API_VERSION",
    "PluginError",
    "PluginNote",
    "ProbeResult",
    "Registry",
    "RegistryError",
    "available_backends",
    "discover_entry_points",
    "get_backend",
    "get_registry",
    "hookimpl",
    "hookspec",
    "load_errors",
    "load_registry",
    "reset_registry",
]
