"""Which entry points to load: distributions found on ``sys.path``, copies of one distribution,
and the names that belong to attnplug itself.

* ``discover_entry_points()`` returns the entry points of the group of *every* distribution on
  ``sys.path``, copies included (``importlib.metadata.entry_points()`` would keep only the first
  copy of a name, so a stale ``attnplug`` dist-info early on the path would hide the built-in
  plugins).
* ``plan(entry_points)`` decides what is loaded:

  - a distribution visible more than once is loaded once. Copies that differ (version or entry
    points) are reported (kind ``"distribution"``). For ``attnplug`` itself the entry points of
    all copies are merged, each name taken from the copy whose version is the imported
    attnplug's (then the first on ``sys.path``), so no copy hides a built-in plugin; for any
    other distribution the first copy on ``sys.path`` is used, as ``importlib.metadata`` does;
  - the entry-point names of the ``attnplug`` distribution are reserved: another distribution's
    entry point with such a name is refused (kind ``"reserved"``) and never imported.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Tuple

from .records import PluginError

__all__ = [
    "ENTRY_POINT_GROUP",
    "CORE_DISTRIBUTION",
    "Plan",
    "discover_entry_points",
    "core_distributions",
    "normalize",
    "plan",
]

ENTRY_POINT_GROUP = "attnplug.backends"
#: the distribution whose entry points are the built-in plugins; their names are reserved
CORE_DISTRIBUTION = "attnplug"


def normalize(name: Optional[str]) -> str:
    """A distribution name as packaging compares them (``Foo_Bar`` == ``foo-bar``)."""
    return re.sub(r"[-_.]+", "-", name or "").lower()


def _location(dist: Any) -> str:
    path = getattr(dist, "_path", None)  # PathDistribution: the dist-info / egg-info folder
    return str(path) if path is not None else repr(dist)


def _dist_name(dist: Any) -> Optional[str]:
    try:
        return dist.metadata["Name"]
    except Exception:  # unreadable metadata: the entry points still load, without a name
        return None


def discover_entry_points() -> List[importlib.metadata.EntryPoint]:
    """Every entry point of the group ``attnplug.backends`` of every distribution on
    ``sys.path``, copies of one distribution included, sorted by (distribution, copy in
    ``sys.path`` order, entry-point name)."""
    copies: Dict[str, int] = {}
    keyed = []
    for dist in importlib.metadata.distributions():
        try:
            eps = [ep for ep in dist.entry_points if ep.group == ENTRY_POINT_GROUP]
        except Exception:  # unreadable entry_points.txt: nothing to load from it
            continue
        if not eps:
            continue
        name = normalize(_dist_name(dist))
        copy = copies[name] = copies.get(name, -1) + 1
        keyed += [((name, copy, ep.name), ep) for ep in eps]
    return [ep for _, ep in sorted(keyed, key=lambda item: item[0])]


def core_distributions() -> List[Any]:
    """Every copy of the ``attnplug`` distribution on ``sys.path``, with or without entry points."""
    return [d for d in importlib.metadata.distributions() if normalize(_dist_name(d)) == CORE_DISTRIBUTION]


@dataclass
class _Copy:
    dist: Any
    name: Optional[str]
    version: Optional[str]
    location: str
    entry_points: List[Any] = field(default_factory=list)

    def describe(self) -> str:
        return f"{self.version} at {self.location}"

    def signature(self) -> Tuple[Optional[str], frozenset]:
        return self.version, frozenset((ep.name, ep.value) for ep in self.entry_points)


@dataclass
class Plan:
    """``entry_points`` to load, in order; ``core``: the built-in entry points by name (their
    names are reserved); ``errors``: copies reported and entry points refused."""

    entry_points: List[Any]
    core: Dict[str, Any]
    errors: List[PluginError]


def _running_version() -> Optional[str]:
    try:
        return importlib.import_module(CORE_DISTRIBUTION).__version__
    except Exception:
        return None


def _copies(entry_points: Iterable[Any], core_dists: Iterable[Any]) -> Dict[str, List[_Copy]]:
    by_location: Dict[str, _Copy] = {}
    by_name: Dict[str, List[_Copy]] = {}
    loose = 0
    for ep in entry_points:
        dist = getattr(ep, "dist", None)
        if dist is None:  # an entry point made by hand: its own group
            loose += 1
            by_name[f"\0{loose}"] = [_Copy(None, None, None, "", [ep])]
            continue
        location = _location(dist)
        copy = by_location.get(location)
        if copy is None:
            name = _dist_name(dist)
            version = getattr(dist, "version", None)
            copy = by_location[location] = _Copy(dist, name, version, location)
            by_name.setdefault(normalize(name), []).append(copy)
        copy.entry_points.append(ep)
    for dist in core_dists:  # copies without any entry point of the group
        location = _location(dist)
        if location not in by_location:
            copy = by_location[location] = _Copy(dist, _dist_name(dist), getattr(dist, "version", None), location)
            by_name.setdefault(CORE_DISTRIBUTION, []).append(copy)
    return by_name


def plan(entry_points: Iterable[Any], core_dists: Iterable[Any] = ()) -> Plan:
    """Decide what to load from ``entry_points`` (see the module docstring); ``core_dists``:
    further copies of the attnplug distribution to take into account (those without entry
    points of the group)."""
    errors: List[PluginError] = []
    chosen: List[Any] = []
    core: Dict[str, Any] = {}
    running = _running_version()
    for norm, copies in _copies(entry_points, core_dists).items():
        if norm == CORE_DISTRIBUTION:
            ordered = sorted(copies, key=lambda c: c.version != running)  # stable: sys.path order next
            merged: Dict[str, Any] = {}
            for copy in ordered:
                for ep in copy.entry_points:
                    merged.setdefault(ep.name, ep)
            core = merged
            eps = [merged[name] for name in sorted(merged)]
            how = (
                f"the built-in plugins are taken from all of them, each from {ordered[0].describe()} first "
                f"(the version of the attnplug package imported here is {running})"
            )
        else:
            ordered = copies
            eps = copies[0].entry_points
            how = f"only the first on sys.path, {copies[0].describe()}, is loaded"
        chosen += eps
        if len({c.signature() for c in copies}) > 1:
            first = ordered[0]
            errors.append(
                PluginError(
                    plugin=first.name or norm,
                    entry_point="",
                    kind="distribution",
                    reason=(
                        f"{len(copies)} copies of distribution {first.name!r} are visible on sys.path "
                        f"({'; '.join(c.describe() for c in copies)}) and they differ; {how}. "
                        "Remove the stale copy."
                    ),
                    distribution=first.name,
                    version=first.version,
                )
            )
    if not core:
        return Plan(chosen, core, errors)
    owner = next(iter(core.values()))
    kept = []
    for ep in chosen:
        dist = getattr(ep, "dist", None)
        name = _dist_name(dist) if dist is not None else None
        if ep.name in core and normalize(name) != CORE_DISTRIBUTION:
            version = getattr(dist, "version", None)
            source = f"{name} {version}" if name and version else (name or "a distribution without a name")
            errors.append(
                PluginError(
                    plugin=ep.name,
                    entry_point=ep.value,
                    kind="reserved",
                    reason=(
                        f"the entry-point name {ep.name!r} is reserved for attnplug's built-in plugin "
                        f"({CORE_DISTRIBUTION} {getattr(owner.dist, 'version', None)}, entry point "
                        f"{core[ep.name].value!r}); this entry point of {source} is refused and not imported"
                    ),
                    distribution=name,
                    version=version,
                )
            )
            continue
        kept.append(ep)
    return Plan(kept, core, errors)
