"""store_attend (one launch: KV store + attention + in-kernel split merge) against float64
(the cases of ``one_launch_cases``): full and SWA-style tables (a key table ``start``), forced
KV splits (the atomic ticket merge), padded requests, invalid store slots, ``loc=None``,
soft-capping and sinks; every launch must leave the tickets at zero (so graph replays can
repeat it). And the planner's one-launch plans (``plan_one_launch``, ``plan_step``).
"""

import dataclasses
import functools

import pytest
import torch

from attnplug_cuda.kernels.interpret import use_interpreter

if not torch.cuda.is_available():
    use_interpreter()  # before triton is imported (tests/conftest.py also arranges this)
pytest.importorskip("triton")

from one_launch_cases import check as _check  # noqa: E402
from one_launch_cases import run_case as _run_case  # noqa: E402

from attnplug_cuda.kernels import pdl_supported  # noqa: E402
from attnplug_cuda.kernels.pdl import EARLY, PLAIN, PROLOGUE, PROLOGUE_ENTRY  # noqa: E402
from attnplug_cuda.planner import (  # noqa: E402
    AttentionShape,
    LaunchShape,
    Path,
    one_launch_serves,
    one_launch_workspace_numel,
    plan_one_launch,
    plan_step,
)
from attnplug_cuda.tuning import CudaTuning  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PDL = pdl_supported(DEVICE)[0]
TUNING = CudaTuning()
MERGE_ROWS = TUNING.merge_rows
run_case = functools.partial(_run_case, device=DEVICE, pdl=PLAIN if PDL else None)


def plan_store_attend(**shape):
    """The planner's one-launch plan (the default tuning) for ``LaunchShape(**shape)`` (the
    token count does not enter it)."""
    return plan_one_launch(LaunchShape(num_tokens=0, **shape), TUNING)


def eligible(num_reqs, num_kv_heads, max_q_len, group, num_sms):
    return one_launch_serves(num_reqs, num_kv_heads, max_q_len, group, num_sms, TUNING)


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
    assert keep["plan"].ROWS * 16 > MERGE_ROWS, "the case must need more than one merge trip"


def test_a_loose_host_bound_still_gives_every_split_keys():
    # the host bound (4096) is 16x the real length (256): the plan's key block (>= 128) is wider
    # than a split's real share, and the splits must still be cut from the real length, every
    # one of them holding keys (whole blocks of 128 would leave 14 of the 16 splits empty)
    keep: dict = {}
    res = run_case([256], 1, splits=16, max_kv_len=4096, seed=13, keep=keep)
    _check(res, torch.float32, bs=1, q_len=1)
    assert keep["plan"].BLOCK_N >= 128
    rows = 4  # q_len x G rows of one (request, kv head) group
    m = keep["workspace"][: 2 * 16 * rows].view(2, 16, rows)[:, :, :4].cpu()  # [groups, splits, rows]
    assert (m > -1e29).all(), f"splits without keys: {(m <= -1e29).all(-1).nonzero().tolist()}"


