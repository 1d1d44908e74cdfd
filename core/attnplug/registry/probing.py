"""Running a registered backend's own code once, contained and timed, and keeping the verdicts.

A ``Prober`` answers, for the backends of one registry: does the probe pass (``probe``), does
the ``"module:Class"`` target import to a concrete ``AttentionBackend`` subclass (``resolve``),
what do the class's ``needs_cpu_seq_lens``, ``declared_capabilities()`` and ``describe()`` say
(``class_facts``), and what did that code do to the process (``notes``).

Where the code runs:

* a backend of an *isolated* plugin (``BackendRecord.isolated``: any entry-point plugin that is
  not part of the attnplug distribution) is probed, trial-imported and described in the probe
  process (``sandbox``). Only when the trial import there went well is the class imported here
  (``get_backend()`` returns it), in a guarded thread under the time limit;
* the attnplug distribution's own plugins, and plugins injected as objects (tests, embedding),
  run here, each call in a guarded thread under the time limit (``containment.TimedCall``).

Either way every caller waits for the same run without holding a lock, the first verdict is
kept, and whatever the plugin's code returns is checked and turned into plain values where it
ran. A verdict says what the code did: raised, returned something malformed, timed out, ended
the probe process (exit code or signal), left a non-daemon thread running; changes it made to
the process state are listed as notes, undone here or ignored in the probe process.
"""

from __future__ import annotations

import enum
import importlib
import inspect
import threading
import uuid
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Type

import torch

from ..backend import AttentionBackend
from ..capabilities import Capabilities, GraphSupport
from .containment import Outcome, TimedCall, exc_text, probe_timeout, run_contained, short_repr
from .hookspecs import HOOK_NAME
from .records import BackendRecord, ProbeResult
from .sandbox import SandboxUnavailable, sandbox

__all__ = ["Prober", "class_facts_of", "resolve_target", "run_probe"]

#: ``(needs_cpu_seq_lens, describe() hints, problem)`` of a backend class
ClassFacts = Tuple[Optional[bool], Optional[Dict[str, Any]], Optional[str]]


def _limit_text(limit: Optional[float]) -> str:
    return "the time limit" if limit is None else f"{limit:g} s"


def _owner(record: BackendRecord) -> str:
    dist = f"{record.distribution} {record.version}" if record.distribution else "no distribution"
    return f"backend {record.name!r} of plugin {record.plugin!r} ({dist})"


