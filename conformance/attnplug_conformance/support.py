"""What the checks share, in one import: ``from attnplug_conformance.support import ...``.

The names live in modules with one job each:

* ``rules``: the rule names every failure message starts with;
* ``config``: what is tested (dtypes, tolerances, capabilities, ``TestConfig``, skips, ``env``);
* ``compare``: output and cache comparisons with the reference, ``conformance_check``;
* ``instruments``: the translation counter, the mapping poison, poisoned free rows;
* ``twins``: the world under test and its reference twin in lockstep, the usual request shapes.

Everything here is device-neutral: tensors are compared on the host after the step, and the
only device services used are the backend class's ``new_graph()`` (through ``GraphRunner``),
``sync_guard()`` and ``synchronize(device)``.
"""

from __future__ import annotations

from . import compare, config, instruments, rules, twins
from .compare import *  # noqa: F403
from .config import *  # noqa: F403
from .instruments import *  # noqa: F403
from .rules import *  # noqa: F403
from .twins import *  # noqa: F403

__all__ = [*rules.__all__, *config.__all__, *compare.__all__, *instruments.__all__, *twins.__all__]
