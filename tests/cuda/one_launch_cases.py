"""One step through ``store_attend`` (the one-launch kernel) against float64.

``run_case`` builds per-request K/V histories in a paged cache (slots shuffled, every other
slot NaN so a stray read shows), writes the step's own K/V only through the kernel's store
(the cache holds NaN at those slots before the call), and returns the output with
``attnplug.oracle.exact_attention``'s; ``check`` compares them and the stored rows, and
checks that the launch left the tickets at zero (so graph replays can repeat it).

``kv_dtype`` (an FP8 dtype) makes the cache FP8 with per-head ``kv_scales``: the history is
stored quantised (``attnplug.memory.fp8.quantize_kv``), the oracle attends over the values the
cache holds (the step's own rows quantised too) and the stored rows must be quantize_kv's bytes.
"""

from typing import List, Optional

import torch

from attnplug.memory.fp8 import dequantize_kv, fp8_max, is_fp8, quantize_kv
from attnplug.oracle import exact_attention
from attnplug_cuda.kernels.common import AttentionInputs, KeyTable, KVScales, num_sms
from attnplug_cuda.kernels.store_attend import store_attend
from attnplug_cuda.planner import LaunchShape, plan_one_launch
from attnplug_cuda.tuning import CudaTuning

TOL = {torch.float16: 4e-3, torch.bfloat16: 2e-2, torch.float32: 1e-5}


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bit pattern as integers (NaN equals itself; FP8 tensors compare where torch has no
    ``equal`` for them)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def hard_values(kv_dtype) -> torch.Tensor:
    """float64 values (before a scale) an FP8 rounding rule gets wrong first: every finite grid
    value of ``kv_dtype``, every midpoint of two neighbours (ties, subnormal ones included: both
    roundings of each tie appear, the even neighbour alternating), a value just above and below
    each midpoint, values past the largest finite, +-inf, NaN and zero; each also negated."""
    g = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(kv_dtype).double()
    g = g[torch.isfinite(g) & (g >= 0)].unique()
    mids = (g[1:] + g[:-1]) / 2
    near = torch.cat([mids * (1 + 2.0**-12), mids * (1 - 2.0**-12)])
    big = fp8_max(kv_dtype)
    past = torch.tensor([big * 1.01, big * 1.5, big * 4, 1e30, float("inf")], dtype=torch.float64)
    out = torch.cat([g, mids, near, past, torch.tensor([0.0, float("nan")], dtype=torch.float64)])
    return torch.cat([out, -out])


def fp8_bytes_match(stored: torch.Tensor, want: torch.Tensor, *, exact: bool) -> None:
    """Assert FP8 tensors hold the same bytes: all of them (``exact``: the host, where the
    interpreter keeps a NaN's sign), or on a GPU, whose float32 division may return a NaN
    without its sign, every non-NaN byte and NaN where ``want`` has NaN."""
    a, b = bits(stored.cpu()), bits(want.cpu())
    if exact:
        bad = (a != b).nonzero()
        assert bad.numel() == 0, f"{bad.shape[0]} bytes differ, the first at {bad[:4].tolist()}"
        return
    nan = stored.cpu().float().isnan()
    assert torch.equal(nan, want.cpu().float().isnan()), "NaN where the rule gives none, or none where it does"
    assert torch.equal(a[~nan], b[~nan]), f"{int((a[~nan] != b[~nan]).sum())} bytes differ"


