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
"""

from __future__ import annotations

import enum
import importlib
import importlib.metadata
import inspect
import os
import re
import sys
import threading
import types
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Type

import pluggy

from ..backend import AttentionBackend
from . import hookspecs
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
    "ENV_BACKEND",
    "ENV_PLUGINS",
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
ENTRY_POINT_GROUP = "attnplug.backends"
ENV_BACKEND = "ATTNPLUG_BACKEND"
ENV_PLUGINS = "ATTNPLUG_PLUGINS"

_HOOK = "attnplug_register_backends"
_VERSION_RE = re.compile(r"^(\d+)\.(\d+)$")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
_TARGET_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def discover_entry_points() -> List[importlib.metadata.EntryPoint]:
    """Every entry point of the group ``attnplug.backends`` visible on ``sys.path``, sorted by
    (distribution, entry-point name) so that loading order (and so which plugin keeps a
    duplicated backend name) does not depend on the file system. A distribution found twice on
    the path counts once: the first one wins, as in ``importlib.metadata``."""
    eps = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)

    def key(ep):
        dist = getattr(ep, "dist", None)
        name = getattr(dist, "name", None) or ""
        return (re.sub(r"[-_.]+", "-", name).lower(), ep.name)

    return sorted(eps, key=key)


def _api_major(version: str) -> int:
    match = _VERSION_RE.match(version)
    assert match, version
    return int(match.group(1))


def _exc_text(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _allow_list_from_env() -> Optional[Tuple[str, ...]]:
    raw = os.environ.get(ENV_PLUGINS, "").strip()
    if not raw:
        return None
    return tuple(part.strip() for part in raw.split(",") if part.strip())


@dataclass(frozen=True)
class _Source:
    """Where one plugin comes from: an entry point, or an object injected by a test."""

    name: str
    entry_point: str
    distribution: Optional[str]
    version: Optional[str]
    load: Callable[[], Any]

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
        return cls(ep.name, ep.value, dist_name, dist_version, ep.load)

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

    Build one with ``load_registry()``. Probes run lazily, at most once per backend, and
    backend classes are imported only when a backend is selected or listed as available.
    """

    def __init__(self, records: Sequence[BackendRecord], errors: Sequence[PluginError],
                 plugin_manager: pluggy.PluginManager, allow: Optional[Tuple[str, ...]] = None) -> None:
        self._records: Dict[str, BackendRecord] = {r.name: r for r in records}
        self._errors: Tuple[PluginError, ...] = tuple(errors)
        self.plugin_manager = plugin_manager
        self.allow = allow
        self._probes: Dict[str, ProbeResult] = {}
        self._classes: Dict[str, Tuple[Optional[type], Optional[str]]] = {}
        self._lock = threading.RLock()

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
    def probe(self, name: str) -> ProbeResult:
        """Run (once) and return the probe of backend ``name``; a probe that raises or
        returns something malformed gives an unavailable result carrying that reason."""
        record = self._records[name]
        with self._lock:
            cached = self._probes.get(name)
            if cached is None:
                cached = self._probes[name] = _run_probe(record)
            return cached

    def resolve(self, name: str) -> Tuple[Optional[Type[AttentionBackend]], Optional[str]]:
        """Import the class of backend ``name`` (once): ``(cls, None)`` or ``(None, reason)``.
        Does not probe: callers decide whether importing is appropriate."""
        record = self._records[name]
        with self._lock:
            cached = self._classes.get(name)
            if cached is None:
                cached = self._classes[name] = _resolve_target(record.target)
            return cached

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
        infos = []
        for record in self._records.values():
            result = self.probe(record.name)
            cls, reason = self._usable(record.name)
            needs_cpu = caps = None
            if cls is not None:
                needs_cpu = bool(getattr(cls, "needs_cpu_seq_lens", True))
                caps, describe_error = _describe(cls)
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
        origin = "get_backend(name=...)"
        if name is None:
            env = os.environ.get(ENV_BACKEND, "").strip()
            if env:
                name, origin = env, f"{ENV_BACKEND}={env}"
        if name is not None:
            return name, self._select(name, origin)
        return self._auto()

    # ------------------------------------------------------------------ selection
    def _available_names(self, exclude: Optional[str] = None) -> Tuple[str, ...]:
        return tuple(
            n for n in sorted(self._records, key=lambda n: (-self._records[n].priority, n))
            if n != exclude and self._usable(n)[0] is not None
        )

    def _select(self, name: str, origin: str) -> Type[AttentionBackend]:
        if name not in self._records:
            related = [e for e in self._errors if name in (e.plugin, e.backend)]
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
                + (f"; plugins that did not load: {', '.join(sorted({e.plugin for e in self._errors}))}"
                   f" (see `attnplug info`)" if self._errors else ""),
                name=name,
                known=known,
            )
        cls, reason = self._usable(name)
        if cls is None:
            alternatives = self._available_names(exclude=name)
            raise BackendUnavailable(
                f"backend {name!r} (selected by {origin}) is unavailable: {reason}. "
                f"{_alternatives_text(alternatives)}",
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
                    f"choose one with get_backend(name) or {ENV_BACKEND}=<name>",
                    candidates=names,
                    priority=priority,
                )
        lines = [f"  {n}: {self._usable(n)[1]}" for n in self._records]
        lines += [f"  {e.describe_source()}: {e.kind}: {e.reason}" for e in self._errors]
        raise BackendUnavailable(
            "no attention backend is available" + (":\n" + "\n".join(lines) if lines else " (no plugin registered one)"),
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
}


