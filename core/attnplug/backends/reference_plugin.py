"""Registers the reference backend. Loaded through the ``attnplug.backends`` entry point
``reference`` of the attnplug distribution, exactly like an external plugin."""

from __future__ import annotations

from ..registry.hookspecs import hookimpl
from ..registry.records import ProbeResult

PLUGIN_API_VERSION = "1.0"


def probe() -> ProbeResult:
    """Always available: pure PyTorch, runs on whatever device the KV pool lives on."""
    return ProbeResult(True, "pure PyTorch, any device", device="any")


@hookimpl
def attnplug_register_backends(register):
    register(name="reference", backend="attnplug.backends.reference:ReferenceBackend", probe=probe, priority=0)
