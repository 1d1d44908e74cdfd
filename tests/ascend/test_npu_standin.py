"""The EMULATED torch_npu operators (tests/ascend/npu_standin.py) against the float64 oracle
(``attnplug.oracle.exact_attention``) and against their documented refusals: what the ascend
backend's host tests rest on. Each rule checked here is cited in the stand-in."""

from __future__ import annotations

import npu_standin
import pytest
import torch
from npu_standin import INT32_MAX, OperatorError

from attnplug.oracle import exact_attention

HALF_TOL = {torch.float16: 2e-3, torch.bfloat16: 1.2e-2}


def cumulative(lens):
    return npu_standin.tnd_reference_inputs(lens)


class Paged:
    """Requests with ``kv_lens`` keys each (the last ``q_lens`` of them are the queries) in a
    paged cache of ``block_size`` whose blocks are handed out scrambled, never block 0."""

    def __init__(
        self, q_lens, kv_lens, *, heads=8, kv_heads=2, head_dim=64, block_size=128, dtype=torch.float16, seed=0
    ):
        g = torch.Generator().manual_seed(seed)
        self.q_lens, self.kv_lens, self.bs = list(q_lens), list(kv_lens), block_size
        self.N, self.Nkv, self.D, self.dtype = heads, kv_heads, head_dim, dtype
        B, K = len(kv_lens), max(kv_lens)
        self.keys = (torch.randn(B, K, kv_heads, head_dim, generator=g)).to(dtype)
        self.values = (torch.randn(B, K, kv_heads, head_dim, generator=g)).to(dtype)
        self.query = torch.randn(sum(q_lens), heads, head_dim, generator=g).to(dtype)
        need = [-(-n // block_size) for n in kv_lens]
        self.num_blocks = sum(need) + 3
        order = (torch.randperm(self.num_blocks - 1, generator=g) + 1).tolist()
        width = max(need) + 1
        self.table = torch.zeros(B, width, dtype=torch.int32)
        cache = torch.full((self.num_blocks, block_size, kv_heads, head_dim), float("nan")).to(dtype)
        vcache = cache.clone()
        for b, n in enumerate(need):
            for c in range(n):
                blk = order.pop()
                self.table[b, c] = blk
                lo, hi = c * block_size, min((c + 1) * block_size, kv_lens[b])
                cache[blk, : hi - lo] = self.keys[b, lo:hi]
                vcache[blk, : hi - lo] = self.values[b, lo:hi]
        self.k_cache = cache.view(self.num_blocks, block_size, kv_heads * head_dim)
        self.v_cache = vcache.view(self.num_blocks, block_size, kv_heads * head_dim)

    def expected(self, *, window=None, scale=0.125, sinks=None):
        return exact_attention(
            self.query.double(),
            self.keys.double(),
            self.values.double(),
            self.kv_lens,
            self.q_lens,
            window,
            scale,
            sinks=sinks,
        )

    def kwargs_v2(self, **over):
        kw = dict(
            actual_seq_qlen=cumulative(self.q_lens),
            actual_seq_kvlen=list(self.kv_lens),
            block_table=self.table,
            block_size=self.bs,
            num_query_heads=self.N,
            num_key_value_heads=self.Nkv,
            softmax_scale=0.125,
            input_layout="TND",
            sparse_mode=3,
            atten_mask=MASK,
            pre_tokens=INT32_MAX,
            next_tokens=0,
        )
        kw.update(over)
        return kw


MASK = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)


def rel_err(out, want):
    out = out.double().flatten(1)
    want = want.flatten(1)
    return ((out - want).norm(dim=1) / want.norm(dim=1).clamp_min(1e-9)).max().item()


# ---------------------------------------------------------------------------- semantics vs the oracle
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [128, 256])
def test_causal_over_a_cached_prefix_matches_the_oracle(dtype, block_size):
    """sparse_mode=3: each request's queries are its last keys (chunked prefill on a prefix)."""
    w = Paged([5, 1, 40], [300, 17, 40], block_size=block_size, dtype=dtype)
    out, lse = npu_standin.STANDIN.npu_fused_infer_attention_score_v2(w.query, w.k_cache, w.v_cache, **w.kwargs_v2())
    assert out.shape == w.query.shape and out.dtype == dtype and lse.shape == (1,)
    assert rel_err(out, w.expected()) < HALF_TOL[dtype]


