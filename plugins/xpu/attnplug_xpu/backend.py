"""The ``xpu`` backend: Intel GPUs through native ``torch.xpu`` (IPEX not required).

Attention runs the portable PyTorch path (``attnplug.backends.portable.PortableBackend``) on
the XPU: device tensors only (``needs_cpu_seq_lens = False``), one translation per step, every
rule of the contract kept. The XPU's own parts (graph class, synchronisation) are in
``device.py``.

Not yet run on Intel GPUs by this project: see the README's support matrix.
"""

from __future__ import annotations

from attnplug.backends.portable import PortableBackend

from .device import XpuDevice

__all__ = ["XpuBackend"]


class XpuBackend(PortableBackend):
    """Portable attention on Intel XPUs (see module docstring)."""

    name = "xpu"
    needs_cpu_seq_lens = False
    device_part = XpuDevice()

    def __init__(self, pool, req_to_token_pool, *, num_heads, sliding_window=None, scaling=None, logit_softcap=None):
        if pool.device.type != "xpu":
            raise ValueError(f"the xpu backend needs a pool on an XPU device, got {pool.device}")
        super().__init__(
            pool,
            req_to_token_pool,
            num_heads=num_heads,
            sliding_window=sliding_window,
            scaling=scaling,
            logit_softcap=logit_softcap,
        )
