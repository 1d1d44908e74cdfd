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
* ``ATTNPLUG_PROBE_TIMEOUT=seconds``: how long each piece of plugin code run at selection time
  may take (default 5): importing a plugin, its hook, a probe, importing a backend class,
  ``describe()``. A probe that takes longer makes its backend unavailable ("probe timed out
  after N s"); an import or hook that does fails its plugin. Read when the registry is built
  and when each probe starts.

All three are parsed by ``attnplug.env``; a malformed value raises ``RegistryError`` naming it.

Trust: plugin code never breaks selection. Every call into a plugin is contained
(``containment``) and timed: an exception, ``SystemExit`` included, is recorded against that
plugin or backend only, and so is a call that outlives the time limit. The probes, trial
class imports and ``describe()`` of third-party plugins run in the probe process (``sandbox``):
one that ends the process (``os._exit``, a crash), hangs or leaves a non-daemon thread is
reported as such and the process killed, and its changes to ``os.environ``, torch's default
dtype or random state never reach the caller. What still runs here (plugin imports and hooks,
backend class imports, and the attnplug distribution's own plugins) runs in a guarded thread:
such changes are undone. Either way they are listed as ``PluginNote``s (``notes()``, ``attnplug
info``). No registry lock is held while plugin code runs; a registry function called from plugin
code the registry is running raises ``RegistryError`` instead of deadlocking. The backend names
of the attnplug distribution's own plugins belong to it: another distribution cannot take them
(``discovery``), and a backend name registered by two other plugins is given to neither.

This module holds the ``Registry`` (what was loaded, the public queries, selection),
``load_registry`` and the process-wide registry; ``discovery`` decides which entry points to
load, ``loading`` loads them, ``probing`` runs each backend's probe, class import and
``describe()`` (here or through ``sandbox`` in the probe process, ``worker``), ``refusals`` words
the errors selection raises.
"""

from __future__ import annotations

import importlib.metadata
import threading
import warnings
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Type

from .. import env
from ..backend import AttentionBackend
from . import refusals
from .containment import guard_reentry
from .discovery import ENTRY_POINT_GROUP, core_distributions, discover_entry_points, plan
from .hookspecs import PLUGIN_API_VERSION, hookimpl
from .loading import load_plugins
from .probing import Prober
from .records import BackendInfo, BackendRecord, PluginError, PluginNote, ProbeResult, RegistryError

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


def _allow_list_from_env() -> Optional[Tuple[str, ...]]:
    try:
        return env.plugin_allow_list()
    except env.EnvError as exc:
        raise RegistryError(str(exc)) from None


class Registry:
    """The loaded plugins: accepted backend records and the errors met while loading.

    Build one with ``load_registry()``. Probes run lazily, at most once per backend, under
    ``$ATTNPLUG_PROBE_TIMEOUT`` (in the probe process for third-party plugins); backend classes
    are imported only when a backend is selected or listed as available. No lock is held while
    plugin code runs: a thread waiting for a slow probe delays no thread that needs another
    backend.
    """

    def __init__(
        self,
        records: Sequence[BackendRecord],
        errors: Sequence[PluginError],
        allow: Optional[Tuple[str, ...]] = None,
        notes: Sequence[PluginNote] = (),
    ) -> None:
        self._records: Dict[str, BackendRecord] = {r.name: r for r in records}
        self._errors: Tuple[PluginError, ...] = tuple(errors)
        self._load_notes: Tuple[PluginNote, ...] = tuple(notes)
        self.allow = allow
        self._prober = Prober(self._records)

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

    def notes(self) -> List[PluginNote]:
        """What plugin code did to the process that was undone or ignored: while loading
        (``backend`` None), then in each backend's probe, class import or ``describe()`` run so
        far (``backend`` set)."""
        notes = list(self._load_notes)
        for name, texts in self._prober.all_notes().items():
            record = self._records[name]
            notes += [
                PluginNote(
                    plugin=record.plugin,
                    entry_point=record.entry_point,
                    note=text,
                    distribution=record.distribution,
                    version=record.version,
                    backend=name,
                )
                for text in texts
            ]
        return notes

    # ------------------------------------------------------------------ probing / resolving
    def probe(self, name: str) -> ProbeResult:
        """Run (once) and return the probe of backend ``name``; a probe that raises (anything,
        ``SystemExit`` included), returns something malformed or outlives
        ``$ATTNPLUG_PROBE_TIMEOUT`` gives an unavailable result carrying that reason."""
        guard_reentry("probe")
        return self._prober.probe(name)

    def resolve(self, name: str) -> Tuple[Optional[Type[AttentionBackend]], Optional[str]]:
        """Import the class of backend ``name`` (once): ``(cls, None)`` or ``(None, reason)``.
        Does not probe: callers decide whether importing is appropriate."""
        guard_reentry("resolve")
        return self._prober.resolve(name)

    # ------------------------------------------------------------------ public queries
    def available_backends(self) -> List[BackendInfo]:
        """Every registered backend, available or not, highest priority first (then by
        name). Runs every probe; imports the class of each backend whose probe passes."""
        guard_reentry("available_backends")
        infos = []
        for record in self._records.values():
            result = self.probe(record.name)
            cls, reason = self._prober.usable(record.name)
            needs_cpu = caps = None
            if cls is not None:
                needs_cpu, caps, describe_error = self._prober.class_facts(record.name, cls)
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
                    notes=self._prober.notes(record.name),
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
            if n != exclude and self._prober.usable(n)[0] is not None
        )

    def _select(self, name: str, origin: str) -> Type[AttentionBackend]:
        if name not in self._records:
            # the name's own plugin first (a built-in that was not loaded), then refused claimants
            related = sorted(
                (e for e in self._errors if name in (e.plugin, e.backend)),
                key=lambda e: e.plugin != name or e.kind == "reserved",
            )
            if related:
                raise refusals.not_loaded(name, origin, related[0], self._available_names())
            raise refusals.not_registered(name, origin, tuple(sorted(self._records)), self._errors)
        cls, reason = self._prober.usable(name)
        if cls is None:
            raise refusals.unusable(name, origin, reason, self._available_names(exclude=name))
        return cls

    def _auto(self) -> Tuple[str, Type[AttentionBackend]]:
        levels = sorted({r.priority for r in self._records.values()}, reverse=True)
        for priority in levels:
            usable = []
            for name in sorted(n for n, r in self._records.items() if r.priority == priority):
                cls, reason = self._prober.usable(name)
                if cls is not None:
                    usable.append((name, cls))
                elif self.probe(name).available:  # probe passed, class broken: say so
                    warnings.warn(f"attnplug: skipping backend {name!r}: {reason}", RuntimeWarning, stacklevel=3)
            if len(usable) == 1:
                return usable[0]
            if len(usable) > 1:
                raise refusals.tied(priority, tuple(n for n, _ in usable))
        raise refusals.none_available([(n, self._prober.usable(n)[1]) for n in self._records], self._errors)


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
    if entry_points is None:
        loading = plan(discover_entry_points(), core_distributions())
    else:
        loading = plan(list(entry_points))
    records, errors, notes = load_plugins(loading, extra_plugins, allow_list)
    return Registry(records, errors, allow_list, notes)


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
