"""The cuda plugin's ``ATTNPLUG_*`` variables (declared into ``attnplug.env.FLAGS``; the
variables every plugin honours, ``ATTNPLUG_DISABLE_PDL`` among them, are core's).

=========================  ==============================  =====================================
variable                   reader                          meaning (default)
=========================  ==============================  =====================================
``ATTNPLUG_KV_STORE``      ``kv_store_kernel()``           ``triton`` or ``cpp``: the KV store
                                                           kernel (triton)
``ATTNPLUG_DISABLE_CPP``   ``cpp_disabled()``              never build or load the plugin's C++
                                                           extension (off)
``ATTNPLUG_CPP_VERBOSE``   ``cpp_verbose()``               show the C++ extension's build (off)
``ATTNPLUG_CACHE_DIR``     ``cache_dir()``                 build cache root
                                                           (``$XDG_CACHE_HOME/attnplug``, else
                                                           ``~/.cache/attnplug``)
=========================  ==============================  =====================================

Parsing is core's (``attnplug.env``): a value that does not parse raises ``EnvError`` naming
the variable; each reader is registered with ``attnplug.env.reader``, so ``attnplug info`` shows
a malformed value as an error. Importing this module imports neither torch nor Triton.
"""

from __future__ import annotations

import os
from pathlib import Path

from attnplug.env import EnvFlag, choice, declare, pdl_disabled, reader, switch

__all__ = [
    "KV_STORE",
    "DISABLE_CPP",
    "CPP_VERBOSE",
    "CACHE_DIR",
    "KV_STORE_KERNELS",
    "kv_store_kernel",
    "cpp_disabled",
    "cpp_verbose",
    "cache_dir",
    "pdl_disabled",
]

#: the values ``ATTNPLUG_KV_STORE`` accepts, the default first
KV_STORE_KERNELS = ("triton", "cpp")

KV_STORE, DISABLE_CPP, CPP_VERBOSE, CACHE_DIR = declare(
    EnvFlag("ATTNPLUG_KV_STORE", "the cuda plugin's KV store kernel: 'triton' or 'cpp'", KV_STORE_KERNELS[0]),
    EnvFlag("ATTNPLUG_DISABLE_CPP", "never build or load the cuda plugin's C++ extension", "off"),
    EnvFlag("ATTNPLUG_CPP_VERBOSE", "print the cuda plugin's C++ extension build log", "off"),
    EnvFlag(
        "ATTNPLUG_CACHE_DIR",
        "root of the cuda plugin's build cache",
        "$XDG_CACHE_HOME/attnplug, else ~/.cache/attnplug",
    ),
)


@reader(KV_STORE)
def kv_store_kernel() -> str:
    """``ATTNPLUG_KV_STORE``: one of ``KV_STORE_KERNELS`` (any case), default ``triton``."""
    return choice(KV_STORE, KV_STORE_KERNELS)


@reader(DISABLE_CPP)
def cpp_disabled() -> bool:
    """``ATTNPLUG_DISABLE_CPP``: True when the C++ extension must not be built or loaded."""
    return switch(DISABLE_CPP)


@reader(CPP_VERBOSE)
def cpp_verbose() -> bool:
    """``ATTNPLUG_CPP_VERBOSE``: True to print the C++ build."""
    return switch(CPP_VERBOSE)


@reader(CACHE_DIR)
def cache_dir() -> Path:
    """``ATTNPLUG_CACHE_DIR`` (``~`` expanded), else ``$XDG_CACHE_HOME/attnplug``, else
    ``~/.cache/attnplug``. The directory is not created here."""
    raw = CACHE_DIR.raw()
    if raw is not None:
        return Path(raw).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "attnplug"
