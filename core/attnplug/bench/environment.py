"""What a run was measured on: device, versions, date, command, commit."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
from typing import Any, Dict, List, Optional

import torch

from ..env import flags_set

__all__ = ["environment"]


def _git_commit() -> Optional[str]:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        return (out.stdout.strip() or None) if out.returncode == 0 else None
    except Exception:
        return None


def _device_name(device: torch.device) -> Optional[str]:
    if device.type == "cpu":
        return platform.processor() or platform.machine() or None
    module = getattr(torch, device.type, None)
    get_name = getattr(module, "get_device_name", None)
    try:
        return get_name(device) if callable(get_name) else None
    except Exception as exc:
        return f"unknown ({type(exc).__name__}: {exc})"


def environment(device: torch.device, argv: Optional[List[str]] = None) -> Dict[str, Any]:
    """The record written next to every result (suites add their own keys)."""
    env: Dict[str, Any] = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.executable)] + list(argv if argv is not None else sys.argv)),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "git_commit": _git_commit(),
        "device": str(device),
        "device_name": _device_name(device),
        "attnplug_env": flags_set(),
    }
    try:
        import triton

        env["triton"] = getattr(triton, "__version__", "?")
    except Exception as exc:
        env["triton"] = f"unavailable ({type(exc).__name__}: {exc})"
    return env
