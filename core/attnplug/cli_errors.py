"""How the ``attnplug`` command and its subcommands report an error that stops a run.

Every error line starts with ``ERROR_PREFIX`` (argument errors included); ``fail`` prints one
and returns the exit code. The command (``attnplug.cli``) and the modules that run its
subcommands (the soak, generate, bench and conformance commands) import it from here, so none
of them imports the command back.

Also here, for the same modules, what every subcommand checks before it runs and how a run
stops on a signal:

* ``device_problem(text)``: why a ``--device`` cannot run anything (it does not parse, its
  device type is not built in or has no device, the index is out of range, ``meta``);
* ``output_problem(path, folder=...)``: why an output file (``--json``, ``--report``,
  ``--junitxml``, ``--history``) or folder (``--out``) cannot be written, found before a run,
  never after it;
* ``interrupts_raise()``: while it is active SIGTERM raises ``Terminated`` (a
  ``KeyboardInterrupt``), so a run stopped by ``kill`` unwinds as one stopped by Ctrl-C does:
  child processes killed, the figures gathered so far written; ``signal_exit_code(exc)`` is the
  conventional exit code (130 for SIGINT, 143 for SIGTERM); ``interrupts_deferred()`` holds
  both signals back while a report is written.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Iterator, List, Optional

__all__ = [
    "ERROR_PREFIX",
    "fail",
    "device_problem",
    "output_problem",
    "Terminated",
    "interrupts_raise",
    "interrupts_deferred",
    "signal_name",
    "signal_exit_code",
]

#: how every error of the command starts (argument errors included)
ERROR_PREFIX = "attnplug: error: "


def fail(message: str, code: int = 2) -> int:
    """Print ``attnplug: error: MESSAGE`` on stderr and return ``code`` (2: the run cannot start)."""
    print(f"{ERROR_PREFIX}{message}", file=sys.stderr)
    return code


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# ---------------------------------------------------------------------------- --device
def device_problem(text: str) -> Optional[str]:
    """Why ``text`` names no device a run can use (one line), or None.

    The string must parse as a torch device; ``meta`` holds no data; a device type with a torch
    module (``torch.<type>``) must report a device available and the index
    must be below its ``device_count()``; any other type must take an empty tensor. Checks
    create no device context."""
    import torch

    if not str(text).strip():
        return "empty: name a torch device, e.g. cpu, or an accelerator type with its index"
    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError, TypeError) as exc:
        return _first_line(exc)
    if dev.type == "meta":
        return "the meta device holds no data: nothing can run on it"
    if dev.type == "cpu":
        return None
    module = getattr(torch, dev.type, None)
    is_available = getattr(module, "is_available", None)
    if callable(is_available):
        try:
            available = bool(is_available())
        except Exception as exc:  # a broken runtime
            return f"{dev.type} runtime unusable: {type(exc).__name__}: {_first_line(exc)}"
        if not available:
            return f"no {dev.type} device is available here (torch {torch.__version__})"
        count = getattr(module, "device_count", None)
        if dev.index is not None and callable(count):
            try:
                n = int(count())
            except Exception:
                n = None
            if n is not None and dev.index >= n:
                return f"no such device: {n} {dev.type} device(s) visible (indices 0..{n - 1})"
        return None
    try:
        torch.empty(0, device=dev)
    except Exception as exc:  # not compiled in, no runtime
        return f"{type(exc).__name__}: {_first_line(exc)}"
    return None


# ---------------------------------------------------------------------------- output paths
def _probe_folder(folder: str) -> Optional[str]:
    """Why no file can be created in the existing folder ``folder``, or None (a file is created
    and removed: permissions, read-only file systems and full quotas all show)."""
    import tempfile

    try:
        with tempfile.TemporaryFile(dir=folder, prefix=".attnplug-write-check-"):
            pass
    except OSError as exc:
        return f"cannot write in {folder!r}: {exc.strerror or exc}"
    return None


def output_problem(path: str, *, folder: bool = False) -> Optional[str]:
    """Why the output ``path`` cannot be written (one line), or None.

    ``folder``: ``path`` is a folder the run writes files into (created when missing), else a
    file (created or replaced; its missing parent folders are created). An existing file must
    be writable; otherwise the nearest existing folder above it must be a folder a file can be
    created in. Nothing is left behind."""
    if not str(path).strip():
        return "empty path"
    path = os.path.abspath(os.path.expanduser(str(path)))
    if os.path.isdir(path):
        return _probe_folder(path) if folder else "is a folder, not a file"
    if os.path.exists(path):
        if folder:
            return "is a file, not a folder"
        try:
            with open(path, "a"):
                pass
        except OSError as exc:
            return f"cannot write it: {exc.strerror or exc}"
        return None
    parent = os.path.dirname(path)
    while parent and not os.path.exists(parent):
        up = os.path.dirname(parent)
        if up == parent:
            break
        parent = up
    if not os.path.isdir(parent):
        return f"{parent!r} is a file, not a folder"
    return _probe_folder(parent)


# ---------------------------------------------------------------------------- signals
class Terminated(KeyboardInterrupt):
    """SIGTERM arrived while ``interrupts_raise()`` was active (``signum``: the signal)."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _raise_terminated(signum, _frame) -> None:
    raise Terminated(signum)


@contextlib.contextmanager
def interrupts_raise() -> Iterator[None]:
    """SIGTERM raises ``Terminated`` (and SIGINT ``KeyboardInterrupt``, as Python's default
    handler does) until the block ends; the previous handlers come back afterwards. Outside
    the main thread nothing changes (only it may set handlers)."""
    if not _in_main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    previous_int = signal.getsignal(signal.SIGINT)
    if previous_int in (signal.SIG_IGN, None):  # e.g. started in the background by a shell
        previous_int = None
    else:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        if previous_int is not None:
            signal.signal(signal.SIGINT, previous_int)


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[List[int]]:
    """SIGINT and SIGTERM are recorded, not acted on, until the block ends (a report being
    written is finished); yields the list of the signal numbers that arrived meanwhile."""
    arrived: List[int] = []
    if not _in_main_thread():
        yield arrived
        return

    def record(signum, _frame) -> None:
        arrived.append(signum)

    previous = {s: signal.signal(s, record) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield arrived
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)


def signal_name(exc: Optional[BaseException] = None, signum: Optional[int] = None) -> str:
    """``"SIGTERM"`` for a ``Terminated``, else ``"SIGINT"`` (a ``KeyboardInterrupt``);
    ``signum`` names a signal number instead."""
    if signum is None:
        signum = getattr(exc, "signum", signal.SIGINT)
    return signal.Signals(signum).name


def signal_exit_code(exc: Optional[BaseException] = None, signum: Optional[int] = None) -> int:
    """The conventional exit code of a run stopped by a signal: 128 + its number (130 for
    SIGINT, 143 for SIGTERM)."""
    if signum is None:
        signum = getattr(exc, "signum", signal.SIGINT)
    return 128 + int(signum)
