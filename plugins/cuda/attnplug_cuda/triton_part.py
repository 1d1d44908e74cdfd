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
* ``fp8_kv_problem(dtype, device)``: why the device's Triton cannot run the kernels over an FP8
  KV cache of ``dtype`` (None: it can); the backend refuses such a pool at construction and
  the op layer such a cache, naming the reason;
* the graph class, sync guard and synchronisation (``DevicePart``).

The backend takes a pool on ``device_type``, or on the CPU while the Triton interpreter runs
the kernels (``TRITON_INTERPRET=1``: how the host tests run every device's plans).

This module imports neither Triton nor a device runtime.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

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

    def serves(self, device: torch.device) -> bool:
        """A device of ``device_type``, or the host while the Triton interpreter runs the
        kernels (``TRITON_INTERPRET=1``)."""
        if super().serves(device):
            return True
        from .kernels.interpret import interpreting  # (Triton is imported only when asked)

        return device.type == "cpu" and interpreting()

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
        tuning = CudaTuning.from_env()
        if getattr(torch.version, "hip", None):  # a register cap and PTX are NVIDIA compile options
            tuning = dataclasses.replace(
                tuning, fp8_decode_registers=None, fp8_ptx_convert=False, settle_flash_products=False
            )
        return tuning

    def fp8_kv_problem(self, dtype: torch.dtype, device: Optional[torch.device] = None) -> Optional[str]:
        """Why the kernels cannot serve an FP8 KV cache of ``dtype`` on ``device`` (None: they
        can). ``device`` None: what holds for the class on this install (no device query).

        The kernels' FP8 code is Triton's ``fp8e4nv`` (``float8_e4m3fn``) and ``fp8e5``
        (``float8_e5m2``) types: loads converted to q's dtype, stores as bytes. Triton's own
        rules, by the device type this part names:

        * NVIDIA: ``fp8e4nv`` compiles for compute capability >= 8.9 only (Triton refuses the
          type below: "not supported in this architecture"); ``fp8e5`` everywhere;
        * AMD (``cuda`` on a ROCm build of torch): ``float8_e5m2`` only. ``float8_e4m3fn`` is the
          OCP format, not the e4m3 of MI300 (``float8_e4m3fnuz``: another exponent bias and NaN
          code), which Triton for gfx942 converts in software where its version accepts the
          type at all; it is refused rather than left to fail or differ at the first launch;
        * Intel XPUs: both (Intel's Triton converts ``fp8e4nv`` and ``fp8e5``)."""
        if dtype == torch.float8_e4m3fn and self.device_type == "cuda":
            hip = getattr(torch.version, "hip", None)
            if hip:
                return (
                    f"ROCm {hip}: float8_e4m3fn is the OCP format, not MI300's float8_e4m3fnuz, and Triton "
                    "converts it there only in software where it accepts it at all; use float8_e5m2"
                )
            if device is not None and device.type == "cuda" and torch.cuda.is_available():
                major, minor = torch.cuda.get_device_capability(device)
                if (major, minor) < (8, 9):
                    return (
                        f"compute capability {major}.{minor}: Triton compiles float8_e4m3fn (fp8e4nv) for "
                        "compute capability >= 8.9 only; use float8_e5m2"
                    )
        return None
