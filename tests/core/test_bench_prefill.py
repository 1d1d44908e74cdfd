"""The prefill benchmark (``attnplug.bench.prefill``) and the arithmetic it reports
(``floors.keys_attended`` / ``attention_flops``), on the host with the reference backend: the
FLOP count against a count of every (query, key) pair, the world's pages, the float32 causal
reference against the float64 oracle, the rows with a peer that is right, wrong or absent, and
``attnplug bench --backend reference --only prefill``."""

import json

import pytest
import torch

from attnplug import cli
from attnplug.backends.reference import ReferenceBackend
from attnplug.bench import Ctx, portable
from attnplug.bench.floors import attention_flops, keys_attended
from attnplug.bench.prefill import (
    PrefillCase,
    PrefillPeer,
    build_prefill_world,
    causal_reference,
    checked_queries,
    request_pages,
    run_prefill_benchmark,
)
from attnplug.bench.step_spec import PeerUnavailable
from attnplug.oracle import exact_attention


def _pairs(seq_len, q_len, window):
    """Every (query, key) pair a causal mask keeps, counted one by one."""
    count = 0
    for p in range(seq_len - q_len, seq_len):
        for j in range(seq_len):
            count += j <= p and (window is None or j > p - window)
    return count


@pytest.mark.parametrize("window", [None, 1, 4, 7, 40])
@pytest.mark.parametrize("seq_len,q_len", [(1, 1), (9, 9), (20, 1), (20, 6), (33, 12), (5, 0)])
def test_keys_attended_counts_every_pair_the_mask_keeps(seq_len, q_len, window):
    assert keys_attended(seq_len, q_len, window) == _pairs(seq_len, q_len, window)


def test_attention_flops_of_a_causal_prefill():
    """2 * 2 * H * D * T (T + 1) / 2: the issue's 16k-token D=128 prefill with 32 heads."""
    T = 16384
    assert attention_flops(32, 128, [T], [T]) == 2 * 2 * 32 * 128 * T * (T + 1) // 2 == 2 * 32 * 128 * T * (T + 1)
    assert attention_flops(32, 128, [1024] * 8, [1024] * 8) == 8 * attention_flops(32, 128, [1024], [1024])
    assert attention_flops(8, 64, [100], [1], window=16) == 2 * 2 * 8 * 64 * 16  # a windowed decode token
    assert PrefillCase(128, (T,), 16).flops(32) == attention_flops(32, 128, [T], [T])
    with pytest.raises(ValueError, match="q_len <= seq_len"):
        keys_attended(4, 5)
    with pytest.raises(ValueError, match="2 seq_lens but 1 q_lens"):
        attention_flops(1, 1, [3, 4], [3])


def test_case_labels():
    assert PrefillCase(128, (16384,), 16).describe() == "D=128 1x16384 page 16"
    assert PrefillCase(256, (1024,) * 8, 1).describe() == "D=256 8x1024 page 1"
    assert PrefillCase(64, (3, 5), 4).describe() == "D=64 2 prompts (8 tokens) page 4"


@pytest.mark.parametrize("page_size", [1, 4])
def test_the_world_stores_the_prompts_in_whole_pages(page_size):
    case = PrefillCase(16, (9, 4, 8), page_size)
    world = build_prefill_world(case, num_heads=4, num_kv_heads=2, dtype=torch.float32, device="cpu")
    assert world.q.shape == (21, 4, 16) and world.k.shape == world.v.shape == (21, 2, 16)
    assert world.batch.num_tokens == 21 and world.batch.extend_seq_lens_cpu == [9, 4, 8]
    indptr, pages, last = request_pages(world)
    k_cache, v_cache = world.pool.get_kv_buffer(0)
    offset = 0
    for i, t in enumerate(case.q_lens):
        own = pages[indptr[i] : indptr[i + 1]].long()
        slots = (own[:, None] * page_size + torch.arange(page_size)).reshape(-1)[:t]
        assert int(last[i]) == t - (own.numel() - 1) * page_size and 1 <= int(last[i]) <= page_size
        assert torch.equal(k_cache[slots], world.k[offset : offset + t])  # stored before anything runs
        assert torch.equal(v_cache[slots], world.v[offset : offset + t])
        offset += t
    assert indptr.dtype == pages.dtype == last.dtype == torch.int32


def test_request_pages_refuses_slots_out_of_page_order():
    world = build_prefill_world(
        PrefillCase(16, (8,), 4), num_heads=4, num_kv_heads=2, dtype=torch.float32, device="cpu"
    )
    row = world.req_rows[0]
    world.rows.req_to_token[row, [0, 1]] = world.rows.req_to_token[row, [1, 0]]
    with pytest.raises(ValueError, match="not whole pages of 4 in order"):
        request_pages(world)


