"""Plugin discovery and backend selection.

Plugins are found through the entry-point group ``attnplug.backends`` (``importlib.metadata``)
and loaded by pluggy, each one on its own: whatever goes wrong with one plugin (its import, its
``PLUGIN_API_VERSION``, its hook, a registration) is recorded as a ``PluginError`` and the others
load normally. Nothing happens at import time: the registry is built the first time it is used
(``available_backends()``, ``get_backend()``, ``load_errors()``) and then cached for the process;
``reset_registry()`` drops the cache (tests, or after changing ``ATTNPLUG_PLUGINS``).

The hot path never sees pluggy: ``get_backend()`` returns the backend class.

Environment:

* ``ATTNPLUG_PLUGINS=a,b``: load only the plugins whose entry-point names are listed; the
  others are listed as ``disabled``. Read when the registry is built.
* ``ATTNPLUG_BACKEND=name``: the backend ``get_backend()`` returns when it is given no name.
  Read at every call.
* ``ATTNPLUG_PROBE_TIMEOUT=seconds``: how long a probe or a backend class's ``describe()`` may
  run (default 5); a probe that takes longer makes its backend unavailable ("probe timed out
  after N s"). Read when the probe starts.

All three are parsed by ``attnplug.env``; a malformed value raises ``RegistryError`` naming it.

Trust: plugin code never breaks selection. Every call into a plugin is contained
(``containment``): an exception, ``SystemExit`` included, is recorded against that plugin or
backend only; probes and ``describe()`` run in their own thread under the time limit, with no
registry lock held, so a slow probe delays only the callers that need its answer; a registry
function called from plugin code the registry is running raises ``RegistryError`` instead of
deadlocking. The backend names of the attnplug distribution's own plugins belong to it: another
distribution cannot take them (``discovery``), and a backend name registered by two other
plugins is given to neither.
"""

from __future__ import annotations

import enum
import functools
import importlib
import importlib.metadata
import inspect
import re
import sys
import threading
import types
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Type

import pluggy

from .. import env
from ..backend import AttentionBackend
from ..versions import api_version
from . import hookspecs
from .containment import TimedCall, contained, exc_text, guard_reentry, probe_timeout
from .discovery import CORE_DISTRIBUTION, ENTRY_POINT_GROUP, core_distributions, discover_entry_points, normalize, plan
from .hookspecs import PROJECT_NAME, hookimpl
from .records import (
    AmbiguousBackend,
    BackendInfo,
    BackendNotFound,
    BackendRecord,
    BackendUnavailable,
    PluginError,
    ProbeResult,
    RegistryError,
)

__all__ = [
    "PLUGIN_API_VERSION",
    "ENTRY_POINT_GROUP",
    "Registry",
    "load_registry",
    "get_registry",
    "reset_registry",
    "available_backends",
    "get_backend",
    "load_errors",
    "discover_entry_points",
    "hookimpl",
]

#: version of the plugin contract (``hookspecs.AttnplugHookspecs``); a plugin declares the
#: version it was written for and is skipped when the major differs
PLUGIN_API_VERSION = "1.0"

_HOOK = "attnplug_register_backends"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
_TARGET_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
#: an entry-point value as ``importlib.metadata`` parses it: ``module``, ``module:attr``, ``[extras]``
_ENTRY_POINT_VALUE_RE = re.compile(r"(?P<module>[\w.]+)\s*(:\s*(?P<attr>[\w.]+)\s*)?((?P<extras>\[.*\])\s*)?$")


_exc_text = exc_text


def _allow_list_from_env() -> Optional[Tuple[str, ...]]:
    try:
        return env.plugin_allow_list()
    except env.EnvError as exc:
        raise RegistryError(str(exc)) from None


