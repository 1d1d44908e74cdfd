"""Graph runner: one captured graph per (mode, batch-size bucket), replayed with padding.

The runner owns the static input buffers of a step (``req_pool_indices``, ``seq_lens``,
``out_cache_loc``, ``positions`` and the per-token model inputs), captures ``step(batch,
inputs)`` once per bucket through the backend's device graph (``backend.new_graph()``), and
at run time:

1. copies the real step into the static buffers and pads up to the bucket: padded requests
   get ``req_pool_indices = 0`` and ``seq_lens = backend.get_cuda_graph_seq_len_fill_value()``,
   padded tokens ``out_cache_loc = 0`` (slot 0, the sink), position 0 and zero inputs. A
   backend that declares ``copies_replay_batch`` does the batch part itself, inside its
   replay metadata (announced with ``backend.set_replay_source(batch, static)``): the runner
   then copies only the model inputs;
2. calls ``backend.init_forward_metadata_replay_cuda_graph`` on the padded static batch (the
   ONE translation of the step happens there, into ``cuda_graph_swa_out_cache_loc``);
3. replays the graph and returns the first ``T`` rows of the static output.

Steps 1-2 are ``prepare(batch, inputs)`` (all host work of a replay), step 3 is ``replay()``;
``run`` is the two together, or the eager step when ``prepare`` finds no graph.

A step that no graph covers (mode not captured, more requests than the largest bucket)
runs eagerly: ``init_forward_metadata`` (which translates once) and ``step``.

The runner never runs eagerly without saying so. ``run()`` captures on first use: the first
step of a mode the runner captures triggers ``capture()`` when it was never called. A step that
still runs eagerly has a reason, ``why_eager(batch)``; the first eager step of each mode and
reason is logged (WARNING when graphs could serve it, e.g. a batch larger than ``max_bs``;
INFO for modes the runner never captures, e.g. EXTEND), and ``status()`` lists the reasons
(``not_captured`` per mode, ``eager_runs`` with the steps counted). A backend that declares
``GraphSupport.NEVER`` is reported once, at construction.

Capture is per bucket and atomic. If capturing one (mode, bucket) fails, the device graph
ends what it began (see ``DeviceGraph``), the bucket is left out, and the reason is kept in
``capture_failures`` (also logged at WARNING, and shown by ``status()``); steps of that size
run in the next larger captured bucket of the mode, or eagerly when there is none. The
other buckets are captured as usual and replay unaffected. ``capture(strict=True)`` also
raises ``GraphCaptureError`` after trying every bucket.

Capture keeps the cyclic garbage collector paused (``collector.collector_paused``), and the
runner holds no reference cycle: dropping the last reference to a runner frees its graphs at
once, never later inside some other capture.

Every replay-path operation is a device copy/fill: the runner never reads device values.
The preparation does as few device operations as it can: one grouped copy of the step into
the static buffers (``torch._foreach_copy_``), a padding fill only when rows the graph reads
may still hold an earlier, larger step's values (the runner tracks how far each static buffer
holds real rather than padding values; ``capture()`` resets them all to padding), views cached
per size, and a per-mode table from batch size to graph.
"""

from __future__ import annotations

import functools
import logging
import traceback
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from ..backend import AttentionBackend, GraphSupport, decide_needs_cpu_seq_lens
from ..batch import ForwardBatch, ForwardMode
from . import collector
from .device_graph import DeviceGraph, EagerGraph

__all__ = ["GraphCaptureError", "GraphRunner", "captured_modes", "default_bucket_sizes", "StepFn"]

logger = logging.getLogger(__name__)

#: a captured graph's key: (mode, bucket size)
GraphKey = Tuple[ForwardMode, int]

#: ``step(batch, inputs) -> Tensor[T, ...]``: runs every layer of one step.
StepFn = Callable[[ForwardBatch, Dict[str, torch.Tensor]], torch.Tensor]

#: the modes a runner can capture: one graph per bucket fixes the tokens per request
_RUNNER_MODES = GraphSupport.UNIFORM.modes


