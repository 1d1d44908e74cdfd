"""Loading the planned plugins, each one on its own.

``load_plugins(plan, extra_plugins, allow)`` imports every entry point the discovery ``plan``
keeps (and every injected object), checks its ``PLUGIN_API_VERSION``, registers it with a pluggy
plugin manager of its own, calls its ``attnplug_register_backends`` hook with a ``register`` that
validates its arguments, and settles who keeps each backend name (``_settle_names``). Whatever
goes wrong with one plugin is returned as a ``PluginError`` against that plugin; the others load
normally.

Each of those steps runs plugin code, so each runs in a guarded thread under the time limit
(``containment.run_contained``, ``$ATTNPLUG_PROBE_TIMEOUT``): an import or hook that hangs is
reported (``"importing 'mod' timed out after 5 s"``) and left behind, and what a step changed in
``os.environ``, torch's default dtype or random state is undone and returned as a
``PluginNote``. A plugin manager per plugin keeps a step left running from touching another
plugin's hook.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import re
import sys
import types
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import pluggy

from .. import env
from ..versions import api_version
from . import hookspecs
from .containment import Outcome, exc_text, probe_timeout, run_contained, short_repr
from .discovery import CORE_DISTRIBUTION, Plan, normalize
from .hookspecs import HOOK_NAME, PLUGIN_API_VERSION, PROJECT_NAME
from .records import BackendRecord, PluginError, PluginNote

__all__ = ["hook_records", "load_plugins"]

_HOOK = HOOK_NAME
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
_TARGET_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
#: an entry-point value as ``importlib.metadata`` parses it: ``module``, ``module:attr``, ``[extras]``
_ENTRY_POINT_VALUE_RE = re.compile(r"(?P<module>[\w.]+)\s*(:\s*(?P<attr>[\w.]+)\s*)?((?P<extras>\[.*\])\s*)?$")


def _label(plugin: str, distribution: Optional[str], version: Optional[str]) -> str:
    """``"plugin 'x' (dist 1.0)"``, or ``(no distribution)`` for an injected plugin."""
    dist = f"{distribution} {version}" if distribution else "no distribution"
    return f"plugin {plugin!r} ({dist})"


@dataclass(frozen=True)
class _Source:
    """Where one plugin comes from: an entry point, or an object injected by a test.
    ``malformed``: why the entry point cannot even be imported (its value does not parse).
    ``isolated``: an entry point of another distribution than attnplug's; its probes run in the
    probe process (``sandbox``)."""

    name: str
    entry_point: str
    distribution: Optional[str]
    version: Optional[str]
    load: Callable[[], Any]
    malformed: Optional[str] = None
    isolated: bool = False

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
        isolated = normalize(dist_name) != CORE_DISTRIBUTION
        return cls(ep.name, ep.value, dist_name, dist_version, ep.load, malformed, isolated)

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
        return _label(self.name, self.distribution, self.version)

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

    def note(self, text: str) -> PluginNote:
        return PluginNote(
            plugin=self.name,
            entry_point=self.entry_point,
            note=text,
            distribution=self.distribution,
            version=self.version,
        )

    def with_distribution(self, distribution: Optional[str], version: Optional[str]) -> "_Source":
        return dataclasses.replace(self, distribution=distribution, version=version)


def _declared_api_version(plugin: Any) -> Optional[Any]:
    """``PLUGIN_API_VERSION`` of the plugin object, or of the module that defines it."""
    version = getattr(plugin, "PLUGIN_API_VERSION", None)
    if version is None and not isinstance(plugin, types.ModuleType):
        module = sys.modules.get(getattr(plugin, "__module__", None) or "")
        version = getattr(module, "PLUGIN_API_VERSION", None)
    return version


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
                isolated=src.isolated,
            )
        )


def _manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(PROJECT_NAME)
    pm.add_hookspecs(hookspecs.AttnplugHookspecs)
    return pm


def _pm_name(source: _Source) -> str:
    return f"{source.distribution or '<injected>'}:{source.name}"


def hook_records(source: _Source, plugin: Any) -> List[BackendRecord]:
    """Register ``plugin`` with a plugin manager of its own and call its hook in this thread,
    uncontained; its registrations. The probe process loads a plugin again this way to reach
    its probes."""
    pm = _manager()
    pm.register(plugin, name=_pm_name(source))
    pm.check_pending()
    registration = _Registration(source)
    try:
        pm.hook.attnplug_register_backends(register=registration)
    finally:
        registration.closed = True
    return registration.records


def _step_notes(source: _Source, subject: str, outcome: Outcome) -> List[PluginNote]:
    notes = [source.note(f"{subject} {change} (undone)") for change in outcome.changes]
    if outcome.threads:
        notes.append(
            source.note(
                f"{subject} left a non-daemon thread running ({', '.join(outcome.threads)}): "
                "this process cannot exit until it ends"
            )
        )
    return notes


def load_plugins(
    loading: Plan, extra_plugins: Iterable[Any] = (), allow_list: Optional[Tuple[str, ...]] = None
) -> Tuple[List[BackendRecord], List[PluginError], List[PluginNote]]:
    """Load and call every plugin of ``loading`` then every one of ``extra_plugins``; return
    the accepted registrations, every problem met (``loading.errors`` first) and what the
    plugins' code did to the process (undone).

    * ``extra_plugins``: plugins without an entry point, loaded after the entry points the same
      way (version check, hook, isolation): modules or objects holding a hookimpl, or
      ``(name, object)`` pairs.
    * ``allow_list``: the plugin names to load (``None``: all); the others are ``disabled``.

    Every step that runs plugin code runs under ``$ATTNPLUG_PROBE_TIMEOUT`` (a malformed value
    raises ``RegistryError``).
    """
    limit = probe_timeout()
    late = f"timed out after {'the time limit' if limit is None else f'{limit:g} s'}"
    errors: List[PluginError] = list(loading.errors)
    notes: List[PluginNote] = []
    sources = [_Source.from_entry_point(ep) for ep in loading.entry_points] + [
        _Source.from_object(p) for p in extra_plugins
    ]

    if allow_list is not None:
        known = {source.name for source in sources}
        for name in allow_list:
            if name not in known:
                errors.append(
                    PluginError(
                        plugin=name,
                        entry_point="-",
                        kind="unknown",
                        reason=f"{env.PLUGINS.name} names {name!r}, which no installed plugin is called "
                        f"(installed: {', '.join(sorted(known)) or 'none'})",
                    )
                )
    loaded_objects: List[Tuple[Any, _Source]] = []
    claims: Dict[str, List[Tuple[_Source, BackendRecord]]] = {}
    for source in sources:
        if allow_list is not None and source.name not in allow_list:
            errors.append(source.error("disabled", f"not in {env.PLUGINS.name}={','.join(allow_list)}"))
            continue
        if source.malformed:
            errors.append(source.error("invalid", source.malformed))
            continue
        imported = run_contained(source.load, f"the import of {source.describe()}", limit)
        notes += _step_notes(source, "importing it", imported)
        if imported.timed_out:
            errors.append(
                source.error("import", f"importing {source.entry_point!r} {late} (left running in a background thread)")
            )
            continue
        if not imported.ok:
            errors.append(source.error("import", imported.error))
            continue
        plugin = imported.value
        twin = next((other for obj, other in loaded_objects if obj is plugin), None)
        if twin is not None:
            errors.append(
                source.error(
                    "invalid", f"this plugin object is already loaded as {twin.describe()} ({twin.entry_point})"
                )
            )
            continue
        declared = run_contained(functools.partial(_declared_api_version, plugin), f"{source.describe()}", limit)
        notes += _step_notes(source, "reading its PLUGIN_API_VERSION", declared)
        if declared.timed_out:
            errors.append(source.error("api-version", f"reading PLUGIN_API_VERSION {late}"))
            continue
        if not declared.ok:
            errors.append(source.error("api-version", f"reading PLUGIN_API_VERSION raised {declared.error}"))
            continue
        problem = _api_version_problem(declared.value)
        if problem:
            errors.append(source.error("api-version", problem))
            continue
        pm = _manager()
        registered = run_contained(
            functools.partial(pm.register, plugin, name=_pm_name(source)), f"{source.describe()}", limit
        )
        notes += _step_notes(source, "registering it with pluggy", registered)
        if not registered.ok:  # PluginValidationError (bad hookimpl), or plugin code that raised or hung
            why = f"registering it with pluggy {late}" if registered.timed_out else registered.error
            errors.append(source.error("invalid", why))
            continue
        try:
            pm.check_pending()  # a hook implementation for a hook nobody specifies (a typo in its name)
        except pluggy.PluginValidationError as exc:
            errors.append(source.error("invalid", exc_text(exc)))
            continue
        loaded_objects.append((plugin, source))
        registration = _Registration(source)
        called = run_contained(
            functools.partial(pm.hook.attnplug_register_backends, register=registration),
            f"the {_HOOK} hook of {source.describe()}",
            limit,
        )
        registration.closed = True
        notes += _step_notes(source, f"its {_HOOK} hook", called)
        if called.timed_out:
            errors.append(
                source.error(
                    "hook",
                    f"{_HOOK} {late} (left running in a background thread; none of its registrations are kept)",
                )
            )
            continue
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
    return records, errors + refused, notes


def _api_version_problem(declared: Any) -> Optional[str]:
    if declared is None:
        return f"does not declare PLUGIN_API_VERSION (this attnplug provides plugin API {PLUGIN_API_VERSION})"
    version = api_version(declared)
    if version is None:
        return f"PLUGIN_API_VERSION={short_repr(declared)} is not a 'MAJOR.MINOR' string"
    if version[0] != api_version(PLUGIN_API_VERSION)[0]:
        return f"built for plugin API {declared}; this attnplug provides {PLUGIN_API_VERSION} (major versions differ)"
    return None


def _owner(record: BackendRecord) -> str:
    return _label(record.plugin, record.distribution, record.version)


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