@pytest.mark.parametrize("window", [1, 7, 128, 1000])
def test_band_with_pre_tokens_w_minus_1_is_the_contract_window(window):
    """sparse_mode=4, pre_tokens=W-1, next_tokens=0: keys p - W < j <= p (W keys with its own)."""
    w = Paged([3, 1, 12], [260, 9, 140])
    kw = w.kwargs_v2(sparse_mode=4, pre_tokens=window - 1, next_tokens=0)
    out, _ = npu_standin.STANDIN.npu_fused_infer_attention_score_v2(w.query, w.k_cache, w.v_cache, **kw)
    assert rel_err(out, w.expected(window=window)) < 2e-3


def test_band_over_a_table_clipped_to_the_window_keeps_positions():
    """Clipping a request's table to the pages of its window (the KV length shrinks by the
    pages dropped) changes nothing: the band is aligned to the last key."""
    window, bs = 40, 128
    w = Paged([4, 1], [700, 300], block_size=bs)
    start = [(k - q - window + 1) // bs for q, k in zip(w.q_lens, w.kv_lens)]
    table = torch.zeros_like(w.table)
    for b, s in enumerate(start):
        table[b, : w.table.shape[1] - s] = w.table[b, s:]
    kv = [k - s * bs for k, s in zip(w.kv_lens, start)]
    kw = w.kwargs_v2(sparse_mode=4, pre_tokens=window - 1, actual_seq_kvlen=kv, block_table=table)
    out, _ = npu_standin.STANDIN.npu_fused_infer_attention_score_v2(w.query, w.k_cache, w.v_cache, **kw)
    assert rel_err(out, w.expected(window=window)) < 2e-3


@pytest.mark.parametrize("heads,kv_heads", [(8, 8), (8, 2), (64, 1)])
def test_gqa_up_to_64_query_heads_per_kv_head(heads, kv_heads):
    w = Paged([6, 2], [50, 130], heads=heads, kv_heads=kv_heads)
    out, _ = npu_standin.STANDIN.npu_fused_infer_attention_score_v2(w.query, w.k_cache, w.v_cache, **w.kwargs_v2())
    assert rel_err(out, w.expected()) < 2e-3


def test_learnable_sink_joins_each_heads_denominator():
    w = Paged([3, 1], [200, 30])
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(5)) * 2 + 0.5
    for kw in (w.kwargs_v2(), w.kwargs_v2(sparse_mode=4, pre_tokens=15)):
        out, _ = npu_standin.STANDIN.npu_fused_infer_attention_score_v2(
            w.query, w.k_cache, w.v_cache, learnable_sink=sinks, **kw
        )
        window = None if kw["sparse_mode"] == 3 else 16
        assert rel_err(out, w.expected(window=window, sinks=sinks)) < 2e-3


def test_v1_is_v2_under_other_names_and_the_4d_cache_layout_is_the_same():
    w = Paged([5, 1], [140, 20])
    v2, _ = npu_standin.STANDIN.npu_fused_infer_attention_score_v2(w.query, w.k_cache, w.v_cache, **w.kwargs_v2())
    v1, _ = npu_standin.STANDIN.npu_fused_infer_attention_score(
        w.query,
        w.k_cache,
        w.v_cache,
        actual_seq_lengths=cumulative(w.q_lens),
        actual_seq_lengths_kv=list(w.kv_lens),
        block_table=w.table,
        block_size=w.bs,
        num_heads=w.N,
        num_key_value_heads=w.Nkv,
        scale=0.125,
        input_layout="TND",
        sparse_mode=3,
        atten_mask=MASK,
    )
    assert torch.equal(v1, v2)
    k4 = w.k_cache.view(w.num_blocks, w.bs, w.Nkv, w.D).permute(0, 2, 1, 3).contiguous()
    v4 = w.v_cache.view(w.num_blocks, w.bs, w.Nkv, w.D).permute(0, 2, 1, 3).contiguous()
    out4, _ = npu_standin.STANDIN.npu_fused_infer_attention_score_v2(w.query, k4, v4, **w.kwargs_v2())
    assert torch.equal(out4, v2)