class Prober:
    """The probes, classes and class facts of the backends in ``records``, each computed at
    most once. No lock is held while plugin code runs: a thread waiting for a slow probe delays
    no thread that needs another backend (isolated plugins share one probe process, which
    answers one request at a time, each bounded by the time limit)."""

    def __init__(self, records: Mapping[str, BackendRecord]) -> None:
        self._records = records
        self._token = uuid.uuid4().hex  # this registry's plugins, in the probe process
        self._state = threading.Lock()  # guards the dicts below; never held while plugin code runs
        self._probes: Dict[str, ProbeResult] = {}
        self._facts: Dict[str, ClassFacts] = {}
        self._trials: Dict[str, Optional[str]] = {}
        self._classes: Dict[str, Tuple[Optional[type], Optional[str]]] = {}
        self._running: Dict[Tuple[str, str], TimedCall] = {}
        self._notes: Dict[str, List[str]] = {}

    def notes(self, name: str) -> Tuple[str, ...]:
        """What the code of backend ``name`` did to the process so far (undone or ignored)."""
        with self._state:
            return tuple(self._notes.get(name, ()))

    def all_notes(self) -> Dict[str, Tuple[str, ...]]:
        with self._state:
            return {name: tuple(notes) for name, notes in self._notes.items() if notes}

    # ------------------------------------------------------------------ running once
    def _once(
        self,
        kind: str,
        name: str,
        cache: Dict[str, Any],
        run: Callable[[], Any],
        what: str,
        timeout: Optional[float],
        guard: bool,
        verdict: Callable[[Outcome], Tuple[Any, List[str]]],
    ) -> Any:
        """Run ``run`` once per (kind, name) in its own thread (under ``timeout``, guarded when
        ``guard``); every caller waits for the same run without holding a lock; the first
        verdict is kept with its notes. ``verdict(outcome)`` gives ``(result, notes)``."""
        with self._state:
            if name in cache:
                return cache[name]
            call = self._running.get((kind, name))
            if call is None:
                call = self._running[(kind, name)] = TimedCall(run, what, timeout, guard=guard)
        outcome = call.wait()
        if outcome is None:
            outcome = Outcome(timed_out=True)
        elif not guard and outcome.ok and isinstance(outcome.value, Outcome):
            outcome = outcome.value  # a request to the probe process: the outcome it gave
        result, notes = verdict(outcome)
        with self._state:
            self._running.pop((kind, name), None)
            if name not in cache:
                cache[name] = result
                if notes:
                    self._notes.setdefault(name, []).extend(notes)
            return cache[name]

    def _isolated(
        self, op: str, args: Dict[str, Any], limit: Optional[float], decode: Callable[[Any], Outcome], fallback
    ) -> Outcome:
        """Request ``op`` from the probe process and ``decode`` its data; where no probe
        process can start, ``fallback`` runs here, guarded, and the outcome says so."""
        try:
            outcome = sandbox().call(op, args, limit)
        except SandboxUnavailable as exc:
            here = run_contained(fallback, f"{op} of backend {args.get('backend')!r}", limit)
            return Outcome(
                value=here.value,
                error=here.error,
                timed_out=here.timed_out,
                changes=tuple(("fallback", c) for c in here.changes) + (("fallback", f"ran in this process: {exc}"),),
                threads=tuple(("fallback", t) for t in here.threads),
            )
        if not outcome.ok:
            return outcome
        decoded = decode(outcome.value if isinstance(outcome.value, dict) else {})
        return Outcome(
            value=decoded.value,
            error=decoded.error,
            phase=outcome.phase,
            changes=outcome.changes,
            threads=outcome.threads,
            isolated=True,
        )

    # ------------------------------------------------------------------ probes
    def probe(self, name: str) -> ProbeResult:
        """Run (once) and return the probe of backend ``name``; a probe that raises (anything,
        ``SystemExit`` included), returns something malformed, outlives
        ``$ATTNPLUG_PROBE_TIMEOUT``, ends its process or leaves a non-daemon thread running gives
        an unavailable result carrying that reason."""
        record = self._records[name]
        limit = probe_timeout()
        what = f"the probe of backend {name!r}"
        if not record.isolated:
            run = lambda: run_probe(record.probe)  # noqa: E731
            return self._once("probe", name, self._probes, run, what, limit, True, self._probe_verdict(record, limit))
        args = {
            "registry": self._token,
            "backend": name,
            "plugin": {
                "name": record.plugin,
                "value": record.entry_point,
                "distribution": record.distribution,
                "version": record.version,
            },
        }

        def decode(data: Dict[str, Any]) -> Outcome:
            result = data.get("result")
            if isinstance(result, list) and len(result) == 3:
                return Outcome(value=ProbeResult(bool(result[0]), str(result[1]), result[2]))
            return Outcome(error=str(data.get("error") or f"malformed reply {short_repr(data)}"))

        run = lambda: self._isolated("probe", args, limit, decode, lambda: run_probe(record.probe))  # noqa: E731
        return self._once("probe", name, self._probes, run, what, None, False, self._probe_verdict(record, limit))

    def _probe_verdict(self, record: BackendRecord, limit: Optional[float]):
        plugin = repr(record.plugin)
        before = {"import": f"importing plugin {plugin}", "hook": f"the {HOOK_NAME} hook of plugin {plugin}"}

        def verdict(o: Outcome) -> Tuple[ProbeResult, List[str]]:
            notes = _notes("the probe", o, {None, "probe", "fallback"})
            subject = before.get(o.phase or "")
            if o.timed_out:
                if subject:
                    why = f"probe not run: {subject} timed out after {_limit_text(limit)} in the probe process (killed)"
                elif o.isolated:
                    why = f"probe timed out after {_limit_text(limit)}; its process was killed"
                else:
                    why = f"probe timed out after {_limit_text(limit)} (left running in a background thread)"
            elif o.ended:
                why = f"probe not run: {subject} {o.ended}" if subject else f"probe {o.ended}"
            elif not o.ok:
                why = f"probe not run: {o.error}" if o.isolated else f"probe raised {o.error}"
            else:
                threads = _threads(o, {None, "probe", "fallback"})
                if not threads:
                    return o.value, notes
                why = f"probe left a non-daemon thread running ({threads}); a probe must not leave threads behind" + (
                    " (its process was stopped)" if o.isolated else " (it keeps this process from exiting)"
                )
            return ProbeResult(False, why), notes

        return verdict

    # ------------------------------------------------------------------ classes
    def resolve(self, name: str) -> Tuple[Optional[Type[AttentionBackend]], Optional[str]]:
        """Import the class of backend ``name`` (once): ``(cls, None)`` or ``(None, reason)``.
        Does not probe: callers decide whether importing is appropriate. The class of an
        isolated plugin is first imported in the probe process; it is imported here only when
        that import returned, within the time limit, a concrete backend class and left no
        thread running."""
        with self._state:
            cached = self._classes.get(name)
        if cached is not None:
            return cached
        record = self._records[name]
        limit = probe_timeout()
        target = record.target
        if record.isolated:
            problem = self._trial_import(record, limit)
            if problem is not None:
                with self._state:
                    return self._classes.setdefault(name, (None, problem))

        def verdict(o: Outcome) -> Tuple[Tuple[Optional[type], Optional[str]], List[str]]:
            notes = _notes(f"importing {target!r}", o, {None})
            threads = _threads(o, {None})
            if threads:
                notes.append(
                    f"importing {target!r} left a non-daemon thread running ({threads}): "
                    "this process cannot exit until it ends"
                )
            if o.timed_out:
                return (None, f"cannot import {target!r}: the import timed out after {_limit_text(limit)}"), notes
            if not o.ok:
                return (None, f"cannot import {target!r}: {o.error}"), notes
            return o.value, notes

        what = f"the import of backend {name!r} from {target!r}"
        return self._once("resolve", name, self._classes, lambda: resolve_target(target), what, limit, True, verdict)

    def _trial_import(self, record: BackendRecord, limit: Optional[float]) -> Optional[str]:
        """Why the class of ``record`` must not be imported here (its import in the probe
        process failed, hung, ended the process or left a thread), or None."""
        target = record.target
        args = {"registry": self._token, "backend": record.name, "target": target}

        def decode(data: Dict[str, Any]) -> Outcome:
            if "problem" in data:
                return Outcome(value=data["problem"])
            return Outcome(error=str(data.get("error") or f"malformed reply {short_repr(data)}"))

        def verdict(o: Outcome) -> Tuple[Optional[str], List[str]]:
            if o.timed_out:
                return (
                    f"cannot import {target!r}: its import timed out after {_limit_text(limit)} in the probe "
                    "process (killed); it is not imported here"
                ), []
            if o.ended:
                return f"cannot import {target!r}: its import {o.ended}; it is not imported here", []
            if not o.ok:
                return f"cannot import {target!r}: {o.error}", []
            threads = _threads(o, {"resolve"})
            if threads:
                return (
                    f"cannot import {target!r}: its import left a non-daemon thread running ({threads}) in the "
                    "probe process; it is not imported here, where it would keep the process from exiting"
                ), []
            prefix = "ran in this process: "
            skipped = [t[len(prefix) :] for p, t in o.changes if p == "fallback" and t.startswith(prefix)]
            return o.value, [
                f"{target!r} was imported without a trial import in the probe process: {why}" for why in skipped
            ]

        run = lambda: self._isolated("resolve", args, limit, decode, lambda: None)  # noqa: E731
        what = f"the trial import of backend {record.name!r}"
        return self._once("trial", record.name, self._trials, run, what, None, False, verdict)

    def class_facts(self, name: str, cls: type) -> ClassFacts:
        """``(needs_cpu_seq_lens, describe() hints, problem)`` of an available backend's class,
        read once under the time limit (``needs_cpu_seq_lens``, ``declared_capabilities()``
        and ``describe()`` are plugin code): in the probe process for an isolated plugin."""
        record = self._records[name]
        limit = probe_timeout()
        owner = f"{cls.__name__} ({_owner(record)})"
        what = f"{cls.__name__}.describe() of backend {name!r}"

        def verdict(o: Outcome) -> Tuple[ClassFacts, List[str]]:
            notes = _notes(f"{cls.__name__}.describe()", o, {None, "describe", "fallback"})
            if o.timed_out:
                killed = "; its process was killed" if o.isolated else ""
                return (None, None, f"{cls.__name__}.describe() timed out after {_limit_text(limit)}{killed}"), notes
            if o.ended:
                return (None, None, f"{cls.__name__}.describe() {o.ended}"), notes
            if not o.ok:
                return (None, None, f"reading {cls.__name__}'s class attributes raised {o.error}"), notes
            threads = _threads(o, {None, "describe", "fallback"})
            if threads:
                facts = o.value
                problem = f"{cls.__name__}.describe() left a non-daemon thread running ({threads})"
                return (facts[0], facts[1], f"{facts[2]}; {problem}" if facts[2] else problem), notes
            return o.value, notes

        if not record.isolated:
            run = lambda: class_facts_of(cls, owner)  # noqa: E731
            return self._once("describe", name, self._facts, run, what, limit, True, verdict)

        def decode(data: Dict[str, Any]) -> Outcome:
            facts = data.get("facts")
            if isinstance(facts, list) and len(facts) == 3:
                return Outcome(value=(facts[0], facts[1], facts[2]))
            return Outcome(error=str(data.get("error") or f"malformed reply {short_repr(data)}"))

        args = {"registry": self._token, "backend": name, "target": record.target, "owner": owner}
        run = lambda: self._isolated("describe", args, limit, decode, lambda: class_facts_of(cls, owner))  # noqa: E731
        return self._once("describe", name, self._facts, run, what, None, False, verdict)

    def usable(self, name: str) -> Tuple[Optional[Type[AttentionBackend]], str]:
        """``(cls, reason)`` when the probe passes and the class resolves, else ``(None, reason)``."""
        result = self.probe(name)
        if not result.available:
            return None, result.reason
        cls, error = self.resolve(name)
        if cls is None:
            return None, f"the probe passed ({result.reason}) but the backend class is unusable: {error}"
        return cls, result.reason


