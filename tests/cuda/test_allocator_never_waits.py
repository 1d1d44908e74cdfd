"""Slot allocation, eviction and freeing never make the host wait for the device: an engine
prepares step N + 1 while step N runs (CUDA only; ``torch.cuda.set_sync_debug_mode("error")``
turns every synchronizing call into an error, with the device kept busy meanwhile)."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device (synchronization is a device matter)", allow_module_level=True)

from attnplug.memory import SWAKVPool, SWATokenAllocator  # noqa: E402


@pytest.mark.parametrize("page_size", [1, 4])
def test_alloc_evict_and_free_never_synchronize(page_size):
    pool = SWAKVPool(
        size=1024,
        size_swa=256,
        num_layers=2,
        swa_layer_ids=[0],
        num_kv_heads=1,
        head_dim=8,
        dtype=torch.bfloat16,
        device="cuda",
        page_size=page_size,
    )
    alloc = SWATokenAllocator(pool)
    torch.cuda._sleep(50_000_000)  # the device stays busy: a synchronizing call would wait
    torch.cuda.set_sync_debug_mode("error")
    try:
        first = alloc.alloc_extend([0, 0], [9, 3], [-1, -1], host=True)
        last = [int(first[8]), int(first[11])]
        more = alloc.alloc_decode([10, 4], last, host=True)
        alloc.free_swa(first[:page_size])  # the first page of request 0 leaves its window
        alloc.free(torch.cat([first, more]))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    alloc.check_invariants()
    assert alloc.full_available_size() == pool.size and alloc.swa_available_size() == pool.size_swa
