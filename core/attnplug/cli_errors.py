"""How the ``attnplug`` command and its subcommands report an error that stops a run.

Every error line starts with ``ERROR_PREFIX`` (argument errors included); ``fail`` prints one
and returns the exit code. The command (``attnplug.cli``) and the modules that run its
subcommands (the soak, generate and conformance commands) import it from here, so none of
them imports the command back.
"""

from __future__ import annotations

import sys

__all__ = ["ERROR_PREFIX", "fail"]

#: how every error of the command starts (argument errors included)
ERROR_PREFIX = "attnplug: error: "


def fail(message: str, code: int = 2) -> int:
    """Print ``attnplug: error: MESSAGE`` on stderr and return ``code`` (2: the run cannot start)."""
    print(f"{ERROR_PREFIX}{message}", file=sys.stderr)
    return code
