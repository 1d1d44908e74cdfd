"""paged_attention against a float64 dense masked softmax, for every mode (the machinery:
``paged_cases``): decode, extends with prefixes, verify, splits and the combine, the unmasked
interior blocks, table entries that are no keys, soft-capping and sinks, and the planner's
paged plans.
"""

import math

import pytest
import torch

from attnplug_cuda.kernels.interpret import use_interpreter

if not torch.cuda.is_available():
    use_interpreter()  # before triton is imported (tests/conftest.py also arranges this)
pytest.importorskip("triton")

from paged_cases import DEVICE, PAD, PDL, TOL, attend, run_case  # noqa: E402

from attnplug_cuda.kernels.pdl import PLAIN, PROLOGUE  # noqa: E402
from attnplug_cuda.planner import LaunchShape, paged_workspace_numel, plan_paged  # noqa: E402
from attnplug_cuda.tuning import CudaTuning  # noqa: E402

PDL_MODES = [None, PLAIN] if PDL else [None]


def plan_attention(*shape):
    """The planner's paged plan (the default tuning) for ``LaunchShape(*shape)``: requests,
    tokens, kv heads, group, head dim, max q len, max kv len, window, SMs."""
    return plan_paged(LaunchShape(*shape), CudaTuning())


@pytest.mark.parametrize(
    "H,Hkv,D,dtype,layer,window",
    [
        (2, 2, 64, torch.float16, "full", None),  # GQA ratio 1
        (8, 2, 128, torch.bfloat16, "full", None),  # GQA ratio 4
        (8, 2, 64, torch.float16, "swa", 16),
        (4, 1, 128, torch.bfloat16, "swa", 5),
        (8, 2, 64, torch.float16, "full", 16),  # a window over the full table
    ],
)
def test_decode(H, Hkv, D, dtype, layer, window):
    out, want = run_case([1] * 4, [PAD, 9, 37, 70], H=H, Hkv=Hkv, D=D, dtype=dtype, layer=layer, window=window)
    assert (out[0] == 0).all()  # the padded request (seq_len 1, row 0) reads the zero sink


@pytest.mark.parametrize("window", [None, 1, 8, 40])
@pytest.mark.parametrize("H,Hkv", [(2, 2), (8, 2)])
def test_extend_with_prefix(window, H, Hkv):
    layer = "full" if window is None else "swa"
    run_case([5, 1, 12, 7], [5, 30, 40, 27], H=H, Hkv=Hkv, D=64, window=window, layer=layer, seed=window or 0)


@pytest.mark.parametrize("window", [3, 13, 1000])  # smaller than, equal to, larger than a sequence
def test_target_verify(window):
    out, _ = run_case(
        [4, 4, 4], [13, PAD, 30], H=8, Hkv=2, D=128, dtype=torch.bfloat16, window=window, layer="swa", seed=1
    )
    # padded request: positions -3..0; the three queries with no key give zeros, never NaN
    assert (out[4:7] == 0).all() and torch.isfinite(out).all()


def test_target_verify_full_layer_via_req_to_token():
    run_case([4, 4], [6, 21], H=4, Hkv=4, D=64, layer="full", seed=2)


def test_long_extend_uses_large_tiles():
    plan = plan_attention(2, 60, 2, 4, 64, 40, 100, None, 8)
    assert plan.BLOCK_M == 128
    run_case([40, 20], [60, 20], H=8, Hkv=2, D=64, layer="full", seed=3)
    run_case([40, 20], [60, 20], H=8, Hkv=2, D=64, window=24, layer="swa", seed=4)


@pytest.mark.parametrize("layer,window", [("full", None), ("swa", 50)])
def test_split_kv_and_combine(layer, window):
    """Forced flash-decoding splits, with empty splits for the short requests."""
    cfg = {"NUM_SPLITS": 3, "BLOCK_N": 16}
    run_case([1, 1, 2], [PAD, 80, 45], H=8, Hkv=2, D=64, window=window, layer=layer, config=cfg, seed=5)