@dataclass(frozen=True)
class _Source:
    """Where one plugin comes from: an entry point, or an object injected by a test.
    ``malformed``: why the entry point cannot even be imported (its value does not parse)."""

    name: str
    entry_point: str
    distribution: Optional[str]
    version: Optional[str]
    load: Callable[[], Any]
    malformed: Optional[str] = None

    @property
    def is_core(self) -> bool:
        """Declared by the attnplug distribution itself (a built-in plugin)."""
        return normalize(self.distribution) == CORE_DISTRIBUTION

    @classmethod
    def from_entry_point(cls, ep: importlib.metadata.EntryPoint) -> "_Source":
        dist = getattr(ep, "dist", None)
        dist_name = dist_version = None
        if dist is not None:
            try:
                dist_name = dist.metadata["Name"]
                dist_version = dist.version
            except Exception:  # unreadable metadata: still load the plugin
                pass
        malformed = None
        if not isinstance(ep.value, str) or not _ENTRY_POINT_VALUE_RE.match(ep.value):
            malformed = (
                f"entry point {ep.name} = {ep.value!r} is malformed: expected 'module' or "
                "'module:attribute' (dotted Python names)"
            )
        return cls(ep.name, ep.value, dist_name, dist_version, ep.load, malformed)

    @classmethod
    def from_object(cls, item: Any) -> "_Source":
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            name, obj = item
        else:
            obj = item
            name = getattr(obj, "__name__", None) or type(obj).__name__
            name = name.rsplit(".", 1)[-1]
        if isinstance(obj, types.ModuleType):
            where = obj.__name__
        else:
            where = f"{getattr(obj, '__module__', '?')}:{getattr(obj, '__qualname__', type(obj).__qualname__)}"
        return cls(name, where, None, None, lambda: obj)

    def describe(self) -> str:
        dist = f"{self.distribution} {self.version}" if self.distribution else "no distribution"
        return f"plugin {self.name!r} ({dist})"

    def error(self, kind: str, reason: str, backend: Optional[str] = None) -> PluginError:
        return PluginError(
            plugin=self.name,
            entry_point=self.entry_point,
            kind=kind,
            reason=reason,
            distribution=self.distribution,
            version=self.version,
            backend=backend,
        )


def _declared_api_version(plugin: Any) -> Optional[Any]:
    """``PLUGIN_API_VERSION`` of the plugin object, or of the module that defines it."""
    version = getattr(plugin, "PLUGIN_API_VERSION", None)
    if version is None and not isinstance(plugin, types.ModuleType):
        module = sys.modules.get(getattr(plugin, "__module__", None) or "")
        version = getattr(module, "PLUGIN_API_VERSION", None)
    return version


