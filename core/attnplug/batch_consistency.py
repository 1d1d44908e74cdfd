"""Is a step consistent with the request table and the pools? (validation mode and host batches)

``batch_checks`` has checked each field on its own (ranges, live rows, lengths). Here the fields
are checked against each other and against what the engine wrote before the step, the rules a
backend relies on without looking (it reads ``req_to_token`` and writes ``out_cache_loc``):

=====  =====================================================================================
rule   what must hold (request ``i`` with row ``r``, ``s = seq_lens[i]``, ``e`` new tokens)
=====  =====================================================================================
once   a row appears once among the real requests (row 0 is the padding row)
pad    a padded request's tokens write to the sink (``0``) or nowhere (``-1``), never a slot
row    token ``j`` of request ``i`` is at position ``p = s - e + j`` and its ``out_cache_loc``
       is ``req_to_token[r, p]`` (the engine writes the row before the step)
held   ``req_to_token[r, q]`` is a usable slot for every ``q < s``
dup    no slot is held twice among the step's rows (and so none twice in ``out_cache_loc``)
other  no new token's slot is held by a live request outside the step
free   every new token's slot has a live SWA slot (a freed slot has none)
swa    with SWA layers, every position ``q >= s - e - W + 1`` (a new token's window) has a
       live SWA slot
pos    ``positions`` (when given) are the new tokens' positions ``p``
=====  =====================================================================================

Every rule is a device op over the step's rows; the verdicts are read in one host copy (on an
accelerator: one sync, which is why this runs only in validation mode there). Only a failing
rule reads more, to name the request, the field, the index and the value. Nothing is written.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List, Optional

import torch

from .batch import BatchError, ForwardBatch

if TYPE_CHECKING:  # pragma: no cover
    from .memory import ReqToTokenPool, SWAKVPool

__all__ = ["check_batch_consistency"]


def check_batch_consistency(
    batch: ForwardBatch,
    pool: "SWAKVPool",
    req_to_token_pool: "ReqToTokenPool",
    rows: List[int],
    seq: List[int],
    ext: List[int],
    *,
    window: Optional[int],
) -> None:
    """Refuse ``batch`` unless it follows every rule of the module docstring.

    ``rows``, ``seq``, ``ext``: the batch's ``req_pool_indices``, ``seq_lens`` and new tokens
    per request as host ints, already checked one by one (``batch_checks``). ``window``: the
    backend's sliding window (None: no SWA check). Reads device tensors; writes nothing."""
    bs = len(rows)
    if bs == 0 or not any(rows):
        _check_padding_only(batch)
        return
    _check_rows_once(rows)
    _Step(batch, pool, req_to_token_pool, rows, seq, ext, window).check()


def _check_rows_once(rows: List[int]) -> None:
    first: Dict[int, int] = {}
    for i, r in enumerate(rows):
        if r == 0:
            continue
        if r in first:
            raise BatchError(
                f"req_pool_indices[{i}] = {r} is also req_pool_indices[{first[r]}]: a request appears once in a step"
            )
        first[r] = i


def _check_padding_only(batch: ForwardBatch) -> None:
    loc = batch.out_cache_loc
    bad = torch.nonzero((loc != 0) & (loc != -1))
    if bad.numel():
        t = int(bad[0, 0])
        raise BatchError(
            f"out_cache_loc[{t}] = {int(loc[t])} belongs to a padded request (row 0): padded tokens write to "
            "the sink 0 or nowhere (-1), never to a slot a request may hold"
        )