def test_plan_and_eligibility():
    # a small batch splits the KV range, each split keeps >= 32 keys, within one program per SM
    p = plan_store_attend(
        num_reqs=1, num_kv_heads=8, group=4, head_dim=128, max_q_len=1, max_kv_len=256, window=256, num_sms=132
    )
    assert p.NUM_SPLITS == 8 and p.BLOCK_N == 32
    p = plan_store_attend(
        num_reqs=1, num_kv_heads=8, group=4, head_dim=128, max_q_len=1, max_kv_len=1024, window=None, num_sms=132
    )
    assert p.NUM_SPLITS == 16 and p.BLOCK_N == 64
    # a share of 68 keys (1088 / 16): a 64-key block, the largest power of two within the share
    p = plan_store_attend(
        num_reqs=1, num_kv_heads=8, group=4, head_dim=128, max_q_len=1, max_kv_len=1088, window=None, num_sms=132
    )
    assert p.NUM_SPLITS == 16 and p.BLOCK_N == 64 and p.num_stages == 1  # one block a program
    # 4 drafts at bs 4: 272 keys a split, 128-key blocks (8 warps: one program an SM)
    p = plan_store_attend(
        num_reqs=4, num_kv_heads=8, group=4, head_dim=128, max_q_len=4, max_kv_len=1088, window=None, num_sms=132
    )
    assert p.NUM_SPLITS == 4 and p.BLOCK_N == 128 and p.num_stages == 1 and p.num_warps == 8
    # a window of 256 at bs 5 (40 groups, a quarter of the SMs at least): one 256-key block, unsplit
    p = plan_store_attend(
        num_reqs=5, num_kv_heads=8, group=4, head_dim=128, max_q_len=1, max_kv_len=1088, window=256, num_sms=132
    )
    assert p.NUM_SPLITS == 1 and p.BLOCK_N == 256 and p.num_warps == 8
    # ... but split at bs 4 (32 groups), and for 4 drafts (259 keys: more than one block)
    p = plan_store_attend(
        num_reqs=4, num_kv_heads=8, group=4, head_dim=128, max_q_len=1, max_kv_len=1088, window=256, num_sms=132
    )
    assert p.NUM_SPLITS > 1
    p = plan_store_attend(
        num_reqs=8, num_kv_heads=8, group=4, head_dim=128, max_q_len=4, max_kv_len=1088, window=256, num_sms=132
    )
    assert p.NUM_SPLITS > 1
    assert eligible(33, 8, 1, 4, 132) and not eligible(34, 8, 1, 4, 132)  # two groups per SM at most
    assert eligible(1, 8, 4, 4, 132) and TUNING.one_launch_rows == 16  # 4 drafts x 4 heads: one launch
    assert not eligible(1, 8, 5, 4, 132)  # 5 drafts x 4 heads: the two-launch path
    # more groups than SMs (bs 32: 256 groups on 132 SMs): unsplit 128-key blocks, 4 warps, 2 stages
    h200 = dict(num_kv_heads=8, group=4, head_dim=128, max_kv_len=1088, num_sms=132)
    for q_len, window in ((1, None), (1, 256), (4, 256)):
        p = plan_store_attend(num_reqs=32, max_q_len=q_len, window=window, **h200)
        assert (p.NUM_SPLITS, p.BLOCK_N, p.num_warps, p.num_stages) == (1, 128, 4, 2)
    p = plan_store_attend(num_reqs=17, max_q_len=4, window=256, **h200)  # 4 drafts at bs 17: crowded, unsplit
    assert (p.NUM_SPLITS, p.BLOCK_N, p.num_warps, p.num_stages) == (1, 128, 4, 2)
    # 16 rows split as far as decode does; the merge takes MERGE_ROWS (split, row) pairs a trip
    p = plan_store_attend(
        num_reqs=1, num_kv_heads=8, group=4, head_dim=128, max_q_len=4, max_kv_len=1088, window=None, num_sms=132
    )
    assert p.ROWS == 16 and p.NUM_SPLITS == 16 and p.BLOCK_N == 64
    assert p.MERGE_CHUNK * p.ROWS == MERGE_ROWS
    # a window-bounded span is the real range: one block covers a split's share as the kernel
    # cuts it (259 keys over 8 splits: 33 keys, cut in 48-key steps, one 64-key block)
    p = plan_store_attend(
        num_reqs=1, num_kv_heads=8, group=4, head_dim=128, max_q_len=4, max_kv_len=1088, window=256, num_sms=132
    )
    assert p.NUM_SPLITS == 8 and p.BLOCK_N == 64 and p.num_stages == 1


