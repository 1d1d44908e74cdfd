"""paged_attention against a float64 dense masked softmax, for every mode.

Each case builds per-request K/V histories, scatters them into a full cache (through
``req_to_token``) and into an SWA cache (through ``full_to_swa_index_mapping``; positions
the window can no longer reach hold NaN there, so reading one would show), builds the step's
tables with ``step_metadata`` and runs the kernel as a full layer (``table=req_to_token``)
or as an SWA layer (``table=swa_window_table``, ``table_start=window_start``).
"""

import math
from typing import List, Optional

import pytest
import torch

from attnplug_cuda.kernels import load_kernels, pdl_supported  # noqa: E402
from attnplug_cuda.kernels.interpret import use_interpreter  # noqa: E402

if not torch.cuda.is_available():
    use_interpreter()  # before triton is imported (tests/conftest.py also arranges this)
pytest.importorskip("triton")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PDL_MODES = [False, True] if pdl_supported(DEVICE)[0] else [False]
K = load_kernels()
from attnplug_cuda.kernels.paged_attention import plan_attention  # noqa: E402

TOL = {torch.float16: 4e-3, torch.bfloat16: 2e-2, torch.float32: 1e-5}
PAD = -1  # a seq_len entry of PAD marks a padded request: seq_len 1, req row 0