def test_causal_reference_equals_the_float64_oracle():
    g = torch.Generator().manual_seed(4)
    t, H, Hkv, D = 23, 6, 2, 8
    q, k, v = (
        torch.randn(t, H, D, generator=g),
        torch.randn(t, Hkv, D, generator=g),
        torch.randn(t, Hkv, D, generator=g),
    )
    want = exact_attention(q.double(), k.double()[None], v.double()[None], [t], [t], None, 0.3)
    pos = checked_queries(t)
    assert torch.equal(pos, torch.arange(t))  # a short prompt: every query checked
    torch.testing.assert_close(causal_reference(q, k, v, pos, 0.3).double(), want, rtol=1e-5, atol=1e-6)
    some = torch.tensor([0, 7, 22])
    torch.testing.assert_close(causal_reference(q[some], k, v, some, 0.3).double(), want[some], rtol=1e-5, atol=1e-6)
    long = checked_queries(1000)
    assert long.numel() == 512 and long[0] == 0 and long[-1] == 999 and long[255] == 255 and long[256] == 744


def _reference_peer(ctx, world):
    backend = ReferenceBackend(world.pool, world.rows, num_heads=world.num_heads)
    backend.init_forward_metadata(world.batch)
    out = backend.forward(world.q, world.k, world.v, 0, world.batch, save_kv_cache=False)
    return 1e6, out, "the reference again", {"config": {"backend": "reference"}}


def _wrong_peer(ctx, world):
    us, out, detail, fields = _reference_peer(ctx, world)
    return us, out.flip(0), detail, fields


def test_rows_with_a_right_a_wrong_and_a_missing_peer():
    asked = []

    def missing(ctx, world):
        asked.append(world.case)
        raise PeerUnavailable("peerlib not installed")

    cases = [PrefillCase(16, (12,), 4), PrefillCase(16, (5, 7), 1)]
    ctx = Ctx(backend_cls=ReferenceBackend)
    rows = run_prefill_benchmark(
        ctx,
        name="prefill",
        make=ReferenceBackend,
        cases=cases,
        num_heads=4,
        num_kv_heads=2,
        dtype=torch.float32,
        peers=[
            PrefillPeer("right", _reference_peer, target=1e-9),
            PrefillPeer("wrong", _wrong_peer),
            PrefillPeer("missing", missing),
        ],
        tflops_target=lambda case: 1e-12 if len(case.q_lens) == 1 else None,
        tolerance=1e-4,
        iters=1,
        need_s=0,
    )
    assert not [r for r in rows if r.get("error")], [r["error"] for r in rows if r.get("error")]
    assert len(asked) == 1  # asked once, then left out
    missing_rows = [r for r in rows if r["case"] == "peer: missing"]
    assert len(missing_rows) == 1 and missing_rows[0]["notes"] == "peerlib not installed"
    own = {r["case"]: r for r in rows if r["metric"] == "time" and r["case"].endswith(" reference")}
    assert set(own) == {"D=16 1x12 page 4 reference", "D=16 2 prompts (12 tokens) page 1 reference"}
    single = own["D=16 1x12 page 4 reference"]
    assert single["flops"] == attention_flops(4, 16, [12], [12]) and single["tflop_s"] > 0
    assert single["target"] == ">= 1e-12 TFLOP/s" and single["met"] is True
    assert own["D=16 2 prompts (12 tokens) page 1 reference"]["target"] is None
    checks = {r["case"]: r for r in rows if r["metric"] == "max |out diff|"}
    assert checks["D=16 1x12 page 4 reference vs float32 torch (checked queries)"]["met"] is True
    assert checks["D=16 1x12 page 4 right vs float32 torch (checked queries)"]["met"] is True
    assert checks["D=16 1x12 page 4 wrong vs float32 torch (checked queries)"]["met"] is False
    right = [r for r in rows if r["metric"] == "speedup (right / reference)"]
    assert len(right) == 2 and all(r["met"] and r["right_us"] == 1e6 for r in right)
    assert [r["config"] for r in rows if r["case"] == "D=16 1x12 page 4 right"] == [{"backend": "reference"}]


def test_a_case_is_skipped_when_the_budget_runs_low():
    from attnplug.bench import Deadline

    ctx = Ctx(backend_cls=ReferenceBackend, deadline=Deadline(0.0))
    rows = run_prefill_benchmark(
        ctx, name="prefill", make=ReferenceBackend, cases=[PrefillCase(16, (8,), 1)], num_heads=4, num_kv_heads=2,
        dtype=torch.float32,
    )  # fmt: skip
    assert [(r["case"], r["notes"]) for r in rows] == [("D=16 1x8 page 1 reference", "skipped: time budget")]


def test_the_portable_suite_runs_prefill_on_the_host(tmp_path):
    assert "prefill" in portable.SUITE.names() and "prefill" not in portable.SUITE.names(default_only=True)
    assert cli.main(["bench", "--backend", "reference", "--quick", "--only", "prefill", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["benchmarks"] == ["prefill"] and result["summary"]["errors"] == []
    times = [r for r in result["rows"] if r["metric"] == "time"]
    assert [r["case"] for r in times] == ["D=16 1x48 page 4 reference", "D=16 2x16 page 1 reference"]
    assert all(r["value"] > 0 and r["tflop_s"] > 0 for r in times)
    assert sum(r["metric"] == "max |out diff|" and r["met"] for r in result["rows"]) == 2