class Registry:
    """The loaded plugins: accepted backend records and the errors met while loading.

    Build one with ``load_registry()``. Probes run lazily, at most once per backend, each in its
    own thread under ``$ATTNPLUG_PROBE_TIMEOUT``; backend classes are imported only when a
    backend is selected or listed as available. No lock is held while plugin code runs: a
    thread waiting for a slow probe delays no thread that needs another backend.
    """

    def __init__(
        self, records: Sequence[BackendRecord], errors: Sequence[PluginError], allow: Optional[Tuple[str, ...]] = None
    ) -> None:
        self._records: Dict[str, BackendRecord] = {r.name: r for r in records}
        self._errors: Tuple[PluginError, ...] = tuple(errors)
        self.allow = allow
        self._state = threading.Lock()  # guards the dicts below; never held while plugin code runs
        self._probes: Dict[str, ProbeResult] = {}
        self._facts: Dict[str, Tuple[Optional[bool], Optional[Dict[str, Any]], Optional[str]]] = {}
        self._running: Dict[Tuple[str, str], TimedCall] = {}
        self._classes: Dict[str, Tuple[Optional[type], Optional[str]]] = {}

    # ------------------------------------------------------------------ what was loaded
    @property
    def records(self) -> Tuple[BackendRecord, ...]:
        """Accepted registrations, in load order."""
        return tuple(self._records.values())

    @property
    def errors(self) -> Tuple[PluginError, ...]:
        """Problems met while loading, in load order."""
        return self._errors

    def names(self) -> Tuple[str, ...]:
        return tuple(self._records)

    # ------------------------------------------------------------------ probing / resolving
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
        guard_reentry("probe")
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
        guard_reentry("resolve")
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

    def _class_facts(self, name: str, cls: type) -> Tuple[Optional[bool], Optional[Dict[str, Any]], Optional[str]]:
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

    def _usable(self, name: str) -> Tuple[Optional[Type[AttentionBackend]], str]:
        """``(cls, reason)`` when the probe passes and the class resolves, else ``(None, reason)``."""
        result = self.probe(name)
        if not result.available:
            return None, result.reason
        cls, error = self.resolve(name)
        if cls is None:
            return None, f"the probe passed ({result.reason}) but the backend class is unusable: {error}"
        return cls, result.reason

    # ------------------------------------------------------------------ public queries
    def available_backends(self) -> List[BackendInfo]:
        """Every registered backend, available or not, highest priority first (then by
        name). Runs every probe; imports the class of each backend whose probe passes."""
        guard_reentry("available_backends")
        infos = []
        for record in self._records.values():
            result = self.probe(record.name)
            cls, reason = self._usable(record.name)
            needs_cpu = caps = None
            if cls is not None:
                needs_cpu, caps, describe_error = self._class_facts(record.name, cls)
                if describe_error:
                    reason = f"{reason}; {describe_error}"
            infos.append(
                BackendInfo(
                    name=record.name,
                    priority=record.priority,
                    available=cls is not None,
                    reason=reason,
                    backend=record.target,
                    plugin=record.plugin,
                    entry_point=record.entry_point,
                    distribution=record.distribution,
                    version=record.version,
                    device=result.device,
                    needs_cpu_seq_lens=needs_cpu,
                    capabilities=caps,
                )
            )
        infos.sort(key=lambda info: (-info.priority, info.name))
        return infos

    def load_errors(self) -> List[PluginError]:
        return list(self._errors)

    def get_backend(self, name: Optional[str] = None) -> Type[AttentionBackend]:
        """The backend class to construct.

        ``name`` if given, else ``$ATTNPLUG_BACKEND`` if set, else the available backend of
        highest priority (a tie at the top raises ``AmbiguousBackend``). An unknown name raises
        ``BackendNotFound`` listing the known names; a backend (or plugin) that cannot be used
        raises ``BackendUnavailable`` with the recorded reason and the available alternatives.
        """
        return self.select(name)[1]

    def select(self, name: Optional[str] = None) -> Tuple[str, Type[AttentionBackend]]:
        """Like ``get_backend`` but returns ``(registry name, class)``."""
        guard_reentry("get_backend")
        origin = "get_backend(name=...)"
        if name is None:
            wanted = env.backend_name()
            if wanted:
                name, origin = wanted, f"{env.BACKEND.name}={wanted}"
        if name is not None:
            return name, self._select(name, origin)
        return self._auto()

    # ------------------------------------------------------------------ selection
    def _available_names(self, exclude: Optional[str] = None) -> Tuple[str, ...]:
        return tuple(
            n
            for n in sorted(self._records, key=lambda n: (-self._records[n].priority, n))
            if n != exclude and self._usable(n)[0] is not None
        )

    def _select(self, name: str, origin: str) -> Type[AttentionBackend]:
        if name not in self._records:
            # the name's own plugin first (a built-in that was not loaded), then refused claimants
            related = sorted(
                (e for e in self._errors if name in (e.plugin, e.backend)),
                key=lambda e: e.plugin != name or e.kind == "reserved",
            )
            if related:
                error = related[0]
                alternatives = self._available_names()
                raise BackendUnavailable(
                    f"backend {name!r} (selected by {origin}) is unavailable: "
                    f"{error.describe_source()} {_ERROR_VERBS.get(error.kind, 'failed')}: {error.reason}. "
                    f"{_alternatives_text(alternatives)}",
                    name=name,
                    reason=error.reason,
                    alternatives=alternatives,
                )
            known = tuple(sorted(self._records))
            raise BackendNotFound(
                f"no backend named {name!r} (selected by {origin}); "
                f"registered backends: {', '.join(known) or 'none'}"
                + (
                    f"; plugins that did not load: {', '.join(sorted({e.plugin for e in self._errors}))}"
                    f" (see `attnplug info`)"
                    if self._errors
                    else ""
                ),
                name=name,
                known=known,
            )
        cls, reason = self._usable(name)
        if cls is None:
            alternatives = self._available_names(exclude=name)
            raise BackendUnavailable(
                f"backend {name!r} (selected by {origin}) is unavailable: {reason}. {_alternatives_text(alternatives)}",
                name=name,
                reason=reason,
                alternatives=alternatives,
            )
        return cls

    def _auto(self) -> Tuple[str, Type[AttentionBackend]]:
        levels = sorted({r.priority for r in self._records.values()}, reverse=True)
        for priority in levels:
            usable = []
            for name in sorted(n for n, r in self._records.items() if r.priority == priority):
                cls, reason = self._usable(name)
                if cls is not None:
                    usable.append((name, cls))
                elif self.probe(name).available:  # probe passed, class broken: say so
                    warnings.warn(f"attnplug: skipping backend {name!r}: {reason}", RuntimeWarning, stacklevel=3)
            if len(usable) == 1:
                return usable[0]
            if len(usable) > 1:
                names = tuple(n for n, _ in usable)
                raise AmbiguousBackend(
                    f"several available backends share the top priority {priority}: {', '.join(names)}; "
                    f"choose one with get_backend(name) or {env.BACKEND.name}=<name>",
                    candidates=names,
                    priority=priority,
                )
        lines = [f"  {n}: {self._usable(n)[1]}" for n in self._records]
        lines += [f"  {e.describe_source()}: {e.kind}: {e.reason}" for e in self._errors]
        raise BackendUnavailable(
            "no attention backend is available"
            + (":\n" + "\n".join(lines) if lines else " (no plugin registered one)"),
            name=None,
            reason="no backend available",
            alternatives=(),
        )