def _alternatives_text(alternatives: Sequence[str]) -> str:
    if alternatives:
        return f"Available backends: {', '.join(alternatives)}."
    return "No other backend is available."


def _run_probe(record: BackendRecord) -> ProbeResult:
    try:
        raw = record.probe()
    except Exception as exc:  # a probe that raises only makes its own backend unavailable
        return ProbeResult(False, f"probe raised {_exc_text(exc)}")
    if isinstance(raw, ProbeResult):
        result = raw
    elif isinstance(raw, tuple) and len(raw) == 2 and isinstance(raw[0], bool) and isinstance(raw[1], str):
        result = ProbeResult(raw[0], raw[1])
    else:
        return ProbeResult(False, f"probe returned {raw!r}; expected a ProbeResult or (available: bool, reason: str)")
    if not isinstance(result.available, bool):
        return ProbeResult(False, f"probe returned available={result.available!r}; expected a bool")
    if not result.reason:
        result = ProbeResult(result.available, "available" if result.available else "unavailable (the probe gave no reason)", result.device)
    return result


def _resolve_target(target: str) -> Tuple[Optional[type], Optional[str]]:
    module_name, _, qualname = target.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except Exception as exc:
        return None, f"cannot import {target!r}: {_exc_text(exc)}"
    if not (isinstance(obj, type) and issubclass(obj, AttentionBackend)):
        return None, f"{target!r} is {obj!r}, not a subclass of attnplug.backend.AttentionBackend"
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


