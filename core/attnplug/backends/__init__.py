"""Backends shipped with attnplug itself: the pure-PyTorch reference backend
(``attnplug.backends.reference``) and its plugin module (``reference_plugin``), which the
registry loads through the ``attnplug.backends`` entry point like any external plugin."""