def test_unpaged_tnd_takes_cumulative_kv_lengths():
    w = Paged([4, 3], [10, 7])
    keys = torch.cat([w.keys[0, :10], w.keys[1, :7]]).contiguous()
    values = torch.cat([w.values[0, :10], w.values[1, :7]]).contiguous()
    out, _ = npu_standin.STANDIN.npu_fused_infer_attention_score_v2(
        w.query, keys, values, **w.kwargs_v2(block_table=None, block_size=0, actual_seq_kvlen=[10, 17])
    )
    assert rel_err(out, w.expected()) < 2e-3
    with pytest.raises(OperatorError, match="cumulative"):
        npu_standin.STANDIN.npu_fused_infer_attention_score_v2(
            w.query, keys, values, **w.kwargs_v2(block_table=None, block_size=0, actual_seq_kvlen=[10, 7])
        )


def test_softmax_lse_and_empty_kv():
    w = Paged([2, 1], [20, 9])
    out, lse = npu_standin.STANDIN.npu_fused_infer_attention_score_v2(
        w.query, w.k_cache, w.v_cache, return_softmax_lse=True, **w.kwargs_v2()
    )
    assert lse.shape == (3, 8, 1) and lse.dtype == torch.float32 and torch.isfinite(lse).all()
    # [FIA]: an empty KV (S2 = 0) fills zeros
    kw = w.kwargs_v2(actual_seq_kvlen=[20, 0], sparse_mode=0, atten_mask=None)
    out, _ = npu_standin.STANDIN.npu_fused_infer_attention_score_v2(w.query, w.k_cache, w.v_cache, **kw)
    assert torch.equal(out[2:], torch.zeros_like(out[2:]))


def test_decode_takes_blocks_of_16_prefill_needs_multiples_of_128():
    w = Paged([1, 1], [40, 3], block_size=16)
    out, _ = npu_standin.STANDIN.npu_fused_infer_attention_score_v2(w.query, w.k_cache, w.v_cache, **w.kwargs_v2())
    assert rel_err(out, w.expected()) < 2e-3
    w = Paged([2, 1], [40, 3], block_size=64)
    with pytest.raises(OperatorError, match="block_size=64"):
        npu_standin.STANDIN.npu_fused_infer_attention_score_v2(w.query, w.k_cache, w.v_cache, **w.kwargs_v2())
    out, _ = npu_standin.RELAXED.npu_fused_infer_attention_score_v2(w.query, w.k_cache, w.v_cache, **w.kwargs_v2())
    assert rel_err(out, w.expected()) < 2e-3


# ---------------------------------------------------------------------------- documented refusals
def _refusals(w: Paged):
    q = w.query
    noncontig = torch.randn(q.shape[1], q.shape[0], q.shape[2]).to(q.dtype).transpose(0, 1)
    return [
        ("cumulative", dict(actual_seq_qlen=[3, 2]), {}),
        ("ends at", dict(actual_seq_qlen=[3, 9]), {}),
        ("host list", dict(actual_seq_qlen=torch.tensor([3, 4])), {}),
        ("needs actual_seq_lengths_kv", dict(actual_seq_kvlen=None), {}),
        ("entries", dict(actual_seq_kvlen=[40]), {}),
        ("> 64", dict(), dict(heads=128, kv_heads=1)),
        ("not a multiple", dict(num_key_value_heads=3), {}),
        ("has 8 heads", dict(num_query_heads=4), {}),
        ("2048", dict(sparse_mode=4, pre_tokens=3, atten_mask=None), {}),
        ("2048 x 2048", dict(atten_mask=torch.ones(1024, 1024, dtype=torch.bool)), {}),
        ("compressed", dict(atten_mask=~MASK), {}),
        ("sparse_mode=5", dict(sparse_mode=5), {}),
        ("int32", dict(block_table=w.table.long()), {}),
        ("columns", dict(block_table=w.table[:, :1].contiguous(), actual_seq_kvlen=[300, 40]), {}),
        ("block_size=0", dict(block_size=0), {}),
        ("more queries than keys", dict(actual_seq_kvlen=[2, 40]), {}),
        ("learnable_sink", dict(learnable_sink=torch.zeros(3)), {}),
        ("not contiguous", dict(), dict(query=noncontig)),
        ("inner_precise", dict(inner_precise=7), {}),
    ]


