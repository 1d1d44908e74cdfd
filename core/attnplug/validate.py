"""The validation switch: ``ATTNPLUG_VALIDATE=1`` turns on checks that need a device read.

Checks whose data already lives on the host (Python ints, lists, CPU tensors, lengths, modes,
dtypes) always run. Checks that would have to copy a device tensor to the host (slot ranges of
an accelerator-resident ``out_cache_loc``, freed rows named by a device ``req_pool_indices``,
``seq_lens >= extend lens`` on the device, ...) synchronise the stream, so they run only when an
engine switches validation on. It is off by default, which keeps graph replay sync-free.

Accepted values for on: ``1``, ``true``, ``yes``, ``on`` (case-insensitive). Anything else,
or the variable unset, is off. The variable is read at every call, so tests may toggle it.
"""

from __future__ import annotations

import os

__all__ = ["ENV_VALIDATE", "validation_enabled"]

ENV_VALIDATE = "ATTNPLUG_VALIDATE"
_TRUE = ("1", "true", "yes", "on")


def validation_enabled() -> bool:
    """True when ``ATTNPLUG_VALIDATE`` is set to an "on" value (see the module docstring)."""
    return os.environ.get(ENV_VALIDATE, "").strip().lower() in _TRUE
