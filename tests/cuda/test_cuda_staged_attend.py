"""staged_attend, the staged CUDA C++ one-launch kernel (``csrc/staged_attend.cu``).

Without a GPU (CI): its plan (splits and the keys a CTA stages at once) for the shapes the
backend meets, what it serves, the routing rule, and the backend's choice: ``store_attend`` by
default, and where ``ATTNPLUG_ONE_LAUNCH=cpp`` cannot be served, naming why.

On a GPU with the C++ extension: the cases of ``one_launch_cases`` against float64 in fp16 /
bf16 at head dims 64 and 128 (full and windowed tables, 1 to 16 splits including empty
ones, several passes of a CTA, the step's own tokens in any pass, padded requests, garbage
store slots, ``loc=None``, soft-capping and sinks, 16-row draft steps, a loose host bound),
PDL with the prologue bit-identical to PDL off, graph replays equal to eager launches, and
clear errors for what it does not serve.
"""

import functools

import pytest
import torch

from attnplug_cuda.staged_attend import (
    MAX_ROWS,
    max_capacity,
    plan_staged_attend,
    resident_capacity,
    serves,
    serves_layers,
    staged_attend,
    workspace_numel,
)

SMS = 132  # an H100 / H200


def test_plan_for_the_backend_shapes():
    plan = functools.partial(plan_staged_attend, num_kv_heads=8, head_dim=128, num_sms=SMS)
    resident = {"splits": 1, "capacity": 256, "resident": 1}
    # decode, a window of 256: one CTA per group holds the 255 cached keys in registers
    assert plan(num_reqs=1, max_q_len=1, max_kv_len=1088, window=256) == resident
    # 4 drafts: still 255 cached keys (the step's own 4 are loaded after the wait)
    assert plan(num_reqs=1, max_q_len=4, max_kv_len=1088, window=256) == resident
    assert plan(num_reqs=8, max_q_len=1, max_kv_len=1088, window=256) == resident
    # a short context without a window: 256 cached keys at most
    assert plan(num_reqs=1, max_q_len=1, max_kv_len=257, window=None) == resident
    assert plan(num_reqs=1, max_q_len=1, max_kv_len=258, window=None)["resident"] == 0
    assert plan(num_reqs=1, max_q_len=1, max_kv_len=1088, window=258)["resident"] == 0
    # a full layer at bs 1: 1088 keys (the host bound) over the fewest CTAs that stage them
    assert plan(num_reqs=1, max_q_len=1, max_kv_len=1088, window=None) == {"splits": 3, "capacity": 384, "resident": 0}
    # bs 8: 64 groups leave room for 2 CTAs each; 544 keys a CTA run in two passes
    assert plan(num_reqs=8, max_q_len=1, max_kv_len=1088, window=None) == {"splits": 2, "capacity": 384, "resident": 0}
    # more groups than SMs: one CTA each, several passes
    assert plan(num_reqs=32, max_q_len=1, max_kv_len=4096, window=None)["splits"] == 1
    # head dim 64 stages up to 512 keys and holds up to 512 in registers
    plan64 = functools.partial(plan_staged_attend, num_reqs=1, num_kv_heads=8, head_dim=64, max_q_len=1, num_sms=SMS)
    assert plan64(max_kv_len=1088, window=None) == {"splits": 3, "capacity": 384, "resident": 0}
    assert plan64(max_kv_len=1088, window=512) == {"splits": 1, "capacity": 512, "resident": 1}
    assert max_capacity(64) == 512 and max_capacity(128) == 384
    assert resident_capacity(64) == 512 and resident_capacity(128) == 256


def test_what_it_serves():
    assert serves_layers(torch.bfloat16, 128) and serves_layers(torch.float16, 64)
    assert not serves_layers(torch.float32, 128) and not serves_layers(torch.bfloat16, 256)
    assert serves(torch.bfloat16, 128, 4, 4) and MAX_ROWS == 16
    assert not serves(torch.bfloat16, 128, 5, 4)  # 20 rows: more than one MMA tile
    # the split workspace: m and l in fp32, the partial output in 16 bits, per CTA and row
    assert workspace_numel(3, 128) == 3 * 16 * (2 + 64)


