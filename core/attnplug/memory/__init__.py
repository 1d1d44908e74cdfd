"""KV memory of the hybrid full + sliding-window cache.

* ``SWAKVPool``: per-layer KV buffers (full and SWA pools) and the device mapping from full
  slots to SWA slots (``translate_loc_from_full_to_swa``).
* ``SWATokenAllocator``: host bookkeeping of which slots/pages are live; allocation is
  all-or-nothing across both pools; out-of-window SWA slots are evicted between steps.
* ``ReqToTokenPool``: the request table ``req_to_token`` and each row's eviction frontier.
* Errors: ``OutOfKVSlots``, ``KVSlotError``, ``OutOfReqSlots``, ``InvariantViolation``.
"""

from .allocator import SWATokenAllocator
from .errors import InvariantViolation, KVSlotError, OutOfKVSlots, OutOfReqSlots
from .req_to_token import ReqToTokenPool
from .swa_pool import SWAKVPool

__all__ = [
    "InvariantViolation",
    "KVSlotError",
    "OutOfKVSlots",
    "OutOfReqSlots",
    "ReqToTokenPool",
    "SWAKVPool",
    "SWATokenAllocator",
]
