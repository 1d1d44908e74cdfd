"""The whole conformance suite as importable test functions: the one-line adoption.

A third-party plugin runs the suite against its backend with a test file holding::

    from attnplug_conformance.suite import *  # noqa: F401,F403

The ``attnplug_conformance`` pytest plugin (installed with attnplug, loaded automatically)
parametrises every check over the backends named by ``--attnplug-backend`` (or the ini
option ``attnplug_backends``; default: every available registered backend).
"""

import importlib

from .plugin import check_names

__all__ = check_names()  # generated from the modules of checks/: one check each, same name
for _name in __all__:
    globals()[_name] = getattr(importlib.import_module(f"{__package__}.checks.{_name}"), _name)
del _name
