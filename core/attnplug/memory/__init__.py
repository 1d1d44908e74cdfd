"""KV memory of the hybrid full + sliding-window cache.

* ``SWAKVPool``: per-layer KV buffers (full and SWA pools) and the device mapping from full
  slots to SWA slots (``translate_loc_from_full_to_swa``).
* ``SWATokenAllocator``: host bookkeeping of which slots/pages are live; allocation is
  all-or-nothing across both pools; out-of-window SWA slots are evicted between steps.
* ``ReqToTokenPool``: the request table ``req_to_token`` and each row's eviction frontier.
* ``fp8``: the FP8 KV cache's dtypes, its quantisation rule and scales.
* Errors: ``OutOfKVSlots``, ``KVSlotError``, ``OutOfReqSlots``, ``InvariantViolation``.

Slot values: ``[page_size, size + page_size)`` usable, 0 (page 0) the padding sink, -1 "no
slot" (translated to -1, never written, never freed); see ``swa_pool``. Every refused call
leaves all of the above exactly as it was.
"""

from .allocator import SWATokenAllocator
from .errors import InvariantViolation, KVSlotError, OutOfKVSlots, OutOfReqSlots
from .fp8 import FP8_KV_DTYPES, resolve_kv_cache_dtype
from .req_to_token import ReqToTokenPool
from .swa_pool import SWAKVPool

__all__ = [
    "FP8_KV_DTYPES",
    "InvariantViolation",
    "KVSlotError",
    "OutOfKVSlots",
    "OutOfReqSlots",
    "ReqToTokenPool",
    "SWAKVPool",
    "SWATokenAllocator",
    "resolve_kv_cache_dtype",
]