def test_plans_pair_programs_on_each_sm():
    """Decode steps split on into 4-warp programs of at most 128-key blocks, two an SM: full
    layers while the grid stays within two programs an SM and a split keeps >= 64 keys, a
    256-key window in two splits once the groups cover a third of the SMs; steps of several
    tokens a request pair both kinds of layer once the groups cover a quarter of the SMs."""
    h200 = dict(num_kv_heads=8, group=4, head_dim=128, num_sms=132)

    def plan(bs, window, max_kv_len=1025, q_len=1):
        p = plan_store_attend(num_reqs=bs, max_q_len=q_len, max_kv_len=max_kv_len, window=window, **h200)
        return p.NUM_SPLITS, p.BLOCK_N, p.num_warps, p.num_stages

    # full layers: (splits, block, warps, stages) at 1,025 keys
    assert plan(1, None) == (16, 64, 4, 1)  # 32 splits would hold 32 keys each
    assert plan(2, None) == (16, 64, 4, 1)
    assert plan(4, None) == (8, 128, 4, 1)
    assert plan(8, None) == (4, 128, 4, 1)
    assert plan(12, None) == (2, 128, 4, 2)  # 513 keys a split: more than four blocks, two stages
    assert plan(16, None) == (2, 128, 4, 2)
    assert plan(17, None) == (1, 128, 4, 2)  # more groups than SMs: unsplit, crowded
    for bs in (1, 2, 4, 5, 8, 12, 16):  # never more than two programs an SM
        splits = plan(bs, None)[0]
        assert bs * 8 * splits <= 2 * 132
    # a long context keeps two stages where a split holds more than eight blocks
    assert plan(8, None, max_kv_len=8192) == (4, 128, 4, 2)
    assert plan(1, None, max_kv_len=4097) == (32, 128, 4, 1)
    # SWA layers, W 256: split as before up to bs 4, unsplit at bs 5, two 128-key splits from bs 6
    assert plan(1, 256) == (8, 32, 4, 1)
    assert plan(4, 256) == (4, 64, 4, 1)
    assert plan(5, 256) == (1, 256, 8, 1)
    for bs in (6, 8, 12, 16):
        assert plan(bs, 256) == (2, 128, 4, 1)
    assert plan(17, 256) == (1, 128, 4, 2)
    # 4-draft steps (16 rows) keep one program an SM up to bs 4 (32 groups), then pair on
    # both kinds of layer (1,028 keys, a 259-key window)
    assert plan(4, None, 1028, q_len=4) == (4, 128, 8, 1)
    assert plan(4, 256, 1028, q_len=4) == (4, 128, 8, 1)
    for bs, splits in ((5, 4), (6, 4), (8, 4), (12, 2), (16, 2)):
        assert plan(bs, 256, 1028, q_len=4) == (splits, 128, 4, 1)
        assert plan(bs, None, 1028, q_len=4) == (splits, 128, 4, 2 if splits == 2 else 1)
        assert bs * 8 * splits <= 2 * 132
    assert plan(17, None, 1028, q_len=4) == (1, 128, 4, 2)
    # every paired plan fits the workspace the backend allocates
    for bs in range(1, 34):
        for window in (None, 256):
            for q_len in (1, 2, 4):
                p = plan_store_attend(num_reqs=bs, max_q_len=q_len, max_kv_len=1025, window=window, **h200)
                if p.NUM_SPLITS > 1:
                    need = bs * 8 * p.NUM_SPLITS * p.ROWS * (128 + 2)
                    assert need <= one_launch_workspace_numel(128, 132, TUNING)


#: (seq_lens, q_len, run_case arguments): the step's own keys after the cached ones
#: (``own_block``: a decode step's one as a vector, more in a block of their own), the first key
#: block laid out before the wait
OWN_BLOCK_CASES = {
    # a window narrower than the step: a draft row sees only the last own keys
    "drafts_window_narrower_than_the_step": ([30, 17, 9], 4, dict(window=2, splits=2)),
    "six_tokens": ([40, 25], 6, dict(H=4, Hkv=2, window=9, splits=4)),
    "decode_unsplit": ([23, 40, 9], 1, dict(splits=1)),
    "decode_window_8_splits": ([23, 40, 9], 1, dict(splits=8, window=6)),
    "sinks_16_splits_some_empty": ([23, 40, 9], 1, dict(splits=16, with_sinks=True)),
    "softcap_sinks": ([33, 12], 1, dict(splits=2, softcap=2.0, with_sinks=True)),
    "half_two_tokens_padded": ([30, 17], 2, dict(H=4, Hkv=1, dtype=torch.float16, window=5, splits=4, padded=2)),
    "drafts_16_rows": ([300, 97], 4, dict(window=70, splits=16, with_sinks=True)),
    "no_store": ([21, 8], 1, dict(splits=2, store=False)),
    # 16-key blocks: the own tokens (3 a request) straddle split and block edges
    "garbage_slots_small_blocks_split": ([75, 50, 34], 3, dict(H=4, splits=4, bad_loc=True, config={"BLOCK_N": 16})),
    "garbage_slots_small_blocks": ([75, 50, 34], 3, dict(H=4, splits=1, bad_loc=True, config={"BLOCK_N": 16})),
    "loose_host_bound": ([256], 1, dict(splits=16, max_kv_len=4096)),
}