def test_heuristic_splits_a_small_batch():
    plan = plan_attention(1, 1, 1, 4, 64, 1, 600, None, 8)
    assert plan.NUM_SPLITS == 3 and plan.BLOCK_M == 16
    run_case([1], [600], H=4, Hkv=1, D=64, seed=6)


def test_prefill_splits_only_programs_that_do_not_cover_the_sms():
    """Flash tiles split the KV range only while their programs number fewer than the SMs: a
    1,024-token prompt (8 kv heads x 32 row blocks = 256 programs on 132 SMs) runs unsplit; a
    512-token chunk of a long prompt on one kv head still splits; decode tiles still split to
    about three programs an SM."""
    assert plan_attention(1, 1024, 8, 4, 128, 1024, 1024, None, 132).NUM_SPLITS == 1
    chunk = plan_attention(1, 512, 1, 4, 128, 512, 16384, None, 132)
    assert chunk.BLOCK_M == 128 and chunk.NUM_SPLITS > 1
    assert plan_attention(2, 2, 8, 4, 128, 1, 4096, None, 132).NUM_SPLITS > 1


def test_fp32():
    run_case([2, 1], [9, 20], H=4, Hkv=2, D=64, dtype=torch.float32, window=6, layer="swa", seed=8)


def test_head_dim_256():
    run_case([1, 3], [20, 9], H=4, Hkv=2, D=256, window=7, layer="swa", seed=9)


@pytest.mark.skipif(len(PDL_MODES) < 2, reason="PDL needs a GPU of compute capability >= 9.0")
def test_pdl_matches_non_pdl():
    args = ([1, 4, 2], [50, 200, 9])
    kw = dict(H=8, Hkv=2, D=128, dtype=torch.bfloat16, window=64, layer="swa", seed=10, check=False)
    for cfg in (None, {"NUM_SPLITS": 4}):
        a, _ = run_case(*args, pdl=None, config=cfg, **kw)
        b, _ = run_case(*args, pdl=PLAIN, config=cfg, **kw)
        assert torch.equal(a, b)


def test_plan_fills_an_h200_for_swa_decode():
    """bs=64, 8 kv heads, window 4096: at least a full wave of programs on 132 SMs, and the
    workspace bound covers every plan it can produce."""
    plan = plan_attention(64, 64, 8, 4, 128, 1, 32768, 4096, 132)
    assert 64 * 8 * plan.NUM_SPLITS >= 132
    for bs in (1, 2, 7, 64, 300):
        for q_len in (1, 4):
            p = plan_attention(bs, bs * q_len, 8, 4, 128, q_len, 32768, None, 132)
            if p.NUM_SPLITS > 1:
                need = bs * q_len * 32 * p.NUM_SPLITS * (128 + 2)
                assert need <= paged_workspace_numel(bs * q_len, 32, 128, CudaTuning())


def test_read_ahead_flash_tiles_settle_their_products_on_nvidia_only():
    """The flash tiles that read their slots ahead settle each key block's products
    (``PagedPlan.SETTLE``, ``CudaTuning.settle_flash_products``); no other tile does, nor any
    where the tuning turns it off (XPU's and ROCm's defaults: the inline asm is NVIDIA's)."""
    import dataclasses

    from attnplug_xpu.device import xpu_tuning

    off = dataclasses.replace(CudaTuning(), settle_flash_products=False)
    seen = set()
    for d in (64, 128, 256):
        for shape in ((1, 2048, 8, 4, d, 2048, 2048, None, 132), (1, 2048, 8, 4, d, 2048, 2048, 1024, 132),
                      (64, 64, 8, 4, d, 1, 1024, None, 132), (8, 32, 8, 4, d, 4, 1024, None, 132)):  # fmt: skip
            plan = plan_attention(*shape)
            assert plan.SETTLE == plan.SLOTS_AHEAD, (shape, plan)
            assert plan_paged(LaunchShape(*shape), off) == plan._replace(SETTLE=False)
            seen.add(plan.SETTLE)
    assert seen == {True, False}
    assert CudaTuning().settle_flash_products and not xpu_tuning().settle_flash_products


