"""attnplug conformance suite: the checks every attention backend must pass, packaged as a
pytest plugin (``attnplug_conformance.plugin``, entry point ``pytest11``), plus the test
harness they are built on.

* ``attnplug conformance`` (``attnplug_conformance.runner.run_conformance``) runs the suite
  against every available backend and prints a backend x check matrix.
* ``pytest --attnplug-backend=NAME`` runs it inside pytest.
* A third-party plugin adopts it with one test file line:
  ``from attnplug_conformance.suite import *  # noqa: F401,F403``.

See docs/conformance.md. Importing this package imports no check and loads no plugin.
"""

from .harness import Request, Step, World, WorldSpec, layer_step

__all__ = ["Request", "Step", "World", "WorldSpec", "layer_step", "run_conformance"]


def run_conformance(*args, **kwargs) -> int:
    """See ``attnplug_conformance.runner.run_conformance``."""
    from .runner import run_conformance as run

    return run(*args, **kwargs)
