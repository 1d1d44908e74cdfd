"""``attnplug soak``: a long random serving simulation checked every step against a float64
oracle, the allocator's invariants and the live KV values (see ``simulation``).

``run_soak(config)`` runs one configuration and returns a ``SoakReport``; the command line
is ``attnplug soak --backend NAME --steps N --seed S`` (``attnplug soak --help``).
"""

from __future__ import annotations

from typing import Callable, Optional

from ..selection import SelectionError, resolve_backend
from .config import DEFAULT_TOLERANCE, DTYPES, SoakConfig, command_line
from .report import ModeFigures, SoakFailure, SoakReport
from .simulation import Soak, SoakSetupError

__all__ = [
    "run_soak",
    "SoakConfig",
    "SoakReport",
    "SoakFailure",
    "ModeFigures",
    "Soak",
    "SoakSetupError",
    "SelectionError",
    "resolve_backend",
    "DEFAULT_TOLERANCE",
    "DTYPES",
    "command_line",
]


def run_soak(config: SoakConfig, *, backend_cls=None, log: Optional[Callable[[str], None]] = print) -> SoakReport:
    """Run ``config`` and return its report. ``backend_cls`` overrides ``config.backend``
    (the device is then ``config.device`` or the host). Raises ``SelectionError`` /
    ``SoakSetupError`` / ``ValueError`` before the first step when the run cannot start
    (an unusable ``config.device`` included); failures during the run are in the report,
    never raised, and so is a Ctrl-C during the steps (``SoakReport.interrupted``). Torch runs with
    ``config.threads`` host threads meanwhile (restored afterwards)."""
    import torch

    from ..cli_errors import device_problem

    if config.device is not None:
        problem = device_problem(config.device)
        if problem:
            raise SoakSetupError(f"--device {config.device!r}: {problem}")
    if backend_cls is None:
        resolved = resolve_backend(config.backend, config.device)
        backend_cls, device = resolved.cls, resolved.device
    else:
        device = torch.device(config.device or "cpu")
    threads = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    try:
        return Soak(config, backend_cls, device, log=log or (lambda _msg: None)).run()
    finally:
        torch.set_num_threads(threads)
