"""The CUDA kernels over FP8 KV caches (``float8_e4m3fn``, ``float8_e5m2``), kernel by kernel.

* Stores: ``kv_store`` writes ``attnplug.memory.fp8.quantize_kv``'s bytes, bit for bit, for
  every model dtype and for the values a rounding rule gets wrong first: ties (the midpoints
  of the FP8 grid), subnormals and their ties, values past the largest finite, ``+-inf``,
  NaN, signed zeros, per-head scales such as 0.01 and 3.0 and one scale for every head (a
  stride-0 view). The stores inside ``store_attend`` and ``paged_attention`` are checked the
  same way by their cases (``one_launch_cases`` / ``paged_cases`` with ``kv_dtype``), and end
  to end in ``test_cuda_fp8_backend.py``.
* Attention: ``store_attend`` (decode with and without the first block laid out before the
  wait, drafts, KV splits merged in-kernel, windows, soft cap, sinks, padded requests, no
  store) and ``paged_attention`` (decode storing the step, split KV with the combine kernel,
  prefill / extend tiles, GQA, SWA windows, soft cap, sinks) against float64 attention over
  the values the cache holds (the step's own rows quantised too), in the model dtype's
  tolerance.

The kernels run under ``TRITON_INTERPRET=1`` on the host (compiled on a GPU). On the host,
NaN bytes compare exactly; on a GPU a NaN may lose its sign in the float32 division, so only
NaN-ness is compared there.
"""

import pytest
import torch

from attnplug_cuda.kernels.interpret import use_interpreter

if not torch.cuda.is_available():
    use_interpreter()  # before triton is imported (tests/conftest.py also arranges this)
pytest.importorskip("triton")

from one_launch_cases import bits, fp8_bytes_match, hard_values  # noqa: E402
from one_launch_cases import check as check_one_launch  # noqa: E402
from one_launch_cases import run_case as run_one_launch  # noqa: E402
from paged_cases import DEVICE, PAD  # noqa: E402
from paged_cases import run_case as run_paged  # noqa: E402

from attnplug.memory.fp8 import FP8_KV_DTYPES, quantize_kv  # noqa: E402
from attnplug_cuda.kernels.common import KVScales  # noqa: E402
from attnplug_cuda.kernels.kv_store import kv_store  # noqa: E402

FP8 = pytest.mark.parametrize("kv_dtype", FP8_KV_DTYPES, ids=["e4m3fn", "e5m2"])
#: per-head scales of the attention cases: a small and a large one (2 kv heads)
SCALES = (torch.tensor([0.01, 3.0]), torch.tensor([0.5, 0.02]))


