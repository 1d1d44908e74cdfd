"""Checks of a ``ForwardBatch`` against the pools a backend serves.

``ForwardBatch`` checks itself on construction (shapes, dtypes, host-known lengths). What it
cannot know is the pools: how many slots they have, which request rows are live. This
module checks that, reading values only where that costs no device sync:

* always: the batch lives on the pool's device;
* when the values are on the host (CPU tensors), or ``read_device=True`` (the engine set
  ``ATTNPLUG_VALIDATE=1``; this copies device tensors to the host and synchronises):

  - ``out_cache_loc``: every entry is a full-pool slot in ``[page_size, size + page_size)``
    (the usable slots), ``0`` (a padded token, the sink) or ``-1`` (no slot);
  - ``req_pool_indices``: every entry is a live row of ``req_to_token`` or ``0`` (a padded
    request); a freed or never-allocated row is refused;
  - ``seq_lens`` of real requests: ``extend_seq_lens <= seq_lens <= max_context_len``;
  - ``extend_seq_lens``: as many new tokens as the mode says, ``sum == len(out_cache_loc)``;
    in a captured EXTEND step's padded batch (no host mirror: a graph runner's static batch) a
    padded request (row 0) may have none and the tokens past ``sum`` are padding (they belong to
    no request: the sink or nowhere, like a padded request's);

  - consistency with the request table (``req_to_token``) and the pool's mapping: a request
    appears once; a padded request's tokens write to the sink (``0``) or nowhere (``-1``); each
    real token's ``out_cache_loc`` is the slot its request's row holds at the token's position
    (``seq_lens - extend_seq_lens + j``: the engine writes the row before the step); the row holds
    a usable slot at every position ``< seq_lens``; no slot is held twice among the step's rows, and no new
    token's slot is held by another live request; every new token's slot has a live SWA slot (a
    freed slot has none); on pools with SWA layers, every position a new token's window reaches
    has a live SWA slot; ``positions`` (when given) are the tokens' positions.

Every refusal is a ``BatchError`` naming the request, the field, the index and the value; the
checks only read, so a refused batch has written nothing. On an accelerator the consistency
checks run as device ops whose verdicts are read in one copy (one sync a step).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List, Optional

import torch

from .batch import BatchError, ForwardBatch, ForwardMode
from .batch_consistency import check_batch_consistency

if TYPE_CHECKING:  # pragma: no cover
    from .memory import ReqToTokenPool, SWAKVPool

__all__ = ["check_batch_against_pools", "check_batch_consistency"]


def _values(t: Optional[torch.Tensor], read_device: bool) -> Optional[List[int]]:
    if t is None or (t.device.type != "cpu" and not read_device):
        return None
    return t.tolist()  # on an accelerator: a sync, allowed only in validation mode


def _first_bad(name: str, values: List[int], ok, meaning: str) -> None:
    for i, x in enumerate(values):
        if not ok(x):
            raise BatchError(f"{name}[{i}] = {x} is out of range ({meaning})")


def check_batch_against_pools(
    batch: ForwardBatch,
    pool: "SWAKVPool",
    req_to_token_pool: "ReqToTokenPool",
    *,
    read_device: bool,
    window: Optional[int] = None,
) -> None:
    """Refuse a batch that does not fit ``pool`` / ``req_to_token_pool`` (see module docstring).
    ``window``: the backend's sliding window (its SWA layers' reach), None without one.

    Must not: read a device tensor unless ``read_device``; change the batch or the pools.
    """
    if batch.device != pool.device:
        raise BatchError(f"out_cache_loc is on {batch.device}, the KV pool on {pool.device}")
    if batch.forward_mode is ForwardMode.IDLE:
        return
    if batch.device.type == "cpu":
        read_device = True  # host values: reading them costs no sync

    lo, hi = pool.page_size, pool.size + pool.page_size
    loc = batch.out_cache_loc
    if read_device and loc.numel():
        bad = torch.nonzero(~((loc == 0) | (loc == -1) | ((loc >= lo) & (loc < hi))))  # a sync off the host
        if bad.numel():
            i = int(bad[0, 0])
            raise BatchError(
                f"out_cache_loc[{i}] = {int(loc[i])} is out of range (full-pool slots are "
                f"[{lo}, {hi - 1}]; 0 is the padding sink, -1 means no slot)"
            )

    rows = _values(batch.req_pool_indices, read_device)
    if rows is not None:
        max_reqs = req_to_token_pool.max_reqs
        _first_bad(
            "req_pool_indices", rows, lambda r: 0 <= r < max_reqs, f"rows are [1, {max_reqs - 1}]; 0 is the padding row"
        )
        _check_rows_live(req_to_token_pool, rows)

    ext = _extend_lens(batch, read_device, rows)
    seq = _values(batch.seq_lens, read_device)
    if seq is not None and rows is not None and ext is not None:
        max_len = req_to_token_pool.max_context_len
        for i, (s, e, r) in enumerate(zip(seq, ext, rows)):
            if r == 0:
                continue  # a padded request: any seq_len, it reads nothing
            if s < e:
                raise BatchError(
                    f"seq_lens[{i}] = {s} is smaller than its {e} new token(s) (seq_lens include this step's tokens)"
                )
            if s > max_len:
                raise BatchError(f"seq_lens[{i}] = {s} exceeds max_context_len = {max_len}")
        if read_device:
            check_batch_consistency(batch, pool, req_to_token_pool, rows, seq, ext, window=window)


def _extend_lens(batch: ForwardBatch, read_device: bool, rows: Optional[List[int]]) -> Optional[List[int]]:
    """New tokens per request, checked against the mode and ``len(out_cache_loc)`` (a padded
    EXTEND batch without a host mirror: padded requests may have none, ``sum`` at most the
    tokens: module docstring)."""
    values = _values(batch.extend_seq_lens, read_device)
    q_len = batch.q_len
    if values is None:
        if q_len is not None:
            return [q_len] * batch.batch_size
        return batch.extend_seq_lens_cpu
    if q_len is not None:
        _first_bad(
            "extend_seq_lens",
            values,
            lambda e: e == q_len,
            f"every request has {q_len} new token(s) in {batch.forward_mode.name} mode",
        )
    padded = q_len is None and batch.extend_seq_lens_cpu is None and rows is not None
    if padded:
        for i, (e, r) in enumerate(zip(values, rows)):
            if e < (1 if r else 0):
                raise BatchError(
                    f"extend_seq_lens[{i}] = {e} is out of range (a request has >= 1 new token, a padded one >= 0)"
                )
    elif q_len is None:
        _first_bad("extend_seq_lens", values, lambda e: e >= 1, "every request has >= 1 new token")
    if batch.extend_seq_lens_cpu is not None and list(batch.extend_seq_lens_cpu) != values:
        raise BatchError(
            f"extend_seq_lens = {values} differs from extend_seq_lens_cpu = {list(batch.extend_seq_lens_cpu)}"
        )
    if sum(values) > batch.num_tokens or (sum(values) < batch.num_tokens and not padded):
        raise BatchError(f"sum(extend_seq_lens) = {sum(values)} but len(out_cache_loc) = {batch.num_tokens}")
    return values


def _check_rows_live(req_to_token_pool: "ReqToTokenPool", rows: List[int]) -> None:
    """Every non-zero row is in use (row 0 is the padding row)."""
    from .memory.errors import KVSlotError

    try:
        req_to_token_pool.check_in_use(rows, "req_pool_indices", allow_padding_row=True)
    except KVSlotError as e:
        raise BatchError(f"{e} (a live request's row, or 0 for a padded request)") from None
