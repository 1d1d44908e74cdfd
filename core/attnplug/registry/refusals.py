"""The errors ``get_backend()`` raises, each worded with the recorded reason and the alternatives.

The ``Registry`` decides (``Registry.select``); this module only says why it refuses:

* ``not_loaded``: the name belongs to a plugin that did not load, or to a refused registration;
* ``not_registered``: no backend and no plugin has the name;
* ``unusable``: the backend's probe fails or its class cannot be used;
* ``tied``: no name given and several available backends share the top priority;
* ``none_available``: no name given and no backend is available.
"""

from __future__ import annotations

from typing import Iterable, Sequence, Tuple

from .. import env
from .records import AmbiguousBackend, BackendNotFound, BackendUnavailable, PluginError

__all__ = ["none_available", "not_loaded", "not_registered", "tied", "unusable"]

#: what happened to a plugin, by ``PluginError.kind``
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


def not_loaded(name: str, origin: str, error: PluginError, alternatives: Tuple[str, ...]) -> BackendUnavailable:
    """Backend ``name`` (selected by ``origin``) is not registered because of ``error``."""
    return BackendUnavailable(
        f"backend {name!r} (selected by {origin}) is unavailable: "
        f"{error.describe_source()} {_ERROR_VERBS.get(error.kind, 'failed')}: {error.reason}. "
        f"{_alternatives_text(alternatives)}",
        name=name,
        reason=error.reason,
        alternatives=alternatives,
    )


def not_registered(name: str, origin: str, known: Tuple[str, ...], errors: Sequence[PluginError]) -> BackendNotFound:
    """No backend is named ``name``; ``known``: the registered names, ``errors``: the plugins
    that did not load."""
    return BackendNotFound(
        f"no backend named {name!r} (selected by {origin}); "
        f"registered backends: {', '.join(known) or 'none'}"
        + (
            f"; plugins that did not load: {', '.join(sorted({e.plugin for e in errors}))} (see `attnplug info`)"
            if errors
            else ""
        ),
        name=name,
        known=known,
    )


def unusable(name: str, origin: str, reason: str, alternatives: Tuple[str, ...]) -> BackendUnavailable:
    """Backend ``name`` is registered but cannot be used here, for ``reason``."""
    return BackendUnavailable(
        f"backend {name!r} (selected by {origin}) is unavailable: {reason}. {_alternatives_text(alternatives)}",
        name=name,
        reason=reason,
        alternatives=alternatives,
    )


def tied(priority: int, names: Tuple[str, ...]) -> AmbiguousBackend:
    """The available backends ``names`` share the top priority ``priority``."""
    return AmbiguousBackend(
        f"several available backends share the top priority {priority}: {', '.join(names)}; "
        f"choose one with get_backend(name) or {env.BACKEND.name}=<name>",
        candidates=names,
        priority=priority,
    )


def none_available(reasons: Iterable[Tuple[str, str]], errors: Iterable[PluginError]) -> BackendUnavailable:
    """No backend is available: ``reasons`` says why for each registered one, ``errors`` lists
    the plugins that did not load."""
    lines = [f"  {name}: {reason}" for name, reason in reasons]
    lines += [f"  {e.describe_source()}: {e.kind}: {e.reason}" for e in errors]
    return BackendUnavailable(
        "no attention backend is available" + (":\n" + "\n".join(lines) if lines else " (no plugin registered one)"),
        name=None,
        reason="no backend available",
        alternatives=(),
    )