_ERROR_VERBS = {
    "disabled": "was not loaded",
    "import": "failed to import",
    "api-version": "was skipped",
    "invalid": "was rejected",
    "hook": "failed to register its backends",
    "duplicate": "was rejected",
    "reserved": "was refused",
    "distribution": "is installed more than once",
}


def _alternatives_text(alternatives: Sequence[str]) -> str:
    if alternatives:
        return f"Available backends: {', '.join(alternatives)}."
    return "No other backend is available."


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
            False, f"probe returned {_short_repr(raw)}; expected a ProbeResult or (available: bool, reason: str)"
        )
    if not isinstance(available, bool):
        return ProbeResult(False, f"probe returned available={_short_repr(available)}; expected a bool")
    if not isinstance(reason, str):
        return ProbeResult(False, f"probe returned reason={_short_repr(reason)}; expected a str")
    if device is not None and not isinstance(device, str):
        return ProbeResult(False, f"probe returned device={_short_repr(device)}; expected a str or None")
    available, reason = bool(available), str.__str__(reason)
    device = None if device is None else str.__str__(device)
    if not reason:
        reason = "available" if available else "unavailable (the probe gave no reason)"
    return ProbeResult(available, reason, device)


def _short_repr(value: Any) -> str:
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - plugin objects may not print
        text = f"<{type(value).__name__} object>"
    return text if len(text) <= 200 else text[:200] + "..."


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
        return None, f"{target!r} is {_short_repr(obj)}, not a subclass of attnplug.backend.AttentionBackend"
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


def _class_facts(cls: type) -> Tuple[Optional[bool], Optional[Dict[str, Any]], Optional[str]]:
    """``(needs_cpu_seq_lens, describe() hints made JSON-able, problem)`` of a backend class.
    Runs in its own thread (``Registry._class_facts``): it calls the plugin's code."""
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


# ---------------------------------------------------------------------------- loading
class _Registration:
    """The ``register`` callable handed to one plugin's hook: it validates the arguments and
    collects the registrations; they are kept only if the hook returns normally."""

    def __init__(self, source: _Source) -> None:
        self.source = source
        self.records: List[BackendRecord] = []
        self.closed = False

    def __call__(self, *, name: str, backend: str, probe: Callable[[], Any], priority: int = 0) -> None:
        if self.closed:
            raise RuntimeError("register() was called after the attnplug_register_backends hook returned")
        # exact types: the values are kept and compared long after the plugin's code returned
        if type(name) is not str or not _NAME_RE.match(name):
            raise ValueError(
                f"register(name={name!r}): a backend name is a non-empty string of letters, digits, '_', '.', '-'"
            )
        if type(backend) is not str or not _TARGET_RE.match(backend):
            raise ValueError(f"register(name={name!r}, backend={backend!r}): backend must be a 'module:Class' string")
        if not callable(probe):
            raise TypeError(f"register(name={name!r}): probe must be callable, got {probe!r}")
        if type(priority) is not int:
            raise TypeError(f"register(name={name!r}): priority must be an int, got {priority!r}")
        if any(record.name == name for record in self.records):
            raise ValueError(f"register(name={name!r}) was called twice by this plugin")
        src = self.source
        self.records.append(
            BackendRecord(
                name=name,
                target=backend,
                probe=probe,
                priority=priority,
                plugin=src.name,
                entry_point=src.entry_point,
                distribution=src.distribution,
                version=src.version,
            )
        )


def _owner(record: BackendRecord) -> str:
    dist = f"{record.distribution} {record.version}" if record.distribution else "no distribution"
    return f"plugin {record.plugin!r} ({dist})"