def _notes(subject: str, o: Outcome, phases) -> List[str]:
    """``"<subject> changed os.environ X (ignored)"`` for each change ``o`` reports in ``phases``
    (``None``: a run here, whose changes were undone)."""
    notes = []
    for change in o.changes:
        phase, text = change if isinstance(change, tuple) else (None, change)
        if phase not in phases:
            continue
        if phase == "fallback" and text.startswith("ran in this process"):
            notes.append(f"{subject} {text}")
        else:
            notes.append(f"{subject} {text} ({'ignored' if o.isolated else 'undone'})")
    return notes


def _threads(o: Outcome, phases) -> str:
    names = [
        t[1] if isinstance(t, tuple) else t for t in o.threads if (t[0] if isinstance(t, tuple) else None) in phases
    ]
    return ", ".join(names)


# ---------------------------------------------------------------------------- the plugin's code, contained
def run_probe(probe: Callable[[], Any]) -> ProbeResult:
    """Call the probe and normalise what it returns into a ``ProbeResult`` of plain values.
    Runs where the probe runs: everything that touches the plugin's objects happens here."""
    try:
        raw = probe()
    except BaseException as exc:  # noqa: BLE001 - a probe that raises only makes its own backend unavailable
        return ProbeResult(False, f"probe raised {exc_text(exc)}")
    try:
        return _probe_result(raw)
    except BaseException as exc:  # noqa: BLE001 - what it returned runs plugin code too (len, str, ...)
        return ProbeResult(False, f"reading what the probe returned raised {exc_text(exc)}")


