"""Running a registered backend's own code once, contained and timed, and keeping the verdicts.

A ``Prober`` answers, for the backends of one registry: does the probe pass (``probe``), does
the ``"module:Class"`` target import to a concrete ``AttentionBackend`` subclass (``resolve``),
what do the class's ``needs_cpu_seq_lens`` and ``describe()`` say (``class_facts``). Probes and
``describe()`` run in their own thread under ``$ATTNPLUG_PROBE_TIMEOUT``; every caller waits for
the same run without holding a lock, and the first verdict is kept. Whatever the plugin's code
returns is checked and turned into plain values here, in the thread that ran it.
"""

from __future__ import annotations

import enum
import importlib
import inspect
import threading
from typing import Any, Callable, Dict, Mapping, Optional, Tuple, Type

from ..backend import AttentionBackend
from .containment import TimedCall, contained, exc_text, probe_timeout, short_repr
from .records import BackendRecord, ProbeResult

__all__ = ["Prober"]

#: ``(needs_cpu_seq_lens, describe() hints, problem)`` of a backend class
ClassFacts = Tuple[Optional[bool], Optional[Dict[str, Any]], Optional[str]]


class Prober:
    """The probes, classes and class facts of the backends in ``records``, each computed at
    most once. No lock is held while plugin code runs: a thread waiting for a slow probe delays
    no thread that needs another backend."""

    def __init__(self, records: Mapping[str, BackendRecord]) -> None:
        self._records = records
        self._state = threading.Lock()  # guards the dicts below; never held while plugin code runs
        self._probes: Dict[str, ProbeResult] = {}
        self._facts: Dict[str, ClassFacts] = {}
        self._running: Dict[Tuple[str, str], TimedCall] = {}
        self._classes: Dict[str, Tuple[Optional[type], Optional[str]]] = {}

    def _timed(
        self,
        kind: str,
        name: str,
        cache: Dict[str, Any],
        fn: Callable[[], Any],
        what: str,
        verdict: Callable[[Optional[Any], Optional[float]], Any],
    ) -> Any:
        """Run ``fn`` once per (kind, name) in its own thread under the time limit; every caller
        waits for the same run without holding a lock; the first verdict is kept.
        ``verdict(outcome, timeout)`` turns the outcome (``None``: timed out) into the result."""
        with self._state:
            if name in cache:
                return cache[name]
            call = self._running.get((kind, name))
            if call is None:
                call = self._running[(kind, name)] = TimedCall(fn, what, probe_timeout())
        result = verdict(call.wait(), call.timeout)
        with self._state:
            self._running.pop((kind, name), None)
            return cache.setdefault(name, result)

    def probe(self, name: str) -> ProbeResult:
        """Run (once) and return the probe of backend ``name``; a probe that raises (anything,
        ``SystemExit`` included), returns something malformed or outlives
        ``$ATTNPLUG_PROBE_TIMEOUT`` gives an unavailable result carrying that reason."""
        record = self._records[name]

        def verdict(outcome, timeout):
            if outcome is None:
                return ProbeResult(False, f"probe timed out after {timeout:g} s")
            if not outcome.ok:
                return ProbeResult(False, f"probe raised {outcome.error}")
            return outcome.value

        return self._timed(
            "probe", name, self._probes, lambda: _run_probe(record), f"the probe of backend {name!r}", verdict
        )

    def resolve(self, name: str) -> Tuple[Optional[Type[AttentionBackend]], Optional[str]]:
        """Import the class of backend ``name`` (once): ``(cls, None)`` or ``(None, reason)``.
        Does not probe: callers decide whether importing is appropriate."""
        record = self._records[name]
        cached = self._classes.get(name)
        if cached is None:  # two threads may both import; the import system serialises them
            outcome = contained(
                lambda: _resolve_target(record.target), f"the import of backend {name!r} from {record.target!r}"
            )
            found = outcome.value if outcome.ok else (None, f"cannot import {record.target!r}: {outcome.error}")
            with self._state:
                cached = self._classes.setdefault(name, found)
        return cached

    def class_facts(self, name: str, cls: type) -> ClassFacts:
        """``(needs_cpu_seq_lens, describe() hints, problem)`` of an available backend's class,
        read once in its own thread under the time limit (``describe()`` is plugin code)."""

        def verdict(outcome, timeout):
            if outcome is None:
                return None, None, f"{cls.__name__}.describe() timed out after {timeout:g} s"
            if not outcome.ok:
                return None, None, f"reading {cls.__name__}'s class attributes raised {outcome.error}"
            return outcome.value

        return self._timed(
            "describe",
            name,
            self._facts,
            lambda: _class_facts(cls),
            f"{cls.__name__}.describe() of backend {name!r}",
            verdict,
        )

    def usable(self, name: str) -> Tuple[Optional[Type[AttentionBackend]], str]:
        """``(cls, reason)`` when the probe passes and the class resolves, else ``(None, reason)``."""
        result = self.probe(name)
        if not result.available:
            return None, result.reason
        cls, error = self.resolve(name)
        if cls is None:
            return None, f"the probe passed ({result.reason}) but the backend class is unusable: {error}"
        return cls, result.reason