def test_routing_rule():
    from attnplug_cuda.staged_attend import takes_layer

    shape = dict(num_kv_heads=8, head_dim=128, max_q_len=1, max_kv_len=1088, num_sms=SMS)
    assert takes_layer(num_reqs=8, window=None, **shape)  # 64 groups x 2 splits = 128 of 132 SMs
    assert not takes_layer(num_reqs=1, window=None, **shape)  # 8 groups x 3 splits
    assert not takes_layer(num_reqs=1, window=300, **shape)  # 299 cached keys: 8 groups x 1 split
    # a window whose cached keys fit one CTA's registers (the resident kernel): taken for steps
    # of several tokens a request once the groups cover half of FILL of the SMs
    drafts = dict(shape, max_q_len=4)
    assert takes_layer(num_reqs=8, window=256, **drafts)  # 64 groups
    assert not takes_layer(num_reqs=4, window=256, **drafts)  # 32 groups
    assert not takes_layer(num_reqs=8, window=256, **shape)  # decode
    assert not takes_layer(num_reqs=16, window=256, **shape)  # decode, 128 groups


def test_backend_chooses_store_attend_unless_asked_and_says_why(monkeypatch):
    from attnplug.memory import ReqToTokenPool, SWAKVPool
    from attnplug_cuda.backend import CudaBackend

    if torch.cuda.is_available():
        pytest.skip("builds on the CPU pool of the interpreter")

    def backend(dtype=torch.float16):
        pool = SWAKVPool(64, 32, 2, [0], 2, 64, dtype, "cpu")
        return CudaBackend(pool, ReqToTokenPool(4, 32, "cpu"), num_heads=4, sliding_window=8)

    monkeypatch.delenv("ATTNPLUG_ONE_LAUNCH", raising=False)
    b = backend()
    assert b.one_launch_impl == "triton" and b._staged_attend is None
    assert b.one_launch_reason.startswith("default")
    monkeypatch.setenv("ATTNPLUG_ONE_LAUNCH", "cpp")  # asked, but no C++ extension on this machine
    b = backend()
    assert b.one_launch_impl == "triton" and "unavailable" in b.one_launch_reason
    b = backend(torch.float32)  # not served by the staged kernel at all
    assert b.one_launch_impl == "triton" and "not served" in b.one_launch_reason


# --------------------------------------------------------------------------- on a GPU


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

    device = torch.device("cuda")

    def plan(group, **shape):
        return plan_staged_attend(**shape, num_sms=num_sms(device))

    def staged(*args, config=None, **kwargs):  # the staged kernel, also where the resident one would serve
        return staged_attend(*args, config=dict({"resident": 0}, **(config or {})), **kwargs)

    return functools.partial(
        _run_case, attend=staged, plan=plan, split_key="splits", device=device, pdl=pdl_supported(device)[0]
    )


