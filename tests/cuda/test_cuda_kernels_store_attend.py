"""store_attend (one launch: KV store + attention + in-kernel split merge) against float64.

Each case builds per-request K/V histories in a paged cache (slots shuffled, every other
slot NaN so a stray read shows), writes the step's own K/V only through the kernel's store
(the cache holds NaN at those slots before the call), and compares the output with
``attnplug.soak.oracle.exact_attention`` and the cache with the expected store. It covers
full and SWA-style tables (``table_start``), forced KV splits (the atomic ticket merge),
padded requests, invalid store slots, ``loc=None``, soft-capping and sinks, and checks that
every launch leaves the tickets at zero (so graph replays can repeat it).
"""

from typing import List, Optional

import pytest
import torch

from attnplug.soak.oracle import exact_attention
from attnplug_cuda.kernels.interpret import use_interpreter

if not torch.cuda.is_available():
    use_interpreter()  # before triton is imported (tests/conftest.py also arranges this)
pytest.importorskip("triton")

from attnplug_cuda.kernels import pdl_supported  # noqa: E402
from attnplug_cuda.kernels.store_attend import (  # noqa: E402
    MAX_ROWS,
    MERGE_ROWS,
    eligible,
    num_sms,
    plan_store_attend,
    store_attend,
    store_attend_workspace_numel,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PDL = pdl_supported(DEVICE)[0]
TOL = {torch.float16: 4e-3, torch.bfloat16: 2e-2, torch.float32: 1e-5}


def run_case(
    seq_lens: List[int],
    q_len: int,
    *,
    H: int = 8,
    Hkv: int = 2,
    D: int = 64,
    dtype=torch.float32,
    window: Optional[int] = None,
    splits: Optional[int] = None,
    softcap: Optional[float] = None,
    with_sinks: bool = False,
    store: bool = True,
    padded: int = 0,
    bad_loc: bool = False,
    seed: int = 0,
    max_kv_len: Optional[int] = None,
    keep: Optional[dict] = None,
    config: Optional[dict] = None,
):
    """Run one step; returns (out, expected, k_cache, v_cache, loc, k, v, tickets).
    ``max_kv_len``: the host bound (default: the table's width); ``keep``: gets the
    ``workspace`` and the ``plan`` used; ``config``: plan keys to override."""
    g = torch.Generator().manual_seed(seed)
    bs = len(seq_lens)
    S = 2 * sum(seq_lens) + 8
    k_cache = torch.full((S, Hkv, D), float("nan"), dtype=dtype)
    v_cache = torch.full((S, Hkv, D), float("nan"), dtype=dtype)
    k_cache[0] = v_cache[0] = 0  # the sink
    width = max(seq_lens) + 2
    table = torch.zeros(bs + padded + 1, width, dtype=torch.int32)
    free = (torch.randperm(S // 2 - 1, generator=g) * 2 + 2).tolist()  # even slots; odd ones stay NaN
    hist_k = torch.zeros(bs + padded, width, Hkv, D, dtype=torch.float64)
    hist_v = torch.zeros_like(hist_k)
    T = (bs + padded) * q_len
    loc = torch.zeros(T, dtype=torch.int64)
    k = torch.randn(T, Hkv, D, generator=g).to(dtype)
    v = torch.randn(T, Hkv, D, generator=g).to(dtype)
    for b, s in enumerate(seq_lens):
        slots = torch.tensor([free.pop() for _ in range(s)])
        table[b + 1, :s] = slots.int()
        old_k = torch.randn(s, Hkv, D, generator=g).to(dtype)
        old_v = torch.randn(s, Hkv, D, generator=g).to(dtype)
        new = slice(b * q_len, (b + 1) * q_len)
        old_k[s - q_len :], old_v[s - q_len :] = k[new], v[new]
        old = slots[: s - q_len]
        k_cache[old], v_cache[old] = old_k[: s - q_len], old_v[: s - q_len]
        if not store:  # the layer saved its KV earlier: the cache already holds the new rows
            k_cache[slots[s - q_len :]], v_cache[slots[s - q_len :]] = k[new], v[new]
        loc[new] = slots[s - q_len :]
        hist_k[b, :s], hist_v[b, :s] = old_k.double(), old_v.double()
    if bad_loc:  # garbage store slots are skipped; the table still names the real slots
        loc[0] = -1
        loc[-1 if not padded else 1] = S + 5
    rows = torch.arange(1, bs + 1).tolist() + [0] * padded  # padded requests read row 0
    seq_all = seq_lens + [1] * padded
    q = torch.randn(T, H, D, generator=g).to(dtype)
    sinks = (torch.randn(H, generator=g) * 2).float() if with_sinks else None
    window_start = None
    tab = table
    if window is not None:  # an SWA-style table: row b holds the window's slots only
        starts = [max(0, s - q_len - window + 1) for s in seq_all]
        wwidth = window + q_len - 1
        tab = torch.zeros(bs + padded, wwidth, dtype=torch.int32)
        for b, (r, s0) in enumerate(zip(rows, starts)):
            n = min(wwidth, width - s0)
            tab[b, :n] = table[r, s0 : s0 + n]
        window_start = torch.tensor(starts, dtype=torch.int32)
        rows = list(range(bs + padded))
    to = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    kc, vc = to(k_cache), to(v_cache)
    tickets = torch.zeros(64, dtype=torch.int32, device=DEVICE)
    workspace = torch.empty(store_attend_workspace_numel(D, 132) * 4, dtype=torch.float32, device=DEVICE)
    bound = tab.shape[1] if max_kv_len is None else max_kv_len
    if keep is not None:
        keep["workspace"] = workspace
        keep["plan"] = plan_store_attend(
            num_reqs=bs + padded,
            num_kv_heads=Hkv,
            group=H // Hkv,
            head_dim=D,
            max_q_len=q_len,
            max_kv_len=bound,
            window=window,
            num_sms=num_sms(DEVICE),
        )
    out = store_attend(
        to(q),
        to(k),
        to(v),
        to(loc) if store else None,
        kc,
        vc,
        torch.empty(T, H, D, dtype=dtype, device=DEVICE),
        cu_q_lens=torch.arange(0, T + 1, q_len, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_all, dtype=torch.int32, device=DEVICE),
        table=to(tab),
        table_rows=torch.tensor(rows, dtype=torch.int64, device=DEVICE),
        table_start=to(window_start),
        max_q_len=q_len,
        max_kv_len=bound,
        sm_scale=0.3,
        window=window,
        workspace=workspace,
        tickets=tickets,
        softcap=softcap,
        sinks=to(sinks),
        pdl=PDL,
        config=dict(config or {}, **({"num_splits": splits} if splits else {})) or None,
    )
    real_T = bs * q_len
    expected = exact_attention(
        q[:real_T].double(),
        hist_k[:bs],
        hist_v[:bs],
        seq_lens,
        [q_len] * bs,
        window,
        0.3,
        logit_softcap=softcap,
        sinks=sinks,
    )
    return out.cpu(), expected, kc.cpu(), vc.cpu(), loc, k, v, tickets.cpu()


def _check(res, dtype, *, bs, q_len, padded=0, store=True, bad_loc=False):
    out, expected, kc, vc, loc, k, v, tickets = res
    real = bs * q_len
    assert torch.isfinite(out).all()
    err = (out[:real].double() - expected).abs().max().item()
    assert err <= TOL[dtype] * max(1.0, expected.abs().max().item()), f"max error {err}"
    assert (out[real:] == 0).all(), "padded requests (no key) must output zeros"
    assert int(tickets.abs().sum()) == 0, "every launch must leave the tickets at zero"
    if store:
        for t in range(real):
            s = int(loc[t])
            if 1 <= s < kc.shape[0]:
                assert torch.equal(kc[s], k[t]) and torch.equal(vc[s], v[t]), f"token {t} not stored at slot {s}"
        if bad_loc:
            assert torch.isnan(kc[1]).all(), "a garbage slot must not be written"


@pytest.mark.parametrize("splits", [1, 2, 8])
@pytest.mark.parametrize("window", [None, 6])
def test_decode_matches_exact_attention(splits, window):
    res = run_case([23, 40, 9], 1, window=window, splits=splits, seed=splits)
    _check(res, torch.float32, bs=3, q_len=1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_two_new_tokens_half_precision_with_padding(dtype):
    res = run_case([30, 17], 2, H=4, Hkv=1, dtype=dtype, window=5, splits=4, padded=2, seed=3)
    _check(res, dtype, bs=2, q_len=2, padded=2)


def test_softcap_and_sinks_split_and_unsplit():
    for splits in (1, 4):
        res = run_case([33, 12], 1, softcap=2.0, with_sinks=True, splits=splits, seed=5)
        _check(res, torch.float32, bs=2, q_len=1)
        plain = run_case([33, 12], 1, splits=splits, seed=5)[0]
        assert (res[0] - plain).abs().max() > 1e-3, "softcap + sinks must change the output"


def test_without_store_reads_every_key_from_the_cache():
    res = run_case([21, 8], 1, splits=2, store=False, seed=7)
    _check(res, torch.float32, bs=2, q_len=1, store=False)


def test_garbage_store_slots_are_skipped():
    res = run_case([15, 26], 1, splits=2, bad_loc=True, seed=9)
    out, expected, *_ = res
    # token 0's key comes from k (the table names its real slot); only its store is skipped
    _check(res, torch.float32, bs=2, q_len=1, bad_loc=True)


@pytest.mark.parametrize("splits", [1, 2])
def test_blocks_before_the_new_tokens_and_blocks_that_hold_them(splits):
    # 16-key blocks: the step's 3 new tokens sit in the last block of a request (75 keys),
    # straddle two blocks (50) or start in the second block (34); blocks wholly before them read
    # the cache alone, the others take the new rows from k / v. The first token's store slot is
    # garbage (skipped) while the table names its real slot, which holds NaN: a block that
    # read a new token from the cache would show it
    res = run_case([75, 50, 34], 3, H=4, Hkv=2, splits=splits, bad_loc=True, seed=19, config={"BLOCK_N": 16})
    _check(res, torch.float32, bs=3, q_len=3, bad_loc=True)


def test_many_splits_merge_in_order_with_empty_splits():
    # 16 splits of 16 keys over 23 / 40 / 9 keys: most splits of each group are empty (m = -1e30,
    # l = 0) and the merge must pass over them; with sinks, the sink joins the denominator once
    res = run_case([23, 40, 9], 1, splits=16, with_sinks=True, seed=11)
    _check(res, torch.float32, bs=3, q_len=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_draft_rows_merge_many_splits_in_several_trips(dtype):
    # 4 drafts x 4 q heads per kv head = 16 rows: a merge holds MERGE_ROWS (split, row) pairs at
    # once, so 16 splits are merged in 4 trips of 4; each trip must fold the right splits, in
    # order (the splits' outputs kept in bf16 for a bf16 step)
    keep: dict = {}
    res = run_case([300, 97], 4, dtype=dtype, window=70, splits=16, with_sinks=True, seed=17, keep=keep)
    _check(res, dtype, bs=2, q_len=4)
    assert keep["plan"]["ROWS"] * 16 > MERGE_ROWS, "the case must need more than one merge trip"


def test_a_loose_host_bound_still_gives_every_split_keys():
    # the host bound (4096) is 16x the real length (256): the plan's key block (128) is wider
    # than a split's real share, and the splits must still be cut from the real length, every
    # one of them holding keys (whole blocks of 128 would leave 14 of the 16 splits empty)
    keep: dict = {}
    res = run_case([256], 1, splits=16, max_kv_len=4096, seed=13, keep=keep)
    _check(res, torch.float32, bs=1, q_len=1)
    assert keep["plan"]["BLOCK_N"] == 128
    rows = 4  # q_len x G rows of one (request, kv head) group
    m = keep["workspace"][: 2 * 16 * rows].view(2, 16, rows)[:, :, :4].cpu()  # [groups, splits, rows]
    assert (m > -1e29).all(), f"splits without keys: {(m <= -1e29).all(-1).nonzero().tolist()}"


def test_plan_and_eligibility():
    # a small batch splits the KV range, each split keeps >= 32 keys, within one program per SM
    p = plan_store_attend(
        num_reqs=1, num_kv_heads=8, group=4, head_dim=128, max_q_len=1, max_kv_len=256, window=256, num_sms=132
    )
    assert p["num_splits"] == 8 and p["BLOCK_N"] == 32
    p = plan_store_attend(
        num_reqs=1, num_kv_heads=8, group=4, head_dim=128, max_q_len=1, max_kv_len=1024, window=None, num_sms=132
    )
    assert p["num_splits"] == 16 and p["BLOCK_N"] == 64
    # a share of 68 keys (1088 / 16): a 64-key block, the largest power of two within the share
    p = plan_store_attend(
        num_reqs=1, num_kv_heads=8, group=4, head_dim=128, max_q_len=1, max_kv_len=1088, window=None, num_sms=132
    )
    assert p["num_splits"] == 16 and p["BLOCK_N"] == 64 and p["num_stages"] == 1  # one block a program
    p = plan_store_attend(
        num_reqs=8, num_kv_heads=8, group=4, head_dim=128, max_q_len=1, max_kv_len=1088, window=None, num_sms=132
    )
    assert p["num_splits"] == 2 and p["BLOCK_N"] == 128 and p["num_stages"] == 1  # five blocks: one stage
    p = plan_store_attend(
        num_reqs=8, num_kv_heads=8, group=4, head_dim=128, max_q_len=1, max_kv_len=8192, window=None, num_sms=132
    )
    assert p["num_splits"] == 2 and p["num_stages"] == 2  # 32 blocks a program: pipelined
    assert eligible(8, 8, 1, 4, 132) and not eligible(16, 8, 1, 4, 132)  # two splits per group at least
    assert eligible(1, 8, 4, 4, 132) and MAX_ROWS == 16  # 4 drafts x 4 heads: one launch
    assert not eligible(1, 8, 5, 4, 132)  # 5 drafts x 4 heads: the two-launch path
    # 16 rows split as far as decode does; the merge takes MERGE_ROWS (split, row) pairs a trip
    p = plan_store_attend(
        num_reqs=1, num_kv_heads=8, group=4, head_dim=128, max_q_len=4, max_kv_len=1088, window=None, num_sms=132
    )
    assert p["ROWS"] == p["BLOCK_M"] == 16 and p["num_splits"] == 16 and p["BLOCK_N"] == 64
    assert p["MERGE_CHUNK"] * p["ROWS"] == MERGE_ROWS
    # a window-bounded span is the real range: one block covers a split's share as the kernel
    # cuts it (259 keys over 8 splits: 33 keys, cut in 48-key steps, one 64-key block)
    p = plan_store_attend(
        num_reqs=1, num_kv_heads=8, group=4, head_dim=128, max_q_len=4, max_kv_len=1088, window=256, num_sms=132
    )
    assert p["num_splits"] == 8 and p["BLOCK_N"] == 64 and p["num_stages"] == 1
