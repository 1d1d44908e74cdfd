"""Errors raised by the KV memory: pools, request table and allocator.

* ``OutOfKVSlots``: an allocation needs more slots than one of the two pools has free; it
  carries both counts so the scheduler can tell which pool is short.
* ``KVSlotError``: a caller error (double free, freeing slots never handed out, slot 0 or
  -1 where a slot is expected, a continuation from a slot that is not the request's last,
  eviction beyond what a row holds, bools / floats where integers are expected, malformed
  arguments); raised before anything changes.
* ``OutOfReqSlots``: every row of the request table is in use.
* ``InvariantViolation``: ``SWATokenAllocator.check_invariants`` found inconsistent state.
"""

from __future__ import annotations

__all__ = ["OutOfKVSlots", "KVSlotError", "OutOfReqSlots", "InvariantViolation"]


class OutOfKVSlots(RuntimeError):
    """An allocation needs more slots than the full or the SWA pool has free.

    Attributes (host ints, in tokens, i.e. slots; whole pages when ``page_size > 1``):

    * ``requested``: slots the call needed from EACH pool;
    * ``full_available``: free slots of the full pool;
    * ``swa_available``: free slots of the SWA pool.

    Nothing was allocated when this is raised.
    """

    def __init__(self, requested: int, full_available: int, swa_available: int) -> None:
        self.requested = requested
        self.full_available = full_available
        self.swa_available = swa_available
        super().__init__(
            f"need {requested} tokens: full pool has {full_available} free, SWA pool has {swa_available} free"
        )


class KVSlotError(ValueError):
    """A slot or request-row operation was called with arguments it cannot honour: a double
    free, slots that were never allocated, slot/row 0, -1 where a slot is expected,
    out-of-range values, a ``last_loc`` that is not the request's own last slot, an eviction
    ``seq_len`` beyond what the row holds, bools or floats where integers are expected, or
    malformed arguments. The message names the argument and (the first few of) the offending
    values. Nothing changed: pools, mapping, free lists and the request table are as before."""


class OutOfReqSlots(RuntimeError):
    """``ReqToTokenPool.alloc`` found no free row."""


class InvariantViolation(AssertionError):
    """The allocator's bookkeeping is inconsistent; the message says which rule broke."""
