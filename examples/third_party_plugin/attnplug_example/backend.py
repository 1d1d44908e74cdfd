"""The example backend: the portable PyTorch path under another name.

A real plugin starts here: everything works on the portable base
(``attnplug.backends.portable.PortableBackend``); then replace one method at a time with the
device's own kernels and let the conformance suite compare the results. The device's part
(graphs, sync guard, synchronisation) is in ``device.py``.
"""

from attnplug.backends.portable import PortableBackend

from .device import ExampleDevice


class ExampleBackend(PortableBackend):
    name = "example"
    device_part = ExampleDevice()