def _run_probe(record: BackendRecord) -> ProbeResult:
    """Call the probe and normalise what it returns into a ``ProbeResult`` of plain values.
    Runs in the probe's own thread: everything that touches the plugin's objects happens here."""
    try:
        raw = record.probe()
    except BaseException as exc:  # noqa: BLE001 - a probe that raises only makes its own backend unavailable
        return ProbeResult(False, f"probe raised {exc_text(exc)}")
    if isinstance(raw, ProbeResult):
        available, reason, device = raw.available, raw.reason, raw.device
    elif isinstance(raw, tuple) and len(raw) == 2 and isinstance(raw[0], bool) and isinstance(raw[1], str):
        (available, reason), device = raw, None
    else:
        return ProbeResult(
            False, f"probe returned {short_repr(raw)}; expected a ProbeResult or (available: bool, reason: str)"
        )
    if not isinstance(available, bool):
        return ProbeResult(False, f"probe returned available={short_repr(available)}; expected a bool")
    if not isinstance(reason, str):
        return ProbeResult(False, f"probe returned reason={short_repr(reason)}; expected a str")
    if device is not None and not isinstance(device, str):
        return ProbeResult(False, f"probe returned device={short_repr(device)}; expected a str or None")
    available, reason = bool(available), str.__str__(reason)
    device = None if device is None else str.__str__(device)
    if not reason:
        reason = "available" if available else "unavailable (the probe gave no reason)"
    return ProbeResult(available, reason, device)


def _resolve_target(target: str) -> Tuple[Optional[type], Optional[str]]:
    module_name, _, qualname = target.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - SystemExit from a backend module is its own problem
        return None, f"cannot import {target!r}: {exc_text(exc)}"
    if not (isinstance(obj, type) and issubclass(obj, AttentionBackend)):
        return None, f"{target!r} is {short_repr(obj)}, not a subclass of attnplug.backend.AttentionBackend"
    if inspect.isabstract(obj):
        missing = ", ".join(sorted(getattr(obj, "__abstractmethods__", ())))
        return None, f"{target!r} is abstract (does not implement: {missing})"
    return obj, None


def _jsonable(value: Any) -> Any:
    if isinstance(value, enum.Enum):  # GraphSupport is an IntEnum: its name, not its number
        return value.name
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in value]
    return str(value).replace("torch.", "")  # torch.float16 -> "float16"


def _class_facts(cls: type) -> ClassFacts:
    """``(needs_cpu_seq_lens, describe() hints made JSON-able, problem)`` of a backend class.
    Runs in its own thread (``Prober.class_facts``): it calls the plugin's code."""
    needs_cpu = bool(getattr(cls, "needs_cpu_seq_lens", True))
    describe = getattr(cls, "describe", None)
    if describe is None or not callable(describe):
        return needs_cpu, None, None
    try:
        raw = describe()
        if hasattr(raw, "to_json"):
            raw = raw.to_json()
        if not isinstance(raw, dict):
            return needs_cpu, None, f"{cls.__name__}.describe() returned {type(raw).__name__}, expected a dict"
        return needs_cpu, _jsonable(raw), None
    except BaseException as exc:  # noqa: BLE001 - contained: the backend stays listed, with the problem
        return needs_cpu, None, f"{cls.__name__}.describe() raised {exc_text(exc)}"
