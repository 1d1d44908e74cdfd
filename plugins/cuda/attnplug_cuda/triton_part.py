"""``TritonDevicePart``: what a device decides for the Triton kernels of this package.

The kernels (``kernels/``), the planner (``planner.py``), the step tables and the backend
(``backend.TritonBackend``) are device-neutral Triton: the same source runs on NVIDIA (the
``cuda`` backend), on AMD through a ROCm torch (the same ``cuda`` backend, PDL compiled out)
and on Intel XPUs (``attnplug_xpu.triton_backend.XpuTritonBackend``). Everything a device
decides comes from the small part a backend class names (``device_part``):

* ``pdl_support(device)``: whether launches are compiled WITH Programmatic Dependent Launch.
  The answer is fixed when the backend is constructed and goes into every plan as the
  kernels' ``PDL: tl.constexpr`` (``None`` without PDL), so a device without PDL never
  compiles a ``griddepcontrol`` instruction (on ROCm that variant does not even link);
* ``compute_units(device)``: the SMs / CUs / Xe-cores the planner sizes its grids for;
* ``kv_store_choice(wanted, build)``: whether the CUDA C++ KV store may run (only on a CUDA
  build of torch);
* ``default_tuning()``: the plan defaults (block sizes, warps, the planner's bounds);
* the graph class, sync guard and synchronisation (``DevicePart``).

The backend takes a pool on ``device_type``, or on the CPU while the Triton interpreter runs
the kernels (``TRITON_INTERPRET=1``: how the host tests run every device's plans).

This module imports neither Triton nor a device runtime.
"""

from __future__ import annotations

from typing import Tuple

import torch

from attnplug.device_part import DevicePart

from .tuning import CudaTuning

__all__ = ["TritonDevicePart"]

#: the compute units the planner assumes on the host (the kernels under the interpreter)
HOST_COMPUTE_UNITS = 8


class TritonDevicePart(DevicePart):
    """The defaults: no PDL, no C++ KV store, the interpreter's stand-in compute units, the
    CUDA plan defaults. A device subclasses it (``CudaDevice``, ``XpuTritonDevice``)."""

    #: the class declares PDL (each instance decides with ``pdl_support``)
    declares_pdl: bool = False

    def pdl_support(self, device: torch.device) -> Tuple[bool, str]:
        """``(compiled with PDL, reason)``: decided once, at construction (the plans carry it)."""
        return False, f"no PDL on {self.device_type}: compiled out (PDL=None in every plan)"

    def compute_units(self, device: torch.device) -> int:
        return HOST_COMPUTE_UNITS

    def kv_store_choice(self, wanted: str, build: bool = True) -> Tuple[str, str]:
        if wanted == "cpp":
            return "triton", f"the CUDA C++ KV store is CUDA-only (not on {self.device_type})"
        return "triton", "the Triton KV store"

    def default_tuning(self) -> CudaTuning:
        return CudaTuning.from_env()
