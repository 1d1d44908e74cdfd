"""Whether Programmatic Dependent Launch (PDL) can be used for kernels on a device.

PDL (Hopper and later) lets a kernel start while its predecessor on the stream is still
finishing: the dependent kernel runs its prologue, then blocks in ``gdc_wait`` (PTX
``griddepcontrol.wait``) until the predecessor's memory is visible; the predecessor calls
``gdc_launch_dependents`` after its last store to let the dependent start early. Every kernel
in this package takes a ``PDL: tl.constexpr`` and is launched with ``launch_pdl=True`` only
when ``pdl_supported(device)`` says so. It is a run-time capability, never assumed:

* the device is a CUDA device (not ROCm) of compute capability >= 9.0;
* Triton >= 3.5 is installed (``tl.extra.cuda.gdc_*`` and the ``launch_pdl`` option);
* the Triton interpreter is off (``TRITON_INTERPRET``), since it has no ``gdc_*``;
* the environment does not set ``ATTNPLUG_DISABLE_PDL=1``.

This module imports neither Triton nor the CUDA runtime at import time, and for a non-CUDA
device (``cpu`` included) it answers without initialising CUDA.
"""

from __future__ import annotations

import functools
from typing import Tuple, Union

import torch

from attnplug.env import pdl_disabled
from attnplug.versions import at_least, dotted

from .interpret import interpreting

__all__ = ["pdl_supported", "MIN_TRITON_VERSION"]

#: oldest Triton whose ``tl.extra.cuda`` has ``gdc_wait`` / ``gdc_launch_dependents``
MIN_TRITON_VERSION = (3, 5)


def _triton_status() -> Tuple[bool, str]:
    try:
        import triton
    except Exception as exc:  # ImportError, or a broken install
        return False, f"triton is not importable ({type(exc).__name__}: {exc})"
    version = getattr(triton, "__version__", "0")
    if not at_least(version, MIN_TRITON_VERSION):
        return False, f"triton {version} is older than {dotted(MIN_TRITON_VERSION)} (no gdc_wait / launch_pdl)"
    if interpreting():
        return False, "the Triton interpreter (TRITON_INTERPRET) has no griddepcontrol"
    return True, f"triton {version}"


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> Tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def pdl_supported(device: Union[torch.device, str, int, None]) -> Tuple[bool, str]:
    """``(True, reason)`` when kernels launched on ``device`` may use PDL, else
    ``(False, reason)``; the reason says which condition decided. Never initialises CUDA
    for a non-CUDA device."""
    if pdl_disabled():
        return False, "disabled by ATTNPLUG_DISABLE_PDL"
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device or "cpu")
    if dev.type != "cuda":
        return False, f"device type {dev.type!r} is not cuda"
    if getattr(torch.version, "hip", None):
        return False, "ROCm build of torch: griddepcontrol is an NVIDIA (sm_90+) feature"
    ok, reason = _triton_status()
    if not ok:
        return False, reason
    if not torch.cuda.is_available():
        return False, "torch.cuda is not available"
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    major, minor = _capability(index)
    if (major, minor) < (9, 0):
        return False, f"compute capability {major}.{minor} < 9.0"
    return True, f"compute capability {major}.{minor}, {reason}"