def test_documented_argument_checks_raise():
    w = Paged([3, 4], [140, 40])
    for match, over, special in _refusals(w):
        q = special.get("query", w.query)
        if "heads" in special:
            ww = Paged([3, 4], [140, 40], heads=special["heads"], kv_heads=special["kv_heads"])
            q, kc, vc, over = ww.query, ww.k_cache, ww.v_cache, dict(over, num_query_heads=special["heads"])
            kw = ww.kwargs_v2(**over)
        else:
            kc, vc, kw = w.k_cache, w.v_cache, w.kwargs_v2(**over)
        with pytest.raises(OperatorError, match=match):
            npu_standin.STANDIN.npu_fused_infer_attention_score_v2(q, kc, vc, **kw)
    with pytest.raises(OperatorError, match="float16 or bfloat16"):
        npu_standin.STANDIN.npu_fused_infer_attention_score_v2(
            w.query.float(), w.k_cache.float(), w.v_cache.float(), **w.kwargs_v2()
        )
    small = Paged([1], [300], block_size=128)
    with pytest.raises(OperatorError, match="blocks, the batch needs"):
        npu_standin.STANDIN.npu_fused_infer_attention_score_v2(
            small.query, small.k_cache[:2].contiguous(), small.v_cache[:2].contiguous(), **small.kwargs_v2()
        )
    with pytest.raises(NotImplementedError, match="emulated"):
        npu_standin.STANDIN.npu_fused_infer_attention_score_v2(
            w.query, w.k_cache, w.v_cache, **w.kwargs_v2(input_layout="BSH")
        )


# ---------------------------------------------------------------------------- the KV store
def test_scatter_pa_kv_cache_writes_the_mapped_slots_only():
    g = torch.Generator().manual_seed(1)
    cache = torch.randn(6, 4, 2, 8, generator=g).half()
    vcache = torch.randn(6, 4, 2, 8, generator=g).half()
    before_k, before_v = cache.clone(), vcache.clone()
    k = torch.randn(3, 2, 8, generator=g).half()
    v = torch.randn(3, 2, 8, generator=g).half()
    slots = torch.tensor([5, 22, 13], dtype=torch.int32)
    npu_standin.STANDIN.npu_scatter_pa_kv_cache(k, v, cache, vcache, slots, cache_mode="Norm")
    want_k, want_v = before_k.view(24, 2, 8).clone(), before_v.view(24, 2, 8).clone()
    want_k[slots.long()], want_v[slots.long()] = k, v
    assert torch.equal(cache.view(24, 2, 8), want_k) and torch.equal(vcache.view(24, 2, 8), want_v)
    for bad, match in (([5, -1, 13], "outside"), ([5, 24, 13], "outside")):
        with pytest.raises(OperatorError, match=match):
            npu_standin.STANDIN.npu_scatter_pa_kv_cache(k, v, cache, vcache, torch.tensor(bad), cache_mode="Norm")
    with pytest.raises(OperatorError, match="dtype"):
        npu_standin.STANDIN.npu_scatter_pa_kv_cache(k, v, cache, vcache, slots.short(), cache_mode="Norm")
    with pytest.raises(OperatorError, match="not contiguous"):
        kt = torch.randn(2, 3, 8).half().transpose(0, 1)
        npu_standin.STANDIN.npu_scatter_pa_kv_cache(kt, v, cache, vcache, slots, cache_mode="Norm")
    with pytest.raises(NotImplementedError, match="PA_NZ"):
        npu_standin.STANDIN.npu_scatter_pa_kv_cache(k, v, cache, vcache, slots)  # the documented default


