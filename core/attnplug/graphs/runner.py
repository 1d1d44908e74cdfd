"""Graph runner: one captured graph per (mode, batch-size bucket), replayed with padding; with
``extend_tokens``, one per EXTEND token-count bucket too.

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

EXTEND steps (prefill chunks: any number of new tokens a request) are captured per token-count
bucket when the runner is built with ``extend_tokens`` and the backend declares
``GraphSupport.ALWAYS`` (its metadata and kernels read every length from device tensors inside
a graph). An EXTEND graph holds ``max_bs`` requests and its bucket's ``T_b`` tokens; a step of
``bs <= max_bs`` requests and ``T <= T_b`` tokens replays the smallest bucket that holds ``T``:
its ``extend_seq_lens`` are copied into a static buffer, the padded requests get row 0, the fill
value and no new token (``extend_seq_lens = 0``), and the padded tokens ``T..T_b`` belong to no
request (slot 0, position 0, zero inputs: they are stored to the sink and attend to nothing).
``extend_rows`` says what the step returns a row of: ``"tokens"`` (``replay`` returns the first
``T`` rows) or ``"requests"`` (a model's last-token logits: the first ``bs`` rows). The runner
copies EXTEND steps itself (``copies_replay_batch`` covers the uniform modes).

A step of a mode the runner captures must fit the captured buffers, whether it would replay or
run eagerly (its acceptance never depends on its batch size): ``positions`` given (the graphs
read the static positions: a step without them would replay the previous step's), each batch
field of the runner's device, an integer dtype and the step's length, each input declared,
of its declared dtype, device and per-token shape with at least ``T`` rows. What does not fit
raises ``ValueError`` naming the field and the value before anything is copied or captured
(``StaticBuffers._check_step``). Steps of modes the runner never captures reach ``step`` as
the engine built them. Construction arguments are checked the same way, before the backend's
``init_cuda_graph_state`` (``runner_args``).

Each runner owns its graph state. ``init_cuda_graph_state`` makes a new one per runner; the
runner keeps it (``backend.get_cuda_graph_state()``) and switches the backend back to it
(``set_cuda_graph_state``) before its captures and replays, so a later runner on the same
backend never replaces the buffers under this runner's graphs, which read them at fixed
addresses. A backend that keeps one state (the contract's default) serves one live runner: a
second is refused while the first lives (``runner_args``).

The runner never runs eagerly without saying so. ``run()`` captures on first use: the first
step of a mode the runner captures captures that mode's buckets when ``capture()`` never did
(a prefill-only run never captures DECODE graphs). A step that
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

Every replay-path operation is a device copy/fill: the runner never reads device values
(``static_buffers``: the static buffers, the grouped copy, the padding fills), and a step
finds its graph with one index in a per-mode table from batch size to graph (``buckets``).
Capturing one bucket is ``capture.capture_bucket``.
"""

from __future__ import annotations

import logging
import traceback
from typing import Callable, Dict, Mapping, Optional, Sequence, Tuple

import torch

from ..backend import AttentionBackend, decide_needs_cpu_seq_lens
from ..batch import ForwardBatch, ForwardMode
from . import collector
from .buckets import (
    GraphKey,
    Routes,
    build_routes,
    captured_modes,
    default_bucket_sizes,
    key_name,
    route,
    why_not_captured,
)
from .capture import Captured, GraphCaptureError, capture_bucket, describe_failure
from .device_graph import EagerGraph
from .runner_args import check_graph_state_free, check_runner_args, claim_graph_state, owns_graph_states
from .static_buffers import StaticBuffers, with_seq_lens_cpu

__all__ = ["GraphCaptureError", "GraphRunner", "captured_modes", "default_bucket_sizes", "StepFn"]

logger = logging.getLogger(__name__)

#: ``step(batch, inputs) -> Tensor[T, ...]``: runs every layer of one step.
StepFn = Callable[[ForwardBatch, Dict[str, torch.Tensor]], torch.Tensor]