def captured_modes(support: GraphSupport) -> Tuple[ForwardMode, ...]:
    """The modes a ``GraphRunner`` captures for a backend of this level: those of
    ``support.modes`` (core's ``GRAPH_MODES`` table) with one q_len per request."""
    return tuple(m for m in support.modes if m in _RUNNER_MODES)


def default_bucket_sizes(max_bs: int) -> Tuple[int, ...]:
    """1, 2, 4, 8, then every 8 up to 64, then every 16, ending at ``max_bs``."""
    sizes = [b for b in (1, 2, 4) if b < max_bs]
    b = 8
    while b < max_bs:
        sizes.append(b)
        b += 8 if b < 64 else 16
    sizes.append(max_bs)
    return tuple(sizes)


class GraphCaptureError(RuntimeError):
    """``GraphRunner.capture(strict=True)`` found buckets it could not capture.
    ``failures`` maps each ``(mode, bucket)`` to the reason."""

    def __init__(self, failures: Mapping[GraphKey, str]) -> None:
        self.failures = dict(failures)
        lines = "; ".join(f"{_key_name(k)}: {r}" for k, r in self.failures.items())
        super().__init__(f"{len(self.failures)} graph capture(s) failed: {lines}")


def _key_name(key: GraphKey) -> str:
    return f"{key[0].name}/bs={key[1]}"


def _describe(exc: BaseException) -> str:
    """``Type: first line of the message`` of ``exc`` and of the exceptions it was raised while
    handling (the full traceback is logged at DEBUG)."""
    parts, seen = [], set()
    while exc is not None and id(exc) not in seen and len(parts) < 3:
        seen.add(id(exc))
        first_line = (str(exc).strip().splitlines() or [""])[0]
        parts.append(f"{type(exc).__name__}: {first_line}")
        exc = exc.__cause__ or exc.__context__
    return " <- raised while handling ".join(parts)


@dataclass
class _Captured:
    graph: DeviceGraph
    batch: ForwardBatch  # padded static batch (views of the runner's buffers)
    output: torch.Tensor  # static output the graph rewrites on replay
    rows: Dict[int, torch.Tensor] = field(default_factory=dict)  # n -> output[:n] (cached views)

    def output_rows(self, n: int) -> torch.Tensor:
        view = self.rows.get(n)
        if view is None:
            view = self.rows[n] = self.output[:n]
        return view


