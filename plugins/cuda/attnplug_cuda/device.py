"""The CUDA device's part (``CudaDevice``): graphs, the sync guard, synchronisation, and what
``attnplug info`` shows.

* ``cuda_graph()``: a ``DeviceGraph`` over ``torch.cuda.CUDAGraph`` (core's ``StreamGraph``:
  garbage collector paused, warm-up on a side stream, capture into a shared pool; a failed
  capture is ended, its pool recording stopped through the caching allocator's
  ``endAllocateToPool`` / ``releasePool`` and the pool retired). Stream capture keeps the
  programmatic (PDL) edges between kernels.
* ``strict_sync_guard()``: any host-device synchronisation inside the block raises
  (``torch.cuda.set_sync_debug_mode("error")``).

* ``CudaDevice``: the ``TritonDevicePart`` the cuda backend names; on a machine without CUDA
  (the kernels under the Triton interpreter) it falls back to the core's eager stand-ins.
  On a ROCm build of torch (``torch.version.hip``) the same backend runs the same Triton
  kernels on AMD GPUs, with PDL compiled out (``pdl_support`` answers False before any plan
  is made: the ``griddepcontrol`` variant does not link for AMD) and the Triton KV store
  (the C++ store is CUDA C++).
  ``describe()`` reads only the environment and the installed tools: no CUDA context, no build.
* ``kv_store_choice``: the KV store kernel a backend gets (the C++ one where it builds).

Everything here touches CUDA only when called, so the module imports on any machine.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, Tuple

import torch

from attnplug.graphs import PoolOps, StreamGraph

from . import env
from .triton_part import TritonDevicePart

__all__ = ["CudaDevice", "cuda_graph", "strict_sync_guard", "kv_store_choice", "rocm_version"]


def rocm_version():
    """The HIP version of a ROCm build of torch (None on a CUDA or CPU build)."""
    return getattr(torch.version, "hip", None) or None


def _pool_ops() -> PoolOps:
    # The caching allocator's calls that torch.cuda.graph's exit makes (or, after a failed
    # cudaStreamEndCapture, may skip) and CUDAGraph.reset makes.
    return PoolOps(end_recording=torch._C._cuda_endAllocateToPool, release=torch._C._cuda_releasePool)


def cuda_graph() -> StreamGraph:
    return StreamGraph(torch.cuda, torch.cuda.CUDAGraph, pool_ops=_pool_ops())


@contextlib.contextmanager
def strict_sync_guard() -> Iterator[None]:
    """Make every host-device sync inside the block raise."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def kv_store_choice(wanted: str, build: bool = True) -> Tuple[str, str]:
    """``(kernel, reason)``: the KV store a backend asked for ``wanted`` (``triton`` or ``cpp``)
    runs with. ``cpp`` only where the plugin's C++ extension loads (with ``build=False``
    nothing is built or loaded: ``cpp`` then means its prerequisites are met)."""
    if wanted == "triton":
        return "triton", f"default ({env.KV_STORE.name}=cpp selects the CUDA C++ KV store)"
    if rocm_version():
        return "triton", f"ROCm {rocm_version()}: the CUDA C++ KV store is CUDA-only (no HIP port)"
    from .cpp_ext import cpp_ext_status, try_load_ext

    ok, reason = cpp_ext_status(build=build)
    if ok and (not build or try_load_ext() is not None):
        return "cpp", f"{env.KV_STORE.name}=cpp" + ("" if build else f" ({reason})")
    return "triton", f"the CUDA C++ KV store is unavailable: {reason}"


class CudaDevice(TritonDevicePart):
    """CUDA graphs and the strict sync guard where CUDA is available; the core's eager
    stand-ins otherwise (the kernels under the Triton interpreter on a CPU). NVIDIA and, on a
    ROCm torch, AMD GPUs (PDL compiled out there)."""

    device_type = "cuda"
    declares_pdl = True

    def pdl_support(self, device: torch.device):
        from .kernels import pdl

        return pdl.pdl_supported(device)

    def compute_units(self, device: torch.device) -> int:
        from .kernels import common  # read at call time (a test may stand in another count)

        return common.num_sms(device)

    def kv_store_choice(self, wanted: str, build: bool = True):
        return kv_store_choice(wanted, build=build)

    def new_graph(self):
        return cuda_graph() if torch.cuda.is_available() else super().new_graph()

    def sync_guard(self):
        return strict_sync_guard() if torch.cuda.is_available() else super().sync_guard()

    def synchronize(self, device: torch.device) -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def describe(self) -> Dict[str, Any]:
        """The PDL rule and the KV store choice, from the environment and the installed tools
        only: no CUDA context is created and nothing is built."""
        store, store_reason = kv_store_choice(env.kv_store_kernel(), build=False)
        hip = rocm_version()
        if hip:
            pdl_rule = f"off: ROCm {hip} build of torch (compiled out: no griddepcontrol on AMD)"
            platform = f"ROCm {hip}: AMD GPUs run this backend's Triton kernels, PDL compiled out"
        else:
            pdl_rule = (
                "off: ATTNPLUG_DISABLE_PDL is set"
                if env.pdl_disabled()
                else "on where compute capability >= 9.0 and triton >= 3.5 (decided per instance)"
            )
            platform = "CUDA (NVIDIA); on a ROCm torch: AMD GPUs, PDL compiled out"
        return {"pdl_rule": pdl_rule, "platform": platform, "kv_store": store, "kv_store_reason": store_reason}