class GraphRunner(StaticBuffers):
    """Capture and replay steps of one backend (see module docstring).

    ``inputs`` maps each per-token model input to its per-token shape and dtype, e.g.
    ``{"q": ((L, H, D), torch.bfloat16)}``; the static buffer is ``[max_num_tokens, *shape]``.
    ``num_draft_tokens`` enables TARGET_VERIFY / DRAFT_EXTEND capture (q_len per request);
    ``extend_tokens`` (strictly increasing token counts) EXTEND capture, one graph per count,
    for a backend at ``GraphSupport.ALWAYS``; ``extend_rows``: ``"tokens"`` or ``"requests"``,
    what an EXTEND step's output has a row of (module docstring).
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
        extend_tokens: Optional[Sequence[int]] = None,
        extend_rows: str = "tokens",
    ) -> None:
        max_bs, inputs, num_draft_tokens, bucket_sizes, modes, extend_tokens = check_runner_args(
            backend, step, max_bs, inputs, num_draft_tokens, bucket_sizes, modes, extend_tokens, extend_rows
        )
        check_graph_state_free(backend)
        self.backend = backend
        self.step = step
        self.num_draft_tokens = num_draft_tokens
        self.bucket_sizes = bucket_sizes or default_bucket_sizes(max_bs)
        #: EXTEND token-count buckets (None: EXTEND steps run eagerly) and what their output rows are
        self.extend_tokens = extend_tokens
        self.extend_rows = extend_rows
        supported = captured_modes(backend.capabilities().graphs)
        wanted = modes if modes is not None else supported + ((ForwardMode.EXTEND,) if extend_tokens else ())
        self.modes = tuple(
            m
            for m in wanted
            if m is ForwardMode.DECODE or (m.is_speculative and num_draft_tokens) or (m is ForwardMode.EXTEND)
        )
        #: mode -> why the runner never replays it (every step of that mode runs eagerly)
        self.not_captured: Dict[ForwardMode, str] = {
            m: why_not_captured(m, backend, supported, wanted, extend_tokens)
            for m in ForwardMode
            if m not in self.modes
        }
        if not supported:
            logger.warning("GraphRunner(%s): the backend declares graphs=NEVER: every step runs eagerly", backend.name)
        self.max_bs = max_bs
        q_max = max([1] + [num_draft_tokens or 1 for m in self.modes if m.is_speculative])
        self.max_num_tokens = max(max_bs * q_max, max(extend_tokens or (0,)))

        fill_value = int(backend.get_cuda_graph_seq_len_fill_value())
        self.needs_cpu_seq_lens = decide_needs_cpu_seq_lens([backend])

        backend.init_cuda_graph_state(max_bs, self.max_num_tokens)
        #: the backend's graph state this runner's graphs read (None: the backend keeps one)
        self._graph_state = backend.get_cuda_graph_state() if owns_graph_states(backend) else None
        if owns_graph_states(backend) and self._graph_state is None:
            raise ValueError(
                f"backend {backend.name!r} implements set_cuda_graph_state but get_cuda_graph_state() is None "
                "after init_cuda_graph_state"
            )
        claim_graph_state(backend, self)
        self._init_static_buffers(backend.device, max_bs, self.max_num_tokens, inputs, fill_value)
        #: the backend writes the padded batch into the static buffers itself (replay metadata)
        self.backend_copies_batch = bool(getattr(backend, "copies_replay_batch", False))
        #: mode -> (num_draft_tokens the graphs need or None, [bs] -> graph or None); see _route
        self._routes: Routes = {}
        self._prepared: Optional[Tuple[Captured, int]] = None  # what replay() runs next
        self.graphs: Dict[GraphKey, Captured] = {}
        #: (mode, bucket) -> why its capture failed (those buckets run in a larger bucket or eagerly)
        self.capture_failures: Dict[GraphKey, str] = {}
        self.capture_ran = False
        self._modes_captured: set = set()  # modes whose buckets capture() has tried
        #: "MODE" -> {"steps": eager steps run, "why": the latest reason}
        self.eager_runs: Dict[str, Dict[str, object]] = {}
        self._eager_logged: set = set()  # (mode, kind) already logged

    # ------------------------------------------------------------------ capture
    def _q_len(self, mode: ForwardMode) -> int:
        return 1 if mode is ForwardMode.DECODE else int(self.num_draft_tokens)

    def _static_batch(self, mode: ForwardMode, bs: int) -> ForwardBatch:
        """The padded static batch of bucket ``bs`` (EXTEND: ``max_bs`` requests and ``bs``
        tokens, the lengths in the static ``extend_seq_lens``)."""
        if mode is ForwardMode.EXTEND:
            return ForwardBatch(
                forward_mode=mode,
                batch_size=self.max_bs,
                req_pool_indices=self.req_pool_indices,
                seq_lens=self.seq_lens,
                out_cache_loc=self.out_cache_loc[:bs],
                positions=self.positions[:bs],
                seq_lens_cpu=[self.fill_value] * self.max_bs if self.needs_cpu_seq_lens else None,
                extend_seq_lens=self.extend_seq_lens,
                validate=False,  # padding: requests without tokens, tokens without a request
            )
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

    def capture(self, *, strict: bool = False, modes: Optional[Sequence[ForwardMode]] = None) -> Dict[GraphKey, str]:
        """Capture every (mode, bucket) graph of ``modes`` (default: every mode of the runner),
        largest bucket first; returns ``capture_failures`` (empty when all were captured).

        Buffers hold padding values during capture, so capture never touches a live KV slot
        (slot 0 only). A bucket whose capture raises is left out and its reason recorded (see
        module docstring); ``strict``: then raise ``GraphCaptureError`` after trying every
        bucket. Calling it again recaptures those modes' buckets.
        """
        wanted = self.modes if modes is None else tuple(m for m in self.modes if m in modes)
        self._prepared = None
        self._use_own_graph_state()
        self._reset_padding()
        with collector.collector_paused(collect=False):  # device graphs collect once, before their first capture
            for mode in wanted:
                for bs in reversed(self.extend_tokens if mode is ForwardMode.EXTEND else self.bucket_sizes):
                    key = (mode, bs)
                    self.graphs.pop(key, None)
                    self.capture_failures.pop(key, None)
                    try:
                        self.graphs[key] = self._capture_bucket(mode, bs)
                    except Exception as exc:
                        self._record_failure(key, exc)
        self.capture_ran = True
        self._modes_captured.update(wanted)
        self._build_routes()
        for mode in wanted:
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

    def _capture_bucket(self, mode: ForwardMode, bs: int) -> Captured:
        batch = self._static_batch(mode, bs)
        views = {name: buf[: batch.num_tokens] for name, buf in self.inputs.items()}
        return capture_bucket(self.backend, self.step, batch, views, rows=self._rows(batch))

    def _rows(self, batch: ForwardBatch) -> int:
        """The output rows of ``batch`` the step returns (its tokens; an EXTEND step's requests
        with ``extend_rows="requests"``)."""
        if batch.forward_mode is ForwardMode.EXTEND and self.extend_rows == "requests":
            return batch.batch_size
        return batch.num_tokens

    def _record_failure(self, key: GraphKey, exc: BaseException) -> None:
        reason = describe_failure(exc)
        self.capture_failures[key] = reason
        logger.warning(
            "GraphRunner(%s): capturing %s failed, that bucket is not captured: %s",
            self.backend.name,
            key_name(key),
            reason,
        )
        logger.debug(
            "capture traceback of %s:\n%s",
            key_name(key),
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
            "captured": [key_name(k) for k in order],
            "failed": {key_name(k): r for k, r in self.capture_failures.items()},
            "eager_modes": [m.name for m in self.modes if not any(k[0] is m for k in self.graphs)],
            "not_captured": {m.name: r for m, r in self.not_captured.items()},
            "eager_runs": {m: dict(v) for m, v in self.eager_runs.items()},
        }

    # ------------------------------------------------------------------ run
    def _build_routes(self) -> None:
        """Per captured mode, a table from batch size to the smallest captured bucket that
        holds it (None: no graph), so a step finds its graph with one index."""
        self._routes = build_routes(
            self.graphs, self.modes, self.max_bs, self.num_draft_tokens, max(self.extend_tokens or (0,))
        )

    def _route(self, batch: ForwardBatch) -> Optional[Captured]:
        """The graph that replays ``batch`` (host values only), or None (eager)."""
        return route(self._routes, batch)

    def bucket_for(self, batch: ForwardBatch) -> Optional[int]:
        """The smallest captured bucket that holds ``batch`` (EXTEND: its token count), or None
        (eager)."""
        captured = self._route(batch)
        if captured is None:
            return None
        return captured.batch.num_tokens if batch.forward_mode is ForwardMode.EXTEND else captured.batch.batch_size

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
        if mode not in self._modes_captured:
            return "not-captured-yet", (
                f"the {mode.name} graphs are not captured yet (run() captures a mode's graphs on its first step)"
            )
        captured = [b for (m, b) in self.graphs if m is mode]
        if not captured:
            failed = {key_name(k): r for k, r in self.capture_failures.items() if k[0] is mode}
            return "capture-failed", f"every {mode.name} capture failed: {failed}"
        if mode is ForwardMode.EXTEND:
            if batch.batch_size > self.max_bs:
                return "too-large", f"batch_size {batch.batch_size} exceeds max_bs={self.max_bs} of the EXTEND graphs"
            failed = sorted(b for (m, b) in self.capture_failures if m is mode and b >= batch.num_tokens)
            extra = f" (the capture of buckets {failed} failed)" if failed else ""
            return "too-large", (
                f"{batch.num_tokens} tokens exceed the largest captured EXTEND bucket {max(captured)} "
                f"(extend_tokens={list(self.extend_tokens)}){extra}"
            )
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
        captured mode captures that mode's graphs when ``capture()`` never did. A step no graph
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
        batch. Returns True when a graph covers the step (call ``replay()`` next), False when
        ``run`` would run it eagerly (then nothing was copied or prepared). Sync-free: device
        copies and fills only, never a device read. Calling it again replaces the prepared step.

        A step of a mode the runner captures must fit the captured buffers whether it replays
        or runs eagerly (so its acceptance never depends on its batch size): ``positions``
        given, every batch field and input of the runner's device and an integer / the
        declared dtype, with the rows the step needs, no input the graphs do not read. What
        does not fit raises ``ValueError`` naming the field and the value before anything is
        copied or captured (``static_buffers.StaticBuffers._check_step``)."""
        self._prepared = None
        mode = self._check_mode(batch)
        if mode in self.modes:
            self._check_step(batch, inputs)
            if mode not in self._modes_captured:
                logger.info("GraphRunner(%s): capturing on first use (first %s step)", self.backend.name, mode.name)
                self.capture(modes=(mode,))
        captured = self._route(batch)
        if captured is None:
            return False
        static = captured.batch
        n = batch.num_tokens
        self._use_own_graph_state()
        backend_copies = self.backend_copies_batch and mode is not ForwardMode.EXTEND
        if backend_copies:
            self._copy_inputs(inputs, n)
        else:
            self._copy_batch(batch, inputs, n)
        if self.needs_cpu_seq_lens:
            static = with_seq_lens_cpu(static, batch, static.batch_size, self.fill_value)
        if backend_copies:
            self.backend.set_replay_source(batch, static)
        self.backend.init_forward_metadata_replay_cuda_graph(static)
        self._prepared = (captured, self._rows(batch))
        return True

    def replay(self) -> torch.Tensor:
        """Replay the graph of the step the last ``prepare()`` prepared (once) and return its
        first ``T`` output rows: a view of the static output, valid until the next replay.
        Refused when another runner of the backend prepared a step in between (the backend's
        replay metadata is then that runner's: ``prepare`` again)."""
        prepared = self._prepared
        if prepared is None:
            raise RuntimeError("replay() needs a step prepared by prepare() (which returned True) and not replayed yet")
        self._prepared = None
        state = self._graph_state
        if state is not None and self.backend.get_cuda_graph_state() is not state:
            raise RuntimeError(
                f"replay(): another GraphRunner of backend {self.backend.name!r} prepared a step since this "
                "runner's prepare(); prepare this step again, then replay"
            )
        captured, n = prepared
        captured.graph.replay()
        return captured.output_rows(n)

    def _use_own_graph_state(self) -> None:
        """Switch the backend to this runner's graph state (the buffers its graphs read) when
        another runner's is in use (see ``runner_args``)."""
        state = self._graph_state
        if state is not None and self.backend.get_cuda_graph_state() is not state:
            self.backend.set_cuda_graph_state(state)
