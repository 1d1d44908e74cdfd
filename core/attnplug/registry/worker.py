"""The probe process's side of ``sandbox``: ``main()`` answers the registry's requests, one at a
time, running the plugin's code in its main thread.

Requests (one JSON line each) carry ``id``, ``op``, ``args`` and the caller's ``env``, ``path``
and ``cwd``, which the process takes on before running anything. Replies are JSON lines on the
process's original stdout: ``{"id", "phase"}`` when a phase starts (``import``, ``hook``,
``probe``, ``resolve``, ``describe``), then ``{"id", "done", "changes", "threads", "retire"}``.
``changes`` / ``threads`` are ``[phase, text]`` pairs (``containment.StateGuard``): every change
is undone before the next phase; a request that left a non-daemon thread running ends the
process after its reply (``retire``). Plugin output (fd 1 and 2) goes to the process's stderr.

Ops (``OPS``):

* ``probe``: import the plugin's entry point, call its hook (once per registry, ``args
  ["registry"]``), run the probe of ``args["backend"]``: ``{"result": [available, reason,
  device]}`` or ``{"error": why it could not run}``;
* ``resolve``: import ``args["target"]`` and check it is a concrete backend class:
  ``{"problem": None or why not}``;
* ``describe``: the class facts (``probing.class_facts_of``): ``{"facts": [needs_cpu_seq_lens,
  capabilities, problem]}`` or ``{"error": ...}``.

The process ignores SIGINT (the user's Ctrl-C is its parent's business) and ends when its stdin
closes, even while plugin code hangs.
"""

from __future__ import annotations

import faulthandler
import importlib
import importlib.metadata
import json
import os
import queue
import signal
import sys
import threading
from typing import Any, Callable, Dict, List, Optional

__all__ = ["OPS", "main"]


class _Worker:
    def __init__(self, send: Callable[[Dict[str, Any]], None]) -> None:
        self.send = send
        self.rid: Any = None
        self.changes: List[List[str]] = []
        self.threads: List[List[str]] = []
        self._phase: Optional[str] = None
        self._guard: Any = None
        #: (registry token, plugin name, entry point, distribution, version) -> {backend: probe},
        #: or why the plugin could not be loaded again
        self._plugins: Dict[Any, Any] = {}

    # ------------------------------------------------------------------ phases
    def phase(self, name: str) -> None:
        from .containment import StateGuard

        self._end_phase()
        self.send({"id": self.rid, "phase": name})
        self._phase, self._guard = name, StateGuard()

    def _end_phase(self) -> None:
        guard, self._guard = self._guard, None
        if guard is None:
            return
        try:
            self.changes += [[self._phase, text] for text in guard.changes(undo=True)]
            self.threads += [[self._phase, name] for name in guard.stray_threads()]
        except Exception:  # noqa: BLE001 - the answer matters more than the audit
            pass

    def handle(self, request: Dict[str, Any]) -> Dict[str, Any]:
        from .containment import exc_text

        self.rid, self.changes, self.threads = request.get("id"), [], []
        _take_on(request)
        try:
            done = OPS[request["op"]](self, request.get("args") or {})
        except BaseException as exc:  # noqa: BLE001 - anything the plugin raised past the op's own handling
            done = {"error": exc_text(exc)}
        self._end_phase()
        return {
            "id": self.rid,
            "done": done,
            "changes": self.changes,
            "threads": self.threads,
            "retire": bool(self.threads),
        }

    # ------------------------------------------------------------------ ops
    def probes(self, args: Dict[str, Any]) -> Any:
        """The probes the plugin registers, or why it could not be loaded again here."""
        from .containment import exc_text, plugin_call
        from .discovery import ENTRY_POINT_GROUP
        from .loading import _HOOK, _Source, hook_records

        plugin = args["plugin"]
        key = (args.get("registry"), plugin["name"], plugin["value"], plugin.get("distribution"), plugin.get("version"))
        if key in self._plugins:
            return self._plugins[key]
        ep = importlib.metadata.EntryPoint(name=plugin["name"], value=plugin["value"], group=ENTRY_POINT_GROUP)
        source = _Source.from_entry_point(ep).with_distribution(plugin.get("distribution"), plugin.get("version"))
        self.phase("import")
        with plugin_call(f"the import of {source.describe()}"):
            try:
                obj = source.load()
            except BaseException as exc:  # noqa: BLE001 - reported as the reason the probe did not run
                return self._plugins.setdefault(key, f"importing plugin {source.name!r} raised {exc_text(exc)}")
        self.phase("hook")
        with plugin_call(f"the {_HOOK} hook of {source.describe()}"):
            try:
                records = hook_records(source, obj)
            except BaseException as exc:  # noqa: BLE001
                return self._plugins.setdefault(
                    key, f"the {_HOOK} hook of plugin {source.name!r} raised {exc_text(exc)}"
                )
        return self._plugins.setdefault(key, {record.name: record.probe for record in records})

    def op_probe(self, args: Dict[str, Any]) -> Dict[str, Any]:
        from .containment import plugin_call
        from .probing import run_probe

        probes = self.probes(args)
        if isinstance(probes, str):
            return {"error": probes}
        name = args["backend"]
        probe = probes.get(name)
        if probe is None:
            return {"error": f"called again in the probe process, the plugin's hook did not register {name!r}"}
        self.phase("probe")
        with plugin_call(f"the probe of backend {name!r}"):
            result = run_probe(probe)
        return {"result": [result.available, result.reason, result.device]}

    def op_resolve(self, args: Dict[str, Any]) -> Dict[str, Any]:
        from .containment import plugin_call
        from .probing import resolve_target

        self.phase("resolve")
        with plugin_call(f"the import of backend {args.get('backend')!r} from {args['target']!r}"):
            cls, problem = resolve_target(args["target"])
        return {"problem": problem}

    def op_describe(self, args: Dict[str, Any]) -> Dict[str, Any]:
        from .containment import exc_text, plugin_call
        from .probing import class_facts_of, resolve_target

        self.phase("resolve")
        with plugin_call(f"the import of backend {args.get('backend')!r} from {args['target']!r}"):
            cls, problem = resolve_target(args["target"])
        if cls is None:
            return {"error": problem}
        self.phase("describe")
        with plugin_call(f"{cls.__name__}.describe() of backend {args.get('backend')!r}"):
            try:
                return {"facts": list(class_facts_of(cls, args.get("owner") or cls.__name__))}
            except BaseException as exc:  # noqa: BLE001 - a class attribute that raises
                return {"error": exc_text(exc)}


