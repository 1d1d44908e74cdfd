"""The soak: a random serving simulation driven through the public API, checked every step.

``Soak`` builds the pools, the backend and (when the backend captures graphs) a
``GraphRunner``, then runs the steps: the ``scheduler`` decides each step (arrivals, chunked
prefill, DECODE, TARGET_VERIFY with rollback, DRAFT_EXTEND, finishing, eviction; ``OutOfKVSlots``
handled by shrinking the batch or retracting a request), the step runs through the runner
(replay when a bucket holds the batch, eager otherwise) or eagerly, and the ``checks`` poison the
dead slots before it and compare the outputs, the allocator's state and the live KV values
after it. A failed check is recorded (``SoakReport.fail``) and the run goes on, unless
``stop_on_failure``.

Determinism: the schedule and the data come from ``random.Random(seed)`` and a CPU
``torch.Generator(seed)``; nothing depends on the device or on the backend's outputs.
"""

from __future__ import annotations

import time
from typing import Callable, Dict, Optional, Tuple, Type

import torch

from ..backend import AttentionBackend, GraphSupport, decide_needs_cpu_seq_lens
from ..batch import ForwardBatch, ForwardMode
from ..cli_errors import signal_name
from ..graphs import EagerGraph, GraphRunner, captures_extend
from ..memory import ReqToTokenPool, SWAKVPool, SWATokenAllocator
from .checks import StepChecks
from .config import DEFAULT_TOLERANCE, SoakConfig, dtype_name
from .report import SoakFailure, SoakReport, StepFailed
from .scheduler import Planned, Scheduler

__all__ = ["Soak", "SoakSetupError"]


class SoakSetupError(ValueError):
    """The backend cannot run the requested configuration; the message names the option."""


