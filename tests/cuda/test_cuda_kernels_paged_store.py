"""paged_attention storing the step's K/V rows in its own launch (``NewRows``, decode and
draft steps), and its PDL schedules (the metadata read before the wait, the early release,
the L2 prefetch of the first key blocks): the same bits as PDL off (machinery:
``paged_cases``).
"""

import pytest
import torch

from attnplug_cuda.kernels.interpret import use_interpreter

if not torch.cuda.is_available():
    use_interpreter()  # before triton is imported (tests/conftest.py also arranges this)
pytest.importorskip("triton")

from paged_cases import DEVICE, PAD, PDL, TOL, attend, run_case  # noqa: E402

from attnplug_cuda.kernels.pdl import EARLY, PLAIN, PROLOGUE, Schedule  # noqa: E402

STORE_CASES = [
    # (q_lens, seq_lens, H, Hkv, D, dtype, layer, window, config)
    ([1] * 4, [PAD, 9, 37, 70], 8, 2, 64, torch.float16, "full", None, None),  # decode
    ([1] * 4, [PAD, 9, 37, 70], 8, 2, 128, torch.bfloat16, "swa", 16, None),
    ([4, 4, 4], [13, PAD, 30], 8, 2, 64, torch.bfloat16, "swa", 5, None),  # 4 drafts: 16 rows
    ([4, 2], [6, 21], 4, 4, 64, torch.float16, "full", None, None),  # group 1, ragged
    ([1, 1, 2], [PAD, 80, 45], 8, 2, 64, torch.float16, "full", None, {"NUM_SPLITS": 3, "BLOCK_N": 16}),
    ([1, 2, 1], [33, 45, 80], 8, 2, 64, torch.float16, "swa", 50, {"NUM_SPLITS": 4, "BLOCK_N": 16}),
    ([2, 1], [9, 20], 4, 2, 64, torch.float32, "swa", 6, None),
    ([5, 3, 1], [20, 9, 40], 6, 2, 64, torch.bfloat16, "swa", 8, None),  # group 3: a tile of 8 tokens stores 5
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


@pytest.mark.parametrize("config", [None, {"BLOCK_M": 16}], ids=["planned", "16-row tile"])
def test_store_needs_one_row_tile(config):
    """More rows a request than the plan's row tile (40 tokens x 4 heads against the planned
    128; 5 tokens x 4 heads against a 16-row tile) is an error that names the limit, raised
    before anything runs: the cache is untouched."""
    n = 40 if config is None else 5
    q, k_cache = torch.zeros(n, 8, 64, dtype=torch.float16), torch.zeros(50, 2, 64, dtype=torch.float16)
    before = k_cache.clone()
    with pytest.raises(AssertionError, match="storing the new rows needs one row block"):
        attend(
            q.to(DEVICE), k_cache.to(DEVICE), k_cache.to(DEVICE), torch.empty_like(q).to(DEVICE),
            cu_q_lens=torch.tensor([0, n], dtype=torch.int32, device=DEVICE),
            seq_lens=torch.tensor([n + 4], dtype=torch.int32, device=DEVICE),
            table=torch.ones(1, n + 4, dtype=torch.int32, device=DEVICE),
            rows=torch.zeros(1, dtype=torch.int32, device=DEVICE), max_q_len=n, max_kv_len=n + 4, config=config,
            k=torch.ones(n, 2, 64, dtype=torch.float16, device=DEVICE),
            v=torch.ones(n, 2, 64, dtype=torch.float16, device=DEVICE),
            loc=torch.arange(1, n + 1, device=DEVICE),
        )  # fmt: skip
    assert torch.equal(k_cache, before)


@pytest.mark.parametrize(
    "bad,match",
    [
        (dict(k=None), "k and v are needed with loc"),
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
    with pytest.raises((AssertionError, ValueError), match=match):
        attend(
            q, cache, cache, torch.empty_like(q), cu_q_lens=torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE),
            seq_lens=torch.tensor([3, 3], dtype=torch.int32, device=DEVICE),
            table=torch.ones(2, 3, dtype=torch.int32, device=DEVICE),
            rows=torch.arange(2, dtype=torch.int32, device=DEVICE), max_q_len=1, max_kv_len=3, **args,
        )  # fmt: skip
    assert not cache.any()


@pytest.mark.skipif(not PDL, reason="PDL needs a GPU of compute capability >= 9.0")
def test_store_pdl_matches_non_pdl():
    """PDL on, with and without the metadata read before the wait and the early release:
    the same bits as PDL off, split or not."""
    args = ([1, 4, 2], [50, 200, 9])
    kw = dict(H=8, Hkv=2, D=128, dtype=torch.bfloat16, window=64, layer="swa", seed=40, store=True, check=False)
    for cfg in (None, {"NUM_SPLITS": 4}):
        a, _ = run_case(*args, pdl=None, config=cfg, **kw)
        for schedule in (PLAIN, Schedule("prologue", "end"), PROLOGUE, EARLY):
            b, _ = run_case(*args, pdl=schedule, config=cfg, **kw)
            assert torch.equal(a, b), (cfg, schedule)


@pytest.mark.skipif(not PDL, reason="PDL needs a GPU of compute capability >= 9.0")
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
        for cfg in ({}, {"NUM_SPLITS": 4}):
            a, _ = run_case(q_lens, seq_lens, pdl=None, config=cfg or None, **layer_kw, **kw)
            for depth in (1, 3, 16):
                for schedule in (Schedule("prologue", "end"), PROLOGUE):
                    b, _ = run_case(
                        q_lens, seq_lens, pdl=schedule, config={**cfg, "PREFETCH": depth}, **layer_kw, **kw
                    )  # fmt: skip
                    assert torch.equal(a, b), (layer_kw, cfg, depth, schedule)