def reference(q, hist_k, hist_v, q_lens, seq_lens, window, sm_scale, softcap=None, sinks=None):
    """float64 dense masked softmax; a query with no valid key gives zeros. ``softcap``:
    logits ``c * tanh(s / c)``; ``sinks`` ([H]): one more logit per head, in the denominator only."""
    T, H, D = q.shape
    out = torch.zeros(T, H, D, dtype=torch.float64)
    qd = q.cpu().double()
    t = 0
    for kh, vh, n, s in zip(hist_k, hist_v, q_lens, seq_lens):
        hkv = kh.shape[1]
        kk = kh.double().repeat_interleave(H // hkv, dim=1)
        vv = vh.double().repeat_interleave(H // hkv, dim=1)
        for i in range(n):
            p = s - n + i
            lo = 0 if window is None else max(0, p - window + 1)
            if p >= 0:
                logits = torch.einsum("hd,jhd->hj", qd[t], kk[lo : p + 1]) * sm_scale
                if softcap is not None:
                    logits = softcap * torch.tanh(logits / softcap)
                if sinks is not None:
                    probs = torch.softmax(torch.cat([logits, sinks.double()[:, None]], -1), -1)[:, :-1]
                else:
                    probs = torch.softmax(logits, -1)
                out[t] = torch.einsum("hj,jhd->hd", probs, vv[lo : p + 1])
            t += 1
    return out


def run_case(
    q_lens: List[int],
    seq_lens: List[int],
    *,
    H: int,
    Hkv: int,
    D: int,
    dtype=torch.float16,
    window: Optional[int] = None,
    layer: str = "full",
    config: Optional[dict] = None,
    pdl: bool = False,
    seed: int = 0,
    check: bool = True,
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
    store: bool = False,
    bad_locs: Optional[List[int]] = None,
    **kernel_kw,
):
    """One paged_attention call against float64. ``store``: the new tokens' cache rows hold
    NaN before the call and the kernel stores them itself (``k``, ``v``, ``loc``); the cache
    after the call must equal the cache with the rows written, nothing else changed.
    ``bad_locs``: slot values for the first ``len(bad_locs)`` new tokens of the last request
    (garbage the kernel must skip; their keys stay out of the reference too)."""
    g = torch.Generator().manual_seed(seed)
    bs = len(q_lens)
    padded = [s == PAD for s in seq_lens]
    seq = [1 if p else s for p, s in zip(padded, seq_lens)]
    size = sum(s for s, p in zip(seq, padded) if not p) + 8
    max_ctx = max(seq) + 3
    # full pool: slot 0 is the sink (zeros: padded tokens' junk is finite)
    k_full = torch.zeros(size, Hkv, D, dtype=dtype)
    v_full = torch.zeros(size, Hkv, D, dtype=dtype)
    k_swa = torch.full((size, Hkv, D), float("nan"), dtype=dtype)
    v_swa = torch.full((size, Hkv, D), float("nan"), dtype=dtype)
    k_swa[0] = 0
    v_swa[0] = 0
    mapping = torch.zeros(size + 2, dtype=torch.int32)
    mapping[1:size] = (torch.randperm(size - 1, generator=g) + 1).int()
    mapping[-1] = -1
    req_to_token = torch.zeros(bs + 2, max_ctx, dtype=torch.int32)
    rows = (torch.randperm(bs + 1, generator=g)[:bs] + 1).tolist()  # shuffled, never row 0
    free = (torch.randperm(size - 1, generator=g) + 1).tolist()
    hist_k, hist_v, locs = [], [], []
    for b in range(bs):
        s, n = seq[b], q_lens[b]
        if padded[b]:
            rows[b] = 0
            hist_k.append(torch.zeros(1, Hkv, D, dtype=dtype))
            hist_v.append(torch.zeros(1, Hkv, D, dtype=dtype))
            locs.append(torch.zeros(n, dtype=torch.int64))
            continue
        slots = torch.tensor([free.pop() for _ in range(s)])
        req_to_token[rows[b], :s] = slots.int()
        kh = torch.randn(s, Hkv, D, generator=g).to(dtype)
        vh = torch.randn(s, Hkv, D, generator=g).to(dtype)
        hist_k.append(kh)
        hist_v.append(vh)
        k_full[slots], v_full[slots] = kh, vh
        reach = 0 if window is None else max(0, s - n - window + 1)  # first position any query sees
        swa_slots = mapping[slots].long()
        k_swa[swa_slots[reach:]], v_swa[swa_slots[reach:]] = kh[reach:], vh[reach:]
        locs.append(slots[s - n :])
    T = sum(q_lens)
    q = torch.randn(T, H, D, generator=g).to(dtype)
    cache_k, cache_v = (k_full, v_full) if layer == "full" else (k_swa, v_swa)
    store_args = {}
    if store:
        # the rows the step stores, and its slots in the layer's pool (SWA: translated)
        def step_rows(hist):  # the last n rows of each history (zeros for a padded request)
            return torch.cat(
                [h.new_zeros(n, Hkv, D) if p else h[h.shape[0] - n :] for h, n, p in zip(hist, q_lens, padded)]
            )

        k_new, v_new = step_rows(hist_k), step_rows(hist_v)
        loc = torch.cat(locs)
        if layer != "full":
            loc = torch.where(loc > 0, mapping[loc].long(), loc).int()
        want_k, want_v = cache_k.clone(), cache_v.clone()
        live = loc > 0
        cache_k[loc[live].long()] = float("nan")  # read back unstored, they would show
        cache_v[loc[live].long()] = float("nan")
        first = T - q_lens[-1]
        for i, bad in enumerate(bad_locs or []):
            slot = loc[first + i].long()
            want_k[slot] = want_v[slot] = float("nan")  # never stored: stays as set above
            loc[first + i] = bad
        store_args = dict(k=k_new.to(DEVICE), v=v_new.to(DEVICE), loc=loc.to(DEVICE))

    to = lambda t: t.to(DEVICE)  # noqa: E731
    rpi = torch.tensor(rows, dtype=torch.int64, device=DEVICE)
    seq_t = torch.tensor(seq, dtype=torch.int32, device=DEVICE)
    max_q = max(q_lens)
    width = max_q + (window - 1 if window is not None else max_ctx)
    cu = torch.empty(bs + 1, dtype=torch.int32, device=DEVICE)
    ws = torch.empty(bs, dtype=torch.int32, device=DEVICE)
    table = torch.empty(bs, width, dtype=torch.int32, device=DEVICE)
    K.step_metadata(
        rpi,
        seq_t,
        torch.tensor(q_lens, device=DEVICE),
        to(torch.cat(locs)),
        cu_q_lens=cu,
        window_start=ws,
        token_pos=torch.empty(T, dtype=torch.int32, device=DEVICE),
        full_to_swa_index_mapping=to(mapping),
        swa_out_cache_loc=torch.empty(T, dtype=torch.int32, device=DEVICE),
        req_to_token=to(req_to_token),
        swa_window_table=table if window is not None else None,
        window=window,
    )
    out = torch.full((T, H, D), float("nan"), dtype=dtype, device=DEVICE)
    common = dict(cu_q_lens=cu, seq_lens=seq_t, max_q_len=max_q, window=window, config=config, pdl=pdl)
    if softcap is not None:
        common["softcap"] = softcap
    if sinks is not None:
        common["sinks"] = sinks.to(DEVICE)
    common.update(store_args, **kernel_kw)
    dev_k, dev_v = to(cache_k), to(cache_v)
    if layer == "full":
        K.paged_attention(
            to(q), dev_k, dev_v, out, table=to(req_to_token), table_rows=rpi, max_kv_len=max_ctx, **common
        )
    else:
        assert window is not None
        K.paged_attention(
            to(q),
            dev_k,
            dev_v,
            out,
            table=table,
            table_rows=torch.arange(bs, dtype=torch.int32, device=DEVICE),
            table_start=ws,
            max_kv_len=max_ctx,
            **common,
        )
    want = reference(q, hist_k, hist_v, q_lens, seq, window, 1.0 / math.sqrt(D), softcap, sinks)
    if store:
        torch.testing.assert_close(dev_k.cpu(), want_k, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(dev_v.cpu(), want_v, rtol=0, atol=0, equal_nan=True)
    if check:
        got = out.cpu().double()
        assert torch.isfinite(got).all(), "non-finite output"
        err = (got - want).norm() / want.norm().clamp_min(1e-30)
        assert err <= TOL[dtype], f"relative error {err:.3e} > {TOL[dtype]:.0e}"
    return out, want


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
    plan = plan_attention(
        num_reqs=2,
        num_tokens=60,
        num_kv_heads=2,
        group=4,
        head_dim=64,
        max_q_len=40,
        max_kv_len=100,
        window=None,
        num_sms=8,
    )
    assert plan["BLOCK_M"] == 128
    run_case([40, 20], [60, 20], H=8, Hkv=2, D=64, layer="full", seed=3)
    run_case([40, 20], [60, 20], H=8, Hkv=2, D=64, window=24, layer="swa", seed=4)


@pytest.mark.parametrize("layer,window", [("full", None), ("swa", 50)])
def test_split_kv_and_combine(layer, window):
    """Forced flash-decoding splits, with empty splits for the short requests."""
    cfg = {"num_splits": 3, "BLOCK_N": 16}
    run_case([1, 1, 2], [PAD, 80, 45], H=8, Hkv=2, D=64, window=window, layer=layer, config=cfg, seed=5)


def test_heuristic_splits_a_small_batch():
    plan = plan_attention(
        num_reqs=1,
        num_tokens=1,
        num_kv_heads=1,
        group=4,
        head_dim=64,
        max_q_len=1,
        max_kv_len=600,
        window=None,
        num_sms=8,
    )
    assert plan["num_splits"] == 3 and plan["BLOCK_M"] == 16
    run_case([1], [600], H=4, Hkv=1, D=64, seed=6)


def test_fp32():
    run_case([2, 1], [9, 20], H=4, Hkv=2, D=64, dtype=torch.float32, window=6, layer="swa", seed=8)


def test_head_dim_256():
    run_case([1, 3], [20, 9], H=4, Hkv=2, D=256, window=7, layer="swa", seed=9)


@pytest.mark.skipif(len(PDL_MODES) < 2, reason="PDL needs a GPU of compute capability >= 9.0")
def test_pdl_matches_non_pdl():
    args = ([1, 4, 2], [50, 200, 9])
    kw = dict(H=8, Hkv=2, D=128, dtype=torch.bfloat16, window=64, layer="swa", seed=10, check=False)
    for cfg in (None, {"num_splits": 4}):
        a, _ = run_case(*args, pdl=False, config=cfg, **kw)
        b, _ = run_case(*args, pdl=True, config=cfg, **kw)
        assert torch.equal(a, b)


def test_plan_fills_an_h200_for_swa_decode():
    """bs=64, 8 kv heads, window 4096: at least a full wave of programs on 132 SMs, and the
    workspace bound covers every plan it can produce."""
    plan = plan_attention(
        num_reqs=64,
        num_tokens=64,
        num_kv_heads=8,
        group=4,
        head_dim=128,
        max_q_len=1,
        max_kv_len=32768,
        window=4096,
        num_sms=132,
    )
    assert 64 * 8 * plan["num_splits"] >= 132
    for bs in (1, 2, 7, 64, 300):
        for q_len in (1, 4):
            p = plan_attention(
                num_reqs=bs,
                num_tokens=bs * q_len,
                num_kv_heads=8,
                group=4,
                head_dim=128,
                max_q_len=q_len,
                max_kv_len=32768,
                window=None,
                num_sms=132,
            )
            if p["num_splits"] > 1:
                need = bs * q_len * 32 * p["num_splits"] * (128 + 2)
                assert need <= K.workspace_numel(bs * q_len, 32, 128)


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
    cfg = {"PHASES": True, "BLOCK_N": 16, "num_splits": splits}
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
    pdl_kw = dict(pdl=True, prologue=True, config={"PHASES": phases, "PREFETCH": 16}) if prefetch else {}
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
    K.paged_attention(
        to(q),
        to(k_cache),
        to(v_cache),
        out,
        cu_q_lens=to(torch.tensor([0, q_len, 2 * q_len], dtype=torch.int32)),
        seq_lens=to(torch.tensor([seq, seq], dtype=torch.int32)),
        table=to(table),
        table_rows=to(torch.tensor([1, -1], dtype=torch.int64)),  # -1: outside the table
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
    "interior-swa-split-both": ([30, 9, 17, 5], [70, 41, 64, 37], 17, "swa", {**_INTERIOR, "num_splits": 3}, 2.0, True),
    # KV splits: the sink joins the denominator once, in the combine kernel
    "split-full-sinks": ([1, 1, 2], [PAD, 80, 45], None, "full", {"num_splits": 3, "BLOCK_N": 16}, None, True),
    "split-swa-both": ([1, 1, 2], [PAD, 80, 45], 50, "swa", {"num_splits": 4, "BLOCK_N": 16}, 1.5, True),
}


@pytest.mark.parametrize("case", list(_FEATURE_CASES))
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


STORE_CASES = [
    # (q_lens, seq_lens, H, Hkv, D, dtype, layer, window, config)
    ([1] * 4, [PAD, 9, 37, 70], 8, 2, 64, torch.float16, "full", None, None),  # decode
    ([1] * 4, [PAD, 9, 37, 70], 8, 2, 128, torch.bfloat16, "swa", 16, None),
    ([4, 4, 4], [13, PAD, 30], 8, 2, 64, torch.bfloat16, "swa", 5, None),  # 4 drafts: 16 rows
    ([4, 2], [6, 21], 4, 4, 64, torch.float16, "full", None, None),  # group 1, ragged
    ([1, 1, 2], [PAD, 80, 45], 8, 2, 64, torch.float16, "full", None, {"num_splits": 3, "BLOCK_N": 16}),
    ([1, 2, 1], [33, 45, 80], 8, 2, 64, torch.float16, "swa", 50, {"num_splits": 4, "BLOCK_N": 16}),
    ([2, 1], [9, 20], 4, 2, 64, torch.float32, "swa", 6, None),
]


@pytest.mark.parametrize("case", range(len(STORE_CASES)))
def test_store_new_rows_in_the_attention_launch(case):
    """With ``k, v, loc`` the kernel stores the step's rows and attends over them: the new
    tokens' cache rows hold NaN before the call, so a program that read one before it was
    stored (its own, or another split's) would give NaN; the cache after the call is the
    cache with exactly those rows written."""
    q_lens, seq_lens, H, Hkv, D, dtype, layer, window, config = STORE_CASES[case]
    run_case(
        q_lens, seq_lens, H=H, Hkv=Hkv, D=D, dtype=dtype, layer=layer, window=window, config=config, store=True,
        seed=20 + case,
    )  # fmt: skip


@pytest.mark.parametrize("layer,window", [("full", None), ("swa", 12)])
def test_store_skips_slots_outside_the_cache(layer, window):
    """Slot 0 (the sink), -1 and values past the cache are skipped: nothing is written
    anywhere (the whole cache is compared), and the other requests are exact."""
    out, want = run_case(
        [1, 1, 3], [20, 31, 40], H=8, Hkv=2, D=64, layer=layer, window=window, store=True, check=False,
        bad_locs=[0, -1, 10**6], seed=30,
    )  # fmt: skip
    got = out[:2].cpu().double()
    err = (got - want[:2]).norm() / want[:2].norm()
    assert err <= TOL[torch.float16]


def test_store_needs_one_row_tile():
    """More rows a request than one tile (here 5 tokens x 4 heads) is an error that names
    the limit, raised before anything runs: the cache is untouched."""
    q, k_cache = torch.zeros(5, 8, 64, dtype=torch.float16), torch.zeros(10, 2, 64, dtype=torch.float16)
    before = k_cache.clone()
    with pytest.raises(AssertionError, match="max_q_len x group <= 16"):
        K.paged_attention(
            q.to(DEVICE), k_cache.to(DEVICE), k_cache.to(DEVICE), torch.empty_like(q).to(DEVICE),
            cu_q_lens=torch.tensor([0, 5], dtype=torch.int32, device=DEVICE),
            seq_lens=torch.tensor([9], dtype=torch.int32, device=DEVICE),
            table=torch.ones(1, 9, dtype=torch.int32, device=DEVICE),
            table_rows=torch.zeros(1, dtype=torch.int32, device=DEVICE), max_q_len=5, max_kv_len=9,
            k=torch.ones(5, 2, 64, dtype=torch.float16, device=DEVICE),
            v=torch.ones(5, 2, 64, dtype=torch.float16, device=DEVICE),
            loc=torch.arange(1, 6, device=DEVICE),
        )  # fmt: skip
    assert torch.equal(k_cache, before)


@pytest.mark.parametrize(
    "bad,match",
    [
        (dict(k=None), "k is needed with loc"),
        (dict(k=torch.ones(3, 2, 64, dtype=torch.float16)), r"k must be \[2, 2, 64\]"),
        (dict(v=torch.ones(2, 2, 64, dtype=torch.float32)), "v is torch.float32"),
        (dict(loc=torch.ones(1, dtype=torch.int64)), r"loc must be \[>= 2\]"),
        (dict(loc=torch.ones(2, dtype=torch.float32)), "loc must be"),
    ],
)
def test_store_rejects_bad_new_rows(bad, match):
    q = torch.zeros(2, 8, 64, dtype=torch.float16, device=DEVICE)
    args = dict(
        k=torch.ones(2, 2, 64, dtype=torch.float16),
        v=torch.ones(2, 2, 64, dtype=torch.float16),
        loc=torch.tensor([1, 2]),
    )
    args.update(bad)
    args = {n: (t.to(DEVICE) if t is not None else None) for n, t in args.items()}
    cache = torch.zeros(10, 2, 64, dtype=torch.float16, device=DEVICE)
    with pytest.raises(AssertionError, match=match):
        K.paged_attention(
            q, cache, cache, torch.empty_like(q), cu_q_lens=torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE),
            seq_lens=torch.tensor([3, 3], dtype=torch.int32, device=DEVICE),
            table=torch.ones(2, 3, dtype=torch.int32, device=DEVICE),
            table_rows=torch.arange(2, dtype=torch.int32, device=DEVICE), max_q_len=1, max_kv_len=3, **args,
        )  # fmt: skip
    assert not cache.any()


@pytest.mark.skipif(len(PDL_MODES) < 2, reason="PDL needs a GPU of compute capability >= 9.0")
def test_store_pdl_matches_non_pdl():
    """PDL on, with and without the metadata read before the wait and the early release:
    the same bits as PDL off, split or not."""
    args = ([1, 4, 2], [50, 200, 9])
    kw = dict(H=8, Hkv=2, D=128, dtype=torch.bfloat16, window=64, layer="swa", seed=40, store=True, check=False)
    for cfg in (None, {"num_splits": 4}):
        a, _ = run_case(*args, pdl=False, config=cfg, **kw)
        for prologue, release_early in ((False, False), (True, False), (True, True), (False, True)):
            b, _ = run_case(*args, pdl=True, config=cfg, prologue=prologue, release_early=release_early, **kw)
            assert torch.equal(a, b), (cfg, prologue, release_early)


@pytest.mark.skipif(len(PDL_MODES) < 2, reason="PDL needs a GPU of compute capability >= 9.0")
@pytest.mark.parametrize("store", [False, True], ids=["cached", "store"])
def test_prefetch_matches_non_pdl(store):
    """The L2 prefetch of the first key blocks before the wait (``PREFETCH``, with the
    prologue) is a hint only: the same bits as PDL off without it, split or not, full and SWA
    layers, prefetch depths short of and past the program's key range."""
    kw = dict(H=8, Hkv=2, D=128, dtype=torch.bfloat16, seed=41, store=store, check=False)
    cases = [
        (([1, 4, 2], [50, 200, 9]), dict(window=64, layer="swa")),
        (([1, 1, 3], [PAD, 300, 77]), dict(layer="full")),
    ]
    for (q_lens, seq_lens), layer_kw in cases:
        for cfg in ({}, {"num_splits": 4}):
            a, _ = run_case(q_lens, seq_lens, pdl=False, config=cfg or None, **layer_kw, **kw)
            for depth in (1, 3, 16):
                for release_early in (False, True):
                    b, _ = run_case(
                        q_lens, seq_lens, pdl=True, config={**cfg, "PREFETCH": depth}, prologue=True,
                        release_early=release_early, **layer_kw, **kw,
                    )  # fmt: skip
                    assert torch.equal(a, b), (layer_kw, cfg, depth, release_early)
