"""The resident kernel (``csrc/resident_attend.cu``): ``staged_attend`` with the plan's
``resident`` key, one CTA a (request, kv head) group holding its cached keys in registers.

On a GPU with the C++ extension: the cases of ``one_launch_cases`` against float64 in fp16 /
bf16 at head dims 64 and 128 — windows up to the capacity (256 at head dim 128, 512 at 64),
full layers of short contexts, every warp's keys partly or wholly masked, padded requests,
garbage store slots, ``loc=None``, soft-capping and sinks, 16-row draft steps whose own keys
fill a whole 16-key step — PDL with the prologue bit-identical to PDL off, graph replays
equal to eager launches, and clear errors for what it does not serve. Without a GPU the plan
is tested with the staged kernel's (``test_cuda_staged_attend``).
"""

import functools

import pytest
import torch

from attnplug_cuda.staged_attend import resident_capacity, staged_attend, workspace_numel


def _ext_or_skip():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from attnplug_cuda.cpp_ext import cpp_ext_status, try_load_ext

    if try_load_ext() is None:
        pytest.skip(f"the C++ extension is unavailable: {cpp_ext_status()[1]}")


@pytest.fixture(scope="module")
def run_case():
    _ext_or_skip()
    from one_launch_cases import run_case as _run_case

    from attnplug_cuda.kernels import pdl_supported
    from attnplug_cuda.kernels.store_attend import num_sms
    from attnplug_cuda.staged_attend import plan_staged_attend

    device = torch.device("cuda")

    def plan(group, **shape):
        return plan_staged_attend(**shape, num_sms=num_sms(device))

    def run(*args, **kwargs):  # fails unless the plan takes the resident kernel
        keep = kwargs.setdefault("keep", {})
        out = _run_case(*args, **kwargs)
        assert keep["plan"]["resident"] == 1, f"the plan did not take the resident kernel: {keep['plan']}"
        return out

    return functools.partial(
        run, attend=staged_attend, plan=plan, split_key="splits", device=device, pdl=pdl_supported(device)[0]
    )


def _check(*args, **kwargs):
    from one_launch_cases import check

    check(*args, **kwargs)


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("window", [None, 6, 40])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_matches_exact_attention(run_case, D, window, dtype):
    # 3 requests of 23 / 40 / 9 keys: most warps hold no key, the last ones part of a tile
    res = run_case([23, 40, 9], 1, D=D, dtype=dtype, window=window, seed=D + (window or 0))
    _check(res, dtype, bs=3, q_len=1)


@pytest.mark.parametrize("D", [64, 128])
def test_windows_at_the_capacity(run_case, D):
    # the window's cached keys fill every warp's registers: 255 at head dim 128, 511 at 64;
    # requests shorter than the window, and one whose window starts past its first key
    cap = resident_capacity(D)
    res = run_case([cap + 300, cap, 100], 1, H=8, Hkv=2, D=D, dtype=torch.bfloat16, window=cap, seed=3)
    _check(res, torch.bfloat16, bs=3, q_len=1)


