"""The small device-specific part of a backend: graphs, the sync guard, synchronisation, and
what ``attnplug info`` says about the device.

A plugin's ``device.py`` subclasses ``DevicePart`` and its backend class names an instance in
``AttentionBackend.device_part``. The graph runner, the conformance suite and the benchmarks
reach the device only through it (``backend.new_graph()``, ``backend.sync_guard()`` and
``backend.synchronize(device)`` delegate here), so they never name a device.

The default instance serves any device without graphs or a sync guard: an eager stand-in graph
(``EagerGraph``), no guard, and ``torch.accelerator.synchronize`` for an accelerator.

Rules for subclasses:

* every method is cheap to call and imports device modules lazily, so a plugin package imports
  on any machine;
* ``describe()`` and ``graphs_available()`` must not start the device runtime, compile or build
  anything: ``attnplug info`` calls them.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, ContextManager, Dict

import torch

if TYPE_CHECKING:  # pragma: no cover
    from .graphs.device_graph import DeviceGraph

__all__ = ["DevicePart"]


class DevicePart:
    """Device services with device-neutral defaults (see module docstring)."""

    #: ``torch.device(...).type`` this part serves; ``"any"``: whatever device the pool is on
    device_type: str = "any"

    def serves(self, device: torch.device) -> bool:
        """Whether a backend with this part runs on ``device`` (default: a device of
        ``device_type``, every device for ``"any"``). A part whose kernels can also run on the
        host (an interpreter) says so here, so the integrations' backend choice accepts a model
        there."""
        return self.device_type in ("any", device.type)

    def new_graph(self) -> "DeviceGraph":
        """A fresh graph object of this device (default: the eager stand-in)."""
        from .graphs.device_graph import EagerGraph

        return EagerGraph()

    def graphs_available(self) -> bool:
        """True when ``new_graph()`` works in this process: a device graph, or the eager
        stand-in (default: True). A part whose device graph class is missing from this install
        returns False, and portable backends then declare ``GraphSupport.NEVER``.
        Must not start the device runtime."""
        return True

    def sync_guard(self) -> ContextManager:
        """A context that makes a host-device sync an error, where the device runtime offers
        one (default: nothing; the conformance suite's own detector still runs)."""
        return contextlib.nullcontext()

    def synchronize(self, device: torch.device) -> None:
        """Wait for all work queued on ``device`` (default: ``torch.accelerator`` for an
        accelerator, nothing for the host)."""
        if device.type != "cpu" and hasattr(torch, "accelerator"):
            torch.accelerator.synchronize(device)

    def describe(self) -> Dict[str, Any]:
        """Facts about the device that ``attnplug info`` shows next to the backend's declared
        capabilities (JSON-able values). Must not start the device runtime or build anything."""
        return {}
