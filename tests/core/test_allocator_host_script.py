"""benchmarks/allocator_host.py on the host: a short run times both calls and leaves the
allocator consistent."""

import importlib.util
import math
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_short_run_times_alloc_and_free():
    path = os.path.join(REPO, "benchmarks", "allocator_host.py")
    spec = importlib.util.spec_from_file_location("allocator_host", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for page_size in (1, 4):
        alloc_us, free_us = module._run(bs=3, page_size=page_size, steps=40, device="cpu")
        assert alloc_us > 0 and math.isfinite(free_us) and free_us > 0  # 64 + 40 positions pass the window
