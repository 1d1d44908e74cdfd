"""The probe process: where third-party plugin code runs at selection time.

A probe (and the checks around it: the trial import of the backend class, its class attributes
and ``describe()``) of a plugin that is not part of the attnplug distribution runs in a child
process, never in the process that selects backends, so no plugin can end that process
(``os._exit``, a crash in native code), keep it alive (a non-daemon thread), hang it, or change
its state (``os.environ``, torch's default dtype or random state).

* One child at a time for the whole process (``sandbox()``), started on the first request
  (``python -c`` importing ``attnplug.registry.worker``), used by every registry, answering one
  request at a time. Its stdout is the protocol (JSON lines); plugin output goes to its stderr, a
  temporary file read back only to quote the last words of a child that ended.
* Each request carries the caller's ``os.environ``, ``sys.path`` and working directory, so the
  plugin sees what it would see in-process; the child undoes every change a phase made before
  the next one and reports them (``Outcome.changes``).
* The child announces each phase (``import`` of the plugin, its ``hook``, the ``probe``, the
  ``resolve`` of the backend class, ``describe``); each phase gets the time limit. A phase that
  outlives it, or a child that ends, is reported as such (``Outcome.timed_out`` / ``ended``,
  with the exit code or signal) and the child is killed; so is a child in which a request left a
  non-daemon thread (``Outcome.threads``). The next request starts a fresh child.
* A child idle for ``IDLE_S`` seconds is stopped, and so is the child at exit; the child also
  ends by itself when the pipe from its parent closes. After ``os.fork()`` the child process
  does not inherit the child: it starts its own.

``Sandbox.call`` raises ``SandboxUnavailable`` only when no child can be started (no usable
``sys.executable``; the failure is remembered for ``RETRY_S`` seconds); the registry then runs
the code in-process, guarded, and says so.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Dict, Optional, Tuple

from .containment import Outcome

__all__ = ["IDLE_S", "RETRY_S", "STARTUP_S", "Sandbox", "SandboxUnavailable", "sandbox"]

#: seconds a child may take to start (a cold import of attnplug and torch); not plugin code
STARTUP_S = 120.0
#: seconds without a request after which the child is stopped
IDLE_S = 30.0
#: seconds after a child failed to start before another start is tried
RETRY_S = 60.0

_BOOT = "import sys; sys.path.insert(0, sys.argv[1]); from attnplug.registry.worker import main; main()"


class SandboxUnavailable(RuntimeError):
    """No probe process could be started; the message says why."""


class _Child:
    """One running child: the process, the queue its stdout lines arrive in (``None``: end of
    file), and its stderr file."""

    def __init__(self, proc: subprocess.Popen, stderr: Any) -> None:
        self.proc = proc
        self.stderr = stderr
        self.lines: "queue.Queue[Optional[bytes]]" = queue.Queue()
        reader = threading.Thread(target=self._read, name="attnplug probe process: replies", daemon=True)
        reader.start()

    def _read(self) -> None:
        try:
            for line in self.proc.stdout:
                self.lines.put(line)
        except (OSError, ValueError):
            pass
        self.lines.put(None)

    def send(self, message: Dict[str, Any]) -> None:
        self.proc.stdin.write(json.dumps(message).encode() + b"\n")
        self.proc.stdin.flush()

    def output_size(self) -> int:
        try:
            return os.fstat(self.stderr.fileno()).st_size
        except (OSError, ValueError):
            return 0

    def last_output(self, since: int) -> str:
        """The last words the child wrote to stderr after offset ``since``, on one line."""
        try:
            self.stderr.seek(since)
            text = self.stderr.read().decode("utf-8", "replace")
        except (OSError, ValueError):
            return ""
        crash = text.find("Fatal Python error:")  # faulthandler's report: its first line says what happened
        if crash >= 0:
            return text[crash:].splitlines()[0].strip()
        text = " ".join(text.split())
        return text if len(text) <= 300 else "..." + text[-300:]

    def kill(self) -> None:
        """Kill the child and everything it started (its own session), and reap it."""
        proc = self.proc
        if proc.poll() is None:
            try:
                if os.name == "posix":
                    os.killpg(proc.pid, signal.SIGKILL)
                else:  # pragma: no cover - no sessions
                    proc.kill()
            except OSError:
                try:
                    proc.kill()
                except OSError:
                    pass
        self.close()

    def close(self, wait: float = 10.0) -> None:
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except (OSError, ValueError):
                pass
        try:
            self.proc.wait(wait)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        try:
            self.stderr.close()
        except (OSError, ValueError):
            pass

    def ended(self, since: int) -> str:
        """How the child ended (it closed its stdout): ``"exited the process with code 3"``."""
        try:
            code = self.proc.wait(5)
        except subprocess.TimeoutExpired:  # closed its stdout but lives on: make it end
            self.kill()
            code = self.proc.returncode
        if code is not None and code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = str(-code)
            text = f"killed the process with signal {name}"
        else:
            text = f"exited the process with code {code}"
        last = self.last_output(since)
        return f"{text} (its last output: {last!r})" if last else text


class Sandbox:
    """The probe process of this process (see the module docstring). ``call`` is thread-safe;
    requests are answered one at a time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._child: Optional[_Child] = None
        self._owner = os.getpid()
        self._serial = 0
        self._last_use = 0.0
        self._timer: Optional[threading.Timer] = None
        self._broken: Optional[Tuple[float, str]] = None  # (when, why) the last start failed
        self.started = 0  #: children started so far (for tests and reports)

    # ------------------------------------------------------------------ life cycle
    def _start(self) -> _Child:
        import attnplug

        root = os.path.dirname(os.path.dirname(os.path.abspath(attnplug.__file__)))
        if not sys.executable:
            raise SandboxUnavailable("sys.executable is empty: no Python interpreter to start")
        stderr = tempfile.TemporaryFile()
        kwargs: Dict[str, Any] = {"start_new_session": True} if os.name == "posix" else {}
        try:
            proc = subprocess.Popen(
                [sys.executable, "-c", _BOOT, root],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                env=dict(os.environ),
                close_fds=True,
                **kwargs,
            )
        except OSError as exc:
            stderr.close()
            raise SandboxUnavailable(f"cannot start {sys.executable}: {exc}") from None
        child = _Child(proc, stderr)
        self.started += 1
        try:
            line = child.lines.get(timeout=STARTUP_S)
        except queue.Empty:
            child.kill()
            raise SandboxUnavailable(f"the probe process did not start within {STARTUP_S:g} s") from None
        if line is None or not _message(line).get("ready"):
            how = child.ended(0)
            child.kill()
            raise SandboxUnavailable(f"the probe process ended before it was ready: it {how}")
        return child

    def _drop(self, kill: bool) -> None:
        child, self._child = self._child, None
        if child is not None:
            if kill:
                child.kill()
            else:
                child.close()

    def close(self) -> None:
        """Stop the child (if any) now; the next request starts a new one."""
        with self._lock:
            self._cancel_idle()
            if self._child is not None and self._owner == os.getpid():
                try:  # politely: the child ends when its stdin closes
                    self._child.close(wait=2.0)
                except Exception:  # noqa: BLE001 - at exit, a child that will not end is killed
                    self._child.kill()
            self._child = None

    def _after_fork_in_child(self) -> None:
        """The probe process belongs to the parent of a fork: forget it without touching it."""
        self._lock = threading.Lock()
        self._child = None
        self._timer = None
        self._owner = os.getpid()

    def _cancel_idle(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _schedule_idle(self) -> None:
        self._last_use = time.monotonic()
        if self._child is None:
            return
        timer = threading.Timer(IDLE_S, self._stop_if_idle)
        timer.name = "attnplug probe process: idle timer"
        timer.daemon = True  # never keeps the process alive
        timer.start()
        self._timer = timer

    def _stop_if_idle(self) -> None:
        if not self._lock.acquire(blocking=False):
            return  # a request is running: it schedules the next check
        try:
            if self._child is not None and time.monotonic() - self._last_use >= IDLE_S * 0.9:
                self._drop(kill=False)
        finally:
            self._lock.release()

    # ------------------------------------------------------------------ requests
    def call(self, op: str, args: Dict[str, Any], limit: Optional[float]) -> Outcome:
        """Run request ``op`` (``worker.OPS``) in the child, each phase under ``limit`` seconds
        (``None``: no limit); returns an ``Outcome`` whose ``value`` is the reply's data.
        Raises ``SandboxUnavailable`` when no child can be started."""
        with self._lock:
            if self._owner != os.getpid():  # forked without register_at_fork: not ours to use
                self._child, self._timer, self._owner = None, None, os.getpid()
            self._cancel_idle()
            try:
                if self._child is None:
                    if self._broken is not None and time.monotonic() - self._broken[0] < RETRY_S:
                        raise SandboxUnavailable(self._broken[1])
                    try:
                        self._child = self._start()
                    except SandboxUnavailable as exc:
                        self._broken = (time.monotonic(), str(exc))
                        raise
                    self._broken = None
                return self._exchange(self._child, op, args, limit)
            finally:
                self._schedule_idle()

    def _exchange(self, child: _Child, op: str, args: Dict[str, Any], limit: Optional[float]) -> Outcome:
        self._serial += 1
        rid = self._serial
        mark = child.output_size()
        request = {"id": rid, "op": op, "args": args, "env": dict(os.environ), "path": list(sys.path)}
        try:
            request["cwd"] = os.getcwd()
        except OSError:
            pass
        phase = None
        try:
            child.send(request)
        except (OSError, ValueError):  # it ended since the last request
            ended = child.ended(mark)
            self._drop(kill=True)
            return Outcome(ended=ended, phase=phase, isolated=True)
        deadline = None if limit is None else time.monotonic() + limit
        while True:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                self._drop(kill=True)
                return Outcome(timed_out=True, phase=phase, isolated=True)
            try:
                line = child.lines.get(timeout=remaining)
            except queue.Empty:
                continue
            if line is None:
                ended = child.ended(mark)
                self._drop(kill=True)
                return Outcome(ended=ended, phase=phase, isolated=True)
            message = _message(line)
            if message.get("id") != rid:
                continue  # not the protocol: something the plugin wrote to the pipe
            if "phase" in message:
                phase = str(message["phase"])
                deadline = None if limit is None else time.monotonic() + limit
                continue
            if "done" in message:
                changes = tuple((str(p), str(t)) for p, t in message.get("changes") or ())
                threads = tuple((str(p), str(t)) for p, t in message.get("threads") or ())
                if message.get("retire"):
                    self._drop(kill=True)
                return Outcome(value=message["done"], phase=phase, changes=changes, threads=threads, isolated=True)


def _message(line: bytes) -> Dict[str, Any]:
    try:
        message = json.loads(line)
    except ValueError:
        return {}
    return message if isinstance(message, dict) else {}


_SANDBOX = Sandbox()
atexit.register(_SANDBOX.close)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_SANDBOX._after_fork_in_child)


def sandbox() -> Sandbox:
    """The probe process of this process."""
    return _SANDBOX