class Soak:
    """One soak run over ``backend_cls`` on ``device`` (see module docstring)."""

    def __init__(
        self,
        config: SoakConfig,
        backend_cls: Type[AttentionBackend],
        device: torch.device,
        *,
        log: Callable[[str], None] = print,
    ) -> None:
        config.check()
        self.cfg = cfg = config
        self.log = log
        self.dtype, self.head_dim = self._choose_shapes(backend_cls, device)
        self.tol = cfg.tolerance if cfg.tolerance is not None else DEFAULT_TOLERANCE[self.dtype]
        size, size_swa = cfg.sizes()
        self.swa_layers = frozenset(cfg.swa_layer_ids())
        self.pool = SWAKVPool(
            size,
            size_swa,
            cfg.num_layers,
            self.swa_layers,
            cfg.num_kv_heads,
            self.head_dim,
            self.dtype,
            device,
            page_size=cfg.page_size,
        )
        self.device = self.pool.device
        self.alloc = SWATokenAllocator(self.pool)
        self.rows = ReqToTokenPool(cfg.max_running + 1, cfg.max_context, self.device)
        self.backend = backend_cls(self.pool, self.rows, num_heads=cfg.num_heads, sliding_window=cfg.sliding_window)
        caps = self.backend.capabilities()
        self._check_supported(caps)
        self.needs_cpu_seq_lens = decide_needs_cpu_seq_lens([self.backend])

        can_capture = caps.graphs > GraphSupport.NEVER
        if cfg.graphs and not can_capture:
            raise SoakSetupError(f"--graphs: backend {backend_cls.name!r} captures no mode (graphs=NEVER)")
        self.graphs = can_capture if cfg.graphs is None else cfg.graphs
        self.runner: Optional[GraphRunner] = None
        graph_kind = "off"
        if self.graphs:
            if max(cfg.buckets) > cfg.max_running:
                raise SoakSetupError(f"buckets {cfg.buckets} exceed max_running={cfg.max_running}")
            L, H, Hkv, D = cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, self.head_dim
            self.runner = GraphRunner(
                self.backend,
                self._model_step,
                max_bs=max(cfg.buckets),
                inputs={"q": ((L, H, D), self.dtype), "k": ((L, Hkv, D), self.dtype), "v": ((L, Hkv, D), self.dtype)},
                num_draft_tokens=cfg.draft_tokens,
                bucket_sizes=cfg.buckets,
                extend_tokens=cfg.extend_tokens if captures_extend(caps.graphs) else None,
            )
            graph_kind = "eager stand-in" if isinstance(backend_cls.new_graph(), EagerGraph) else "device graphs"

        import attnplug

        cfg_json = cfg.to_json()
        cfg_json.update(dtype=dtype_name(self.dtype), head_dim=self.head_dim, graphs=self.graphs)
        self.report = SoakReport(
            backend=cfg.backend,
            device=str(self.device),
            dtype=dtype_name(self.dtype),
            pdl=caps.pdl,
            graphs=self.graphs,
            graph_kind=graph_kind,
            tolerance=self.tol,
            config=cfg_json,
            versions={"attnplug": attnplug.__version__, "torch": torch.__version__},
        )
        self.scheduler = Scheduler(cfg, self.alloc, self.rows, self.report, needs_cpu_seq_lens=self.needs_cpu_seq_lens)
        self.checks = StepChecks(cfg, self.pool, self.alloc, self.rows, self.report, tol=self.tol)

    # ------------------------------------------------------------------ setup
    def _choose_shapes(self, backend_cls, device) -> Tuple[torch.dtype, int]:
        """The KV dtype and head dim: as configured, else what the backend declares (float16
        where supported, the smallest head dim), read from a throw-away instance."""
        cfg = self.cfg
        probe_dtype = cfg.dtype or torch.float16
        probe_dim = cfg.head_dim or 64
        ps = cfg.page_size
        try:
            pool = SWAKVPool(ps, ps, 1, [0], cfg.num_kv_heads, probe_dim, probe_dtype, device, page_size=ps)
            rows = ReqToTokenPool(2, 1, pool.device)
            caps = backend_cls(pool, rows, num_heads=cfg.num_heads, sliding_window=cfg.sliding_window).capabilities()
        except Exception as exc:
            raise SoakSetupError(
                f"cannot build backend {backend_cls.name!r} on {device} with dtype "
                f"{dtype_name(probe_dtype)}, head_dim {probe_dim}: {type(exc).__name__}: {exc} "
                "(choose --dtype / --head-dim / --device)"
            ) from exc
        dtype = cfg.dtype or (torch.float16 if torch.float16 in caps.dtypes else caps.dtypes[0])
        head_dim = cfg.head_dim or min(caps.head_dims)
        return dtype, head_dim

    def _check_supported(self, caps) -> None:
        for option, value, supported in (
            ("--dtype", self.dtype, caps.dtypes),
            ("--head-dim", self.head_dim, caps.head_dims),
            ("--page-size", self.cfg.page_size, caps.page_sizes),
        ):
            if value not in supported:
                shown = [dtype_name(s) if isinstance(s, torch.dtype) else s for s in supported]
                value = dtype_name(value) if isinstance(value, torch.dtype) else value
                raise SoakSetupError(f"{option} {value}: backend {self.backend.name!r} supports {shown}")

    def _model_step(self, batch: ForwardBatch, inputs: Dict[str, torch.Tensor]) -> torch.Tensor:
        """Every layer's attention of one step, stacked to ``[T, L, H, D]``."""
        outs = [
            self.backend.forward(inputs["q"][:, l], inputs["k"][:, l], inputs["v"][:, l], l, batch)
            for l in range(self.cfg.num_layers)
        ]
        return torch.stack(outs, dim=1)

    # ------------------------------------------------------------------ run
    def run(self) -> SoakReport:
        """Run the steps; returns the report. A ``KeyboardInterrupt`` (Ctrl-C, or SIGTERM where
        the command turns it into one: ``cli_errors.Terminated``) stops the run between or
        inside a step and is not raised: the report keeps the figures of the steps that ran and
        names the signal (``interrupted``)."""
        cfg, rep = self.cfg, self.report
        start = last_log = time.perf_counter()
        try:
            if self.runner is not None:
                self.runner.capture(strict=True)  # a capture failure fails the soak
            start = last_log = time.perf_counter()
            for index in range(cfg.steps):
                self._step(index)
                rep.steps = index + 1
                now = time.perf_counter()
                if cfg.progress_every and now - last_log >= cfg.progress_every:
                    last_log = now
                    self.log(
                        f"step {index + 1:,}/{cfg.steps:,}: {rep.requests_finished:,} requests finished, "
                        f"{rep.replays:,} replays, {rep.eager_steps:,} eager, max err {rep.max_error:.2e}, "
                        f"failures {rep.failures}, {(index + 1) / (now - start):,.0f} steps/s"
                    )
                if rep.failures and cfg.stop_on_failure:
                    break
        except KeyboardInterrupt as exc:  # the step in progress is dropped; what ran is kept
            rep.interrupted = signal_name(exc)
        finally:
            rep.wall_s = time.perf_counter() - start
        return rep

    def _step(self, index: int) -> None:
        rep, scheduler, checks = self.report, self.scheduler, self.checks
        planned: Optional[Planned] = None
        scheduler.attempt = None
        path = "not run"
        try:
            scheduler.arrivals()
            checks.poison(scheduler.running)
            planned = scheduler.plan()
            path = self._path(planned)
            output = self._execute(planned)
            self._account(planned, path)
            scheduler.commit(planned)
            if index % self.cfg.kv_check_every == 0 or index == self.cfg.steps - 1:
                checks.check_kv(scheduler.running)
            checks.check_attention(planned, output)
            scheduler.after_step(planned)
            checks.check_state(scheduler.running)
        except StepFailed as failure:
            rep.fail(self._failure(index, planned, path, failure.check, str(failure)))
        except Exception as exc:  # the backend or the memory API raised: a failure, reported
            rep.fail(self._failure(index, planned, path, "error", f"{type(exc).__name__}: {exc}"))

    def _failure(self, index, planned, path, check, message) -> SoakFailure:
        if planned is not None:
            attempt = (planned.mode, planned.reqs, planned.new)
        else:  # failed while allocating: the step being planned
            attempt = self.scheduler.attempt or (None, [], [])
        mode = attempt[0].name if attempt[0] is not None else "-"
        batch = ", ".join(f"request {r.rid} +{n}" for r, n in zip(attempt[1], attempt[2])) or "no requests"
        return SoakFailure(
            seed=self.cfg.seed, step=index, mode=mode, path=path, check=check, message=message, batch=batch
        )

    # ------------------------------------------------------------------ execution
    def _path(self, planned: Planned) -> str:
        if self.runner is None:
            return "eager"
        bucket = self.runner.bucket_for(planned.batch)
        if bucket is None:
            return "eager"
        return f"replay ({'tokens' if planned.mode is ForwardMode.EXTEND else 'bucket'} {bucket})"

    def _execute(self, planned: Planned) -> torch.Tensor:
        """Run the step; returns ``[T, L, H, D]`` float64 on the host."""
        if self.runner is not None:
            out = self.runner.run(planned.batch, planned.inputs)
        else:
            self.backend.init_forward_metadata(planned.batch)
            out = self._model_step(planned.batch, planned.inputs)
        return out.to("cpu", torch.float64)

    def _account(self, planned: Planned, path: str) -> None:
        rep = self.report
        figures = rep.mode(planned.mode.name)
        figures.steps += 1
        figures.tokens += sum(planned.new)
        rep.tokens += sum(planned.new)
        if path.startswith("replay"):
            figures.replays += 1
            rep.replays += 1
        else:
            figures.eager += 1
            rep.eager_steps += 1