def _check(*args, **kwargs):
    from one_launch_cases import check

    check(*args, **kwargs)


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("splits", [1, 2, 3, 8])
@pytest.mark.parametrize("window", [None, 6])
def test_decode_matches_exact_attention(run_case, D, splits, window):
    res = run_case([23, 40, 9], 1, D=D, dtype=torch.bfloat16, window=window, splits=splits, seed=splits)
    _check(res, torch.bfloat16, bs=3, q_len=1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_two_new_tokens_half_precision_with_padding(run_case, dtype):
    res = run_case([30, 17], 2, H=4, Hkv=1, dtype=dtype, window=5, splits=4, padded=2, seed=3)
    _check(res, dtype, bs=2, q_len=2, padded=2)


@pytest.mark.parametrize("splits", [1, 4])
def test_softcap_and_sinks(run_case, splits):
    res = run_case([33, 12], 1, dtype=torch.float16, softcap=2.0, with_sinks=True, splits=splits, seed=5)
    _check(res, torch.float16, bs=2, q_len=1)
    plain = run_case([33, 12], 1, dtype=torch.float16, splits=splits, seed=5)[0]
    assert (res[0].float() - plain.float()).abs().max() > 1e-2, "softcap + sinks must change the output"


def test_without_store_reads_every_key_from_the_cache(run_case):
    res = run_case([21, 8], 1, dtype=torch.float16, splits=2, store=False, seed=7)
    _check(res, torch.float16, bs=2, q_len=1, store=False)


@pytest.mark.parametrize("splits", [1, 2])
def test_several_passes_with_the_step_tokens_in_any_pass(run_case, splits):
    # 128 keys a pass: 300 keys take three passes in one CTA (two in each of two), the step's
    # 3 tokens sit in the last pass, straddle two (129 + 128 = 257: tokens 255..257) or fall in
    # the first (34); the first token's store slot is garbage while the table names its real
    # slot, which holds NaN: a pass that read a new token from the cache would show it
    res = run_case(
        [300, 258, 34],
        3,
        H=4,
        Hkv=2,
        D=128,
        dtype=torch.bfloat16,
        splits=splits,
        bad_loc=True,
        seed=19,
        config={"capacity": 128},
    )
    _check(res, torch.bfloat16, bs=3, q_len=3, bad_loc=True)


def test_many_splits_merge_in_order_with_empty_splits(run_case):
    # 16 splits over 23 / 40 / 9 keys: most are empty (m = -1e30, l = 0); the sink joins once
    res = run_case([23, 40, 9], 1, dtype=torch.float16, splits=16, with_sinks=True, seed=11)
    _check(res, torch.float16, bs=3, q_len=1)


@pytest.mark.parametrize("splits,capacity", [(1, 384), (1, 128), (5, 128)])
def test_draft_rows(run_case, splits, capacity):
    # 4 drafts x 4 q heads per kv head: 16 rows, one MMA tile; causal within the step's tokens
    res = run_case(
        [300, 97],
        4,
        D=128,
        dtype=torch.bfloat16,
        window=70,
        splits=splits,
        with_sinks=True,
        seed=17,
        config={"capacity": capacity},
    )
    _check(res, torch.bfloat16, bs=2, q_len=4)


def test_a_loose_host_bound(run_case):
    # the host bound (4096) is 16x the real length: the splits are cut from the real length
    keep: dict = {}
    res = run_case([256], 1, D=128, dtype=torch.bfloat16, max_kv_len=4096, seed=13, keep=keep)
    _check(res, torch.bfloat16, bs=1, q_len=1)
    assert keep["plan"]["splits"] > 1


def test_pdl_and_prologue_are_bit_identical_to_plain_launches(run_case):
    from attnplug_cuda.kernels import pdl_supported

    if not pdl_supported(torch.device("cuda"))[0]:
        pytest.skip("no PDL on this device")
    args = ([200, 31], 2)
    kw = dict(H=8, Hkv=2, D=128, dtype=torch.bfloat16, window=64, splits=3, seed=23)
    plain = run_case(*args, **kw, pdl=False)[0]
    early = run_case(*args, **kw, pdl=True, prologue=True)[0]
    assert torch.equal(plain, early)


def test_graph_replays_equal_eager_launches():
    _ext_or_skip()
    from attnplug_cuda.kernels import pdl_supported

    dev = torch.device("cuda")
    pdl = pdl_supported(dev)[0]
    g = torch.Generator(device=dev).manual_seed(0)
    bs, Hkv, G, D, S = 3, 2, 4, 128, 4096
    kc = torch.randn(S, Hkv, D, generator=g, device=dev).bfloat16()
    vc = torch.randn(S, Hkv, D, generator=g, device=dev).bfloat16()
    table = torch.randperm(S - 1, generator=g, device=dev)[: bs * 600].view(bs, 600).int() + 1
    q = torch.randn(bs, Hkv * G, D, generator=g, device=dev).bfloat16()
    k = torch.randn(bs, Hkv, D, generator=g, device=dev).bfloat16()
    v = torch.randn(bs, Hkv, D, generator=g, device=dev).bfloat16()
    loc = table[:, 599].clone()
    seq_lens = torch.full((bs,), 600, dtype=torch.int32, device=dev)
    kw = dict(
        cu_q_lens=torch.arange(bs + 1, dtype=torch.int32, device=dev),
        seq_lens=seq_lens,
        table=table,
        table_rows=torch.arange(bs, dtype=torch.int32, device=dev),
        max_q_len=1,
        max_kv_len=600,
        workspace=torch.empty(workspace_numel(1024, D), dtype=torch.float32, device=dev),
        tickets=torch.zeros(bs * Hkv, dtype=torch.int32, device=dev),
        pdl=pdl,
        config={"splits": 4},
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
        for _ in range(3):  # three layers' launches back to back, reusing the tickets
            staged_attend(q, k, v, loc, kc, vc, out, **kw)
    for _ in range(4):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
    assert int(kw["tickets"].abs().sum()) == 0


def test_unserved_arguments_name_the_problem():
    _ext_or_skip()
    dev = torch.device("cuda")
    q = torch.zeros(1, 4, 128, dtype=torch.bfloat16, device=dev)
    kc = torch.zeros(8, 1, 128, dtype=torch.bfloat16, device=dev)
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
    k = torch.zeros(1, 1, 128, dtype=torch.bfloat16, device=dev)
    with pytest.raises(RuntimeError, match="capacity is not a multiple of 128"):
        staged_attend(q, k, k, None, kc, kc.clone(), torch.empty_like(q), config={"capacity": 100, "resident": 0}, **kw)
    with pytest.raises(AssertionError, match="staged_attend serves float16/bfloat16"):
        staged_attend(q.float(), k.float(), k.float(), None, kc.float(), kc.float(), q.float(), **kw)
    with pytest.raises(RuntimeError, match="workspace has"):
        kw["workspace"] = torch.empty(8, dtype=torch.float32, device=dev)
        staged_attend(q, k, k, None, kc, kc.clone(), torch.empty_like(q), config={"splits": 2, "resident": 0}, **kw)