@pytest.mark.parametrize("name", sorted(OWN_BLOCK_CASES))
def test_own_keys_in_their_own_block_match_exact_attention(name):
    seq_lens, q_len, kw = OWN_BLOCK_CASES[name]
    kw = dict(kw)
    config = dict(kw.pop("config", {}), OWN_BLOCK=True)
    res = run_case(seq_lens, q_len, config=config, seed=3, **kw)
    _check(
        res,
        kw.get("dtype", torch.float32),
        bs=len(seq_lens),
        q_len=q_len,
        padded=kw.get("padded", 0),
        store=kw.get("store", True),
        bad_loc=kw.get("bad_loc", False),
    )


@pytest.mark.skipif(not PDL, reason="PDL needs sm_90 and Triton >= 3.5")
@pytest.mark.parametrize("own_block", [False, True])
@pytest.mark.parametrize("schedule", [EARLY, PROLOGUE, PROLOGUE_ENTRY], ids=lambda s: f"{s.wait}-{s.release}")
def test_every_pdl_schedule_gives_the_bits_of_pdl_off(own_block, schedule):
    for name in ("decode_window_8_splits", "drafts_16_rows", "garbage_slots_small_blocks"):
        seq_lens, q_len, kw = OWN_BLOCK_CASES[name]
        kw = dict(kw)
        config = dict(kw.pop("config", {}), OWN_BLOCK=own_block)
        off = run_case(seq_lens, q_len, config=config, pdl=None, seed=2, **kw)[0]
        on = run_case(seq_lens, q_len, config=config, pdl=schedule, seed=2, **kw)[0]
        assert torch.equal(off, on), name


def test_decode_steps_fold_their_own_key_and_release_at_entry_from_two_requests():
    def step(bs, q_len, window, pdl=True):
        shape = AttentionShape(
            num_heads=32, num_kv_heads=8, head_dim=128, max_context_len=1088, window=window, num_sms=132
        )
        return plan_step(shape, bs, bs * q_len, q_len, TUNING, pdl)

    for window in (None, 256):
        plan = step(1, 1, window)  # 8 groups: the own key folded, released after the wait
        assert plan.path is Path.ONE_LAUNCH
        for layer in (plan.full, plan.swa or plan.full):
            assert layer.kernel.OWN_BLOCK and (layer.first, layer.later) == (EARLY, PROLOGUE), window
        for bs in (2, 5, 8, 12, 16):  # 16 to 128 groups: a sixteenth of the SMs to all of them
            plan = step(bs, 1, window)
            assert plan.full.kernel.OWN_BLOCK and (plan.full.first, plan.full.later) == (EARLY, PROLOGUE_ENTRY)
    for bs, q_len in ((17, 1), (32, 1), (1, 4), (8, 4)):  # more groups than SMs; drafts
        plan = step(bs, q_len, 256)
        for layer in (plan.full, plan.swa):
            assert not layer.kernel.OWN_BLOCK and (layer.first, layer.later) == (EARLY, PROLOGUE), (bs, q_len)
    assert step(8, 1, 256, pdl=False).swa.later is None  # no PDL: no schedule


def test_the_step_path_follows_the_tuning():
    shape = AttentionShape(num_heads=32, num_kv_heads=8, head_dim=128, max_context_len=1088, window=256, num_sms=132)
    assert plan_step(shape, 8, 8, 1, TUNING, True).path is Path.ONE_LAUNCH
    assert plan_step(shape, 64, 64, 1, TUNING, True).path is Path.PAGED_STORE  # 512 groups
    assert plan_step(shape, 2, 100, 50, TUNING, True).path is Path.TWO_LAUNCH  # an extend
    off = dataclasses.replace(TUNING, one_launch=False)
    assert plan_step(shape, 8, 8, 1, off, True).path is Path.PAGED_STORE
    two = dataclasses.replace(TUNING, one_launch=False, paged_store=False)
    plan = plan_step(shape, 8, 8, 1, two, True)
    assert plan.path is Path.TWO_LAUNCH and plan.swa.first == plan.swa.later == PLAIN
    cpp = dataclasses.replace(TUNING, kv_store="cpp")
    assert plan_step(shape, 64, 64, 1, cpp, True).path is Path.TWO_LAUNCH  # the C++ store is a launch of its own