def rows_of(values: torch.Tensor, hkv: int, d: int) -> torch.Tensor:
    """``values`` laid out as ``[T, hkv, d]`` rows (padded with zeros)."""
    per = hkv * d
    T = -(-values.numel() // per)
    flat = torch.zeros(T * per, dtype=values.dtype)
    flat[: values.numel()] = values
    return flat.view(T, hkv, d)


def assert_bytes(stored: torch.Tensor, want: torch.Tensor) -> None:
    fp8_bytes_match(stored, want, exact=DEVICE.type == "cpu")


@FP8
@pytest.mark.parametrize("model_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_kv_store_writes_quantize_kv_bytes(kv_dtype, model_dtype):
    """Per-head scales: 1 and 0.25 keep the hard values exact (ties stay ties after the
    division), 0.01 and 3.0 make the division round; model dtypes round some hard values
    themselves, which the reference sees the same way (it starts from the model-dtype rows)."""
    hkv, d = 4, 64
    k_scale = torch.tensor([1.0, 0.25, 0.01, 3.0])
    v_scale = torch.tensor([3.0, 0.01, 1.0, 0.25])
    values = hard_values(kv_dtype)
    k = rows_of(torch.cat([values, values * 0.25, values * 0.01, values * 3.0]), hkv, d).to(model_dtype)
    g = torch.Generator().manual_seed(1)
    v = (torch.randn(k.shape, generator=g, dtype=torch.float64) * 40).to(model_dtype)
    T = k.shape[0]
    S = T + 5
    k_cache = torch.zeros(S, hkv, d, dtype=kv_dtype, device=DEVICE)
    v_cache = torch.zeros(S, hkv, d, dtype=kv_dtype, device=DEVICE)
    loc = torch.randperm(S - 1, generator=g)[:T] + 1
    scales = KVScales.of(k_scale.to(DEVICE), v_scale.to(DEVICE))
    kv_store(k.to(DEVICE), v.to(DEVICE), k_cache, v_cache, loc.to(DEVICE), scales=scales)
    assert_bytes(k_cache.cpu()[loc], quantize_kv(k, k_scale, kv_dtype))
    assert_bytes(v_cache.cpu()[loc], quantize_kv(v, v_scale, kv_dtype))
    untouched = torch.ones(S, dtype=torch.bool)
    untouched[loc] = False
    assert int(bits(k_cache.cpu()[untouched]).count_nonzero()) == 0, "a slot outside loc was written"


@FP8
def test_kv_store_one_scale_for_every_head_and_strided_cache(kv_dtype):
    """One scale expanded over the heads (stride 0: what the op layer passes for an engine's
    per-layer scale) into the K / V halves of an interleaved cache; slots outside the cache,
    0 and -1 are skipped."""
    hkv, d = 3, 32
    g = torch.Generator().manual_seed(2)
    k = torch.randn(6, hkv, d, generator=g).to(torch.bfloat16) * 50
    v = torch.randn(6, hkv, d, generator=g).to(torch.bfloat16)
    one_k, one_v = torch.tensor([0.07], device=DEVICE), torch.tensor([2.5], device=DEVICE)
    scales = KVScales.of(one_k.expand(hkv), one_v.expand(hkv))
    assert scales.stride_k == 0
    inter = torch.zeros(10, hkv, 2 * d, dtype=kv_dtype, device=DEVICE)
    loc = torch.tensor([3, 0, -1, 9, 10, 5], device=DEVICE)
    kv_store(k.to(DEVICE), v.to(DEVICE), inter[..., :d], inter[..., d:], loc, scales=scales)
    out = inter.cpu()
    kept = [0, 3, 5]  # tokens whose slot is in [1, 10)
    slots = [3, 9, 5]
    assert_bytes(out[slots, :, :d], quantize_kv(k[kept], torch.full((hkv,), 0.07), kv_dtype))
    assert_bytes(out[slots, :, d:], quantize_kv(v[kept], torch.full((hkv,), 2.5), kv_dtype))
    others = [s for s in range(10) if s not in slots]
    assert int(bits(out[others]).count_nonzero()) == 0


def test_kv_store_refuses_missing_or_stray_scales():
    k = torch.zeros(2, 2, 16, dtype=torch.float16, device=DEVICE)
    loc = torch.tensor([1, 2], device=DEVICE)
    fp8 = torch.zeros(4, 2, 16, dtype=torch.float8_e4m3fn, device=DEVICE)
    with pytest.raises(AssertionError, match="needs KVScales"):
        kv_store(k, k, fp8, fp8.clone(), loc)
    ones = torch.ones(2, device=DEVICE)
    with pytest.raises(AssertionError, match="k_scale must be float32"):
        kv_store(k, k, fp8, fp8.clone(), loc, scales=KVScales.of(ones.half(), ones))
    plain = torch.zeros(4, 2, 16, dtype=torch.float16, device=DEVICE)
    with pytest.raises(AssertionError, match="for an FP8 cache"):
        kv_store(k, k, plain, plain.clone(), loc, scales=KVScales.of(ones, ones))
    with pytest.raises(AssertionError, match="a cache stores k's dtype"):
        kv_store(k, k, plain.bfloat16(), plain.bfloat16(), loc)


# ----------------------------------------------------------------------------- store_attend
ONE_LAUNCH_CASES = {
    # name: (seq_lens, q_len, run_case keywords, check keywords)
    "decode": ([23, 40, 9], 1, dict(splits=1), {}),
    "decode-splits": ([23, 40, 9], 1, dict(splits=4), {}),
    # OWN_BLOCK off (a decode step of more groups than SMs): the own key as a vector all the same
    "decode-no-own-block": ([23, 40, 9], 1, dict(splits=2, config={"OWN_BLOCK": False}), {}),
    "decode-own-block": ([23, 40, 9], 1, dict(splits=2, config={"OWN_BLOCK": True}), {}),
    "no-store": ([21, 8], 1, dict(splits=2, store=False), dict(store=False)),
    "garbage-slots": ([15, 26], 1, dict(splits=2, bad_loc=True), dict(bad_loc=True)),
    "softcap-sinks": ([33, 12], 1, dict(softcap=2.0, with_sinks=True, splits=4), {}),
    # drafts: the own keys in a block of their own, after 16-key blocks (some straddle them)
    "drafts": ([75, 50, 34], 3, dict(H=4, splits=2, bad_loc=True, config={"BLOCK_N": 16}), dict(bad_loc=True)),
    "drafts-window-bf16-padded": (
        [30, 17],
        2,
        dict(H=4, Hkv=1, dtype=torch.bfloat16, window=5, splits=4, padded=2),
        dict(padded=2),
    ),
}


@FP8
@pytest.mark.parametrize("case", list(ONE_LAUNCH_CASES))
def test_store_attend_over_fp8_cache(kv_dtype, case):
    """Against float64 over what the cache holds: the stored rows must be quantize_kv's bytes
    and attention must use them (an unquantised own key would miss by the FP8 rounding, far
    above the float32 tolerance), in the model dtype's tolerance; the tickets end at zero."""
    seq_lens, q_len, kw, check_kw = ONE_LAUNCH_CASES[case]
    dtype = kw.get("dtype", torch.float32)
    scales = SCALES if kw.get("Hkv", 2) == 2 else (SCALES[0][1:], SCALES[1][:1])
    res = run_one_launch(seq_lens, q_len, kv_dtype=kv_dtype, kv_scales=scales, device=DEVICE, seed=7, **kw)
    bs = len(seq_lens)
    check_one_launch(res, dtype, bs=bs, q_len=q_len, **check_kw)


# ----------------------------------------------------------------------------- paged_attention
PAGED_CASES = {
    # name: (q_lens, seq_lens, run_case keywords); the model dtypes alternate (FP8 tiles are
    # converted to float16 and to bfloat16 by different instructions)
    "decode-store": ([1] * 4, [PAD, 9, 37, 70], dict(H=8, Hkv=2, D=64, store=True)),
    "decode-store-swa": (
        [1] * 4,
        [PAD, 9, 37, 70],
        dict(H=8, Hkv=2, D=128, dtype=torch.bfloat16, layer="swa", window=16, store=True),
    ),
    "drafts-store-swa": ([4, 4, 4], [13, PAD, 30], dict(H=8, Hkv=2, D=64, layer="swa", window=5, store=True)),
    # a group of 3: up to 5 tokens (15 rows) a request, stored from a tile of 8 tokens
    "drafts-store-group3": ([5, 3, 1], [20, 9, 40], dict(H=6, Hkv=2, D=64, layer="swa", window=8, store=True)),
    # split KV: partials scaled per kv head, merged by the combine kernel (sinks once there)
    "decode-splits-combine": (
        [1, 1, 2],
        [PAD, 80, 45],
        dict(H=8, Hkv=2, D=64, dtype=torch.bfloat16, store=True, config={"NUM_SPLITS": 3, "BLOCK_N": 16}),
    ),
    "splits-softcap-sinks": (
        [1, 2, 1],
        [33, 45, 80],
        dict(H=8, Hkv=2, D=64, layer="swa", window=50, softcap=3.0, config={"NUM_SPLITS": 4, "BLOCK_N": 16}),
    ),
    # prefill / extend tiles (64 and 128 rows, the unmasked middle phase), GQA 4:1 and 2:1
    "extend-full": ([40, 70], [50, 90], dict(H=8, Hkv=2, D=64, dtype=torch.bfloat16)),
    "extend-swa": ([5, 33], [30, 40], dict(H=8, Hkv=2, D=64, layer="swa", window=8)),
    "extend-gqa-softcap": ([37, 20], [37, 60], dict(H=4, Hkv=1, D=64, dtype=torch.bfloat16, softcap=5.0)),
}


@FP8
@pytest.mark.parametrize("case", list(PAGED_CASES))
def test_paged_attention_over_fp8_cache(kv_dtype, case):
    """Against float64 over what the cache holds, in the model dtype's tolerance; a case that
    stores the step leaves exactly quantize_kv's bytes at the step's slots and nothing else."""
    q_lens, seq_lens, kw = PAGED_CASES[case]
    kw = dict(kw)
    hkv = kw["Hkv"]
    scales = SCALES if hkv == 2 else (SCALES[0][1:], SCALES[1][:1])
    softcap = kw.pop("softcap", None)
    if softcap is not None:
        kw.update(softcap=softcap, sinks=torch.randn(kw["H"], generator=torch.Generator().manual_seed(3)))
    kw.setdefault("dtype", torch.float16)
    run_paged(q_lens, seq_lens, kv_dtype=kv_dtype, kv_scales=scales, seed=11, **kw)