@pytest.mark.parametrize(
    "q_lens,seq_lens,window,splits",
    [
        # one request per residue of the lengths modulo BLOCK_N, so that every block edge lands
        # on a query position and on a window start somewhere
        ([1] * 17, [PAD] + list(range(40, 56)), 21, 1),  # decode
        ([2] * 16, list(range(40, 56)), 21, 1),  # verify
        ([2] * 16, list(range(40, 56)), 21, 2),  # verify, split KV
        ([5] * 16, list(range(40, 56)), None, 1),  # short extends
        ([5] * 16, list(range(40, 56)), 19, 1),
        ([30, 9, 17, 5], [70, 9, 64, 37], None, 1),  # extend: diagonal and whole interior blocks
        ([30, 9, 17, 5], [70, 41, 64, 37], 17, 3),
    ],
)
def test_unmasked_interior_blocks(q_lens, seq_lens, window, splits):
    """The loop split into masked edge blocks and unmasked interior blocks (PHASES, the
    default for large tiles) is exact at every block edge; the other tests cover the single
    masked loop."""
    cfg = {"PHASES": True, "BLOCK_N": 16, "NUM_SPLITS": splits}
    layer = "full" if window is None else "swa"
    run_case(q_lens, seq_lens, H=4, Hkv=2, D=64, window=window, layer=layer, config=cfg, seed=11)


def _dense(q, k, v, keep, sm_scale):
    """float64 attention of each query row over the key positions ``keep[t]`` (a list)."""
    T, H, D = q.shape
    G = H // k.shape[1]
    out = torch.zeros(T, H, D, dtype=torch.float64)
    for t in range(T):
        if keep[t]:
            kk = k[keep[t]].double().repeat_interleave(G, dim=1)
            vv = v[keep[t]].double().repeat_interleave(G, dim=1)
            p = torch.softmax(torch.einsum("hd,jhd->hj", q[t].double(), kk) * sm_scale, -1)
            out[t] = torch.einsum("hj,jhd->hd", p, vv)
    return out


@pytest.mark.parametrize("prefetch", [False, True], ids=["plain", "prefetch"])
@pytest.mark.parametrize("q_len,phases", [(1, False), (16, True)], ids=["decode", "extend-interior"])
def test_no_slot_entries_are_no_keys_whatever_the_sink_holds(q_len, phases, prefetch):
    """Table entries outside [1, S) (the sink 0, -1 "no slot", garbage >= S) inside a request's
    range are no keys: nothing outside the cache is read, and the sink's NaN / Inf and the
    free slots' NaN never reach an output (masked loads, not a multiplication by zero). A
    table row outside the table reads row 0: no key, zeros. ``prefetch``: the same with the
    PDL prologue's L2 prefetch over every key block (its addresses stay inside the cache)."""
    if prefetch and len(PDL_MODES) < 2:
        pytest.skip("the prefetch runs with PDL: a GPU of compute capability >= 9.0")
    pdl_kw = dict(pdl=PROLOGUE, config={"PHASES": phases, "PREFETCH": 16}) if prefetch else {}
    H, Hkv, D, S, seq = 4, 2, 64, 512, 200
    g = torch.Generator().manual_seed(3)
    k_cache = torch.full((S, Hkv, D), float("nan"), dtype=torch.float16)  # free slots: NaN
    v_cache = torch.full((S, Hkv, D), float("nan"), dtype=torch.float16)
    k_cache[0], v_cache[0] = float("inf"), float("nan")  # the sink
    slots = torch.randperm(S - 1, generator=g)[:seq] + 1
    k_cache[slots] = torch.randn(seq, Hkv, D, generator=g).half()
    v_cache[slots] = torch.randn(seq, Hkv, D, generator=g).half()
    table = torch.zeros(3, 256, dtype=torch.int32)
    table[1, :seq] = slots.int()
    holes = {10: 0, 70: -1, 90: S + 9, 120: -(2**30)}
    for p, s in holes.items():
        table[1, p] = s
    table[1, seq:] = -1  # past seq_len: never read either
    q = torch.randn(2 * q_len, H, D, generator=g).half()
    keep = [[p for p in range(seq - q_len + i + 1) if p not in holes] for i in range(q_len)] + [[]] * q_len
    want = _dense(
        q.float(), k_cache.float(), v_cache.float(), [[int(table[1, p]) for p in ks] for ks in keep], 1.0 / math.sqrt(D)
    )
    to = lambda t: t.to(DEVICE)  # noqa: E731
    out = torch.full_like(to(q), float("nan"))
    attend(
        to(q),
        to(k_cache),
        to(v_cache),
        out,
        cu_q_lens=to(torch.tensor([0, q_len, 2 * q_len], dtype=torch.int32)),
        seq_lens=to(torch.tensor([seq, seq], dtype=torch.int32)),
        table=to(table),
        rows=to(torch.tensor([1, -1], dtype=torch.int64)),  # -1: outside the table
        max_q_len=q_len,
        max_kv_len=256,
        **(pdl_kw or dict(config={"PHASES": phases})),
    )
    got = out.cpu().double()
    assert torch.isfinite(got).all(), "a masked column leaked NaN/Inf into an output"
    err = (got - want).norm() / want.norm()
    assert err <= TOL[torch.float16], f"relative error {err:.3e}"
    assert (got[q_len:] == 0).all()  # the request whose row is outside the table reads nothing