OPS: Dict[str, Callable[[_Worker, Dict[str, Any]], Dict[str, Any]]] = {
    "probe": _Worker.op_probe,
    "resolve": _Worker.op_resolve,
    "describe": _Worker.op_describe,
}


def _take_on(request: Dict[str, Any]) -> None:
    """The caller's environment, import path and working directory."""
    env = request.get("env")
    if isinstance(env, dict):
        os.environ.clear()
        os.environ.update({str(k): str(v) for k, v in env.items()})
    path = request.get("path")
    if isinstance(path, list):
        sys.path[:] = [str(p) for p in path]
        importlib.invalidate_caches()
    cwd = request.get("cwd")
    if isinstance(cwd, str):
        try:
            os.chdir(cwd)
        except OSError:
            pass


def main() -> None:
    """Serve requests from stdin until it closes (see the module docstring)."""
    sys.stdout.flush()
    replies = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # print() of plugin code goes to stderr, never into the protocol
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    except (ValueError, OSError):  # pragma: no cover
        pass
    faulthandler.enable()
    lock = threading.Lock()

    def send(message: Dict[str, Any]) -> None:
        try:
            text = json.dumps(message)
        except (TypeError, ValueError) as exc:
            text = json.dumps({"id": message.get("id"), "done": {"error": f"unreadable reply: {exc}"}})
        with lock:
            replies.write(text + "\n")
            replies.flush()

    requests: "queue.Queue[bytes]" = queue.Queue()

    def read() -> None:
        try:
            for line in sys.stdin.buffer:
                requests.put(line)
        finally:
            os._exit(0)  # the registry's process closed the pipe or is gone: stop, even mid-probe

    threading.Thread(target=read, name="attnplug probe process: requests", daemon=True).start()
    import attnplug.registry  # noqa: F401 - before "ready": the import is part of starting

    worker = _Worker(send)
    send({"ready": True, "pid": os.getpid()})
    while True:
        line = requests.get()
        try:
            request = json.loads(line)
        except ValueError:
            continue
        if not isinstance(request, dict):
            continue
        reply = worker.handle(request)
        send(reply)
        if reply["retire"]:
            replies.flush()
            os._exit(0)
