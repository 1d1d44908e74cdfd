"""What a soak run found: counters, the first failure, the summary table and the JSON figures."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

__all__ = ["SoakFailure", "StepFailed", "ModeFigures", "SoakReport"]


@dataclass
class SoakFailure:
    """One failed check. ``step`` counts from 0; ``--steps step + 1`` with the same seed and
    options reproduces it. ``check``: ``attention`` (error above tolerance or non-finite),
    ``kv`` (a live slot lost its value), ``invariants`` (allocator or slot ownership),
    ``error`` (an exception from the backend or the memory API)."""

    seed: int
    step: int
    mode: str
    path: str  # "replay (bucket B)", "replay (tokens T)" (EXTEND) or "eager"
    check: str
    message: str
    batch: str  # requests, new tokens and lengths of the step

    def describe(self) -> str:
        return (
            f"seed {self.seed}, step {self.step}, mode {self.mode} ({self.path}), check {self.check}: "
            f"{self.message} [batch: {self.batch}]"
        )


class StepFailed(Exception):
    """A check failed during a step (``check``: as in ``SoakFailure``); the soak records it as a
    ``SoakFailure`` and goes on with the next step."""

    def __init__(self, check: str, message: str) -> None:
        super().__init__(message)
        self.check = check


@dataclass
class ModeFigures:
    steps: int = 0
    replays: int = 0
    eager: int = 0
    tokens: int = 0
    max_error: float = 0.0


@dataclass
class SoakReport:
    """Counters of one run (host ints/floats; ``to_json`` is what ``--json`` writes)."""

    backend: str
    device: str
    dtype: str
    pdl: Optional[bool]
    graphs: bool
    graph_kind: str  # "device graphs", "eager stand-in" or "off"
    tolerance: float
    config: Dict[str, Any]
    steps: int = 0
    requests_arrived: int = 0
    requests_finished: int = 0
    requests_retracted: int = 0
    tokens: int = 0  # new tokens run through attention
    tokens_rolled_back: int = 0  # rejected drafts whose slots were freed
    replays: int = 0
    eager_steps: int = 0
    modes: Dict[str, ModeFigures] = field(default_factory=dict)
    max_error: float = 0.0
    out_of_kv_slots: int = 0  # OutOfKVSlots raised and handled by the scheduler
    out_of_req_rows: int = 0  # OutOfReqSlots raised and handled (arrival kept waiting)
    swa_slots_evicted: int = 0
    slots_reused: int = 0  # allocated full slots that an earlier request had used
    invariant_checks: int = 0
    kv_checks: int = 0
    kv_slots_verified: int = 0
    data_lost: int = 0  # live (layer, slot) values that differed from what was written
    failures: int = 0
    first_failure: Optional[SoakFailure] = None
    failure_log: List[SoakFailure] = field(default_factory=list)
    wall_s: float = 0.0
    versions: Dict[str, str] = field(default_factory=dict)
    #: the signal that stopped the run before its last step ("SIGINT", "SIGTERM"), else None:
    #: the figures then cover the steps that ran (``steps``), not ``config["steps"]``
    interrupted: Optional[str] = None

    def mode(self, name: str) -> ModeFigures:
        return self.modes.setdefault(name, ModeFigures())

    def fail(self, failure: SoakFailure) -> None:
        self.failures += 1
        if self.first_failure is None:
            self.first_failure = failure
        if len(self.failure_log) < 20:
            self.failure_log.append(failure)

    @property
    def ok(self) -> bool:
        """Every step asked for ran and passed (an interrupted run is not ok, whatever it found)."""
        return self.failures == 0 and self.data_lost == 0 and not self.interrupted

    def to_json(self) -> Dict[str, Any]:
        data = asdict(self)
        data["ok"] = self.ok
        data["steps_per_s"] = self.steps / self.wall_s if self.wall_s else None
        for key in ("max_error",):
            if not math.isfinite(data[key]):
                data[key] = str(data[key])
        for figures in data["modes"].values():
            if not math.isfinite(figures["max_error"]):
                figures["max_error"] = str(figures["max_error"])
        return data

    def write_json(self, path: str) -> None:
        """Write ``to_json()`` to ``path`` (its missing folders created; replaced atomically,
        so an earlier file is never left half written)."""
        import os

        folder = os.path.dirname(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        tmp = f"{path}.tmp"
        with open(tmp, "w") as fh:
            json.dump(self.to_json(), fh, indent=2)
            fh.write("\n")
        os.replace(tmp, path)

    # ------------------------------------------------------------------ printing
    def print_summary(self, console=None) -> None:
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text

        console = console or Console()
        cfg = self.config
        title = (
            f"attnplug soak: {self.backend} on {self.device}, {self.dtype}, page_size {cfg['page_size']}, "
            f"seed {cfg['seed']}, graphs {self.graph_kind}, PDL {_yes_no(self.pdl)}"
        )
        console.print(Text(title, style="bold"))
        table = Table()
        table.add_column("figure")
        table.add_column("value", justify="right")
        rate = f"{self.steps / self.wall_s:,.0f}/s" if self.wall_s else "-"
        rows = [
            ("steps", f"{self.steps:,} ({rate}, {self.wall_s:.1f} s)"),
            (
                "requests arrived / finished / retracted",
                f"{self.requests_arrived:,} / {self.requests_finished:,} / {self.requests_retracted:,}",
            ),
            ("tokens attended / drafts rolled back", f"{self.tokens:,} / {self.tokens_rolled_back:,}"),
            ("graph replays / eager steps", f"{self.replays:,} / {self.eager_steps:,}"),
            ("OutOfKVSlots handled / request rows full", f"{self.out_of_kv_slots:,} / {self.out_of_req_rows:,}"),
            ("SWA slots evicted / full slots reused", f"{self.swa_slots_evicted:,} / {self.slots_reused:,}"),
            ("max relative error (tolerance)", f"{self.max_error:.2e} ({self.tolerance:.0e})"),
            ("invariant checks", f"{self.invariant_checks:,}"),
            ("KV checks / live slot values verified", f"{self.kv_checks:,} / {self.kv_slots_verified:,}"),
            ("data lost", _count(self.data_lost)),
            ("failures", _count(self.failures)),
        ]
        for name, value in rows:
            table.add_row(name, value if isinstance(value, Text) else Text(value))
        console.print(table)

        modes = Table(title="per mode", title_justify="left")
        for column in ("mode", "steps", "replays", "eager", "tokens", "max rel. error"):
            modes.add_column(column, justify="right" if column != "mode" else "left")
        for name, m in sorted(self.modes.items()):
            modes.add_row(name, f"{m.steps:,}", f"{m.replays:,}", f"{m.eager:,}", f"{m.tokens:,}", f"{m.max_error:.2e}")
        console.print(modes)
        if self.interrupted:
            console.print(
                Text(
                    f"INTERRUPTED by {self.interrupted} after {self.steps:,} of {cfg['steps']:,} steps: "
                    "the figures cover the steps that ran",
                    style="yellow bold",
                ),
                soft_wrap=True,
            )
        if self.first_failure is not None:
            console.print(
                Text(f"FAILED ({self.failures} failure(s)); first: {self.first_failure.describe()}", style="red"),
                soft_wrap=True,
            )
            console.print(Text(f"reproduce: {self.reproduce_command()}"), soft_wrap=True)
        elif self.interrupted:
            console.print(Text(f"no failure in {self.steps:,} steps, data lost: {self.data_lost}", style="yellow"))
        else:
            console.print(Text(f"OK: {self.steps:,} steps, 0 failures, data lost: 0", style="green"))

    def reproduce_command(self) -> str:
        """The command line that re-runs this configuration up to the first failing step."""
        from .config import command_line

        steps = self.first_failure.step + 1 if self.first_failure is not None else self.config["steps"]
        return command_line(self.config, steps)


def _yes_no(value: Optional[bool]) -> str:
    return "?" if value is None else ("yes" if value else "no")


def _count(n: int):
    from rich.text import Text

    return Text(f"{n:,}", style="green" if n == 0 else "red bold")
