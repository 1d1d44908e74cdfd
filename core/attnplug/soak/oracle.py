"""Where the float64 oracle used to live: it is ``attnplug.oracle`` now (kept for the
importers not yet moved: tests/cuda/one_launch_cases.py)."""

from ..oracle import exact_attention

__all__ = ["exact_attention"]