def _describe(cls: type) -> Tuple[Optional[Dict[str, Any]], Optional[str]]:
    """The class's optional ``describe()`` hints (a dict), made JSON-able."""
    describe = getattr(cls, "describe", None)
    if describe is None or not callable(describe):
        return None, None
    try:
        raw = describe()
    except Exception as exc:
        return None, f"{cls.__name__}.describe() raised {_exc_text(exc)}"
    if hasattr(raw, "to_json"):
        raw = raw.to_json()
    if not isinstance(raw, dict):
        return None, f"{cls.__name__}.describe() returned {type(raw).__name__}, expected a dict"
    return _jsonable(raw), None


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
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise ValueError(f"register(name={name!r}): a backend name is a non-empty string of letters, digits, '_', '.', '-'")
        if not isinstance(backend, str) or not _TARGET_RE.match(backend):
            raise ValueError(f"register(name={name!r}, backend={backend!r}): backend must be a 'module:Class' string")
        if not callable(probe):
            raise TypeError(f"register(name={name!r}): probe must be callable, got {probe!r}")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise TypeError(f"register(name={name!r}): priority must be an int, got {priority!r}")
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

    * ``entry_points``: the entry points to load (default: ``discover_entry_points()``).
    * ``extra_plugins``: plugins without an entry point, loaded after the entry points the same
      way (version check, hook, isolation): modules or objects holding a hookimpl, or
      ``(name, object)`` pairs. For tests and embedding.
    * ``allow``: plugin names to load (default: ``$ATTNPLUG_PLUGINS`` when set, else all).
    """
    allow_list = tuple(allow) if allow is not None else _allow_list_from_env()
    pm = pluggy.PluginManager(PROJECT_NAME)
    pm.add_hookspecs(hookspecs.AttnplugHookspecs)

    eps = discover_entry_points() if entry_points is None else list(entry_points)
    sources = [_Source.from_entry_point(ep) for ep in eps] + [_Source.from_object(p) for p in extra_plugins]

    errors: List[PluginError] = []
    loaded: List[Tuple[str, _Source, Any]] = []  # (pluggy name, source, plugin object)
    taken_pm_names: set = set()
    for source in sources:
        if allow_list is not None and source.name not in allow_list:
            errors.append(source.error("disabled", f"not in {ENV_PLUGINS}={','.join(allow_list)}"))
            continue
        try:
            plugin = source.load()
        except (Exception, SystemExit) as exc:
            errors.append(source.error("import", _exc_text(exc)))
            continue
        declared = _declared_api_version(plugin)
        if declared is None:
            errors.append(source.error(
                "api-version",
                f"does not declare PLUGIN_API_VERSION (this attnplug provides plugin API {PLUGIN_API_VERSION})"))
            continue
        if not isinstance(declared, str) or not _VERSION_RE.match(declared):
            errors.append(source.error("api-version", f"PLUGIN_API_VERSION={declared!r} is not a 'MAJOR.MINOR' string"))
            continue
        if _api_major(declared) != _api_major(PLUGIN_API_VERSION):
            errors.append(source.error(
                "api-version",
                f"built for plugin API {declared}; this attnplug provides {PLUGIN_API_VERSION} (major versions differ)"))
            continue
        pm_name = f"{source.distribution or '<injected>'}:{source.name}"
        base, n = pm_name, 1
        while pm_name in taken_pm_names:
            n += 1
            pm_name = f"{base}#{n}"
        try:
            pm.register(plugin, name=pm_name)
        except Exception as exc:  # PluginValidationError (bad hookimpl), or the same object twice
            errors.append(source.error("invalid", _exc_text(exc)))
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

    records: Dict[str, BackendRecord] = {}
    for pm_name, source, plugin in loaded:
        others = [p for other_name, _, p in loaded if other_name != pm_name]
        caller = pm.subset_hook_caller(_HOOK, remove_plugins=others)
        registration = _Registration(source)
        try:
            caller(register=registration)
        except Exception as exc:
            errors.append(source.error("hook", f"{_HOOK} raised {_exc_text(exc)}"))
            continue
        finally:
            registration.closed = True
        if not registration.records:
            errors.append(source.error("invalid", f"registered no backend (no {_HOOK} hookimpl, or it never called register)"))
            continue
        for record in registration.records:
            first = records.get(record.name)
            if first is not None:
                errors.append(source.error(
                    "duplicate",
                    f"backend name {record.name!r} is already registered by {_owner(first)} as {first.target!r}; "
                    f"this registration ({record.target!r}) is ignored",
                    backend=record.name))
                continue
            records[record.name] = record
    return Registry(list(records.values()), errors, pm, allow_list)


# ---------------------------------------------------------------------------- process-wide registry
_LOCK = threading.Lock()
_REGISTRY: Optional[Registry] = None


def get_registry() -> Registry:
    """The process-wide registry, built on first use from the installed entry points."""
    global _REGISTRY
    registry = _REGISTRY
    if registry is None:
        with _LOCK:
            if _REGISTRY is None:
                _REGISTRY = load_registry()
            registry = _REGISTRY
    return registry


def reset_registry(registry: Optional[Registry] = None) -> None:
    """Drop the cached process-wide registry (the next use rediscovers the plugins), or
    install ``registry`` in its place (for tests)."""
    global _REGISTRY
    with _LOCK:
        _REGISTRY = registry


def available_backends() -> List[BackendInfo]:
    """Every registered backend with its availability and reason (see ``Registry``)."""
    return get_registry().available_backends()


def load_errors() -> List[PluginError]:
    """The problems met while loading plugins (what ``attnplug info`` lists as errors)."""
    return get_registry().load_errors()


def get_backend(name: Optional[str] = None) -> Type[AttentionBackend]:
    """The backend class: ``name`` > ``$ATTNPLUG_BACKEND`` > the highest available priority.
    Raises a ``RegistryError`` (``BackendNotFound``, ``BackendUnavailable``,
    ``AmbiguousBackend``) whose message carries the reason and the alternatives."""
    return get_registry().get_backend(name)
