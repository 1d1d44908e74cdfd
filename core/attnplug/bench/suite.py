"""Benchmark definitions: what a plugin ships (``Benchmark``, ``Suite``, ``SuiteUnavailable``).

A plugin ships its benchmarks as a ``Suite`` named ``SUITE`` in the module ``bench`` of its
top-level package; ``lookup.suite_for(backend_cls)`` finds it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

__all__ = ["Benchmark", "Suite", "SuiteUnavailable"]


class SuiteUnavailable(RuntimeError):
    """The suite cannot run here (e.g. it needs a device this machine lacks); the message
    says why."""


@dataclass(frozen=True)
class Benchmark:
    """One benchmark: ``target`` is ``"module:function"``, a function ``fn(ctx) -> rows``
    imported only when the benchmark runs. ``reserve_s``: seconds of the run's budget it
    needs at least (kept back while earlier benchmarks run). ``default``: part of a run that
    names no benchmark (False: only with ``--only``)."""

    name: str
    target: str
    description: str = ""
    reserve_s: float = 60.0
    default: bool = True

    def load(self) -> Callable[[Any], List[dict]]:
        module, _, attr = self.target.partition(":")
        return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class Suite:
    """The benchmarks a plugin ships.

    * ``module``: the module that holds this suite as ``SUITE`` (child processes import it);
    * ``baseline``: the variant that ratio plots divide by (e.g. ``"before"``);
    * ``requires``: ``() -> None``, raising ``SuiteUnavailable`` when the suite cannot run;
    * ``environment``: ``() -> dict``, what the suite adds to the run's environment record;
    * ``options``: option name -> default (the type of the default is the option's type),
      set on the command line with ``--set NAME=VALUE``;
    * ``isolate``: run each benchmark in its own child process by default (a sticky device
      error, an out-of-memory or a hang then costs one benchmark);
    * ``budget_s``: the run's default wall-clock budget (None: unlimited).
    """

    name: str
    module: str
    benchmarks: Sequence[Benchmark]
    baseline: str = "before"
    requires: Optional[Callable[[], None]] = None
    environment: Optional[Callable[[], Dict[str, Any]]] = None
    options: Dict[str, Any] = field(default_factory=dict)
    isolate: bool = False
    budget_s: Optional[float] = None

    def names(self, default_only: bool = False) -> List[str]:
        return [b.name for b in self.benchmarks if b.default or not default_only]

    def get(self, name: str) -> Benchmark:
        for b in self.benchmarks:
            if b.name == name:
                return b
        raise ValueError(f"unknown benchmark {name!r} in suite {self.name!r}; choose from {self.names()}")

    def select(self, only: Optional[Sequence[str]]) -> List[Benchmark]:
        """The benchmarks ``only`` names (in suite order), or the default ones."""
        if not only:
            return [b for b in self.benchmarks if b.default]
        unknown = [n for n in only if n not in self.names()]
        if unknown:
            raise ValueError(f"unknown benchmark(s) {unknown} in suite {self.name!r}; choose from {self.names()}")
        return [b for b in self.benchmarks if b.name in only]

    def parse_options(self, assignments: Sequence[str]) -> Dict[str, Any]:
        """``options`` with ``NAME=VALUE`` assignments applied; ``ValueError`` naming the bad one."""
        out = dict(self.options)
        for text in assignments or ():
            name, sep, value = text.partition("=")
            if not sep:
                raise ValueError(f"--set {text!r}: expected NAME=VALUE")
            if name not in self.options:
                known = ", ".join(sorted(self.options)) or "none"
                raise ValueError(f"--set {text!r}: suite {self.name!r} has no option {name!r} (options: {known})")
            out[name] = _convert(name, value, self.options[name])
        return out

    def check(self) -> None:
        """Raise ``SuiteUnavailable`` when the suite cannot run here."""
        if self.requires is not None:
            self.requires()


def _convert(name: str, value: str, default: Any) -> Any:
    if isinstance(default, bool):
        low = value.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"--set {name}={value!r}: expected a boolean (1/0, true/false)")
    if isinstance(default, (int, float)):
        try:
            return type(default)(value)
        except ValueError:
            raise ValueError(f"--set {name}={value!r}: expected a {type(default).__name__}") from None
    return value