class _Step:
    """The step's tensors on the pool's device, and each rule as a mask over them."""

    def __init__(self, batch, pool, req_to_token_pool, rows, seq, ext, window) -> None:
        dev = pool.device
        self.batch, self.pool, self.table = batch, pool, req_to_token_pool
        self.rows_host, self.seq_host = rows, seq
        self.window = window if pool.swa_layer_ids else None
        max_len = req_to_token_pool.max_context_len
        # the batch's own device tensors (already checked equal to the host values above)
        self.rows = batch.req_pool_indices.to(torch.int64)
        self.seq = batch.seq_lens.to(torch.int64)
        given = batch.extend_seq_lens
        e = self.ext = given.to(torch.int64) if given is not None else torch.as_tensor(ext, dtype=torch.int64).to(dev)
        self.real = self.rows != 0
        T, n = batch.num_tokens, sum(ext)  # n < T: a padded EXTEND batch, its last T - n tokens no request's
        self.num_new = n
        self.tok_req = torch.repeat_interleave(torch.arange(len(rows), device=dev), e, output_size=n)
        self.tok_req = torch.cat([self.tok_req, self.tok_req.new_zeros(T - n)])
        starts = torch.cumsum(e, 0) - e
        self.tok_pos = self.seq[self.tok_req] - e[self.tok_req] + torch.arange(T, device=dev) - starts[self.tok_req]
        self.tok_real = self.real[self.tok_req] & (torch.arange(T, device=dev) < n)
        self.loc = batch.out_cache_loc.to(torch.int64)
        self.width = max(1, min(max(seq), max_len))
        # the step's rows up to the longest seq_len: [bs, width] int64 (row 0 all zero)
        self.held_rows = req_to_token_pool.req_to_token[self.rows, : self.width].to(torch.int64)
        self.col = torch.arange(self.width, device=dev)[None, :]  # [1, width] positions
        self.held = self.real[:, None] & (self.col < self.seq[:, None])
        self.lo, self.hi = pool.page_size, pool.size + pool.page_size
        self.mapping = pool.full_to_swa_index_mapping

    # ---------------------------------------------------------------- the rules, as masks
    def _masks(self) -> Dict[str, torch.Tensor]:
        loc, slots, held = self.loc, self.held_rows, self.held
        m: Dict[str, torch.Tensor] = {}
        m["pad"] = ~self.tok_real & (loc != 0) & (loc != -1)
        pos = self.tok_pos.clamp(0, self.width - 1)
        m["row"] = self.tok_real & (loc != slots[self.tok_req, pos])
        m["held"] = held & ~((slots >= self.lo) & (slots < self.hi))
        m["dup"] = held & (self._times_held()[slots.clamp(0, self.hi - 1)] > 1)
        m["other"] = self.tok_real & torch.isin(loc, self._other_rows())
        live = self.mapping[torch.where((loc >= self.lo) & (loc < self.hi), loc, -1)] != 0
        m["free"] = self.tok_real & ~live
        if self.window is not None:
            first_key = (self.seq - self.ext - self.window + 1)[:, None]
            reach = held & (self.col >= first_key)
            safe = torch.where(reach & (slots >= self.lo) & (slots < self.hi), slots, -1)
            m["swa"] = reach & (self.mapping[safe] == 0)
        if self.batch.positions is not None:
            m["pos"] = self.tok_real & (self.batch.positions.to(torch.int64) != self.tok_pos)
        return m

    def _other_rows(self) -> torch.Tensor:
        """Every slot held by a live request outside the step (its row's non-zero entries)."""
        in_step = set(self.rows_host)
        others = [r for r in self.table.rows_in_use() if r not in in_step]
        if not others:
            return self.loc.new_zeros(0)
        table = self.table.req_to_token[torch.as_tensor(others, device=self.table.device)].reshape(-1)
        return table[table != 0].to(torch.int64)

    def check(self) -> None:
        masks = self._masks()
        verdicts = torch.stack([mask.any() for mask in masks.values()]).tolist()  # the one read
        for (rule, mask), bad in zip(masks.items(), verdicts):
            if bad:
                raise BatchError(getattr(self, f"_say_{rule}")(mask))

    # ---------------------------------------------------------------- the messages
    def _token(self, mask: torch.Tensor):
        t = int(torch.nonzero(mask)[0, 0])
        i = int(self.tok_req[t])
        return t, i, self.rows_host[i], int(self.tok_pos[t]), int(self.loc[t])

    def _request(self, mask: torch.Tensor):
        i, q = (int(x) for x in torch.nonzero(mask)[0])
        return i, self.rows_host[i], q, int(self.held_rows[i, q])

    def _say_pad(self, mask) -> str:
        t, i, _, _, slot = self._token(mask)
        whose = (
            f"belongs to padded request {i} (req_pool_indices[{i}] = 0)"
            if t < self.num_new
            else f"belongs to no request (past the {self.num_new} new tokens of extend_seq_lens)"
        )
        return (
            f"out_cache_loc[{t}] = {slot} {whose}: padded tokens write to the sink 0 or nowhere (-1), never to a "
            "slot a request may hold"
        )

    def _say_row(self, mask) -> str:
        t, i, r, p, slot = self._token(mask)
        want = int(self.held_rows[i, p]) if p < self.width else None
        return (
            f"out_cache_loc[{t}] = {slot} (request {i}, row {r}, seq_lens[{i}] = {self.seq_host[i]}, position {p}) "
            "is not the slot its row holds "
            f"there: req_to_token[{r}, {p}] = {want}. Write each new token's slot into its request's row "
            "before the step (seq_lens - extend_seq_lens + j is the position of its token j)"
        )

    def _say_held(self, mask) -> str:
        i, r, q, slot = self._request(mask)
        what = "nothing (0)" if slot == 0 else f"{slot}, not a usable slot of [{self.lo}, {self.hi - 1}]"
        return (
            f"seq_lens[{i}] = {self.seq_host[i]} but req_to_token[{r}, {q}] holds {what}: request {i} (row {r}) "
            f"does not hold {self.seq_host[i]} positions"
        )

    def _times_held(self) -> torch.Tensor:
        """How often each usable slot is held among the step's rows: ``[hi]`` int64."""
        held_slots = self.held_rows[self.held & (self.held_rows >= self.lo) & (self.held_rows < self.hi)]
        return torch.bincount(held_slots, minlength=self.hi)

    def _say_dup(self, mask) -> str:
        i, r, q, slot = self._request(mask)
        where = [
            f"req_to_token[{self.rows_host[int(k)]}, {int(p)}]"
            for k, p in torch.nonzero(self.held & (self.held_rows == slot))
        ]
        tokens = torch.nonzero(self.loc == slot).reshape(-1).tolist()
        also = f"; out_cache_loc{tokens}" if tokens else ""
        return f"slot {slot} is held twice in this step: {', '.join(where)}{also} (one token's KV would be lost)"

    def _say_other(self, mask) -> str:
        t, i, _, _, slot = self._token(mask)
        in_step = set(self.rows_host)
        owner = next(
            r for r in self.table.rows_in_use() if r not in in_step and bool((self.table.req_to_token[r] == slot).any())
        )
        return (
            f"out_cache_loc[{t}] = {slot} (request {i}) is held by live request row {owner}, which is not in "
            "this step: the step would overwrite its KV"
        )

    def _say_free(self, mask) -> str:
        t, i, _, _, slot = self._token(mask)
        return (
            f"out_cache_loc[{t}] = {slot} (request {i}) is not an allocated slot (it has no live SWA slot: freed, "
            "or never handed out): allocate a new token's slots before the step"
        )

    def _say_swa(self, mask) -> str:
        i, r, q, slot = self._request(mask)
        return (
            f"request {i} (row {r}): position {q} (full slot {slot}) is inside the sliding window of this step's "
            f"tokens (window {self.window}, seq_lens[{i}] = {self.seq_host[i]}) but its SWA slot was freed: evict "
            "only positions below window_limit(seq_len before the step, window)"
        )

    def _say_pos(self, mask) -> str:
        t, i, _, p, _ = self._token(mask)
        return (
            f"positions[{t}] = {int(self.batch.positions[t])} but token {t} (request {i}) is at position {p} "
            "(seq_lens - extend_seq_lens + j)"
        )
