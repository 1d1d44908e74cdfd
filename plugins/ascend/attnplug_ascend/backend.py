"""The ``ascend`` backend: Ascend NPUs through torch_npu, with NPU graphs.

Attention runs the portable PyTorch path (``attnplug.backends.portable.PortableBackend``) on
the NPU: device tensors only (``needs_cpu_seq_lens = False``), one translation per step, every
rule of the contract kept. The NPU's own parts (graph class, synchronisation) are in
``device.py``. ``torch_npu`` is imported when the backend is constructed, never when this
package is imported.

Not yet run on Ascend hardware by this project: see the README's support matrix.
"""

from __future__ import annotations

from attnplug.backends.portable import PortableBackend

from .device import AscendDevice, npu_module

__all__ = ["AscendBackend"]


class AscendBackend(PortableBackend):
    """Portable attention on Ascend NPUs (see module docstring)."""

    name = "ascend"
    needs_cpu_seq_lens = False
    device_part = AscendDevice()

    def __init__(self, pool, req_to_token_pool, *, num_heads, sliding_window=None, scaling=None, logit_softcap=None):
        npu_module()
        if pool.device.type != "npu":
            raise ValueError(f"the ascend backend needs a pool on an NPU device, got {pool.device}")
        super().__init__(
            pool,
            req_to_token_pool,
            num_heads=num_heads,
            sliding_window=sliding_window,
            scaling=scaling,
            logit_softcap=logit_softcap,
        )
