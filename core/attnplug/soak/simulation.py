"""The soak: a random serving simulation driven through the public API, checked every step.

A small scheduler (``Soak``) admits arriving requests, prefills them in chunks (EXTEND, mixed
with short extensions of running requests), then runs DECODE, TARGET_VERIFY (the rejected
drafts are rolled back: their slots freed, their ``req_to_token`` entries zeroed) and
DRAFT_EXTEND steps over random subsets, finishes requests (slots and row freed) and evicts
out-of-window SWA slots between steps. Pools are small: ``OutOfKVSlots`` is routine, handled
by shrinking the batch or retracting a request, and slots are reused constantly. Uniform
steps go through a ``GraphRunner`` (replay when a bucket holds the batch, eager otherwise).

Before every step the free slots of both pools and the sink (page 0) are filled with NaN, so
reading anything but a live slot shows up. After every step:

* every layer's output is compared with ``oracle.exact_attention`` (float64, over the k/v
  each request was given, kept on the host) — relative error within the dtype's tolerance;
* ``SWATokenAllocator.check_invariants()``, plus slot ownership: live full slots distinct,
  every position a future query can reach still has a distinct SWA slot, ``req_to_token``
  rows equal to what the scheduler wrote (zero past each request's length);
* every live KV value (full layers: every committed position; SWA layers: positions from the
  eviction frontier on) is bit-identical to what was written (``data_lost``).

Determinism: the schedule and the data come from ``random.Random(seed)`` and a CPU
``torch.Generator(seed)``; nothing depends on the device or on the backend's outputs.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Type

import torch

from ..backend import AttentionBackend, GraphSupport, decide_needs_cpu_seq_lens
from ..batch import ForwardBatch, ForwardMode
from ..graphs import EagerGraph, GraphRunner
from ..memory import OutOfKVSlots, OutOfReqSlots, ReqToTokenPool, SWAKVPool, SWATokenAllocator
from ..oracle import History, exact_attention, relative_errors, stack_histories
from .config import DEFAULT_TOLERANCE, SoakConfig, dtype_name
from .report import SoakFailure, SoakReport

__all__ = ["Soak", "SoakSetupError"]


class SoakSetupError(ValueError):
    """The backend cannot run the requested configuration; the message names the option."""


@dataclass
class _Request:
    rid: int
    prompt_len: int
    target_len: int
    history: History
    row: Optional[int] = None
    slots: Optional[List[int]] = None  # full slot of each committed position (host)

    @property
    def seq_len(self) -> int:
        return len(self.slots) if self.slots is not None else 0

    @property
    def prefilling(self) -> bool:
        return self.seq_len < self.prompt_len


@dataclass
class _Planned:
    mode: ForwardMode
    reqs: List[_Request]
    new: List[int]
    batch: ForwardBatch
    locs: List[int]  # host copy of out_cache_loc
    inputs: Dict[str, torch.Tensor]  # device, pool dtype: q [T, L, H, D], k/v [T, L, Hkv, D]
    host: Dict[str, torch.Tensor]  # the same values, float64 CPU


class _StepFailed(Exception):
    def __init__(self, check: str, message: str) -> None:
        super().__init__(message)
        self.check = check


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
        self.rng = random.Random(cfg.seed)
        self.gen = torch.Generator().manual_seed(cfg.seed)
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
        self.scaling = 1.0 / math.sqrt(self.head_dim)

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
        self.waiting: List[_Request] = []
        self.running: List[_Request] = []
        self._next_rid = 0
        self._ever_used = torch.zeros(size + cfg.page_size, dtype=torch.bool)
        self._attempt: Optional[Tuple[ForwardMode, List[_Request], List[int]]] = None

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
        cfg, rep = self.cfg, self.report
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
        rep.wall_s = time.perf_counter() - start
        return rep

    def _step(self, index: int) -> None:
        rep = self.report
        planned: Optional[_Planned] = None
        self._attempt = None
        path = "not run"
        try:
            self._arrivals()
            self._poison()
            planned = self._plan()
            path = self._path(planned)
            output = self._execute(planned)
            self._account(planned, path)
            self._commit(planned)
            if index % self.cfg.kv_check_every == 0 or index == self.cfg.steps - 1:
                self._check_kv()
            self._check_attention(planned, output)
            self._after_step(planned)
            self._check_state()
        except _StepFailed as failure:
            rep.fail(self._failure(index, planned, path, failure.check, str(failure)))
        except Exception as exc:  # the backend or the memory API raised: a failure, reported
            rep.fail(self._failure(index, planned, path, "error", f"{type(exc).__name__}: {exc}"))

    def _failure(self, index, planned, path, check, message) -> SoakFailure:
        if planned is not None:
            attempt = (planned.mode, planned.reqs, planned.new)
        else:  # failed while allocating: the step being planned
            attempt = self._attempt or (None, [], [])
        mode = attempt[0].name if attempt[0] is not None else "-"
        batch = ", ".join(f"request {r.rid} +{n}" for r, n in zip(attempt[1], attempt[2])) or "no requests"
        return SoakFailure(
            seed=self.cfg.seed, step=index, mode=mode, path=path, check=check, message=message, batch=batch
        )

    # ------------------------------------------------------------------ scheduling
    def _arrivals(self) -> None:
        cfg, rng = self.cfg, self.rng
        if len(self.waiting) < cfg.max_running and rng.random() < 0.35:
            for _ in range(1 + (rng.random() < 0.2)):
                prompt = rng.randint(1, cfg.max_prompt)
                longest = cfg.max_context - max(cfg.draft_tokens, cfg.alt_draft_tokens)
                target = rng.randint(prompt + 1, longest)
                self.waiting.append(
                    _Request(
                        self._next_rid,
                        prompt,
                        target,
                        History(cfg.num_layers, cfg.max_context, cfg.num_kv_heads, self.head_dim),
                    )
                )
                self._next_rid += 1
                self.report.requests_arrived += 1

    def _admit(self, count: int) -> List[_Request]:
        admitted = []
        while self.waiting and len(admitted) < count:
            try:
                row = self.rows.alloc()
            except OutOfReqSlots:
                self.report.out_of_req_rows += 1
                break
            req = self.waiting.pop(0)
            req.row, req.slots = row, []
            self.running.append(req)
            admitted.append(req)
        return admitted

    def _plan(self) -> _Planned:
        cfg, rng = self.cfg, self.rng
        decoding = [r for r in self.running if not r.prefilling]
        prefilling = [r for r in self.running if r.prefilling]
        if not self.running and not self.waiting:
            return self._build(ForwardMode.IDLE, [], [])
        if (prefilling or self.waiting) and (not decoding or rng.random() < 0.4):
            reqs = rng.sample(prefilling, min(len(prefilling), rng.randint(1, 4)))
            reqs += self._admit(rng.randint(0, 2) if reqs else rng.randint(1, 2))
            new = [min(r.prompt_len - r.seq_len, rng.randint(1, cfg.max_chunk)) for r in reqs]
            if decoding and rng.random() < 0.3:  # a mixed batch: a running request extended too
                extra = rng.choice(decoding)
                reqs.append(extra)
                new.append(rng.randint(1, max(cfg.draft_tokens, cfg.alt_draft_tokens)))
            if reqs:
                return self._allocate(ForwardMode.EXTEND, reqs, new)
            if not decoding:
                return self._build(ForwardMode.IDLE, [], [])
        roll = rng.random()
        if roll < 0.5:
            mode, q = ForwardMode.DECODE, 1
        elif roll < 0.8:
            mode = ForwardMode.TARGET_VERIFY
            q = cfg.alt_draft_tokens if rng.random() < 0.15 else cfg.draft_tokens
        else:
            mode, q = ForwardMode.DRAFT_EXTEND, cfg.draft_tokens
        cap = len(decoding) if rng.random() < 0.3 else min(len(decoding), max(cfg.buckets))
        reqs = rng.sample(decoding, rng.randint(1, cap))
        return self._allocate(mode, reqs, [q] * len(reqs))

    def _allocate(self, mode: ForwardMode, reqs: List[_Request], new: List[int]) -> _Planned:
        """Slots for the step; on ``OutOfKVSlots`` drop requests from the batch, and when
        not even one fits, retract the request holding the most slots and run IDLE."""
        rep = self.report
        while reqs:
            self._attempt = (mode, list(reqs), list(new))
            before = (self.alloc.full_available_size(), self.alloc.swa_available_size())
            try:
                locs = self._alloc_slots(mode, reqs, new)
            except OutOfKVSlots:
                rep.out_of_kv_slots += 1
                after = (self.alloc.full_available_size(), self.alloc.swa_available_size())
                if after != before:
                    raise _StepFailed(
                        "invariants", f"OutOfKVSlots changed the free counts {before} -> {after}"
                    ) from None
                reqs, new = reqs[:-1], new[:-1]
                continue
            return self._build(mode, reqs, new, locs)
        self._retract(max(self.running, key=lambda r: r.seq_len))
        return self._plan()

    def _alloc_slots(self, mode: ForwardMode, reqs: Sequence[_Request], new: Sequence[int]) -> torch.Tensor:
        last = [r.slots[-1] if r.slots else -1 for r in reqs]
        seq = [r.seq_len + n for r, n in zip(reqs, new)]
        if mode is ForwardMode.DECODE:
            return self.alloc.alloc_decode(seq, last)
        if self.cfg.page_size == 1 and mode is ForwardMode.EXTEND:
            return self.alloc.alloc(sum(new))
        return self.alloc.alloc_extend([r.seq_len for r in reqs], seq, last)

    def _build(
        self, mode: ForwardMode, reqs: List[_Request], new: List[int], locs: Optional[torch.Tensor] = None
    ) -> _Planned:
        cfg, dev = self.cfg, self.device
        T = sum(new)
        locs_host = locs.cpu().tolist() if locs is not None else []
        if locs is not None:
            fresh = torch.tensor(locs_host, dtype=torch.int64)
            self.report.slots_reused += int(self._ever_used[fresh].sum())
            self._ever_used[fresh] = True
        offset, positions = 0, []
        for r, n in zip(reqs, new):
            self.rows.req_to_token[r.row, r.seq_len : r.seq_len + n] = locs[offset : offset + n].to(torch.int32)
            positions.extend(range(r.seq_len, r.seq_len + n))
            offset += n
        seq_after = [r.seq_len + n for r, n in zip(reqs, new)]
        L, H, Hkv, D = cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, self.head_dim
        host = {
            name: torch.randn(T, L, heads, D, generator=self.gen).to(self.dtype)
            for name, heads in (("q", H), ("k", Hkv), ("v", Hkv))
        }
        inputs = {name: t.to(dev) for name, t in host.items()}
        host = {name: t.to(torch.float64) for name, t in host.items()}

        def ints(values):
            return torch.tensor(values, dtype=torch.int64).to(dev)

        batch = ForwardBatch(
            forward_mode=mode,
            batch_size=len(reqs),
            req_pool_indices=ints([r.row for r in reqs]),
            seq_lens=ints(seq_after),
            out_cache_loc=locs.to(dev) if locs is not None else ints([]),
            positions=ints(positions),
            seq_lens_cpu=list(seq_after) if self.needs_cpu_seq_lens else None,
            extend_seq_lens=ints(new) if mode is ForwardMode.EXTEND else None,
            extend_seq_lens_cpu=list(new) if mode is ForwardMode.EXTEND else None,
            num_draft_tokens=new[0] if mode.is_speculative else None,
        )
        return _Planned(mode, list(reqs), list(new), batch, locs_host, inputs, host)

    def _retract(self, req: _Request) -> None:
        """Preempt ``req``: free its slots and row; it waits to be prefilled again."""
        self._release(req)
        self.running.remove(req)
        req.row, req.slots = None, None
        self.waiting.insert(0, req)
        self.report.requests_retracted += 1

    def _release(self, req: _Request) -> None:
        if req.slots:
            self.alloc.free(torch.tensor(req.slots, dtype=torch.int64))
        self.rows.free(req.row)

    # ------------------------------------------------------------------ execution
    def _path(self, planned: _Planned) -> str:
        if self.runner is None:
            return "eager"
        bucket = self.runner.bucket_for(planned.batch)
        return "eager" if bucket is None else f"replay (bucket {bucket})"

    def _execute(self, planned: _Planned) -> torch.Tensor:
        """Run the step; returns ``[T, L, H, D]`` float64 on the host."""
        if self.runner is not None:
            out = self.runner.run(planned.batch, planned.inputs)
        else:
            self.backend.init_forward_metadata(planned.batch)
            out = self._model_step(planned.batch, planned.inputs)
        return out.to("cpu", torch.float64)

    def _account(self, planned: _Planned, path: str) -> None:
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

    def _commit(self, planned: _Planned) -> None:
        """Record the step's tokens: their slots and their k/v (each request's history)."""
        offset = 0
        for r, n in zip(planned.reqs, planned.new):
            r.history.write(r.seq_len, planned.host["k"][offset : offset + n], planned.host["v"][offset : offset + n])
            r.slots.extend(planned.locs[offset : offset + n])
            offset += n

    def _check_attention(self, planned: _Planned, output: torch.Tensor) -> None:
        """Compare every layer's output with the exact attention (after ``_commit``)."""
        if not planned.reqs:
            if output.shape[0] != 0:
                raise _StepFailed("attention", f"an IDLE step returned {output.shape[0]} rows")
            return
        seq_after = [r.seq_len for r in planned.reqs]
        keys, values = stack_histories([r.history for r in planned.reqs], max(seq_after))
        figures = self.report.mode(planned.mode.name)
        token_req = [r for r, n in zip(planned.reqs, planned.new) for _ in range(n)]
        token_pos = [p for r, n in zip(planned.reqs, planned.new) for p in range(r.seq_len - n, r.seq_len)]
        for layer in range(self.cfg.num_layers):
            window = self.cfg.sliding_window if layer in self.swa_layers else None
            expected = exact_attention(
                planned.host["q"][:, layer],
                keys[:, layer],
                values[:, layer],
                seq_after,
                planned.new,
                window,
                self.scaling,
            )
            errors = relative_errors(output[:, layer], expected)
            worst = int(errors.argmax())
            err = float(errors[worst])
            figures.max_error = max(figures.max_error, err)
            self.report.max_error = max(self.report.max_error, err)
            if not err <= self.tol:
                kind = "SWA" if window else "full"
                what = "non-finite output" if math.isinf(err) else f"relative error {err:.3e} > {self.tol:.1e}"
                raise _StepFailed(
                    "attention",
                    f"layer {layer} ({kind}): {what} at request {token_req[worst].rid} position {token_pos[worst]}",
                )

    def _after_step(self, planned: _Planned) -> None:
        """Roll back rejected drafts, finish requests, evict out-of-window SWA slots."""
        cfg, rep = self.cfg, self.report
        if planned.mode is ForwardMode.TARGET_VERIFY:
            for r, n in zip(planned.reqs, planned.new):
                self._rollback(r, self._accepted_length(r.seq_len - n, r.seq_len))
        for r in list(self.running):
            if r.seq_len >= r.target_len:
                self._release(r)
                self.running.remove(r)
                rep.requests_finished += 1
        for r in planned.reqs:
            if r in self.running:
                rep.swa_slots_evicted += self.alloc.evict_out_of_window(self.rows, r.row, r.seq_len, cfg.sliding_window)

    def _accepted_length(self, before: int, after: int) -> int:
        """How many positions a verified request keeps: ``before`` plus the accepted drafts
        (any number, also the middle of a page)."""
        return self.rng.choice(list(range(before, after + 1)))

    def _rollback(self, req: _Request, keep: int) -> None:
        """Drop positions ``keep..`` (rejected drafts): ``rollback`` gives their slots back (a
        partly kept page stays allocated and is continued by the next allocation) and their
        ``req_to_token`` entries are zeroed."""
        seq = req.seq_len
        if keep >= seq:
            return
        self.alloc.rollback(torch.tensor(req.slots[keep:seq], dtype=torch.int64))
        self.rows.req_to_token[req.row, keep:seq] = 0
        del req.slots[keep:]
        self.report.tokens_rolled_back += seq - keep

    # ------------------------------------------------------------------ state checks
    def _live_positions(self) -> Tuple[torch.Tensor, torch.Tensor, List[Tuple[_Request, int]]]:
        """Host int64 full slots of every committed position, the SWA-live subset (positions
        from each request's eviction frontier on) and ``(request, frontier)`` pairs."""
        full, swa_full, frontiers = [], [], []
        for r in self.running:
            if not r.slots:
                continue
            frontier = self.rows.swa_evicted_len(r.row)
            full.extend(r.slots)
            swa_full.extend(r.slots[frontier:])
            frontiers.append((r, frontier))
        return torch.tensor(full, dtype=torch.int64), torch.tensor(swa_full, dtype=torch.int64), frontiers

    def _poison(self) -> None:
        """Fill every slot that holds no live token (free slots, page tails, the sink) with NaN."""
        if self.cfg.poison != "nan":
            return
        full, swa_full, _ = self._live_positions()
        mapping = self._mapping_host()
        for layer in range(self.cfg.num_layers):
            is_swa = layer in self.swa_layers
            live = torch.zeros(self.pool.num_slots(layer), dtype=torch.bool)
            live[mapping[swa_full] if is_swa else full] = True
            dead = torch.nonzero(~live).flatten().to(self.device)
            k, v = self.pool.get_kv_buffer(layer)
            k.index_fill_(0, dead, math.nan)
            v.index_fill_(0, dead, math.nan)

    def _mapping_host(self) -> torch.Tensor:
        """The device full -> SWA slot mapping, copied to the host (int64)."""
        return self.pool.full_to_swa_index_mapping.to("cpu", torch.int64)

    def _check_state(self) -> None:
        """The allocator's invariants and slot ownership (see the module docstring)."""
        self.alloc.check_invariants()
        self.report.invariant_checks += 1
        full, swa_full, frontiers = self._live_positions()
        if full.numel() and (int(full.min()) < self.cfg.page_size or torch.unique(full).numel() != full.numel()):
            raise _StepFailed("invariants", "live requests share a full slot or hold page 0")
        swa = self._mapping_host()[swa_full]
        if swa.numel() and (int(swa.min()) < self.cfg.page_size or torch.unique(swa).numel() != swa.numel()):
            raise _StepFailed("invariants", "a position inside a window has no SWA slot, or two share one")
        table = self.rows.req_to_token.to("cpu", torch.int64)
        for r, _ in frontiers:
            row = table[r.row]
            if row[: r.seq_len].tolist() != r.slots or bool(row[r.seq_len :].any()):
                raise _StepFailed(
                    "invariants",
                    f"req_to_token row {r.row} of request {r.rid} differs from the slots the scheduler wrote",
                )

    def _check_kv(self) -> None:
        """Every live KV value equals what its request wrote (bit for bit)."""
        rep = self.report
        full, swa_full, frontiers = self._live_positions()
        swa = self._mapping_host()[swa_full]
        rep.kv_checks += 1
        lost = 0
        for layer in range(self.cfg.num_layers):
            is_swa = layer in self.swa_layers
            parts_k, parts_v = [], []
            for r, frontier in frontiers:
                lo = frontier if is_swa else 0
                parts_k.append(r.history.k[layer, lo : r.seq_len])
                parts_v.append(r.history.v[layer, lo : r.seq_len])
            if not parts_k:
                continue
            slots = (swa if is_swa else full).to(self.device)
            k, v = self.pool.get_kv_buffer(layer)
            got_k = k[slots].to("cpu", torch.float64)
            got_v = v[slots].to("cpu", torch.float64)
            bad = (got_k != torch.cat(parts_k)).flatten(1).any(1) | (got_v != torch.cat(parts_v)).flatten(1).any(1)
            lost += int(bad.sum())
            rep.kv_slots_verified += slots.numel()
        if lost:
            rep.data_lost += lost
            raise _StepFailed("kv", f"{lost} live (layer, slot) KV values differ from what was written")
