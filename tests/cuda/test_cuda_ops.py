"""The cuda backend's op layer (``CudaOps``) under the Triton interpreter: the strided KV store
(the halves of an interleaved cache) stores exactly what the dense path stores, and the
attention over an interleaved cache equals the one over separate caches."""

from __future__ import annotations

import pytest
import torch

from attnplug_cuda.backend import CudaBackend
from attnplug_cuda.kernels.kv_store import kv_store

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("hkv,d", [(2, 32), (1, 64), (3, 16)])
def test_strided_kv_store_matches_dense(hkv, d):
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(5, hkv, d, generator=g).to(DEVICE), torch.randn(5, hkv, d, generator=g).to(DEVICE)
    loc = torch.tensor([3, -1, 7, 0, 9], device=DEVICE)
    dense_k, dense_v = torch.zeros(12, hkv, d, device=DEVICE), torch.zeros(12, hkv, d, device=DEVICE)
    kv_store(k, v, dense_k, dense_v, loc)
    inter = torch.zeros(12, hkv, 2 * d, device=DEVICE)
    kv_store(k, v, inter[..., :d], inter[..., d:], loc)
    assert torch.equal(inter[..., :d], dense_k) and torch.equal(inter[..., d:], dense_v)
    assert torch.count_nonzero(dense_k[[0, 1, 2, 4, 5, 6, 8, 10, 11]]) == 0  # 0 and -1 skipped


def test_attend_interleaved_equals_separate():
    ops = CudaBackend.paged_ops(DEVICE)
    g = torch.Generator().manual_seed(1)
    P, hkv, D = 4, 2, 32
    inter = torch.full((6, P, hkv, 2 * D), float("nan"), device=DEVICE)
    sep_k = torch.full((6, P, hkv, D), float("nan"), device=DEVICE)
    sep_v = torch.full((6, P, hkv, D), float("nan"), device=DEVICE)
    k, v = torch.randn(9, hkv, D, generator=g).to(DEVICE), torch.randn(9, hkv, D, generator=g).to(DEVICE)
    slots = torch.tensor([4 * b + o for b in (3, 1, 5) for o in range(4)][:9], device=DEVICE)
    ops.store_kv(k, v, inter[..., :D], inter[..., D:], slots)
    ops.store_kv(k, v, sep_k, sep_v, slots)
    step = ops.plan(
        torch.tensor([0, 9], dtype=torch.int32, device=DEVICE),
        torch.tensor([9], dtype=torch.int32, device=DEVICE),
        torch.tensor([[3, 1, 5, 0]], dtype=torch.int32, device=DEVICE),
        P,
        num_tokens=9,
        max_query_len=9,
        max_seq_len=9,
    )
    q = torch.randn(9, 4, D, generator=g).to(DEVICE)
    a = ops.attend(q, inter[..., :D], inter[..., D:], step, scale=0.2, window=5)
    b = ops.attend(q, sep_k, sep_v, step, scale=0.2, window=5)
    assert torch.isfinite(a).all() and torch.equal(a, b)
