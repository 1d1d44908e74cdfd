"""Programmatic Dependent Launch (PDL): whether a device can use it, and where a launch waits
and releases.

PDL (Hopper and later) lets a kernel start while its predecessor on the stream is still
finishing: the dependent kernel runs its prologue, then blocks in ``gdc_wait`` (PTX
``griddepcontrol.wait``) until the predecessor's memory is visible; the predecessor calls
``gdc_launch_dependents`` to let the next launch start early. Every kernel of this package
takes ``PDL: tl.constexpr``: ``None`` (launched without PDL) or a ``Schedule``, and is
launched with ``launch_pdl=True`` only with one. Whether PDL is used is a run-time capability
(``pdl_supported``), decided at compile time for each launch, never assumed:

* the device is a CUDA device (not ROCm) of compute capability >= 9.0;
* Triton >= 3.5 is installed (``tl.extra.cuda.gdc_*`` and the ``launch_pdl`` option);
* the Triton interpreter is off (``TRITON_INTERPRET``), since it has no ``gdc_*``;
* the environment does not set ``ATTNPLUG_DISABLE_PDL=1``.

The schedules (``Schedule(wait, release)``):

* ``PLAIN``: wait before the first load, release after the last store. Every kernel that
  reads what its predecessor wrote without more knowledge runs so.
* ``EARLY``: wait first, release right after the wait (the next launch's prologue overlaps
  this kernel's work).
* ``PROLOGUE``: first read what no kernel of the last two launches wrote (the step's
  metadata, cached K/V of earlier positions), then wait, then release. Where each kernel of
  a chain waits before it releases the next, every kernel two or more launches back has
  completed when a launch starts, so that data is final. Never the first launch after the
  kernel that writes the step's metadata.
* ``PROLOGUE_ENTRY``: as ``PROLOGUE``, releasing at entry. Such a launch may start while
  earlier ones still run, so it may read before its wait only what was written before the
  step's first attention launch (which never releases at entry).

This module imports neither Triton nor the CUDA runtime at import time, and for a non-CUDA
device (``cpu`` included) it answers without initialising CUDA.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Tuple, Union

import torch

from attnplug.env import pdl_disabled
from attnplug.versions import at_least, dotted

from .interpret import interpreting

__all__ = ["pdl_supported", "MIN_TRITON_VERSION", "Schedule", "PLAIN", "EARLY", "PROLOGUE", "PROLOGUE_ENTRY"]

#: oldest Triton whose ``tl.extra.cuda`` has ``gdc_wait`` / ``gdc_launch_dependents``
MIN_TRITON_VERSION = (3, 5)


class Schedule(NamedTuple):
    """Where a PDL launch waits (``"entry"`` or ``"prologue"``) and where it lets the next
    launch start (``"end"``, ``"wait"`` or ``"entry"``); module docstring."""

    wait: str
    release: str

    def check(self) -> "Schedule":
        if self.wait not in ("entry", "prologue") or self.release not in ("end", "wait", "entry"):
            raise ValueError(f"not a PDL schedule: {self}")
        if self.release == "entry" and self.wait != "prologue":
            raise ValueError(f"a launch released at entry reads before its wait: {self}")
        return self


PLAIN = Schedule("entry", "end")
EARLY = Schedule("entry", "wait")
PROLOGUE = Schedule("prologue", "wait")
PROLOGUE_ENTRY = Schedule("prologue", "entry")


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


def launch_options(pdl: "Schedule | None") -> dict:
    """The launch keyword a kernel with this schedule takes (``launch_pdl`` with PDL)."""
    return {"launch_pdl": True} if pdl is not None else {}