def _probe_result(raw: Any) -> ProbeResult:
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


def resolve_target(target: str) -> Tuple[Optional[type], Optional[str]]:
    """Import ``"module:Class"``: ``(cls, None)`` for a concrete ``AttentionBackend`` subclass,
    else ``(None, reason)``."""
    module_name, _, qualname = target.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
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


def _kind(value: Any) -> str:
    return f"{short_repr(value)} (a {type(value).__name__})"


def _bad_int_tuple(value: Any) -> bool:
    return not isinstance(value, tuple) or not all(type(v) is int and v > 0 for v in value)


#: field -> (check that fails on a wrong value, what is expected)
_CAPABILITY_FIELDS: Dict[str, Tuple[Callable[[Any], bool], str]] = {
    "device_type": (lambda v: not isinstance(v, str) or not v, "a device type string such as 'cpu'"),
    "needs_cpu_seq_lens": (lambda v: not isinstance(v, bool), "True or False"),
    "pdl": (lambda v: not isinstance(v, bool), "True or False"),
    "graphs": (lambda v: not isinstance(v, GraphSupport), "a GraphSupport"),
    "dtypes": (
        lambda v: not isinstance(v, tuple) or not all(isinstance(d, torch.dtype) for d in v),
        "a tuple of torch dtypes",
    ),
    "head_dims": (_bad_int_tuple, "a tuple of positive ints"),
    "page_sizes": (_bad_int_tuple, "a tuple of positive ints"),
    "sliding_window": (lambda v: not isinstance(v, bool), "True or False"),
    "logit_softcap": (lambda v: not isinstance(v, bool), "True or False"),
    "attention_sinks": (lambda v: not isinstance(v, bool), "True or False"),
    "large_kv_buffers": (lambda v: not isinstance(v, bool), "True or False"),
}


