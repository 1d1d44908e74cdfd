"""Fixtures of the transformers integration tests (skipped when transformers is missing)."""

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run many small ops: one intra-op thread is faster and, on a busy host, far
    faster than several that spin-wait for each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
