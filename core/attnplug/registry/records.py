"""Plain data kept by the registry, and the errors it raises.

* ``ProbeResult``: what a plugin's probe says about this process.
* ``BackendRecord``: one accepted ``register(...)`` call (nothing imported, nothing probed).
* ``PluginError``: one problem found while loading plugins (a plugin that failed to import,
  was built for another plugin API, raised in its hook, or a rejected registration). It is
  data, not an exception: it is listed by ``attnplug info`` and becomes an exception only when
  the user selects the backend it concerns.
* ``PluginNote``: something a plugin's code did to the process that attnplug undid or ignored
  (changed ``os.environ``, torch's default dtype or random state, left a thread running).
* ``BackendInfo``: the public description of one backend, as ``available_backends()`` returns
  it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, Optional, Tuple

__all__ = [
    "ProbeResult",
    "BackendRecord",
    "PluginError",
    "PluginNote",
    "BackendInfo",
    "RegistryError",
    "BackendNotFound",
    "BackendUnavailable",
    "AmbiguousBackend",
]


@dataclass(frozen=True)
class ProbeResult:
    """Availability of a backend in this process.

    * ``available``: the backend can be constructed here.
    * ``reason``: what was found (when available) or what is missing (when not), in words a
      user can act on.
    * ``device``: optional short description of the device the probe found (for example
      ``"any"`` or ``"2 devices"``); shown by ``attnplug info``.
    """

    available: bool
    reason: str = ""
    device: Optional[str] = None


@dataclass(frozen=True)
class BackendRecord:
    """One accepted registration.

    ``target`` is the ``"module:Class"`` string given as ``backend=``; ``plugin`` the entry-point
    name (or the injected plugin's name), ``entry_point`` its value (``"module"`` or
    ``"module:attr"``), ``distribution`` / ``version`` the installed distribution that declared
    the entry point (None for plugins injected without one). ``isolated``: the plugin's code at
    selection time (probe, backend-class check, ``describe()``) runs in the probe process
    (``sandbox``): true for every entry-point plugin that is not part of the attnplug
    distribution.
    """

    name: str
    target: str
    probe: Callable[[], Any] = field(repr=False, compare=False)
    priority: int
    plugin: str
    entry_point: str
    distribution: Optional[str] = None
    version: Optional[str] = None
    isolated: bool = field(default=False, compare=False)


class _FromPlugin:
    """What a record about one plugin's code shares (its fields ``plugin``, ``entry_point``,
    ``distribution``, ``version``)."""

    def to_json(self) -> Dict[str, Any]:
        return asdict(self)

    def describe_source(self) -> str:
        """``"plugin 'x' (dist 1.0, entry point mod)"``."""
        return _source(self.plugin, self.distribution, self.version, self.entry_point)


@dataclass(frozen=True)
class PluginError(_FromPlugin):
    """A problem met while loading plugins; never raised, always listed.

    ``kind`` is one of:

    * ``"disabled"``: not loaded, because ``ATTNPLUG_PLUGINS`` does not name it;
    * ``"unknown"``: ``ATTNPLUG_PLUGINS`` names a plugin no installed distribution provides
      (``plugin`` is the name given; the reason lists the installed ones);
    * ``"import"``: importing the entry point raised;
    * ``"api-version"``: no ``PLUGIN_API_VERSION``, a malformed one, or another major;
    * ``"invalid"``: its entry-point value is malformed, pluggy rejected the plugin (bad hook
      signature, unknown hook, registered twice), or it registered no backend;
    * ``"hook"``: its ``attnplug_register_backends`` raised (none of its registrations kept);
    * ``"duplicate"``: it registered a backend name another third-party plugin registered too
      (``backend`` names it); neither keeps the name, each error names every claimant;
    * ``"reserved"``: it used a name that belongs to the attnplug distribution: a backend name
      of a built-in plugin (``backend`` names it; the registration is refused) or a built-in
      entry-point name (the plugin is not imported);
    * ``"distribution"``: a distribution is visible more than once on ``sys.path`` and the
      copies differ (``plugin`` is the distribution's name); the reason says which copy is used.
    """

    plugin: str
    entry_point: str
    kind: str
    reason: str
    distribution: Optional[str] = None
    version: Optional[str] = None
    backend: Optional[str] = None


@dataclass(frozen=True)
class PluginNote(_FromPlugin):
    """What a plugin's code did to the process, which attnplug undid (it ran in this process)
    or ignored (it ran in the probe process), e.g. ``"the probe changed os.environ
    ATTNPLUG_BACKEND (ignored)"``. Never an error by itself; ``attnplug info`` shows it.
    ``backend`` is set when the code was the backend's (its probe, class import or
    ``describe()``), None for the plugin's import and hook."""

    plugin: str
    entry_point: str
    note: str
    distribution: Optional[str] = None
    version: Optional[str] = None
    backend: Optional[str] = None


@dataclass(frozen=True)
class BackendInfo:
    """Description of one registered backend (``available_backends()``).

    ``backend`` is the ``"module:Class"`` path. ``needs_cpu_seq_lens`` and ``capabilities`` are
    filled only for available backends, from the class (never an instance, so nothing is
    allocated on a device): ``needs_cpu_seq_lens`` is the class attribute, ``capabilities`` the
    JSON-able dict returned by the class's optional ``describe()`` classmethod (None when the
    class has none). ``notes``: what the backend's code (probe, class import, ``describe()``)
    did to the process that was undone or ignored (``PluginNote.note``).
    """

    name: str
    priority: int
    available: bool
    reason: str
    backend: str
    plugin: str
    entry_point: str
    distribution: Optional[str] = None
    version: Optional[str] = None
    device: Optional[str] = None
    needs_cpu_seq_lens: Optional[bool] = None
    capabilities: Optional[Dict[str, Any]] = None
    notes: Tuple[str, ...] = ()

    def to_json(self) -> Dict[str, Any]:
        return asdict(self)


def _source(plugin: str, distribution: Optional[str], version: Optional[str], entry_point: str) -> str:
    dist = f"{distribution} {version}" if distribution else "no distribution"
    return f"plugin {plugin!r} ({dist}, entry point {entry_point!r})"


class RegistryError(LookupError):
    """A backend could not be selected."""


class BackendNotFound(RegistryError):
    """No backend and no plugin has this name. ``known`` lists the registered names."""

    def __init__(self, message: str, *, name: str, known: Tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.name = name
        self.known = known


class BackendUnavailable(RegistryError):
    """The backend (or its plugin) exists but cannot be used here. ``reason`` is the
    recorded reason; ``alternatives`` the names of backends that are available."""

    def __init__(self, message: str, *, name: Optional[str], reason: str, alternatives: Tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.name = name
        self.reason = reason
        self.alternatives = alternatives


class AmbiguousBackend(RegistryError):
    """No backend was named and several available backends share the top priority."""

    def __init__(self, message: str, *, candidates: Tuple[str, ...], priority: int) -> None:
        super().__init__(message)
        self.candidates = candidates
        self.priority = priority
