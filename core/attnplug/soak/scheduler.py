"""The soak's serving schedule: which requests run in each step, and the slots they hold.

Requests arrive at random, are admitted to a ``req_to_token`` row, prefilled in chunks (EXTEND,
mixed with short extensions of running requests), then run DECODE, TARGET_VERIFY (the rejected
drafts are rolled back: their slots freed, their ``req_to_token`` entries zeroed) and
DRAFT_EXTEND steps over random subsets; finished requests give their slots and row back, and
out-of-window SWA slots are evicted between steps. Pools are small: ``OutOfKVSlots`` is routine,
handled by shrinking the batch or retracting a request.

The ``Scheduler`` owns the schedule and the data (``random.Random(seed)`` and a CPU
``torch.Generator(seed)``): nothing depends on the device or on the backend's outputs.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..batch import ForwardBatch, ForwardMode
from ..memory import OutOfKVSlots, OutOfReqSlots, ReqToTokenPool, SWATokenAllocator
from ..oracle import History
from .config import SoakConfig
from .report import SoakReport, StepFailed

__all__ = ["Planned", "Request", "Scheduler"]


@dataclass
class Request:
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
class Planned:
    mode: ForwardMode
    reqs: List[Request]
    new: List[int]
    batch: ForwardBatch
    locs: List[int]  # host copy of out_cache_loc
    inputs: Dict[str, torch.Tensor]  # device, pool dtype: q [T, L, H, D], k/v [T, L, Hkv, D]
    host: Dict[str, torch.Tensor]  # the same values, float64 CPU


class Scheduler:
    """The waiting and running requests of one soak run, and how each step is chosen (the
    step's data in the pool's dtype and head dim, on its device).
    ``attempt``: the step being allocated (mode, requests, new tokens), for a failure report
    when allocating raises."""

    def __init__(
        self,
        cfg: SoakConfig,
        alloc: SWATokenAllocator,
        rows: ReqToTokenPool,
        report: SoakReport,
        *,
        needs_cpu_seq_lens: bool,
    ) -> None:
        self.cfg, self.alloc, self.rows, self.report = cfg, alloc, rows, report
        self.dtype, self.head_dim, self.device = alloc.pool.dtype, alloc.pool.head_dim, alloc.pool.device
        self.needs_cpu_seq_lens = needs_cpu_seq_lens
        self.rng = random.Random(cfg.seed)
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.waiting: List[Request] = []
        self.running: List[Request] = []
        self.attempt: Optional[Tuple[ForwardMode, List[Request], List[int]]] = None
        self._next_rid = 0
        self._ever_used = torch.zeros(cfg.sizes()[0] + cfg.page_size, dtype=torch.bool)

    def arrivals(self) -> None:
        cfg, rng = self.cfg, self.rng
        if len(self.waiting) < cfg.max_running and rng.random() < 0.35:
            for _ in range(1 + (rng.random() < 0.2)):
                prompt = rng.randint(1, cfg.max_prompt)
                longest = cfg.max_context - max(cfg.draft_tokens, cfg.alt_draft_tokens)
                target = rng.randint(prompt + 1, longest)
                self.waiting.append(
                    Request(
                        self._next_rid,
                        prompt,
                        target,
                        History(cfg.num_layers, cfg.max_context, cfg.num_kv_heads, self.head_dim),
                    )
                )
                self._next_rid += 1
                self.report.requests_arrived += 1

    def _admit(self, count: int) -> List[Request]:
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

    def plan(self) -> Planned:
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

    def _allocate(self, mode: ForwardMode, reqs: List[Request], new: List[int]) -> Planned:
        """Slots for the step; on ``OutOfKVSlots`` drop requests from the batch, and when
        not even one fits, retract the request holding the most slots and run IDLE."""
        rep = self.report
        while reqs:
            self.attempt = (mode, list(reqs), list(new))
            before = (self.alloc.full_available_size(), self.alloc.swa_available_size())
            try:
                locs = self._alloc_slots(mode, reqs, new)
            except OutOfKVSlots:
                rep.out_of_kv_slots += 1
                after = (self.alloc.full_available_size(), self.alloc.swa_available_size())
                if after != before:
                    raise StepFailed(
                        "invariants", f"OutOfKVSlots changed the free counts {before} -> {after}"
                    ) from None
                reqs, new = reqs[:-1], new[:-1]
                continue
            return self._build(mode, reqs, new, locs)
        self._retract(max(self.running, key=lambda r: r.seq_len))
        return self.plan()

    def _alloc_slots(self, mode: ForwardMode, reqs: Sequence[Request], new: Sequence[int]) -> torch.Tensor:
        last = [r.slots[-1] if r.slots else -1 for r in reqs]
        seq = [r.seq_len + n for r, n in zip(reqs, new)]
        if mode is ForwardMode.DECODE:
            return self.alloc.alloc_decode(seq, last)
        if self.cfg.page_size == 1 and mode is ForwardMode.EXTEND:
            return self.alloc.alloc(sum(new))
        return self.alloc.alloc_extend([r.seq_len for r in reqs], seq, last)

    def _build(
        self, mode: ForwardMode, reqs: List[Request], new: List[int], locs: Optional[torch.Tensor] = None
    ) -> Planned:
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
        return Planned(mode, list(reqs), list(new), batch, locs_host, inputs, host)

    def _retract(self, req: Request) -> None:
        """Preempt ``req``: free its slots and row; it waits to be prefilled again."""
        self._release(req)
        self.running.remove(req)
        req.row, req.slots = None, None
        self.waiting.insert(0, req)
        self.report.requests_retracted += 1

    def _release(self, req: Request) -> None:
        if req.slots:
            self.alloc.free(torch.tensor(req.slots, dtype=torch.int64))
        self.rows.free(req.row)

    def commit(self, planned: Planned) -> None:
        """Record the step's tokens: their slots and their k/v (each request's history)."""
        offset = 0
        for r, n in zip(planned.reqs, planned.new):
            r.history.write(r.seq_len, planned.host["k"][offset : offset + n], planned.host["v"][offset : offset + n])
            r.slots.extend(planned.locs[offset : offset + n])
            offset += n

    def after_step(self, planned: Planned) -> None:
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

    def _rollback(self, req: Request, keep: int) -> None:
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
