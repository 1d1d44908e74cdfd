"""The Intel XPU's device parts: XPU graphs, synchronisation, what ``attnplug info`` shows, and
what the XPU decides for the Triton kernels.

* ``XpuDevice``: the portable fallback's part. The graph class (``torch.xpu.XPUGraph``,
  present from torch 2.11) is found by feature detection (``TorchDevicePart``): without it
  ``graphs_available()`` is False and the backend declares ``GraphSupport.NEVER``.
* ``XpuTritonDevice``: the same, plus the ``TritonDevicePart`` decisions of the ``xpu``
  backend (``triton_backend.XpuTritonBackend``): no PDL (compiled out: Intel's Triton has no
  ``griddepcontrol`` counterpart), Xe-cores as the planner's compute units, the Triton KV
  store only, and the XPU plan defaults (``xpu_tuning``; docs/xpu.md says why).

Intel Extension for PyTorch is optional and never imported here; nothing here imports Triton
or starts the XPU runtime at import time, and ``describe()`` neither.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from typing import Any, Dict, Optional, Tuple

import torch

from attnplug.backends.torch_device import TorchDevicePart
from attnplug.device_part import DevicePart
from attnplug_cuda.triton_part import HOST_COMPUTE_UNITS, TritonDevicePart
from attnplug_cuda.tuning import CudaTuning

__all__ = ["XpuDevice", "XpuTritonDevice", "xpu_tuning", "triton_xpu_status", "FALLBACK"]

#: the portable fallback, selectable by module:Class where Triton for XPU is missing
FALLBACK = "attnplug_xpu.backend:XpuPortableBackend"


class XpuDevice(TorchDevicePart):
    """XPU graphs (``StreamGraph`` over ``torch.xpu.XPUGraph``) and XPU synchronisation."""

    device_type = "xpu"
    graph_class_name = "XPUGraph"
    missing_graph = "this torch has no torch.xpu.XPUGraph: the xpu backend declares GraphSupport.NEVER"


def xpu_tuning() -> CudaTuning:
    """The XPU plan defaults: the user's environment (``ATTNPLUG_KV_STORE``), no PDL, key
    blocks of at most 64 keys and at least 8 warps for the flash-attention tiles (Intel's
    guidance for its Triton backend: narrow key blocks loaded by 2D block loads into DPAS,
    more sub-groups per tile; docs/xpu.md). The planner's other bounds are the CUDA ones,
    with Xe-cores in the place of SMs, no register cap and no PTX (NVIDIA compile options);
    to be retuned on hardware."""
    return dataclasses.replace(
        CudaTuning.from_env(),
        pdl=False,
        max_block_n=64,
        min_flash_warps=8,
        fp8_decode_registers=None,
        fp8_ptx_convert=False,
        settle_flash_products=False,
    )


def triton_xpu_status() -> Tuple[bool, str]:
    """``(found, reason)``: whether the installed Triton has Intel's XPU backend
    (``triton/backends/intel``, shipped by ``pytorch-triton-xpu`` with torch's XPU wheels).
    Looks at the files only: imports nothing."""
    try:
        spec = importlib.util.find_spec("triton")
    except (ImportError, ValueError) as exc:
        return False, f"triton is not importable ({type(exc).__name__}: {exc})"
    if spec is None or not spec.submodule_search_locations:
        return False, "triton is not installed"
    for root in spec.submodule_search_locations:
        if os.path.isdir(os.path.join(root, "backends", "intel")):
            return True, f"triton with Intel's XPU backend ({os.path.join(root, 'backends', 'intel')})"
    return (
        False,
        "the installed triton has no Intel XPU backend (triton/backends/intel; pip install pytorch-triton-xpu)",
    )


class XpuTritonDevice(XpuDevice, TritonDevicePart):
    """The ``xpu`` backend's part: XPU graphs where torch has them (the core's eager stand-in
    on the host, under the Triton interpreter), no PDL, Xe-cores, the XPU plan defaults."""

    declares_pdl = False

    def _xpu_here(self) -> bool:
        module = self.module()
        try:
            return module is not None and bool(module.is_available())
        except Exception:
            return False

    def new_graph(self):
        return super().new_graph() if self._xpu_here() else DevicePart.new_graph(self)

    def synchronize(self, device: torch.device) -> None:
        if device.type == "xpu":
            super().synchronize(device)

    def pdl_support(self, device: torch.device) -> Tuple[bool, str]:
        return False, "Intel XPU: Triton's XPU backend has no PDL (griddepcontrol): compiled out (PDL=None)"

    def compute_units(self, device: torch.device) -> int:
        """Xe-cores of the device (``gpu_subslice_count``; EUs / 8 where torch lacks it); the
        interpreter's stand-in on the host."""
        if device.type != "xpu":
            return HOST_COMPUTE_UNITS
        props = torch.xpu.get_device_properties(device.index if device.index is not None else 0)
        cores: Optional[int] = getattr(props, "gpu_subslice_count", None)
        if not cores:
            cores = (getattr(props, "gpu_eu_count", 0) or 0) // 8
        return int(cores) if cores else HOST_COMPUTE_UNITS

    def kv_store_choice(self, wanted: str, build: bool = True) -> Tuple[str, str]:
        if wanted == "cpp":
            return "triton", "the CUDA C++ KV store is CUDA-only: the XPU uses the Triton store"
        return "triton", "the Triton KV store"

    def default_tuning(self) -> CudaTuning:
        return xpu_tuning()

    def describe(self) -> Dict[str, Any]:
        found, reason = triton_xpu_status()
        facts = super().describe()
        t = xpu_tuning()
        facts.update(
            kernels="triton: attnplug_cuda's kernels and planner with XPU plans, PDL compiled out"
            if found
            else f"triton (missing here: {reason}); the portable fallback is {FALLBACK}",
            triton_xpu=reason,
            plan_defaults=f"max_block_n={t.max_block_n}, min_flash_warps={t.min_flash_warps}, pdl=False",
            pdl_rule="off: compiled out (no PDL on Intel XPUs)",
            kv_store="triton",
        )
        return facts
