"""step_metadata: one launch builds the step's tables; compared with a plain torch computation.

Covers the SWA slot translation with its tail zeroing (graph buffers longer than T), -1 / 0
mapping entries, cu_q_lens / window_start / token_pos for uniform and EXTEND steps, the SWA
window table, T = 0, and more than 1024 requests.
"""

import pytest
import torch

from attnplug_cuda.kernels import pdl_supported  # noqa: E402
from attnplug_cuda.kernels.interpret import use_interpreter  # noqa: E402

if not torch.cuda.is_available():
    use_interpreter()  # before triton is imported (tests/conftest.py also arranges this)
pytest.importorskip("triton")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PDL_MODES = [False, True] if pdl_supported(DEVICE)[0] else [False]
from attnplug_cuda.kernels import step_metadata as K  # noqa: E402

POISON = -77


def reference(req_pool_indices, seq_lens, q_lens, out_cache_loc, mapping, req_to_token, loc_len, width, window):
    """The same tables, computed with torch ops on the CPU."""
    rpi, seq, q = req_pool_indices.cpu().long(), seq_lens.cpu().long(), q_lens.cpu().long()
    bs = rpi.shape[0]
    cu = torch.zeros(bs + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(q, 0)
    ws = (seq - q - window + 1).clamp_min(0) if window is not None else torch.zeros(bs, dtype=torch.int64)
    pos = [torch.arange(int(s) - int(n), int(s)) for s, n in zip(seq, q)]
    token_pos = torch.cat(pos) if pos else torch.zeros(0, dtype=torch.int64)
    out = {"cu_q_lens": cu, "window_start": ws, "token_pos": token_pos}
    if mapping is not None:
        m = mapping.cpu().long()
        swa = torch.zeros(loc_len, dtype=torch.int64)
        loc = out_cache_loc.cpu().long()
        inside = (loc >= 0) & (loc < m.shape[0])  # outside the mapping (-1 included): no slot, -1
        swa[: loc.shape[0]] = torch.where(inside, m[loc.clamp(0, m.shape[0] - 1)], -1)
        out["swa_out_cache_loc"] = swa
        if width is not None:
            r2t = req_to_token.cpu().long()
            table = torch.zeros(bs, width, dtype=torch.int64)
            for b in range(bs):
                row = int(rpi[b]) if 0 <= int(rpi[b]) < r2t.shape[0] else 0  # outside the table: row 0
                for c in range(width):
                    p = int(ws[b]) + c
                    if p < int(seq[b]):
                        f = int(r2t[row, p])
                        table[b, c] = m[f] if 0 <= f < m.shape[0] else 0
            out["swa_window_table"] = table
    return out


def run_kernel(req_pool_indices, seq_lens, ext, out_cache_loc, mapping, req_to_token, loc_len, width, window, pdl):
    bs, T = req_pool_indices.shape[0], out_cache_loc.shape[0]
    full = lambda n: torch.full((n,), POISON, dtype=torch.int32, device=DEVICE)  # noqa: E731
    bufs = {"cu_q_lens": full(bs + 1), "window_start": full(bs), "token_pos": full(T)}
    kwargs = dict(bufs)
    if mapping is not None:
        bufs["swa_out_cache_loc"] = full(loc_len)
        kwargs.update(full_to_swa_index_mapping=mapping, swa_out_cache_loc=bufs["swa_out_cache_loc"])
        if width is not None:
            bufs["swa_window_table"] = torch.full((bs, width), POISON, dtype=torch.int32, device=DEVICE)
            kwargs.update(req_to_token=req_to_token, swa_window_table=bufs["swa_window_table"])
    K.step_metadata(req_pool_indices, seq_lens, ext, out_cache_loc, window=window, pdl=pdl, **kwargs)
    return bufs


def make_step(q_lens, seq_lens, *, size=200, max_ctx=96, idx_dtype=torch.int64, seed=0, evict_below=None):
    """A pool mapping (0 = evicted, last entry -1) and a req_to_token whose rows hold the
    requests' full slots; request b lives in row b + 1 (row 0 is the padding row)."""
    g = torch.Generator().manual_seed(seed)
    bs = len(q_lens)
    mapping = torch.zeros(size + 2, dtype=torch.int32)
    mapping[1:size] = (torch.randperm(size - 1, generator=g) + 1).int()
    mapping[-1] = -1
    mapping[5] = 0  # a full slot whose SWA slot was evicted
    req_to_token = torch.zeros(bs + 2, max_ctx, dtype=torch.int32)
    slots = torch.randperm(size - 1, generator=g) + 1
    used, locs = 0, []
    for b, (n, s) in enumerate(zip(q_lens, seq_lens)):
        req_to_token[b + 1, :s] = slots[used : used + s].int()
        used += s
        locs.append(req_to_token[b + 1, s - n : s].long())
    out_cache_loc = torch.cat(locs) if locs else torch.zeros(0, dtype=torch.int64)
    rpi = torch.arange(1, bs + 1, dtype=idx_dtype)
    return (
        rpi.to(DEVICE),
        torch.tensor(seq_lens, dtype=idx_dtype, device=DEVICE),
        out_cache_loc.to(DEVICE),
        mapping.to(DEVICE),
        req_to_token.to(DEVICE),
    )


def check(got, want):
    for name, expected in want.items():
        actual = got[name].cpu().long()
        assert torch.equal(actual, expected), f"{name}:\n got {actual}\nwant {expected}"


@pytest.mark.parametrize("pdl", PDL_MODES)
@pytest.mark.parametrize("window", [None, 1, 4, 64])
def test_decode_with_tail_and_window_table(window, pdl):
    q_lens, seq = [1] * 5, [1, 3, 9, 17, 30]
    rpi, seq_t, loc, mapping, r2t = make_step(q_lens, seq, idx_dtype=torch.int32)
    loc[1] = 5  # maps to 0 (evicted)
    loc[3] = -1  # "no slot": -1
    width = (window + 0) if window is not None else None  # max q_len + W - 1 = W
    got = run_kernel(rpi, seq_t, 1, loc, mapping, r2t, 13, width, window, pdl)
    want = reference(rpi, seq_t, torch.ones(5), loc, mapping, r2t, 13, width, window)
    check(got, want)
    assert int(got["swa_out_cache_loc"][3]) == -1 and int(got["swa_out_cache_loc"][1]) == 0


@pytest.mark.parametrize("window", [3, 1000])
def test_target_verify_uniform(window):
    q_lens, seq = [4] * 3, [4, 11, 40]
    rpi, seq_t, loc, mapping, r2t = make_step(q_lens, seq, seed=1)
    width = 4 + window - 1 if window < 100 else 48  # a table wider than needed
    got = run_kernel(rpi, seq_t, 4, loc, mapping, r2t, loc.shape[0] + 1, width, window, False)
    check(got, reference(rpi, seq_t, torch.tensor(q_lens), loc, mapping, r2t, loc.shape[0] + 1, width, window))


@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_extend_variable_lengths(idx_dtype):
    q_lens, seq = [5, 1, 12, 3], [5, 20, 40, 3]
    rpi, seq_t, loc, mapping, r2t = make_step(q_lens, seq, idx_dtype=idx_dtype, seed=2)
    ext = torch.tensor(q_lens, dtype=idx_dtype, device=DEVICE)
    window, width = 6, 12 + 6 - 1
    got = run_kernel(rpi, seq_t, ext, loc, mapping, r2t, loc.shape[0] + 40, width, window, False)
    check(got, reference(rpi, seq_t, ext, loc, mapping, r2t, loc.shape[0] + 40, width, window))


def test_no_swa_outputs():
    q_lens, seq = [2, 3], [2, 10]
    rpi, seq_t, loc, mapping, r2t = make_step(q_lens, seq, seed=3)
    got = run_kernel(rpi, seq_t, torch.tensor(q_lens, device=DEVICE), loc, None, r2t, 0, None, None, False)
    check(got, reference(rpi, seq_t, torch.tensor(q_lens), loc, None, r2t, 0, None, None))


def test_zero_tokens_zeroes_the_whole_buffer():
    mapping = torch.arange(10, dtype=torch.int32, device=DEVICE)
    empty = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    swa = torch.full((2500,), POISON, dtype=torch.int32, device=DEVICE)  # several programs' worth
    cu = torch.full((1,), POISON, dtype=torch.int32, device=DEVICE)
    e32 = torch.zeros(0, dtype=torch.int32, device=DEVICE)
    K.step_metadata(
        empty,
        empty,
        empty,
        empty,
        cu_q_lens=cu,
        window_start=e32,
        token_pos=e32,
        full_to_swa_index_mapping=mapping,
        swa_out_cache_loc=swa,
        window=8,
    )
    assert (swa == 0).all() and int(cu[0]) == 0


def test_more_than_1024_requests():
    g = torch.Generator().manual_seed(4)
    bs = 1030
    q = torch.randint(1, 4, (bs,), generator=g)
    seq = q + torch.randint(0, 5, (bs,), generator=g)
    T = int(q.sum())
    loc = torch.randint(1, 50, (T,), generator=g).to(DEVICE)
    mapping = torch.randperm(60, generator=g).int().to(DEVICE)
    rpi = torch.zeros(bs, dtype=torch.int64, device=DEVICE)
    args = (rpi, seq.to(DEVICE), q.to(DEVICE), loc, mapping, None, T + 3, None, 5)
    got = run_kernel(*args, False)
    check(got, reference(*args))


@pytest.mark.parametrize("window", [4, 64])
def test_out_of_range_indices_never_wrap_or_read_outside(window):
    """Garbage from the engine is read on the device only: out_cache_loc outside the mapping
    translates to -1 (no slot), never wraps to another entry; a req_pool_indices entry
    outside req_to_token reads row 0; a req_to_token entry outside the mapping gives 0."""
    q_lens, seq = [1] * 5, [3, 9, 17, 30, 6]
    rpi, seq_t, loc, mapping, r2t = make_step(q_lens, seq, seed=4)
    M, R = mapping.shape[0], r2t.shape[0]
    loc[0], loc[1], loc[2] = -2, M, -M  # -M would wrap to mapping[0], -2 to a live entry
    rpi[3] = -1  # would wrap to the last row
    rpi[4] = R + 5
    r2t[rpi[1], 7] = -3
    r2t[rpi[2], 14] = M + 7
    width = window
    got = run_kernel(rpi, seq_t, 1, loc, mapping, r2t, 8, width, window, False)
    check(got, reference(rpi, seq_t, torch.ones(5), loc, mapping, r2t, 8, width, window))
    assert got["swa_out_cache_loc"][:3].tolist() == [-1, -1, -1]
    assert (got["swa_window_table"][3:] == 0).all()


@pytest.mark.parametrize("q_lens", [[1] * 5, [3, 1, 4]])
def test_swa_buffer_equals_the_core_definition(q_lens):
    """The fused launch writes cuda_graph_swa_out_cache_loc exactly as the core defines it:
    the pool's translate_loc_from_full_to_swa of the step's slots in [:T], zeros after
    (attnplug.graph_buffers.GraphBuffers.expected_swa_out_cache_loc)."""
    from attnplug import SWAKVPool
    from attnplug.graph_buffers import GraphBuffers

    seq = [s + 20 for s in range(len(q_lens))]
    rpi, seq_t, loc, mapping, r2t = make_step(q_lens, seq, size=200, seed=7)
    pool = SWAKVPool(200, 200, 1, [0], 1, 16, torch.float16, DEVICE)
    assert pool.full_to_swa_index_mapping.shape == mapping.shape
    pool.full_to_swa_index_mapping.copy_(mapping)
    loc[0], loc[-1] = 5, 10_000  # an evicted SWA slot (0) and a slot outside the mapping (-1)
    ext = torch.tensor(q_lens, dtype=torch.int64, device=DEVICE) if len(set(q_lens)) > 1 else q_lens[0]
    T = loc.shape[0]
    got = run_kernel(rpi, seq_t, ext, loc, mapping, r2t, T + 6, None, 8, False)
    want = GraphBuffers.expected_swa_out_cache_loc(pool, loc, T + 6)
    assert torch.equal(got["swa_out_cache_loc"].cpu(), want.cpu())
    assert want[0] == 0 and want[T - 1] == -1 and (want[T:] == 0).all()
