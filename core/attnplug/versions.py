"""Version numbers: of installed packages (torch, triton, ...) and of the plugin API.

* ``release(text)``: the leading release numbers of a package version string, as a tuple to
  compare with ``>=``: ``"3.5.0+git1234"`` -> ``(3, 5, 0)``, ``"2.13.0.dev20250101"`` ->
  ``(2, 13, 0)``, ``"3.5rc1"`` -> ``(3, 5)``; ``()`` when the text starts with no number
  (``"?"``, ``"unknown"``), which is older than any minimum.
* ``at_least(text, minimum)``: ``release(text) >= minimum``.
* ``dotted((3, 5))`` -> ``"3.5"``: a minimum as a user reads it.
* ``installed_version(distribution)``: the installed distribution's version, or ``None``.
* ``api_version(value)``: a plugin API version, exactly ``"MAJOR.MINOR"``, as ``(major,
  minor)``; ``None`` for anything else (another type, ``"1"``, ``"1.0.0"``, ``" 1.0"``).
"""

from __future__ import annotations

import importlib.metadata
import re
from typing import Any, Optional, Sequence, Tuple

__all__ = ["release", "at_least", "dotted", "installed_version", "api_version"]

_RELEASE = re.compile(r"\s*v?(\d+(?:\.\d+)*)")
_API = re.compile(r"(\d+)\.(\d+)")


def release(text: str) -> Tuple[int, ...]:
    """The numbers before the first non-numeric part of ``text`` (see the module docstring)."""
    match = _RELEASE.match(text) if isinstance(text, str) else None
    return tuple(int(part) for part in match.group(1).split(".")) if match else ()


def at_least(text: str, minimum: Sequence[int]) -> bool:
    """True when version ``text`` is ``minimum`` or newer (``"3.5.0+git"`` is at least ``(3, 5)``)."""
    return release(text) >= tuple(minimum)


def dotted(version: Sequence[int]) -> str:
    """``(3, 5)`` -> ``"3.5"``."""
    return ".".join(str(part) for part in version)


def installed_version(distribution: str) -> Optional[str]:
    """The version of the installed ``distribution`` (``importlib.metadata``), or ``None``
    when it is not installed. Imports nothing."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def api_version(value: Any) -> Optional[Tuple[int, int]]:
    """``"MAJOR.MINOR"`` (a ``str``, nothing around it) as ``(major, minor)``, else ``None``."""
    if type(value) is not str:
        return None
    match = _API.fullmatch(value)
    return (int(match.group(1)), int(match.group(2))) if match else None