def load_registry(
    *,
    entry_points: Optional[Iterable[importlib.metadata.EntryPoint]] = None,
    extra_plugins: Iterable[Any] = (),
    allow: Optional[Iterable[str]] = None,
) -> Registry:
    """Discover, load and call every plugin; return a new ``Registry`` (not cached).

    * ``entry_points``: the entry points to load (default: ``discover_entry_points()``, every
      copy of every distribution on ``sys.path``; ``discovery.plan`` settles copies and
      reserved names).
    * ``extra_plugins``: plugins without an entry point, loaded after the entry points the same
      way (version check, hook, isolation): modules or objects holding a hookimpl, or
      ``(name, object)`` pairs. For tests and embedding.
    * ``allow``: plugin names to load (default: ``$ATTNPLUG_PLUGINS`` when set, else all).
    """
    allow_list = tuple(allow) if allow is not None else _allow_list_from_env()
    pm = pluggy.PluginManager(PROJECT_NAME)
    pm.add_hookspecs(hookspecs.AttnplugHookspecs)

    if entry_points is None:
        loading = plan(discover_entry_points(), core_distributions())
    else:
        loading = plan(list(entry_points))
    errors: List[PluginError] = list(loading.errors)
    sources = [_Source.from_entry_point(ep) for ep in loading.entry_points] + [
        _Source.from_object(p) for p in extra_plugins
    ]

    loaded: List[Tuple[str, _Source, Any]] = []  # (pluggy name, source, plugin object)
    taken_pm_names: set = set()
    for source in sources:
        if allow_list is not None and source.name not in allow_list:
            errors.append(source.error("disabled", f"not in {env.PLUGINS.name}={','.join(allow_list)}"))
            continue
        if source.malformed:
            errors.append(source.error("invalid", source.malformed))
            continue
        imported = contained(source.load, f"the import of {source.describe()}")
        if not imported.ok:
            errors.append(source.error("import", imported.error))
            continue
        plugin = imported.value
        declared = contained(functools.partial(_declared_api_version, plugin), f"{source.describe()}")
        if not declared.ok:
            errors.append(source.error("api-version", f"reading PLUGIN_API_VERSION raised {declared.error}"))
            continue
        problem = _api_version_problem(declared.value)
        if problem:
            errors.append(source.error("api-version", problem))
            continue
        pm_name = f"{source.distribution or '<injected>'}:{source.name}"
        base, n = pm_name, 1
        while pm_name in taken_pm_names:
            n += 1
            pm_name = f"{base}#{n}"
        registered = contained(functools.partial(pm.register, plugin, name=pm_name), f"{source.describe()}")
        if not registered.ok:  # PluginValidationError (bad hookimpl), the same object twice, or plugin code
            errors.append(source.error("invalid", registered.error))
            continue
        taken_pm_names.add(pm_name)
        loaded.append((pm_name, source, plugin))

    # Hook implementations for hooks nobody specifies (a typo in the hook name). Checked for the
    # whole manager as pluggy intends; an offending plugin is dropped and recorded, the rest stay.
    by_pm_name = {pm_name: source for pm_name, source, _ in loaded}
    for _ in range(len(loaded) + 1):
        try:
            pm.check_pending()
            break
        except pluggy.PluginValidationError as exc:
            pm_name = pm.get_name(exc.plugin)
            source = by_pm_name.get(pm_name) if pm_name else None
            pm.unregister(exc.plugin)
            loaded = [item for item in loaded if item[0] != pm_name]
            if source is not None:
                errors.append(source.error("invalid", _exc_text(exc)))

    claims: Dict[str, List[Tuple[_Source, BackendRecord]]] = {}
    for pm_name, source, _plugin in loaded:
        others = [p for other_name, _, p in loaded if other_name != pm_name]
        caller = pm.subset_hook_caller(_HOOK, remove_plugins=others)
        registration = _Registration(source)
        called = contained(functools.partial(caller, register=registration), f"the {_HOOK} hook of {source.describe()}")
        registration.closed = True
        if not called.ok:
            errors.append(source.error("hook", f"{_HOOK} raised {called.error}"))
            continue
        if not registration.records:
            errors.append(
                source.error("invalid", f"registered no backend (no {_HOOK} hookimpl, or it never called register)")
            )
            continue
        for record in registration.records:
            claims.setdefault(record.name, []).append((source, record))

    records, refused = _settle_names(claims, loading.core)
    errors += refused
    return Registry(records, errors, allow_list)


