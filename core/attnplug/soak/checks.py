"""What the soak checks around every step.

Before the step, every slot that holds no live token (free slots, page tails, the sink) is
filled with NaN (``poison``), so reading anything but a live slot shows up. After it:

* ``check_attention``: every layer's output against ``oracle.exact_attention`` (float64, over
  the k/v each request was given, kept on the host), relative error within the tolerance;
* ``check_state``: ``SWATokenAllocator.check_invariants()``, plus slot ownership: live full
  slots distinct, every position a future query can reach still has a distinct SWA slot,
  ``req_to_token`` rows equal to what the scheduler wrote (zero past each request's length);
* ``check_kv``: every live KV value (full layers: every committed position; SWA layers:
  positions from the eviction frontier on) bit-identical to what was written (``data_lost``).

A check that fails raises ``StepFailed``.
"""

from __future__ import annotations

import math
from typing import List, Sequence, Tuple

import torch

from ..memory import ReqToTokenPool, SWAKVPool, SWATokenAllocator
from ..oracle import exact_attention, relative_errors, stack_histories
from .config import SoakConfig
from .report import SoakReport, StepFailed
from .scheduler import Planned, Request

__all__ = ["StepChecks"]


class StepChecks:
    """The checks of one soak run over its pool, allocator and request table; ``tol``: the
    largest relative error allowed."""

    def __init__(
        self,
        cfg: SoakConfig,
        pool: SWAKVPool,
        alloc: SWATokenAllocator,
        rows: ReqToTokenPool,
        report: SoakReport,
        *,
        tol: float,
    ) -> None:
        self.cfg, self.pool, self.alloc, self.rows, self.report = cfg, pool, alloc, rows, report
        self.tol = tol
        self.swa_layers = frozenset(cfg.swa_layer_ids())
        self.scaling = 1.0 / math.sqrt(pool.head_dim)  # the softmax scale of the oracle
        self.device = pool.device

    def check_attention(self, planned: Planned, output: torch.Tensor) -> None:
        """Compare every layer's output with the exact attention (after ``Scheduler.commit``)."""
        if not planned.reqs:
            if output.shape[0] != 0:
                raise StepFailed("attention", f"an IDLE step returned {output.shape[0]} rows")
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
                raise StepFailed(
                    "attention",
                    f"layer {layer} ({kind}): {what} at request {token_req[worst].rid} position {token_pos[worst]}",
                )

    def _live_positions(
        self, running: Sequence[Request]
    ) -> Tuple[torch.Tensor, torch.Tensor, List[Tuple[Request, int]]]:
        """Host int64 full slots of every committed position, the SWA-live subset (positions
        from each request's eviction frontier on) and ``(request, frontier)`` pairs."""
        full, swa_full, frontiers = [], [], []
        for r in running:
            if not r.slots:
                continue
            frontier = self.rows.swa_evicted_len(r.row)
            full.extend(r.slots)
            swa_full.extend(r.slots[frontier:])
            frontiers.append((r, frontier))
        return torch.tensor(full, dtype=torch.int64), torch.tensor(swa_full, dtype=torch.int64), frontiers

    def poison(self, running: Sequence[Request]) -> None:
        """Fill every slot that holds no live token (free slots, page tails, the sink) with NaN."""
        if self.cfg.poison != "nan":
            return
        full, swa_full, _ = self._live_positions(running)
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

    def check_state(self, running: Sequence[Request]) -> None:
        """The allocator's invariants and slot ownership (see the module docstring)."""
        self.alloc.check_invariants()
        self.report.invariant_checks += 1
        full, swa_full, frontiers = self._live_positions(running)
        if full.numel() and (int(full.min()) < self.cfg.page_size or torch.unique(full).numel() != full.numel()):
            raise StepFailed("invariants", "live requests share a full slot or hold page 0")
        swa = self._mapping_host()[swa_full]
        if swa.numel() and (int(swa.min()) < self.cfg.page_size or torch.unique(swa).numel() != swa.numel()):
            raise StepFailed("invariants", "a position inside a window has no SWA slot, or two share one")
        table = self.rows.req_to_token.to("cpu", torch.int64)
        for r, _ in frontiers:
            row = table[r.row]
            if row[: r.seq_len].tolist() != r.slots or bool(row[r.seq_len :].any()):
                raise StepFailed(
                    "invariants",
                    f"req_to_token row {r.row} of request {r.rid} differs from the slots the scheduler wrote",
                )

    def check_kv(self, running: Sequence[Request]) -> None:
        """Every live KV value equals what its request wrote (bit for bit)."""
        rep = self.report
        full, swa_full, frontiers = self._live_positions(running)
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
            raise StepFailed("kv", f"{lost} live (layer, slot) KV values differ from what was written")
