"""Device-neutral environment policy for Programmatic Dependent Launch (PDL).

Whether kernels use PDL is a run-time capability that each plugin decides for its own device
(hardware generation, compiler version, ...). The one switch every plugin must honour is the
user's opt-out, ``ATTNPLUG_DISABLE_PDL=1``, read here so that all plugins agree on it.
"""

from __future__ import annotations

import os

__all__ = ["ENV_DISABLE_PDL", "pdl_disabled_by_env"]

ENV_DISABLE_PDL = "ATTNPLUG_DISABLE_PDL"
_TRUE = ("1", "true", "yes", "on")


def pdl_disabled_by_env() -> bool:
    """True when the user turned PDL off (``ATTNPLUG_DISABLE_PDL=1``; ``true``/``yes``/``on``
    are accepted too, case-insensitively). Read at every call, so tests may toggle it."""
    return os.environ.get(ENV_DISABLE_PDL, "").strip().lower() in _TRUE
