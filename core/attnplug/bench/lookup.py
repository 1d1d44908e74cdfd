"""How the harness finds a backend's benchmarks: ``suite_for(backend_cls)``.

A plugin ships its benchmarks as a ``Suite`` named ``SUITE`` in the module ``bench`` of its
top-level package (``<package>.bench.SUITE``, e.g. the package of the backend class's
module); a backend whose package ships none gets the portable suite
(``attnplug.bench.portable``: whole steps through ``GraphRunner``, any backend, any device).
"""

from __future__ import annotations

import importlib

from .portable import SUITE as PORTABLE
from .suite import Suite

__all__ = ["suite_for"]


def suite_for(backend_cls: type) -> Suite:
    """The suite ``backend_cls``'s package ships (``<package>.bench.SUITE``), else the
    portable suite."""
    package = backend_cls.__module__.split(".")[0]
    name = f"{package}.bench"
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name not in (name, package):
            raise  # the bench module exists but one of its imports is missing: say so
        module = None
    suite = getattr(module, "SUITE", None)
    if suite is None:
        suite = PORTABLE
    if not isinstance(suite, Suite):
        raise TypeError(f"{name}.SUITE is {type(suite).__name__}, not an attnplug.bench.Suite")
    return suite
