"""Running plugin code without letting it break backend selection.

Every call the registry makes into a plugin (importing its entry point, reading its
``PLUGIN_API_VERSION``, registering it with pluggy, its hook, a probe, importing a backend class,
``describe()``) goes through this module or through the probe process (``sandbox``), and every
one of them is bounded by the time limit ``$ATTNPLUG_PROBE_TIMEOUT`` (``probe_timeout()``;
default ``attnplug.env.DEFAULT_PROBE_TIMEOUT``):

* ``TimedCall(fn, what, timeout, guard=...)`` runs ``fn`` once in a daemon thread; ``wait()``
  returns its ``Outcome`` or ``None`` when ``timeout`` seconds passed first. The thread is then
  abandoned (a hung plugin keeps nothing waiting past the limit). In that thread even
  ``KeyboardInterrupt`` is contained: signals reach only the main thread, so it can only come
  from the plugin; the caller, waiting in its own thread, still gets the user's Ctrl-C.
  ``run_contained`` is ``TimedCall`` + ``wait`` with a timed-out ``Outcome`` instead of ``None``.
* With ``guard=True`` a ``StateGuard`` watches the call: what it changed in ``os.environ``,
  torch's default dtype, torch's CPU random state or Python's ``random`` state is undone and
  reported in ``Outcome.changes``; the non-daemon threads it left running are named in
  ``Outcome.threads`` (a thread cannot be stopped in-process: only the probe process can be).
  A call that outlived the limit is neither undone nor reported: it is still running.
* ``exc_text(exc)`` and ``short_repr(value)`` print a plugin's exceptions and objects without
  ever raising.
* While plugin code runs, the thread is marked; ``guard_reentry`` turns a registry call made
  from plugin code (a plugin calling ``attnplug.get_backend()`` at import time, in its hook or in
  its probe) into a ``RegistryError`` instead of a deadlock or a recursion.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import random
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from .. import env
from .records import RegistryError

__all__ = [
    "Outcome",
    "StateGuard",
    "TimedCall",
    "run_contained",
    "exc_text",
    "guard_reentry",
    "plugin_call",
    "probe_timeout",
    "short_repr",
]

_local = threading.local()


def exc_text(exc: BaseException) -> str:
    """``"Type: message"`` of an exception, never raising (its ``__str__`` is plugin code)."""
    name = type(exc).__name__
    try:
        text = str(exc).strip()
    except BaseException:  # noqa: BLE001 - an unprintable exception still has a type
        text = "<unprintable message>"
    return f"{name}: {text}" if text else name


def short_repr(value: Any) -> str:
    """``repr(value)`` cut to 200 characters, never raising (plugin objects may not print)."""
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - plugin objects may not print
        text = f"<{type(value).__name__} object>"
    return text if len(text) <= 200 else text[:200] + "..."


@dataclass(frozen=True)
class Outcome:
    """What running plugin code gave: ``value`` when it returned, else ``error`` (``exc_text``),
    ``timed_out`` when it outlived the time limit, ``ended`` when it ended the probe process
    (``"exited the process with code 3"``). ``phase``: what was running in the probe process
    when it hung or ended (``sandbox``). ``changes`` / ``threads``: the state changes undone or
    ignored and the non-daemon threads left running (``StateGuard``); for a run in the probe
    process, ``(phase, text)`` pairs. ``isolated``: it ran in the probe process."""

    value: Any = None
    error: Optional[str] = None
    timed_out: bool = False
    ended: Optional[str] = None
    phase: Optional[str] = None
    changes: Tuple[Any, ...] = ()
    threads: Tuple[Any, ...] = ()
    isolated: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None and not self.timed_out and self.ended is None


class StateGuard:
    """The process state plugin code must not change, taken when created: ``os.environ``,
    torch's default dtype and CPU random state (when torch is imported), Python's ``random``
    state, and the non-daemon threads alive. ``changes(undo=True)`` names what differs now and
    puts it back; ``stray_threads()`` names the non-daemon threads started since."""

    def __init__(self) -> None:
        self._environ: Dict[str, str] = dict(os.environ)
        self._torch = sys.modules.get("torch")
        self._dtype = self._rng = None
        if self._torch is not None:
            self._dtype = self._torch.get_default_dtype()
            self._rng = self._torch.random.get_rng_state()
        self._random = random.getstate()
        self._threads = {t for t in threading.enumerate() if not t.daemon}

    def changes(self, undo: bool = True) -> List[str]:
        """What differs from the snapshot, in words (``"changed os.environ A, B"``), each put
        back when ``undo``."""
        found: List[str] = []
        before, now = self._environ, dict(os.environ)
        keys = sorted(k for k in set(before) | set(now) if before.get(k) != now.get(k))
        if keys:
            shown = ", ".join(keys[:6]) + (f" and {len(keys) - 6} more" if len(keys) > 6 else "")
            found.append(f"changed os.environ {shown}")
            if undo:
                for key in keys:
                    if key in before:
                        os.environ[key] = before[key]
                    else:
                        os.environ.pop(key, None)
        torch = self._torch
        if torch is not None:
            dtype = torch.get_default_dtype()
            if dtype != self._dtype:
                found.append(f"changed torch's default dtype to {dtype}")
                if undo:
                    torch.set_default_dtype(self._dtype)
            if not torch.equal(torch.random.get_rng_state(), self._rng):
                found.append("changed the state of torch's random number generator (a seed or a draw)")
                if undo:
                    torch.random.set_rng_state(self._rng)
        if random.getstate() != self._random:
            found.append("changed the state of Python's random module")
            if undo:
                random.setstate(self._random)
        return found

    def stray_threads(self) -> List[str]:
        """The names (``repr``) of the non-daemon threads alive now that were not at the snapshot."""
        return sorted(
            repr(t.name) for t in threading.enumerate() if not t.daemon and t.is_alive() and t not in self._threads
        )


@contextlib.contextmanager
def plugin_call(what: str) -> Iterator[None]:
    """Mark this thread as running plugin code (``what``: e.g. ``"the probe of backend 'x'"``)."""
    previous = getattr(_local, "what", None)
    _local.what = what
    try:
        yield
    finally:
        _local.what = previous


def guard_reentry(api: str) -> None:
    """Raise ``RegistryError`` when a registry function is called from plugin code that the
    registry itself is running in this thread."""
    what = getattr(_local, "what", None)
    if what is not None:
        raise RegistryError(
            f"attnplug.{api}() cannot be called from plugin code that the registry is running ({what}): "
            "the registry is not ready at that point. Call it later, for example when the backend is constructed."
        )


def probe_timeout() -> Optional[float]:
    """Seconds a probe or ``describe()`` may take (``attnplug.env.probe_timeout()``); ``None``
    for no limit. A malformed ``ATTNPLUG_PROBE_TIMEOUT`` raises ``RegistryError`` naming the
    variable and its value."""
    try:
        return env.probe_timeout()
    except env.EnvError as exc:
        raise RegistryError(str(exc)) from None


class TimedCall:
    """``fn`` running once in its own daemon thread, awaited by any number of threads (none of
    them holding a lock) until ``timeout`` seconds after the start (``None``: no limit). With
    ``guard``, a ``StateGuard`` undoes and reports what the call changed (when it returns in
    time)."""

    def __init__(self, fn: Callable[[], Any], what: str, timeout: Optional[float], *, guard: bool = False) -> None:
        self.what = what
        self.timeout = timeout
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._lock = threading.Lock()  # orders the end of the call against a waiter giving up
        self._abandoned = False
        self._outcome: Optional[Outcome] = None
        context = contextvars.copy_context()
        self._thread = threading.Thread(
            target=self._run, args=(context, fn, guard), name=f"attnplug: {what}", daemon=True
        )
        self._thread.start()

    def _run(self, context: contextvars.Context, fn: Callable[[], Any], guard: bool) -> None:
        with plugin_call(self.what):
            value = error = None
            try:
                state = StateGuard() if guard else None
            except Exception:  # noqa: BLE001 - no snapshot: run unguarded rather than not at all
                state = None
            try:
                value = context.run(fn)
            except BaseException as exc:  # noqa: BLE001 - not the main thread: it came from the plugin
                error = exc_text(exc)
            changes: Tuple[str, ...] = ()
            threads: Tuple[str, ...] = ()
            with self._lock:
                if state is not None and not self._abandoned:
                    try:
                        changes, threads = tuple(state.changes(undo=True)), tuple(state.stray_threads())
                    except Exception:  # noqa: BLE001 - the verdict matters more than the audit
                        pass
                self._outcome = Outcome(value=value, error=error, changes=changes, threads=threads)

    def wait(self) -> Optional[Outcome]:
        """The outcome, or ``None`` when the time limit passed first."""
        remaining = None if self._deadline is None else max(0.0, self._deadline - time.monotonic())
        # joining (not an event): the call's thread has ended when its outcome is returned, so
        # no daemon thread is still unwinding when the interpreter exits (torch's native code
        # aborts the process if one is killed at exit), and the caller wakes up once
        self._thread.join(remaining)
        with self._lock:
            if self._outcome is None:
                self._abandoned = True
                return None
        self._thread.join(1.0)  # it may be between its outcome and its end
        return self._outcome


def run_contained(fn: Callable[[], Any], what: str, timeout: Optional[float], *, guard: bool = True) -> Outcome:
    """``fn`` as a guarded ``TimedCall``, awaited: its ``Outcome``, ``timed_out`` past ``timeout``."""
    outcome = TimedCall(fn, what, timeout, guard=guard).wait()
    return Outcome(timed_out=True) if outcome is None else outcome
