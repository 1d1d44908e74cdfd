"""The reference backend: the conformance suite's numerical oracle.

It is the portable PyTorch path (``attnplug.backends.portable.PortableBackend``) under the name
``reference``: device-generic, every rule of the contract kept, written for clarity rather
than speed. It is also the embedded default on machines without an accelerator. Its device
part is the core's default (``attnplug.device_part.DevicePart``): graphs through the eager
stand-in, so the capture and replay metadata paths run on any device.

A plugin that wants the portable path on its own device subclasses ``PortableBackend``, not
this class: the oracle stays the oracle.
"""

from __future__ import annotations

from .portable import PortableBackend, _StepMetadata  # noqa: F401  (_StepMetadata: the layers' metadata type)

__all__ = ["ReferenceBackend"]


class ReferenceBackend(PortableBackend):
    """Pure-PyTorch attention over the hybrid paged KV cache (see ``portable``)."""

    name = "reference"
