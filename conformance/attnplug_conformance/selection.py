"""Which backend a conformance run tests, and on which device: ``attnplug.selection``, the one
definition every command uses (re-exported here for the suite's modules)."""

from attnplug.selection import (  # noqa: F401
    ResolvedBackend,
    SelectionError,
    concrete_device,
    device_from_text,
    resolve_backend,
)

__all__ = ["ResolvedBackend", "SelectionError", "resolve_backend", "device_from_text", "concrete_device"]
