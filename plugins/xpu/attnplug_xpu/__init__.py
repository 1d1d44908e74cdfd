"""attnplug plugin for Intel GPUs through PyTorch's native ``torch.xpu`` and Triton
(Intel Extension for PyTorch is optional, not required).

Importing this package touches no device: the probe checks ``torch.xpu``, and the backend module
is imported when the backend is selected.
"""