# ---------------------------------------------------------------------------- soft-cap and sinks
def _sinks(H: int, seed: int) -> torch.Tensor:
    """Sink logits of the size of real ones (GPT-OSS: around -1 .. 3), one per q head."""
    return (torch.randn(H, generator=torch.Generator().manual_seed(seed)) * 2 + 0.5).float()


_INTERIOR = {"PHASES": True, "BLOCK_N": 16}  # unmasked interior blocks between masked edge blocks
_FEATURE_CASES = {
    # id: (q_lens, seq_lens, window, layer, config, softcap, sinks)
    "decode-full-both": ([1] * 4, [PAD, 9, 37, 70], None, "full", None, 1.5, True),  # a padded request
    "decode-swa-sinks": ([1] * 4, [PAD, 9, 37, 70], 16, "swa", None, None, True),
    "extend-swa-softcap": ([5, 1, 12, 7], [5, 30, 40, 27], 8, "swa", None, 1.5, False),
    "interior-full-softcap": ([30, 9, 17, 5], [70, 41, 64, 37], None, "full", _INTERIOR, 2.0, False),
    "interior-swa-split-both": ([30, 9, 17, 5], [70, 41, 64, 37], 17, "swa", {**_INTERIOR, "NUM_SPLITS": 3}, 2.0, True),
    # KV splits: the sink joins the denominator once, in the combine kernel
    "split-full-sinks": ([1, 1, 2], [PAD, 80, 45], None, "full", {"NUM_SPLITS": 3, "BLOCK_N": 16}, None, True),
    "split-swa-both": ([1, 1, 2], [PAD, 80, 45], 50, "swa", {"NUM_SPLITS": 4, "BLOCK_N": 16}, 1.5, True),
}


@pytest.mark.parametrize("case", list(_FEATURE_CASES))
@pytest.mark.slow
def test_softcap_and_sinks_match_float64(case):
    """Soft-capped logits and sink logits against the float64 formula, in every loop shape
    (masked, unmasked interior, KV splits with the combine kernel), and they change the result
    (the case has teeth: the same inputs without them are far from the expected output)."""
    q_lens, seq_lens, window, layer, config, softcap, with_sinks = _FEATURE_CASES[case]
    H = 8
    sinks = _sinks(H, 7) if with_sinks else None
    kw = dict(H=H, Hkv=2, D=64, window=window, layer=layer, config=config, seed=21)
    out, want = run_case(q_lens, seq_lens, softcap=softcap, sinks=sinks, **kw)  # checks against float64
    out_plain, _ = run_case(q_lens, seq_lens, check=False, **kw)
    got, base = out.cpu().double(), out_plain.cpu().double()
    assert (got - base).norm() / want.norm() > 20 * TOL[torch.float16], "the feature changed nothing"
    no_key = want.norm(dim=-1) == 0  # the padded request's query: zeros, never NaN
    assert (got[no_key] == 0).all()
