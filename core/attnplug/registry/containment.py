"""Running plugin code without letting it break backend selection.

Every call the registry makes into a plugin (importing its entry point, its hook, a probe,
``describe()``, importing a backend class) goes through this module:

* ``contained(fn, what)`` runs ``fn`` in the calling thread and returns an ``Outcome``; any
  exception, ``SystemExit`` and other ``BaseException`` included, becomes data. Only
  ``KeyboardInterrupt`` propagates, because in the calling thread it may be the user's Ctrl-C.
* ``TimedCall(fn, what, timeout)`` runs ``fn`` once in a daemon thread; ``wait()`` returns its
  ``Outcome`` or ``None`` when ``timeout`` seconds passed first. The thread is then abandoned
  (a hung probe keeps nothing waiting). In that thread even ``KeyboardInterrupt`` is contained:
  signals reach only the main thread, so it can only come from the plugin.
* ``exc_text(exc)`` and ``short_repr(value)`` print a plugin's exceptions and objects without
  ever raising.
* While plugin code runs, the thread is marked; ``guard_reentry`` turns a registry call made
  from plugin code (a plugin calling ``attnplug.get_backend()`` at import time, in its hook or in
  its probe) into a ``RegistryError`` instead of a deadlock or a recursion.

The time limit of probes and ``describe()`` is ``$ATTNPLUG_PROBE_TIMEOUT`` seconds
(``probe_timeout()``; default ``attnplug.env.DEFAULT_PROBE_TIMEOUT``).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

from .. import env
from .records import RegistryError

__all__ = [
    "Outcome",
    "TimedCall",
    "contained",
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
    """What a plugin call gave: ``value`` when it returned, else ``error`` (``exc_text``)."""

    value: Any = None
    error: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.error is None


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


def contained(fn: Callable[[], Any], what: str) -> Outcome:
    """Run plugin code in this thread; every exception but ``KeyboardInterrupt`` becomes data."""
    with plugin_call(what):
        try:
            return Outcome(value=fn())
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - SystemExit from a plugin must not end the process
            return Outcome(error=exc_text(exc))


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
    them holding a lock) until ``timeout`` seconds after the start (``None``: no limit)."""

    def __init__(self, fn: Callable[[], Any], what: str, timeout: Optional[float]) -> None:
        self.what = what
        self.timeout = timeout
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._done = threading.Event()
        self._outcome: Optional[Outcome] = None
        context = contextvars.copy_context()
        thread = threading.Thread(target=self._run, args=(context, fn), name=f"attnplug: {what}", daemon=True)
        thread.start()

    def _run(self, context: contextvars.Context, fn: Callable[[], Any]) -> None:
        with plugin_call(self.what):
            try:
                self._outcome = Outcome(value=context.run(fn))
            except BaseException as exc:  # noqa: BLE001 - not the main thread: it came from the plugin
                self._outcome = Outcome(error=exc_text(exc))
            finally:
                self._done.set()

    def wait(self) -> Optional[Outcome]:
        """The outcome, or ``None`` when the time limit passed first."""
        remaining = None if self._deadline is None else max(0.0, self._deadline - time.monotonic())
        if self._done.wait(remaining):
            return self._outcome
        return None