def capabilities_problem(caps: Any) -> Optional[str]:
    """Why ``caps`` (what ``declared_capabilities()`` returned) is not ``None`` or a well-typed
    ``Capabilities``, or None."""
    if caps is None:
        return None
    if not isinstance(caps, Capabilities):
        return f"returned {_kind(caps)}; expected an attnplug.Capabilities or None"
    wrong = []
    for name, (bad, expected) in _CAPABILITY_FIELDS.items():
        value = getattr(caps, name, None)
        if bad(value):
            wrong.append(f"{name}={_kind(value)}, expected {expected}")
    if wrong:
        return "returned a Capabilities with wrong-typed fields: " + "; ".join(wrong)
    return None


def class_facts_of(cls: type, owner: str) -> ClassFacts:
    """``(needs_cpu_seq_lens, describe() hints made JSON-able, problem)`` of a backend class;
    ``owner`` names the class, its backend and plugin in a problem about the capabilities.
    Runs where the plugin's code runs (``Prober.class_facts``)."""
    raw_needs = getattr(cls, "needs_cpu_seq_lens", True)
    problems = []
    needs_cpu: Optional[bool] = raw_needs if isinstance(raw_needs, bool) else None
    if needs_cpu is None:
        problems.append(f"{owner}: needs_cpu_seq_lens is {_kind(raw_needs)}; expected True or False")
    declared = getattr(cls, "declared_capabilities", None)
    if callable(declared):
        try:
            problem = capabilities_problem(declared())
        except BaseException as exc:  # noqa: BLE001 - contained: the backend stays listed, with the problem
            problem = f"raised {exc_text(exc)}"
        if problem:
            problems.append(f"{owner}: declared_capabilities() {problem}")
            return needs_cpu, None, "; ".join(problems)
    describe = getattr(cls, "describe", None)
    if describe is None or not callable(describe):
        return needs_cpu, None, "; ".join(problems) or None
    try:
        raw = describe()
        if hasattr(raw, "to_json"):
            raw = raw.to_json()
        if not isinstance(raw, dict):
            problems.append(f"{owner}: {cls.__name__}.describe() returned {_kind(raw)}; expected a dict")
            return needs_cpu, None, "; ".join(problems)
        return needs_cpu, _jsonable(raw), "; ".join(problems) or None
    except BaseException as exc:  # noqa: BLE001 - contained: the backend stays listed, with the problem
        problems.append(f"{cls.__name__}.describe() raised {exc_text(exc)}")
        return needs_cpu, None, "; ".join(problems)