def test_scatter_duplicates_are_undefined_unless_identical():
    s = npu_standin.fresh()
    cache, vcache = torch.zeros(2, 4, 1, 8).half(), torch.zeros(2, 4, 1, 8).half()
    same = torch.ones(2, 1, 8).half()
    s.npu_scatter_pa_kv_cache(same, same, cache, vcache, torch.tensor([3, 3]), cache_mode="Norm")
    assert torch.equal(cache.view(8, 1, 8)[3], same[0]) and s.poisoned == 0
    diff = torch.stack([torch.ones(1, 8), 2 * torch.ones(1, 8)]).half()
    s.npu_scatter_pa_kv_cache(diff, diff, cache, vcache, torch.tensor([5, 5]), cache_mode="Norm")
    assert torch.isnan(cache.view(8, 1, 8)[5]).all() and s.poisoned == 1


# ---------------------------------------------------------------------------- the graph runtime
def _captured_call(s: npu_standin.StandIn, w: Paged, kv_lens):
    """Capture one FIA task group the way the docs' example does; returns (graph, handle, event, out)."""
    npu = s.npu
    graph = npu.NPUGraph()
    kw = w.kwargs_v2(actual_seq_kvlen=list(kv_lens))
    with npu.graph(graph):
        stream = npu.current_stream()
        event = npu.ExternalEvent()
        ws = s._npu_fused_infer_attention_score_v2_get_max_workspace(w.query, w.k_cache, w.v_cache, **kw)
        out = torch.empty_like(w.query)
        lse = torch.empty(1)
        event.wait(stream)
        event.reset(stream)
        npu.graph_task_group_begin(stream)
        s.npu_fused_infer_attention_score_v2.out(w.query, w.k_cache, w.v_cache, workspace=ws, out=[out, lse], **kw)
        handle = npu.graph_task_group_end(stream)
    return graph, handle, event, out, (ws, lse)


def test_graph_replay_keeps_captured_lengths_until_the_task_is_updated():
    s = npu_standin.fresh()
    npu = s.npu
    w = Paged([1, 1], [100, 60])
    graph, handle, event, out, (ws, lse) = _captured_call(s, w, [90, 50])  # captured with shorter KV
    with pytest.raises(RuntimeError, match="nobody recorded"):
        graph.replay()  # on hardware: the task would wait for its update forever
    update = npu.Stream()
    with pytest.raises(OperatorError, match="capture stream"):
        npu.graph_task_update_begin(handle.capture_stream, handle)
    for kv in ([90, 50], [100, 60]):
        with npu.stream(update):
            npu.graph_task_update_begin(update, handle)
            kw = w.kwargs_v2(actual_seq_kvlen=kv)
            s.npu_fused_infer_attention_score_v2.out(w.query, w.k_cache, w.v_cache, workspace=ws, out=[out, lse], **kw)
            npu.graph_task_update_end(update)
            event.record(update)
        out.zero_()
        graph.replay()
        want, _ = s.npu_fused_infer_attention_score_v2(
            w.query, w.k_cache, w.v_cache, **w.kwargs_v2(actual_seq_kvlen=kv)
        )
        assert torch.equal(out, want)
    assert handle.updates == 2
    # a replay reads the tensors' current contents (device values), with the host lengths it was given
    w.query.mul_(-1)
    with npu.stream(update):
        npu.graph_task_update_begin(update, handle)
        kw = w.kwargs_v2(actual_seq_kvlen=[100, 60])
        s.npu_fused_infer_attention_score_v2.out(w.query, w.k_cache, w.v_cache, workspace=ws, out=[out, lse], **kw)
        npu.graph_task_update_end(update)
        event.record(update)
    out.zero_()
    graph.replay()
    want, _ = s.npu_fused_infer_attention_score_v2(w.query, w.k_cache, w.v_cache, **w.kwargs_v2())
    assert torch.equal(out, want)


def test_a_replay_without_the_update_keeps_the_captured_lengths():
    s = npu_standin.fresh()
    w = Paged([1, 1], [100, 60])
    graph, handle, event, out, _ = _captured_call(s, w, [90, 50])
    event.record(None)  # the event recorded, the task NOT re-issued: the captured lengths stay
    graph.replay()
    stale, _ = s.npu_fused_infer_attention_score_v2(
        w.query, w.k_cache, w.v_cache, **w.kwargs_v2(actual_seq_kvlen=[90, 50])
    )
    fresh, _ = s.npu_fused_infer_attention_score_v2(w.query, w.k_cache, w.v_cache, **w.kwargs_v2())
    assert torch.equal(out, stale) and not torch.equal(out, fresh)
