"""benchmarks/allocator_host.py on the host: a short run times both calls and leaves the
allocator consistent."""

import math

from scripts import load_script


def test_short_run_times_alloc_and_free():
    module = load_script("allocator_host")
    for page_size in (1, 4):
        alloc_us, free_us = module._run(bs=3, page_size=page_size, steps=40, device="cpu")
        assert alloc_us > 0 and math.isfinite(free_us) and free_us > 0  # 64 + 40 positions pass the window
