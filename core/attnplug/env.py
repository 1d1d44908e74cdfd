"""The ``ATTNPLUG_*`` environment variables: their names, meanings, defaults and parsing.

The variables every part of attnplug honours are declared here (the table); a plugin declares
its own in its ``env`` module with ``declare`` and the parsers below, so ``FLAGS`` lists every
variable of the plugins loaded and ``flags_set()`` (what ``attnplug info`` and a benchmark
report show) sees them all. Nothing reads an ``ATTNPLUG_*`` variable except through a declared
flag's reader. Each reader looks at the environment at every call (so tests and engines may
change a variable between calls) and costs one dictionary lookup.

=========================  ==============================  =====================================
variable                   reader                          meaning (default)
=========================  ==============================  =====================================
``ATTNPLUG_BACKEND``       ``backend_name()``              the backend ``get_backend()`` returns
                                                           when given no name (the available one
                                                           of highest priority)
``ATTNPLUG_PLUGINS``       ``plugin_allow_list()``         comma-separated entry-point names: load
                                                           only these plugins (all)
``ATTNPLUG_PROBE_TIMEOUT`` ``probe_timeout()``             seconds each piece of plugin code run at
                                                           selection may take (import, hook,
                                                           probe, class import, ``describe()``);
                                                           ``inf``: no limit (5)
``ATTNPLUG_VALIDATE``      ``validation_enabled()``        also run the batch checks that read
                                                           device tensors (a host sync) (off)
``ATTNPLUG_DISABLE_PDL``   ``pdl_disabled()``              launch without Programmatic Dependent
                                                           Launch, in every plugin (off)
``ATTNPLUG_VLLM_SLOTS``    ``vllm_slots()``                comma-separated vLLM backend names
                                                           attnplug also takes over, e.g.
                                                           ``CPU_ATTN`` (``CUSTOM`` only)
=========================  ==============================  =====================================

Parsing: surrounding blanks are ignored and an empty value means unset. A switch accepts
``1``/``true``/``yes``/``on`` and ``0``/``false``/``no``/``off`` (any case). A value that
does not parse raises ``EnvError`` (a ``ValueError``) naming the variable, the value and what
is expected, e.g. ``ATTNPLUG_VALIDATE='ture': expected a switch: 1, true, yes, on or 0,
false, no, off``; it is never silently read as the default. ``flag_errors()`` runs the reader
of every variable that is set (``reader`` registers one: core's below, a plugin's in its ``env``
module), so ``attnplug info`` shows a malformed value as the error it is.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

__all__ = [
    "EnvError",
    "EnvFlag",
    "FLAGS",
    "BACKEND",
    "PLUGINS",
    "PROBE_TIMEOUT",
    "VALIDATE",
    "DISABLE_PDL",
    "DEFAULT_PROBE_TIMEOUT",
    "declare",
    "reader",
    "flag_errors",
    "switch",
    "choice",
    "backend_name",
    "plugin_allow_list",
    "probe_timeout",
    "validation_enabled",
    "pdl_disabled",
    "flags_set",
]

#: seconds; generous because a probe or a backend class import may import a vendor runtime,
#: which can take a few seconds
DEFAULT_PROBE_TIMEOUT = 5.0

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
    "seconds each piece of plugin code run at selection may take: import, hook, probe, class import, describe() "
    "('inf': no limit)",
    f"{DEFAULT_PROBE_TIMEOUT:g}",
)
VALIDATE = EnvFlag("ATTNPLUG_VALIDATE", "also run the batch checks that read device tensors (a host sync)", "off")
DISABLE_PDL = EnvFlag("ATTNPLUG_DISABLE_PDL", "launch kernels without Programmatic Dependent Launch", "off")
VLLM_SLOTS = EnvFlag(
    "ATTNPLUG_VLLM_SLOTS",
    "comma-separated vLLM attention-backend names attnplug also takes over (e.g. CPU_ATTN, TRITON_ATTN)",
    "CUSTOM only",
)

#: every declared variable, by name: this module's, then each loaded plugin's (``declare``)
FLAGS: Dict[str, EnvFlag] = {}


def declare(*flags: EnvFlag) -> Tuple[EnvFlag, ...]:
    """Add ``flags`` to ``FLAGS`` (a plugin's ``env`` module declares its variables so);
    returns them. Declaring a name twice with another meaning raises ``ValueError``."""
    for flag in flags:
        known = FLAGS.get(flag.name)
        if known is not None and known != flag:
            raise ValueError(f"{flag.name} is declared twice: {known} and {flag}")
        FLAGS[flag.name] = flag
    return flags


declare(BACKEND, PLUGINS, PROBE_TIMEOUT, VALIDATE, DISABLE_PDL, VLLM_SLOTS)

#: variable name -> its reader (no arguments; parses the value, raising ``EnvError``)
_READERS: Dict[str, Callable[[], Any]] = {}


def reader(flag: EnvFlag) -> Callable[[Callable[[], Any]], Callable[[], Any]]:
    """Decorator: the function (no arguments) reads and parses ``flag``; ``flag_errors()``
    calls it to check a value that is set. A plugin's ``env`` module decorates its readers so."""

    def register(read: Callable[[], Any]) -> Callable[[], Any]:
        _READERS[flag.name] = read
        return read

    return register


def switch(flag: EnvFlag) -> bool:
    """A switch (module docstring), False when unset; anything else raises ``EnvError``."""
    raw = flag.raw()
    if raw is None:
        return False
    value = raw.lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise flag.error(raw, "a switch: " + ", ".join(_ON) + " or " + ", ".join(_OFF))


def choice(flag: EnvFlag, values: Tuple[str, ...]) -> str:
    """One of ``values`` (any case), the first when unset; anything else raises ``EnvError``."""
    raw = flag.raw()
    if raw is None:
        return values[0]
    if raw.lower() not in values:
        raise flag.error(raw, " or ".join(repr(v) for v in values))
    return raw.lower()


@reader(BACKEND)
def backend_name() -> Optional[str]:
    """``ATTNPLUG_BACKEND``: a backend name, or ``None`` when unset."""
    return BACKEND.raw()


@reader(PLUGINS)
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


@reader(PROBE_TIMEOUT)
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


@reader(VLLM_SLOTS)
def vllm_slots() -> Tuple[str, ...]:
    """``ATTNPLUG_VLLM_SLOTS``: the vLLM backend names (upper case) attnplug registers itself
    under besides ``CUSTOM``; empty when unset. A value that is not a list of identifiers raises."""
    raw = VLLM_SLOTS.raw()
    if raw is None:
        return ()
    names = tuple(part.strip().upper() for part in raw.split(",") if part.strip())
    if not names or not all(n.replace("_", "").isalnum() for n in names):
        raise VLLM_SLOTS.error(raw, "comma-separated vLLM backend names, e.g. CPU_ATTN or TRITON_ATTN,FLASH_ATTN")
    return names


@reader(VALIDATE)
def validation_enabled() -> bool:
    """``ATTNPLUG_VALIDATE``: True when switched on."""
    return switch(VALIDATE)


@reader(DISABLE_PDL)
def pdl_disabled() -> bool:
    """``ATTNPLUG_DISABLE_PDL``: True when the user turned PDL off; every plugin honours it."""
    return switch(DISABLE_PDL)


def flags_set() -> Dict[str, str]:
    """The declared ``ATTNPLUG_*`` variables (``FLAGS``) that are set (non-empty), as given:
    what a report records about the run's environment."""
    return {name: os.environ[name] for name in FLAGS if FLAGS[name].raw() is not None}


def flag_errors() -> Dict[str, str]:
    """The declared variables that are set to a value their reader refuses: name -> the
    ``EnvError`` message (``"ATTNPLUG_VALIDATE='ture': expected a switch: ..."``). A variable
    without a registered reader is not checked."""
    errors: Dict[str, str] = {}
    for name, flag in list(FLAGS.items()):
        read = _READERS.get(name)
        if read is None or flag.raw() is None:
            continue
        try:
            read()
        except EnvError as exc:
            errors[name] = str(exc)
    return errors