def _api_version_problem(declared: Any) -> Optional[str]:
    if declared is None:
        return f"does not declare PLUGIN_API_VERSION (this attnplug provides plugin API {PLUGIN_API_VERSION})"
    version = api_version(declared)
    if version is None:
        return f"PLUGIN_API_VERSION={_short_repr(declared)} is not a 'MAJOR.MINOR' string"
    if version[0] != api_version(PLUGIN_API_VERSION)[0]:
        return f"built for plugin API {declared}; this attnplug provides {PLUGIN_API_VERSION} (major versions differ)"
    return None


def _settle_names(
    claims: Dict[str, List[Tuple[_Source, BackendRecord]]], core_entry_points: Dict[str, Any]
) -> Tuple[List[BackendRecord], List[PluginError]]:
    """Who keeps each registered backend name, whatever the loading order.

    * A name registered by a plugin of the attnplug distribution, or equal to one of its
      entry-point names (a built-in that is disabled or failed to load), belongs to attnplug;
      every other claimant is refused (kind ``"reserved"``), naming both distributions.
    * A name claimed by several other plugins is given to none of them: each is reported (kind
      ``"duplicate"``), naming all of them, so selecting it fails with that reason.
    """
    records: List[BackendRecord] = []
    errors: List[PluginError] = []
    for name, claimants in claims.items():
        core = [(s, r) for s, r in claimants if s.is_core]
        others = [(s, r) for s, r in claimants if not s.is_core]
        if core or name in core_entry_points:
            if core:
                records.append(core[0][1])
                owner = f"{_owner(core[0][1])} registers it as {core[0][1].target!r}"
            else:
                ep = core_entry_points[name]
                owner = (
                    f"it is the name of the built-in entry point {name} = {ep.value!r} of "
                    f"{CORE_DISTRIBUTION} {getattr(getattr(ep, 'dist', None), 'version', '')}".rstrip()
                )
            for source, record in core[1:] + others:
                errors.append(
                    source.error(
                        "reserved",
                        f"backend name {name!r} belongs to {CORE_DISTRIBUTION} ({owner}); this registration by "
                        f"{_owner(record)} as {record.target!r} is refused",
                        backend=name,
                    )
                )
        elif len(others) == 1:
            records.append(others[0][1])
        else:
            everyone = "; ".join(f"{_owner(r)} as {r.target!r}" for _, r in others)
            for source, _record in others:
                errors.append(
                    source.error(
                        "duplicate",
                        f"backend name {name!r} is registered by several plugins ({everyone}); none of them gets it. "
                        f"Uninstall all but one, or load one with {env.PLUGINS.name}",
                        backend=name,
                    )
                )
    return records, errors


# ---------------------------------------------------------------------------- process-wide registry
_LOCK = threading.RLock()
_REGISTRY: Optional[Registry] = None
_BUILDING: Optional[int] = None  # the thread that is building the process-wide registry


def _process_registry(api: str) -> Registry:
    global _REGISTRY, _BUILDING
    guard_reentry(api)
    registry = _REGISTRY
    if registry is None:
        with _LOCK:
            if _BUILDING == threading.get_ident():  # re-entered from the loading thread
                raise RegistryError(
                    f"attnplug.{api}() was called while this thread is loading the plugins; "
                    "call it once loading has finished"
                )
            if _REGISTRY is None:
                _BUILDING = threading.get_ident()
                try:
                    _REGISTRY = load_registry()
                finally:
                    _BUILDING = None
            registry = _REGISTRY
    return registry


def get_registry() -> Registry:
    """The process-wide registry, built on first use from the installed entry points."""
    return _process_registry("get_registry")


def reset_registry(registry: Optional[Registry] = None) -> None:
    """Drop the cached process-wide registry (the next use rediscovers the plugins), or
    install ``registry`` in its place (for tests)."""
    global _REGISTRY
    with _LOCK:
        _REGISTRY = registry


def available_backends() -> List[BackendInfo]:
    """Every registered backend with its availability and reason (see ``Registry``)."""
    return _process_registry("available_backends").available_backends()


def load_errors() -> List[PluginError]:
    """The problems met while loading plugins (what ``attnplug info`` lists as errors)."""
    return _process_registry("load_errors").load_errors()


def get_backend(name: Optional[str] = None) -> Type[AttentionBackend]:
    """The backend class: ``name`` > ``$ATTNPLUG_BACKEND`` > the highest available priority.
    Raises a ``RegistryError`` (``BackendNotFound``, ``BackendUnavailable``,
    ``AmbiguousBackend``) whose message carries the reason and the alternatives."""
    return _process_registry("get_backend").get_backend(name)
