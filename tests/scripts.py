"""The scripts of ``benchmarks/`` as modules, for their tests (they are files, not packages)."""

import importlib.util
import os
from types import ModuleType

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def load_script(name: str) -> ModuleType:
    """``benchmarks/<name>.py``, executed as a module named ``name``."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCHMARKS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
