"""kv_store: writes exactly the step's rows of the cache, and nothing else; plus pdl_supported.

Runs the Triton interpreter on the CPU when no GPU is present (tests/conftest.py sets
TRITON_INTERPRET=1 before any kernel module is imported), compiled kernels on a GPU.
"""

import os

import pytest
import torch

from attnplug_cuda.kernels import pdl_supported  # noqa: E402
from attnplug_cuda.kernels.interpret import use_interpreter  # noqa: E402

if not torch.cuda.is_available():
    use_interpreter()  # before triton is imported (tests/conftest.py also arranges this)
pytest.importorskip("triton")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PDL_MODES = [False, True] if pdl_supported(DEVICE)[0] else [False]
from attnplug_cuda.kernels import kv_store as K  # noqa: E402


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern, so that NaN poison compares equal to itself."""
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize("pdl", PDL_MODES)
@pytest.mark.parametrize(
    "dtype,loc_dtype,hkv,d",
    [
        (torch.float16, torch.int32, 2, 64),
        (torch.bfloat16, torch.int64, 4, 128),
        (torch.float32, torch.int64, 3, 64),  # Hkv * D not a power of two
        (torch.float16, torch.int32, 36, 128),  # Hkv * D > one program chunk
    ],
)
def test_writes_exactly_the_given_rows(dtype, loc_dtype, hkv, d, pdl):
    g = torch.Generator().manual_seed(hkv * d)
    S, T = 64, 9
    k_cache = torch.full((S, hkv, d), float("nan"), dtype=dtype, device=DEVICE)
    v_cache = torch.full((S, hkv, d), float("nan"), dtype=dtype, device=DEVICE)
    k_cache[::2] = 3.0  # mixed poison: NaN rows and finite rows
    before_k, before_v = k_cache.clone(), v_cache.clone()
    loc = (torch.randperm(S - 1, generator=g)[:T] + 1).to(DEVICE, loc_dtype)
    k = torch.randn(T, hkv, d, generator=g).to(DEVICE, dtype)
    v = torch.randn(T, hkv, d, generator=g).to(DEVICE, dtype)

    K.kv_store(k, v, k_cache, v_cache, loc, pdl=pdl)

    rows = loc.long()
    assert torch.equal(_bits(k_cache[rows]), _bits(k)) and torch.equal(_bits(v_cache[rows]), _bits(v))
    others = torch.ones(S, dtype=torch.bool, device=DEVICE)
    others[rows] = False
    assert torch.equal(_bits(k_cache[others]), _bits(before_k[others]))
    assert torch.equal(_bits(v_cache[others]), _bits(before_v[others]))


def test_strided_inputs_padding_sink_and_out_of_range_slots():
    """k/v as views of a fused qkv tensor; only slots in [1, S) are written: the sink 0, -1
    ("no slot") and garbage (negative, >= S) are skipped, nothing wraps."""
    S, hkv, d, H = 16, 2, 64, 4
    qkv = torch.randn(8, H + 2 * hkv, d).to(DEVICE, torch.float16)
    k, v = qkv[:, H : H + hkv], qkv[:, H + hkv :]
    assert not k.is_contiguous()
    k_cache = torch.full((S, hkv, d), 7.0, dtype=torch.float16, device=DEVICE)
    v_cache = k_cache.clone()
    loc = torch.tensor([4, 0, -1, 9, 11, S, -S, 2**40], dtype=torch.int64, device=DEVICE)
    K.kv_store(k, v, k_cache, v_cache, loc)
    assert torch.equal(k_cache[4], k[0]) and torch.equal(v_cache[9], v[3]) and torch.equal(k_cache[11], k[4])
    untouched = [i for i in range(S) if i not in (4, 9, 11)]  # the sink 0 and the last slot included
    assert (k_cache[untouched] == 7).all() and (v_cache[untouched] == 7).all()


def test_zero_tokens_is_a_no_op():
    k_cache = torch.full((8, 2, 64), 5.0, dtype=torch.float16, device=DEVICE)
    v_cache = k_cache.clone()
    empty = torch.empty(0, 2, 64, dtype=torch.float16, device=DEVICE)
    K.kv_store(empty, empty, k_cache, v_cache, torch.empty(0, dtype=torch.int64, device=DEVICE))
    assert (k_cache == 5).all() and (v_cache == 5).all()


def test_rejects_mismatched_dtype():
    k_cache = torch.zeros(8, 2, 64, dtype=torch.float16, device=DEVICE)
    k = torch.zeros(1, 2, 64, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(AssertionError, match="cache"):
        K.kv_store(k, k, k_cache, k_cache.clone(), torch.zeros(1, dtype=torch.int64, device=DEVICE))


def test_pdl_supported_answers_without_cuda(monkeypatch):
    ok, reason = pdl_supported("cpu")
    assert not ok and "cpu" in reason
    monkeypatch.setenv("ATTNPLUG_DISABLE_PDL", "1")
    ok, reason = pdl_supported(DEVICE)
    assert not ok and "ATTNPLUG_DISABLE_PDL" in reason
    monkeypatch.delenv("ATTNPLUG_DISABLE_PDL")
    if os.environ.get("TRITON_INTERPRET") == "1":
        ok, reason = pdl_supported("cuda")
        assert not ok and ("interpreter" in reason or "not cuda" in reason or "ROCm" in reason)