class GraphRunner:
    """Capture and replay steps of one backend (see module docstring).

    ``inputs`` maps each per-token model input to its per-token shape and dtype, e.g.
    ``{"q": ((L, H, D), torch.bfloat16)}``; the static buffer is ``[max_num_tokens, *shape]``.
    ``num_draft_tokens`` enables TARGET_VERIFY / DRAFT_EXTEND capture (q_len per request).
    """

    def __init__(
        self,
        backend: AttentionBackend,
        step: StepFn,
        *,
        max_bs: int,
        inputs: Mapping[str, Tuple[Sequence[int], torch.dtype]],
        num_draft_tokens: Optional[int] = None,
        bucket_sizes: Optional[Sequence[int]] = None,
        modes: Optional[Sequence[ForwardMode]] = None,
    ) -> None:
        if max_bs < 1:
            raise ValueError(f"max_bs must be >= 1, got {max_bs}")
        self.backend = backend
        self.step = step
        self.num_draft_tokens = num_draft_tokens
        self.bucket_sizes = tuple(sorted(set(bucket_sizes or default_bucket_sizes(max_bs))))
        if self.bucket_sizes[0] < 1 or self.bucket_sizes[-1] > max_bs:
            raise ValueError(f"bucket sizes must lie in 1..{max_bs}, got {self.bucket_sizes}")
        supported = captured_modes(backend.capabilities().graphs)
        wanted = tuple(modes) if modes is not None else supported
        unsupported = [m.name for m in wanted if m not in supported]
        if unsupported:
            raise ValueError(
                f"backend {backend.name!r} cannot capture {unsupported} (graphs={backend.capabilities().graphs.name})"
            )
        if modes is not None and num_draft_tokens is None and any(m.is_speculative for m in wanted):
            raise ValueError(
                f"modes {[m.name for m in wanted if m.is_speculative]} need num_draft_tokens "
                "(the q_len of every request)"
            )
        self.modes = tuple(m for m in wanted if m is ForwardMode.DECODE or num_draft_tokens)
        #: mode -> why the runner never replays it (every step of that mode runs eagerly)
        self.not_captured: Dict[ForwardMode, str] = {
            m: _why_not_captured(m, backend, supported, wanted) for m in ForwardMode if m not in self.modes
        }
        if not supported:
            logger.warning("GraphRunner(%s): the backend declares graphs=NEVER: every step runs eagerly", backend.name)
        self.max_bs = max_bs
        q_max = max([1] + [num_draft_tokens or 1 for m in self.modes if m.is_speculative])
        self.max_num_tokens = max_bs * q_max
        self.fill_value = int(backend.get_cuda_graph_seq_len_fill_value())
        self.needs_cpu_seq_lens = decide_needs_cpu_seq_lens([backend])

        dev, n = backend.device, self.max_num_tokens
        backend.init_cuda_graph_state(max_bs, n)
        self.req_pool_indices = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.seq_lens = torch.full((max_bs,), self.fill_value, dtype=torch.int64, device=dev)
        self.out_cache_loc = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.inputs = {
            name: torch.zeros((n, *shape), dtype=dtype, device=dev) for name, (shape, dtype) in inputs.items()
        }
        #: the backend writes the padded batch into the static buffers itself (replay metadata)
        self.backend_copies_batch = bool(getattr(backend, "copies_replay_batch", False))
        self._input_names = tuple(self.inputs)
        # Replay-path caches: views per size, and how far each static buffer may hold values
        # other than padding (rows past it hold padding: no fill needed there).
        self._request_views: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}
        self._token_views: Dict[int, Tuple[torch.Tensor, ...]] = {}  # (out_cache_loc, positions, *inputs)
        self._dirty_requests = 0  # req_pool_indices, seq_lens
        self._dirty_tokens = 0  # out_cache_loc and the inputs
        self._dirty_positions = 0
        #: mode -> (num_draft_tokens the graphs need or None, [bs] -> graph or None); see _route
        self._routes: Dict[ForwardMode, Tuple[Optional[int], List[Optional[_Captured]]]] = {}
        self._prepared: Optional[Tuple[_Captured, int]] = None  # what replay() runs next
        self._grouped_copy = True  # torch._foreach_copy_ works here (cleared on first failure)
        self.graphs: Dict[GraphKey, _Captured] = {}
        #: (mode, bucket) -> why its capture failed (those buckets run in a larger bucket or eagerly)
        self.capture_failures: Dict[GraphKey, str] = {}
        self.capture_ran = False
        #: "MODE" -> {"steps": eager steps run, "why": the latest reason}
        self.eager_runs: Dict[str, Dict[str, object]] = {}
        self._eager_logged: set = set()  # (mode, kind) already logged

    # ------------------------------------------------------------------ capture
    def _q_len(self, mode: ForwardMode) -> int:
        return 1 if mode is ForwardMode.DECODE else int(self.num_draft_tokens)

    def _static_batch(self, mode: ForwardMode, bs: int) -> ForwardBatch:
        n = bs * self._q_len(mode)
        return ForwardBatch(
            forward_mode=mode,
            batch_size=bs,
            req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs],
            out_cache_loc=self.out_cache_loc[:n],
            positions=self.positions[:n],
            seq_lens_cpu=[self.fill_value] * bs if self.needs_cpu_seq_lens else None,
            num_draft_tokens=self.num_draft_tokens if mode.is_speculative else None,
            validate=False,  # padding views: padded requests may be shorter than q_len
        )

    def capture(self, *, strict: bool = False) -> Dict[GraphKey, str]:
        """Capture every (mode, bucket) graph, largest bucket first; returns
        ``capture_failures`` (empty when all were captured).

        Buffers hold padding values during capture, so capture never touches a live KV slot
        (slot 0 only). A bucket whose capture raises is left out and its reason recorded (see
        module docstring); ``strict``: then raise ``GraphCaptureError`` after trying every
        bucket. Calling it again recaptures every bucket.
        """
        self._prepared = None
        self._reset_padding()
        with collector.collector_paused(collect=False):  # device graphs collect once, before their first capture
            for mode in self.modes:
                for bs in reversed(self.bucket_sizes):
                    key = (mode, bs)
                    self.graphs.pop(key, None)
                    self.capture_failures.pop(key, None)
                    try:
                        self.graphs[key] = self._capture_bucket(mode, bs)
                    except Exception as exc:
                        self._record_failure(key, exc)
        self.capture_ran = True
        self._build_routes()
        for mode in self.modes:
            if not any(k[0] is mode for k in self.graphs):
                logger.error(
                    "GraphRunner(%s): no %s graph captured; every %s step runs eagerly",
                    self.backend.name,
                    mode.name,
                    mode.name,
                )
        if strict and self.capture_failures:
            raise GraphCaptureError(self.capture_failures)
        return dict(self.capture_failures)

    def _capture_bucket(self, mode: ForwardMode, bs: int) -> _Captured:
        batch = self._static_batch(mode, bs)
        views = {name: buf[: batch.num_tokens] for name, buf in self.inputs.items()}
        self.backend.init_forward_metadata_capture_cuda_graph(batch)
        graph = self.backend.new_graph()
        # The callable holds the step, the batch and the views, never the runner (no cycle).
        output = graph.capture(functools.partial(self.step, batch, views))
        if not isinstance(output, torch.Tensor) or output.dim() == 0 or output.shape[0] < batch.num_tokens:
            got = tuple(output.shape) if isinstance(output, torch.Tensor) else type(output).__name__
            raise ValueError(f"the step must return a tensor of >= {batch.num_tokens} rows, got {got}")
        return _Captured(graph, batch, output)

    def _record_failure(self, key: GraphKey, exc: BaseException) -> None:
        reason = _describe(exc)
        self.capture_failures[key] = reason
        logger.warning(
            "GraphRunner(%s): capturing %s failed, that bucket is not captured: %s",
            self.backend.name,
            _key_name(key),
            reason,
        )
        logger.debug(
            "capture traceback of %s:\n%s",
            _key_name(key),
            "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
        )

    def status(self) -> Dict[str, object]:
        """What the runner captured, JSON-ready: ``backend``, ``capture_ran``, ``device_graphs``
        (False: the eager stand-in), ``captured`` (``"MODE/bs=N"``), ``failed`` (name ->
        reason), ``eager_modes`` (modes the runner captures but has no graph of: all their
        steps run eagerly), ``not_captured`` (``"MODE"`` -> why the runner never captures it)
        and ``eager_runs`` (``"MODE"`` -> ``{"steps": n, "why": latest reason}`` of the steps
        ``run()`` ran eagerly)."""
        order = sorted(self.graphs, key=lambda k: (self.modes.index(k[0]), k[1]))
        return {
            "backend": self.backend.name,
            "capture_ran": self.capture_ran,
            "device_graphs": any(not isinstance(c.graph, EagerGraph) for c in self.graphs.values()),
            "captured": [_key_name(k) for k in order],
            "failed": {_key_name(k): r for k, r in self.capture_failures.items()},
            "eager_modes": [m.name for m in self.modes if not any(k[0] is m for k in self.graphs)],
            "not_captured": {m.name: r for m, r in self.not_captured.items()},
            "eager_runs": {m: dict(v) for m, v in self.eager_runs.items()},
        }

    # ------------------------------------------------------------------ run
    def _build_routes(self) -> None:
        """Per captured mode, a table from batch size to the smallest captured bucket that
        holds it (None: no graph), so a step finds its graph with one index."""
        routes = {}
        for mode in self.modes:
            sizes = sorted(b for (m, b) in self.graphs if m is mode)
            table: List[Optional[_Captured]] = [None] * (self.max_bs + 1)
            for bs in range(1, self.max_bs + 1):
                bucket = next((b for b in sizes if b >= bs), None)
                table[bs] = None if bucket is None else self.graphs[(mode, bucket)]
            routes[mode] = (self.num_draft_tokens if mode.is_speculative else None, table)
        self._routes = routes

    def _route(self, batch: ForwardBatch) -> Optional[_Captured]:
        """The graph that replays ``batch`` (host values only), or None (eager)."""
        route = self._routes.get(batch.forward_mode)
        if route is None:
            return None
        ndt, table = route
        bs = batch.batch_size
        if bs >= len(table) or (ndt is not None and batch.num_draft_tokens != ndt):
            return None
        return table[bs]

    def bucket_for(self, batch: ForwardBatch) -> Optional[int]:
        """The smallest captured bucket that holds ``batch``, or None (eager)."""
        captured = self._route(batch)
        return None if captured is None else captured.batch.batch_size

    def why_eager(self, batch: ForwardBatch) -> Optional[str]:
        """Why ``run(batch)`` would run eagerly now, or None when it replays a graph (host
        values only: mode, ``batch_size``, ``num_draft_tokens``)."""
        reason = self._eager_reason(batch)
        return None if reason is None else reason[1]

    def _eager_reason(self, batch: ForwardBatch) -> Optional[Tuple[str, str]]:
        """``(kind, sentence)`` for a batch no graph covers, else None. ``kind`` is
        ``"never"`` for modes the runner never captures, else a short key of the cause."""
        mode = batch.forward_mode
        if mode in self.not_captured:
            return "never", f"{mode.name} steps are not captured: {self.not_captured[mode]}"
        if self.bucket_for(batch) is not None:
            return None
        if mode.is_speculative and batch.num_draft_tokens != self.num_draft_tokens:
            return "num-draft-tokens", (
                f"num_draft_tokens={batch.num_draft_tokens}, the graphs are captured for "
                f"num_draft_tokens={self.num_draft_tokens}"
            )
        if not self.capture_ran:
            return "not-captured-yet", (
                f"capture() has not run yet (run() captures on the first step of "
                f"{', '.join(m.name for m in self.modes)})"
            )
        captured = [b for (m, b) in self.graphs if m is mode]
        if not captured:
            failed = {_key_name(k): r for k, r in self.capture_failures.items() if k[0] is mode}
            return "capture-failed", f"every {mode.name} capture failed: {failed}"
        failed = sorted(b for (m, b) in self.capture_failures if m is mode and b >= batch.batch_size)
        extra = f" (the capture of buckets {failed} failed)" if failed else ""
        return "too-large", (
            f"batch_size {batch.batch_size} exceeds the largest captured {mode.name} bucket "
            f"{max(captured)} (max_bs={self.max_bs}){extra}"
        )

    def _note_eager(self, batch: ForwardBatch) -> None:
        """Count an eager step and log its reason the first time (per mode and kind)."""
        kind, why = self._eager_reason(batch) or ("unknown", "no graph covers this step")
        mode = batch.forward_mode.name
        entry = self.eager_runs.setdefault(mode, {"steps": 0, "why": why})
        entry["steps"] = int(entry["steps"]) + 1
        entry["why"] = why
        if (mode, kind) not in self._eager_logged:
            self._eager_logged.add((mode, kind))
            level = logging.INFO if kind == "never" else logging.WARNING
            logger.log(level, "GraphRunner(%s): eager %s step: %s", self.backend.name, mode, why)

    def run(self, batch: ForwardBatch, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Run one step; returns ``[T, ...]``, the step function's output for the real tokens.

        After a replay this is a view of the graph's static output: valid until the next
        ``run()`` of this runner (read it, or ``clone()`` it, before then). The first step of a
        captured mode captures every graph when ``capture()`` was never called. A step no graph
        covers runs eagerly (``init_forward_metadata`` + ``step``); ``why_eager`` says why.
        ``run`` is ``prepare`` then ``replay`` when a graph covers the step.
        """
        if self.prepare(batch, inputs):
            return self.replay()
        self._note_eager(batch)
        self.backend.init_forward_metadata(batch)
        return self.step(batch, dict(inputs))

    def prepare(self, batch: ForwardBatch, inputs: Mapping[str, torch.Tensor]) -> bool:
        """All host work of one replay, without the replay: capture on first use, find the
        graph, copy ``batch`` and ``inputs[name]`` (``[T, *shape]``, at least ``T`` rows) into
        the static buffers padded to the bucket (see the module docstring; an input that is
        ``runner.inputs[name][:T]`` itself, written in place by the engine, is not copied),
        and the backend's ``init_forward_metadata_replay_cuda_graph`` on the padded static
        batch. Returns True
        when a graph covers the step (call ``replay()`` next), False when ``run`` would run
        it eagerly (then nothing was copied or prepared). Sync-free: device copies and fills
        only, never a device read. Calling it again replaces the prepared step."""
        self._prepared = None
        if not self.capture_ran and batch.forward_mode in self.modes:
            logger.info(
                "GraphRunner(%s): capturing on first use (first %s step)", self.backend.name, batch.forward_mode.name
            )
            self.capture()
        captured = self._route(batch)
        if captured is None:
            return False
        static = captured.batch
        n = batch.num_tokens
        if self.backend_copies_batch:
            self._copy_inputs(inputs, n)
        else:
            self._copy_batch(batch, inputs, n)
        if self.needs_cpu_seq_lens:
            static = _with_seq_lens_cpu(static, batch, static.batch_size, self.fill_value)
        if self.backend_copies_batch:
            self.backend.set_replay_source(batch, static)
        self.backend.init_forward_metadata_replay_cuda_graph(static)
        self._prepared = (captured, n)
        return True

    def replay(self) -> torch.Tensor:
        """Replay the graph of the step the last ``prepare()`` prepared (once) and return its
        first ``T`` output rows: a view of the static output, valid until the next replay."""
        prepared = self._prepared
        if prepared is None:
            raise RuntimeError("replay() needs a step prepared by prepare() (which returned True) and not replayed yet")
        self._prepared = None
        captured, n = prepared
        captured.graph.replay()
        return captured.output_rows(n)

    # ------------------------------------------------------------------ static buffers
    def _views_for_requests(self, bs: int) -> Tuple[torch.Tensor, torch.Tensor]:
        views = self._request_views.get(bs)
        if views is None:
            views = self._request_views[bs] = (self.req_pool_indices[:bs], self.seq_lens[:bs])
        return views

    def _views_for_tokens(self, n: int) -> Tuple[torch.Tensor, ...]:
        views = self._token_views.get(n)
        if views is None:
            views = (self.out_cache_loc[:n], self.positions[:n], *(self.inputs[k][:n] for k in self._input_names))
            self._token_views[n] = views
        return views

    def _copy_batch(self, batch: ForwardBatch, inputs: Mapping[str, torch.Tensor], n: int) -> None:
        """Copy the step and its inputs into the static buffers in one grouped copy, then pad
        the rows that may still hold an earlier step's values."""
        bs = batch.batch_size
        req, seq = self._views_for_requests(bs)
        tok = self._views_for_tokens(n)
        dst = [req, seq, tok[0]]
        src = [batch.req_pool_indices, batch.seq_lens, batch.out_cache_loc]
        if batch.positions is not None:
            dst.append(tok[1])
            src.append(batch.positions)
        self._add_inputs(dst, src, inputs, tok, n)
        self._copy_all(dst, src)
        if self._dirty_requests > bs:
            self.req_pool_indices[bs : self._dirty_requests].zero_()
            self.seq_lens[bs : self._dirty_requests].fill_(self.fill_value)
        self._dirty_requests = bs
        if batch.positions is not None:
            if self._dirty_positions > n:
                self.positions[n : self._dirty_positions].zero_()
            self._dirty_positions = n
        self._pad_tokens(n, with_out_cache_loc=True)

    def _copy_inputs(self, inputs: Mapping[str, torch.Tensor], n: int) -> None:
        """The model inputs only (the backend copies the batch itself)."""
        if not self._input_names:
            return
        dst: List[torch.Tensor] = []
        src: List[torch.Tensor] = []
        self._add_inputs(dst, src, inputs, self._views_for_tokens(n), n)
        if dst:
            self._copy_all(dst, src)
        self._pad_tokens(n, with_out_cache_loc=False)

    def _add_inputs(self, dst: list, src: list, inputs: Mapping[str, torch.Tensor], tok: tuple, n: int) -> None:
        """Queue each input's copy, except an input the engine wrote in place: the view
        ``runner.inputs[name][:T]`` itself (same memory, same layout: nothing to copy)."""
        for name, view in zip(self._input_names, tok[2:]):
            x = inputs[name]
            if x.data_ptr() == view.data_ptr() and x.shape == view.shape and x.stride() == view.stride():
                continue
            dst.append(view)
            src.append(x if x.shape[0] == n else x[:n])

    def _copy_all(self, dst: List[torch.Tensor], src: List[torch.Tensor]) -> None:
        """``dst[i].copy_(src[i])`` for every i (none: nothing): one grouped call (``torch._foreach_copy_``)
        where this torch has it for the device, else one copy each (decided on first use)."""
        if not dst:
            return
        if len(dst) > 1 and self._grouped_copy:
            try:
                torch._foreach_copy_(dst, src)
                return
            except (AttributeError, NotImplementedError):
                self._grouped_copy = False  # no grouped copy on this device: one copy each
            except RuntimeError:
                pass  # e.g. mismatched shapes: the single copies below raise the clear error
        for d, x in zip(dst, src):
            d.copy_(x)

    def _pad_tokens(self, n: int, *, with_out_cache_loc: bool) -> None:
        end = self._dirty_tokens
        if end > n:
            if with_out_cache_loc:
                self.out_cache_loc[n:end].zero_()
            for buf in self.inputs.values():
                buf[n:end].zero_()
        self._dirty_tokens = n

    def _reset_padding(self) -> None:
        """Every static buffer back to padding values (capture runs on padding only)."""
        self.req_pool_indices.zero_()
        self.seq_lens.fill_(self.fill_value)
        self.out_cache_loc.zero_()
        self.positions.zero_()
        for buf in self.inputs.values():
            buf.zero_()
        self._dirty_requests = self._dirty_tokens = self._dirty_positions = 0


def _why_not_captured(
    mode: ForwardMode, backend: AttentionBackend, supported: Tuple[ForwardMode, ...], wanted: Tuple[ForwardMode, ...]
) -> str:
    """Why a runner over ``backend`` never captures ``mode`` (one sentence)."""
    graphs = backend.capabilities().graphs.name
    if not supported:
        return f"backend {backend.name!r} declares graphs=NEVER"
    if mode not in _RUNNER_MODES:
        return (
            "GraphRunner captures only modes with the same number of new tokens per request "
            "(DECODE, TARGET_VERIFY, DRAFT_EXTEND)"
        )
    if mode not in supported:
        return f"backend {backend.name!r} declares graphs={graphs} ({', '.join(m.name for m in supported)})"
    if mode not in wanted:
        return f"not in the runner's modes {[m.name for m in wanted]}"
    return "the runner was built without num_draft_tokens (the q_len these modes need)"


def _with_seq_lens_cpu(static: ForwardBatch, batch: ForwardBatch, bucket: int, fill: int) -> ForwardBatch:
    """The static batch with the host mirror of the padded ``seq_lens`` (only for backends
    that declared ``needs_cpu_seq_lens``; the engine then supplies ``seq_lens_cpu``)."""
    if batch.seq_lens_cpu is None:
        raise ValueError("the backend needs seq_lens_cpu but the batch has none")
    return ForwardBatch(
        forward_mode=static.forward_mode,
        batch_size=static.batch_size,
        req_pool_indices=static.req_pool_indices,
        seq_lens=static.seq_lens,
        out_cache_loc=static.out_cache_loc,
        positions=static.positions,
        seq_lens_cpu=list(batch.seq_lens_cpu) + [fill] * (bucket - batch.batch_size),
        extend_seq_lens=static.extend_seq_lens,
        num_draft_tokens=static.num_draft_tokens,
        validate=False,
    )