class Stored:
    """What a cache of ``cache_dtype`` holds for rows of the model's dtype: the rows as they
    are, or (an FP8 cache) quantised with the per-head ``scale``; ``held`` is that in float64."""

    def __init__(self, cache_dtype, k_scale=None, v_scale=None):
        self.dtype, self.k_scale, self.v_scale = cache_dtype, k_scale, v_scale

    def rows(self, x: torch.Tensor, which: str) -> torch.Tensor:
        if not is_fp8(self.dtype):
            return x
        return quantize_kv(x, self.k_scale if which == "k" else self.v_scale, self.dtype)

    def held(self, x: torch.Tensor, which: str) -> torch.Tensor:
        if not is_fp8(self.dtype):
            return x.double()
        return dequantize_kv(self.rows(x, which), self.k_scale if which == "k" else self.v_scale, torch.float64)

    def put(self, cache: torch.Tensor, index, x: torch.Tensor, which: str) -> None:
        """``cache[index] = rows(x)`` (written as bytes: every device indexes uint8)."""
        bits(cache)[index] = bits(self.rows(x, which))


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
    device: torch.device,
    pdl=None,
    kv_dtype=None,
    kv_scales=None,
):
    """Run one step through ``store_attend``; returns (out, expected, k_cache, v_cache, loc, k,
    v, tickets), ``k`` / ``v`` as the cache must hold them (quantised for an FP8 cache).
    ``max_kv_len``: the host bound (default: the table's width); ``keep``: gets the
    ``workspace`` and the ``plan`` used; ``config``: plan fields to override, ``splits`` the
    plan's ``NUM_SPLITS``; ``pdl``: the launch's PDL schedule; ``kv_dtype``: the cache's dtype
    (default ``dtype``), with ``kv_scales`` = (k_scale, v_scale) float32 ``[Hkv]`` for an FP8
    one (default ones)."""
    g = torch.Generator().manual_seed(seed)
    bs = len(seq_lens)
    S = 2 * sum(seq_lens) + 8
    cache_dtype = dtype if kv_dtype is None else kv_dtype
    if is_fp8(cache_dtype) and kv_scales is None:
        kv_scales = (torch.ones(Hkv), torch.ones(Hkv))
    kv = Stored(cache_dtype, *(kv_scales or (None, None)))
    k_cache = torch.full((S, Hkv, D), float("nan"), dtype=cache_dtype)
    v_cache = torch.full((S, Hkv, D), float("nan"), dtype=cache_dtype)
    bits(k_cache)[0] = bits(v_cache)[0] = 0  # the sink
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
        kv.put(k_cache, old, old_k[: s - q_len], "k")
        kv.put(v_cache, old, old_v[: s - q_len], "v")
        if not store:  # the layer saved its KV earlier: the cache already holds the new rows
            kv.put(k_cache, slots[s - q_len :], k[new], "k")
            kv.put(v_cache, slots[s - q_len :], v[new], "v")
        loc[new] = slots[s - q_len :]
        hist_k[b, :s], hist_v[b, :s] = kv.held(old_k, "k"), kv.held(old_v, "v")
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
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    kc, vc = to(k_cache), to(v_cache)
    tickets = torch.zeros(64, dtype=torch.int32, device=device)
    workspace = torch.empty(4 * 132 * 16 * (D + 2) * 4, dtype=torch.float32, device=device)
    bound = tab.shape[1] if max_kv_len is None else max_kv_len
    tuning = CudaTuning()
    shape = LaunchShape(bs + padded, T, Hkv, H // Hkv, D, q_len, bound, window, num_sms(torch.device(device)))
    plan = plan_one_launch(shape, tuning)
    if splits:
        chunk = max(1, min(splits, tuning.merge_rows // plan.ROWS))  # as the planner takes it
        plan = plan._replace(NUM_SPLITS=splits, MERGE_CHUNK=chunk)
    plan = plan._replace(**(config or {}))
    if keep is not None:
        keep["workspace"] = workspace
        keep["plan"] = plan
    cu = torch.arange(0, T + 1, q_len, dtype=torch.int32, device=device)
    keys = KeyTable.of(to(tab), torch.tensor(rows, dtype=torch.int64, device=device), to(window_start))
    seq_t = torch.tensor(seq_all, dtype=torch.int32, device=device)
    scales = KVScales.of(*(t.float().to(device) for t in kv_scales)) if is_fp8(cache_dtype) else None
    inputs = AttentionInputs(cu, seq_t, keys, q_len, 0.3, window, softcap, to(sinks), scales)
    out = torch.empty(T, H, D, dtype=dtype, device=device)
    loc_arg = to(loc) if store else None
    out = store_attend(
        to(q), to(k), to(v), loc_arg, kc, vc, out, inputs, plan, workspace=workspace, tickets=tickets, pdl=pdl
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
    return out.cpu(), expected, kc.cpu(), vc.cpu(), loc, kv.rows(k, "k"), kv.rows(v, "v"), tickets.cpu()


def check(res, dtype, *, bs, q_len, padded=0, store=True, bad_loc=False):
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
                stored = torch.equal(bits(kc[s]), bits(k[t])) and torch.equal(bits(vc[s]), bits(v[t]))
                assert stored, f"token {t} not stored at slot {s}"
        if bad_loc:
            assert torch.isnan(kc[1].float()).all(), "a garbage slot must not be written"
