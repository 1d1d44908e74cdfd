"""Backends shipped with attnplug itself: the pure-PyTorch reference backend
(``attnplug.backends.reference``) and its plugin module (``reference_plugin``), which the
registry loads through the ``attnplug.backends`` entry point like any external plugin, and the
bases plugins build on: ``portable`` (attention in plain PyTorch on any device) and
``torch_device`` (that base on one of torch's device modules, with its graphs)."""