def test_a_full_layer_of_a_short_context(run_case):
    # no window: up to 256 cached keys (the table's width bounds them)
    res = run_case([257, 130], 1, D=128, dtype=torch.bfloat16, max_kv_len=257, seed=5)
    _check(res, torch.bfloat16, bs=2, q_len=1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_two_new_tokens_half_precision_with_padding(run_case, dtype):
    res = run_case([30, 17], 2, H=4, Hkv=1, dtype=dtype, window=5, padded=2, seed=3)
    _check(res, dtype, bs=2, q_len=2, padded=2)


def test_softcap_and_sinks(run_case):
    res = run_case([33, 12], 1, dtype=torch.float16, window=32, softcap=2.0, with_sinks=True, seed=5)
    _check(res, torch.float16, bs=2, q_len=1)
    plain = run_case([33, 12], 1, dtype=torch.float16, window=32, seed=5)[0]
    assert (res[0].float() - plain.float()).abs().max() > 1e-2, "softcap + sinks must change the output"


def test_without_store_reads_every_key_from_the_cache(run_case):
    res = run_case([21, 300], 1, D=128, dtype=torch.float16, window=200, store=False, seed=7)
    _check(res, torch.float16, bs=2, q_len=1, store=False)


def test_garbage_store_slots_are_skipped(run_case):
    # the first token's store slot is below 1, the last one's past the cache; the table names
    # the real slots, which hold NaN: reading a new token from the cache would show
    res = run_case([300, 258, 34], 3, H=4, Hkv=2, D=128, dtype=torch.bfloat16, window=256, bad_loc=True, seed=19)
    _check(res, torch.bfloat16, bs=3, q_len=3, bad_loc=True)


@pytest.mark.parametrize("q_len,group", [(4, 4), (16, 1), (2, 8)])
def test_draft_rows(run_case, q_len, group):
    # 16 rows (one MMA tile); causal within the step's tokens; 16 own keys fill warp 7's
    # extra 16-key step
    H = 2 * group
    res = run_case(
        [300, 97], q_len, H=H, Hkv=2, D=128, dtype=torch.bfloat16, window=256, with_sinks=True, seed=17 + q_len
    )
    _check(res, torch.bfloat16, bs=2, q_len=q_len)


def test_pdl_and_prologue_are_bit_identical_to_plain_launches(run_case):
    from attnplug_cuda.kernels import pdl_supported

    if not pdl_supported(torch.device("cuda"))[0]:
        pytest.skip("no PDL on this device")
    args = ([200, 31], 2)
    kw = dict(H=8, Hkv=2, D=128, dtype=torch.bfloat16, window=64, seed=23)
    plain = run_case(*args, **kw, pdl=False)[0]
    early = run_case(*args, **kw, pdl=True, prologue=True)[0]
    assert torch.equal(plain, early)


def test_graph_replays_equal_eager_launches():
    _ext_or_skip()
    from attnplug_cuda.kernels import pdl_supported

    dev = torch.device("cuda")
    pdl = pdl_supported(dev)[0]
    g = torch.Generator(device=dev).manual_seed(0)
    bs, Hkv, G, D, S, W = 3, 2, 4, 128, 4096, 256
    kc = torch.randn(S, Hkv, D, generator=g, device=dev).bfloat16()
    vc = torch.randn(S, Hkv, D, generator=g, device=dev).bfloat16()
    table = torch.randperm(S - 1, generator=g, device=dev)[: bs * 600].view(bs, 600).int() + 1
    q = torch.randn(bs, Hkv * G, D, generator=g, device=dev).bfloat16()
    k = torch.randn(bs, Hkv, D, generator=g, device=dev).bfloat16()
    v = torch.randn(bs, Hkv, D, generator=g, device=dev).bfloat16()
    loc = table[:, 599].clone()
    kw = dict(
        cu_q_lens=torch.arange(bs + 1, dtype=torch.int32, device=dev),
        seq_lens=torch.full((bs,), 600, dtype=torch.int32, device=dev),
        table=table,
        table_rows=torch.arange(bs, dtype=torch.int32, device=dev),
        max_q_len=1,
        max_kv_len=600,
        window=W,
        workspace=torch.empty(workspace_numel(1024, D), dtype=torch.float32, device=dev),
        tickets=torch.zeros(bs * Hkv, dtype=torch.int32, device=dev),
        pdl=pdl,
        prologue=pdl,
        release_early=pdl,
    )
    eager = staged_attend(q, k, v, loc, kc, vc, torch.empty_like(q), **kw).clone()
    out = torch.empty_like(q)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        staged_attend(q, k, v, loc, kc, vc, out, **kw)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(3):  # three layers' launches back to back
            staged_attend(q, k, v, loc, kc, vc, out, **kw)
    for _ in range(4):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)


def test_unserved_arguments_name_the_problem():
    _ext_or_skip()
    dev = torch.device("cuda")
    q = torch.zeros(1, 4, 128, dtype=torch.bfloat16, device=dev)
    kc = torch.zeros(8, 1, 128, dtype=torch.bfloat16, device=dev)
    k = torch.zeros(1, 1, 128, dtype=torch.bfloat16, device=dev)
    kw = dict(
        cu_q_lens=torch.tensor([0, 1], dtype=torch.int32, device=dev),
        seq_lens=torch.tensor([3], dtype=torch.int32, device=dev),
        table=torch.tensor([[1, 2, 3]], dtype=torch.int32, device=dev),
        table_rows=torch.tensor([0], dtype=torch.int32, device=dev),
        max_q_len=1,
        max_kv_len=3,
        workspace=torch.empty(4096, dtype=torch.float32, device=dev),
        tickets=torch.zeros(4, dtype=torch.int32, device=dev),
    )
    with pytest.raises(RuntimeError, match="the resident kernel runs one CTA a group"):
        staged_attend(q, k, k, None, kc, kc.clone(), torch.empty_like(q), config={"splits": 2}, **kw)
    with pytest.raises(RuntimeError, match="the resident kernel's capacity"):
        staged_attend(q, k, k, None, kc, kc.clone(), torch.empty_like(q), config={"capacity": 384}, **kw)
