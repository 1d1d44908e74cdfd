"""Every ``ATTNPLUG_*`` environment variable: its name, meaning, default and parsing.

Nothing else in attnplug or its plugins reads an ``ATTNPLUG_*`` variable directly; they call
the reader named in the table. Each reader looks at the environment at every call (so tests
and engines may change a variable between calls) and costs one dictionary lookup.

=========================  ==============================  =====================================
variable                   reader                          meaning (default)
=========================  ==============================  =====================================
``ATTNPLUG_BACKEND``       ``backend_name()``              the backend ``get_backend()`` returns
                                                           when given no name (the available one
                                                           of highest priority)
``ATTNPLUG_PLUGINS``       ``plugin_allow_list()``         comma-separated entry-point names: load
                                                           only these plugins (all)
``ATTNPLUG_PROBE_TIMEOUT`` ``probe_timeout()``             seconds a plugin probe or a backend's
                                                           ``describe()`` may take; ``inf``: no
                                                           limit (5)
``ATTNPLUG_VALIDATE``      ``validation_enabled()``        also run the batch checks that read
                                                           device tensors (a host sync) (off)
``ATTNPLUG_DISABLE_PDL``   ``pdl_disabled()``              launch without Programmatic Dependent
                                                           Launch, in every plugin (off)
``ATTNPLUG_KV_STORE``      ``kv_store_kernel()``           ``triton`` or ``cpp``: the KV store
                                                           kernel of a plugin that ships both
                                                           (triton)
``ATTNPLUG_ONE_LAUNCH``    ``one_launch_kernel()``         ``triton`` or ``cpp``: the one-launch
                                                           small-step kernel of a plugin that
                                                           ships both (triton)
``ATTNPLUG_DISABLE_CPP``   ``cpp_disabled()``              never build or load a plugin's C++
                                                           extension (off)
``ATTNPLUG_CPP_VERBOSE``   ``cpp_verbose()``               show the C++ extension's build (off)
``ATTNPLUG_CACHE_DIR``     ``cache_dir()``                 build cache root
                                                           (``$XDG_CACHE_HOME/attnplug``, else
                                                           ``~/.cache/attnplug``)
=========================  ==============================  =====================================

Parsing: surrounding blanks are ignored and an empty value means unset. A switch accepts
``1``/``true``/``yes``/``on`` and ``0``/``false``/``no``/``off`` (any case). A value that
does not parse raises ``EnvError`` (a ``ValueError``) naming the variable, the value and what
is expected, e.g. ``ATTNPLUG_VALIDATE='ture': expected a switch: 1, true, yes, on or 0,
false, no, off``; it is never silently read as the default.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Tuple

__all__ = [
    "EnvError",
    "EnvFlag",
    "FLAGS",
    "BACKEND",
    "PLUGINS",
    "PROBE_TIMEOUT",
    "VALIDATE",
    "DISABLE_PDL",
    "KV_STORE",
    "ONE_LAUNCH",
    "DISABLE_CPP",
    "CPP_VERBOSE",
    "CACHE_DIR",
    "DEFAULT_PROBE_TIMEOUT",
    "KV_STORE_KERNELS",
    "ONE_LAUNCH_KERNELS",
    "backend_name",
    "plugin_allow_list",
    "probe_timeout",
    "validation_enabled",
    "pdl_disabled",
    "kv_store_kernel",
    "one_launch_kernel",
    "cpp_disabled",
    "cpp_verbose",
    "cache_dir",
    "flags_set",
]

#: seconds; generous because a probe may import a vendor runtime, which can take a few seconds
DEFAULT_PROBE_TIMEOUT = 5.0
#: the values ``ATTNPLUG_KV_STORE`` accepts, the default first
KV_STORE_KERNELS = ("triton", "cpp")
#: the values ``ATTNPLUG_ONE_LAUNCH`` accepts, the default first
ONE_LAUNCH_KERNELS = ("triton", "cpp")

_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


class EnvError(ValueError):
    """An ``ATTNPLUG_*`` variable holds a value that does not parse; the message names the
    variable, its value and what it expects."""


@dataclass(frozen=True)
class EnvFlag:
    """One variable: ``name``, what it means, its ``default`` as a user would write it."""

    name: str
    meaning: str
    default: str

    def raw(self) -> Optional[str]:
        """The value with surrounding blanks removed; ``None`` when unset or empty."""
        value = os.environ.get(self.name)
        if value is None:
            return None
        value = value.strip()
        return value or None

    def error(self, value: str, expected: str) -> EnvError:
        return EnvError(f"{self.name}={value!r}: expected {expected}")


BACKEND = EnvFlag(
    "ATTNPLUG_BACKEND",
    "the backend get_backend() returns when given no name",
    "the available backend of highest priority",
)
PLUGINS = EnvFlag("ATTNPLUG_PLUGINS", "comma-separated plugin (entry-point) names: load only these", "all")
PROBE_TIMEOUT = EnvFlag(
    "ATTNPLUG_PROBE_TIMEOUT",
    "seconds a plugin probe or a backend's describe() may take ('inf': no limit)",
    f"{DEFAULT_PROBE_TIMEOUT:g}",
)
VALIDATE = EnvFlag("ATTNPLUG_VALIDATE", "also run the batch checks that read device tensors (a host sync)", "off")
DISABLE_PDL = EnvFlag("ATTNPLUG_DISABLE_PDL", "launch kernels without Programmatic Dependent Launch", "off")
KV_STORE = EnvFlag(
    "ATTNPLUG_KV_STORE", "the KV store kernel of plugins that ship two: 'triton' or 'cpp'", KV_STORE_KERNELS[0]
)
ONE_LAUNCH = EnvFlag(
    "ATTNPLUG_ONE_LAUNCH",
    "the one-launch small-step kernel of plugins that ship two: 'triton' or 'cpp'",
    ONE_LAUNCH_KERNELS[0],
)
DISABLE_CPP = EnvFlag("ATTNPLUG_DISABLE_CPP", "never build or load a plugin's C++ extension", "off")
CPP_VERBOSE = EnvFlag("ATTNPLUG_CPP_VERBOSE", "print the C++ extension's build log", "off")
CACHE_DIR = EnvFlag("ATTNPLUG_CACHE_DIR", "root of the build cache", "$XDG_CACHE_HOME/attnplug, else ~/.cache/attnplug")

#: every variable, by name, in the order of the module docstring's table
FLAGS: Dict[str, EnvFlag] = {
    flag.name: flag
    for flag in (
        BACKEND,
        PLUGINS,
        PROBE_TIMEOUT,
        VALIDATE,
        DISABLE_PDL,
        KV_STORE,
        ONE_LAUNCH,
        DISABLE_CPP,
        CPP_VERBOSE,
        CACHE_DIR,
    )
}


def _switch(flag: EnvFlag) -> bool:
    raw = flag.raw()
    if raw is None:
        return False
    value = raw.lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise flag.error(raw, "a switch: " + ", ".join(_ON) + " or " + ", ".join(_OFF))


def backend_name() -> Optional[str]:
    """``ATTNPLUG_BACKEND``: a backend name, or ``None`` when unset."""
    return BACKEND.raw()


def plugin_allow_list() -> Optional[Tuple[str, ...]]:
    """``ATTNPLUG_PLUGINS``: the entry-point names to load (blanks and empty items dropped), or
    ``None`` when unset (load all). A value with no name at all (``","``) raises ``EnvError``."""
    raw = PLUGINS.raw()
    if raw is None:
        return None
    names = tuple(part.strip() for part in raw.split(",") if part.strip())
    if not names:
        raise PLUGINS.error(raw, "comma-separated plugin names, e.g. reference,example")
    return names


def probe_timeout() -> Optional[float]:
    """``ATTNPLUG_PROBE_TIMEOUT``: seconds (> 0), ``None`` for ``inf`` (no limit), default
    ``DEFAULT_PROBE_TIMEOUT``. Anything else (``0``, ``-1``, ``nan``, ``soon``) raises."""
    raw = PROBE_TIMEOUT.raw()
    if raw is None:
        return DEFAULT_PROBE_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not value > 0:
        raise PROBE_TIMEOUT.error(
            raw, f"a positive number of seconds (default {DEFAULT_PROBE_TIMEOUT:g}; 'inf' for no limit)"
        )
    return None if math.isinf(value) else value


def validation_enabled() -> bool:
    """``ATTNPLUG_VALIDATE``: True when switched on."""
    return _switch(VALIDATE)


def pdl_disabled() -> bool:
    """``ATTNPLUG_DISABLE_PDL``: True when the user turned PDL off; every plugin honours it."""
    return _switch(DISABLE_PDL)


def kv_store_kernel() -> str:
    """``ATTNPLUG_KV_STORE``: one of ``KV_STORE_KERNELS`` (any case), default ``triton``."""
    raw = KV_STORE.raw()
    if raw is None:
        return KV_STORE_KERNELS[0]
    if raw.lower() not in KV_STORE_KERNELS:
        raise KV_STORE.error(raw, " or ".join(repr(k) for k in KV_STORE_KERNELS))
    return raw.lower()


def one_launch_kernel() -> str:
    """``ATTNPLUG_ONE_LAUNCH``: one of ``ONE_LAUNCH_KERNELS`` (any case), default ``triton``."""
    raw = ONE_LAUNCH.raw()
    if raw is None:
        return ONE_LAUNCH_KERNELS[0]
    if raw.lower() not in ONE_LAUNCH_KERNELS:
        raise ONE_LAUNCH.error(raw, " or ".join(repr(k) for k in ONE_LAUNCH_KERNELS))
    return raw.lower()


def cpp_disabled() -> bool:
    """``ATTNPLUG_DISABLE_CPP``: True when C++ extensions must not be built or loaded."""
    return _switch(DISABLE_CPP)


def cpp_verbose() -> bool:
    """``ATTNPLUG_CPP_VERBOSE``: True to print the C++ build."""
    return _switch(CPP_VERBOSE)


def cache_dir() -> Path:
    """``ATTNPLUG_CACHE_DIR`` (``~`` expanded), else ``$XDG_CACHE_HOME/attnplug``, else
    ``~/.cache/attnplug``. The directory is not created here."""
    raw = CACHE_DIR.raw()
    if raw is not None:
        return Path(raw).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "attnplug"


def flags_set() -> Dict[str, str]:
    """The ``ATTNPLUG_*`` variables of ``FLAGS`` that are set (non-empty), as given: what a
    report records about the run's environment."""
    return {name: os.environ[name] for name in FLAGS if FLAGS[name].raw() is not None}
