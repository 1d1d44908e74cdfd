"""The ascend op layer (``AscendBackend.paged_ops``: ``attnplug_ascend.paged_ops.AscendOps``)
through the EMULATED torch_npu operators (tests/ascend/npu_standin.py).

An engine-like twin stores and attends over caches it owns, the way vLLM lays them out, through
``AscendOps`` and through ``PortableOps`` over a copy of the same caches. Each step checks that
the KV caches agree bit for bit, that the outputs agree with each other and with float64
attention (``attnplug.oracle.exact_attention``), and which path ran: the stand-in counts its
operator calls, and ``AscendOps.fallbacks`` names each portable call's reason. Every slot no
request owns holds NaN (slot 0, never a key, a finite value), so a read outside a request's
keys shows.
"""

from __future__ import annotations

from typing import List

import npu_standin
import pytest
import torch
from emulated import EmulatedAscendBackend

import suite_runs
from attnplug.ops import OpsInputError, PortableOps
from attnplug.oracle import exact_attention
from attnplug_ascend.backend import AscendBackend
from attnplug_ascend.fused import FIA_DTYPES
from attnplug_ascend.ops import load_ops
from attnplug_ascend.paged_ops import AscendOps, AscendStep
from attnplug_conformance.checks.check_paged_ops import padded_block_table
from attnplug_conformance.exact import LONG_TOL

#: the engine's step pattern: prompts (one of 300 keys), decodes beside a fresh prompt, a chunk
#: on a cached prefix beside a verify-like step and a decode, decodes over 301 and fewer keys
STEPS = [([0, 1, 2], [5, 17, 300]), ([0, 1, 3, 2], [1, 1, 9, 1]), ([3, 0, 1], [20, 3, 1]), ([2, 0, 1, 3], [1] * 4)]


def make_ops(standin=None, **over):
    """``AscendOps`` on the host over ``standin`` (a fresh stand-in by default), declaring what
    ``EmulatedAscendBackend`` declares unless ``over`` says otherwise."""
    standin = standin if standin is not None else npu_standin.fresh()
    kw = dict(
        name="ascend-emulated",
        dtypes=FIA_DTYPES,
        head_dims=(64, 128, 256),
        native_block_sizes=(128, 256, 512),
        device_type="cpu",
    )
    return AscendOps("cpu", load_ops(standin), **{**kw, **over}), standin


def caches(layout: str, num_blocks: int, P: int, hkv: int, D: int, dtype):
    """``(raw, key_cache, value_cache)``, every element NaN: ``separate`` ``[N, P, Hkv, D]``
    each; ``stacked`` vLLM's ``[2, N, P, Hkv, D]`` (K and V contiguous halves); ``flat``
    ``[S, Hkv, D]`` each; ``interleaved`` the K and V halves of ``[N, P, Hkv, 2 * D]``."""
    nan = dict(dtype=dtype)
    if layout == "separate":
        k, v = (torch.full((num_blocks, P, hkv, D), float("nan"), **nan) for _ in range(2))
        return [k, v], k, v
    if layout == "stacked":
        kv = torch.full((2, num_blocks, P, hkv, D), float("nan"), **nan)
        return [kv], kv[0], kv[1]
    if layout == "flat":
        k, v = (torch.full((num_blocks * P, hkv, D), float("nan"), **nan) for _ in range(2))
        return [k, v], k, v
    assert layout == "interleaved"
    kv = torch.full((num_blocks, P, hkv, 2 * D), float("nan"), **nan)
    return [kv], kv[..., :D], kv[..., D:]


def bits(tensors) -> List[torch.Tensor]:
    return [t.view(torch.int16).clone() for t in tensors]


class Twin:
    """One engine's caches twice: through ``AscendOps`` and through ``PortableOps``."""

    def __init__(
        self, layout="separate", P=128, *, H=8, hkv=2, D=64, dtype=torch.float16, seed=0, ops=None, num_blocks=None
    ):
        self.ops, self.standin = ops if ops is not None else make_ops()
        self.portable = PortableOps("cpu", dtypes=FIA_DTYPES, fp8_kv_dtypes=())
        self.P, self.H, self.hkv, self.D, self.dtype = P, H, hkv, D, dtype
        self.num_blocks = num_blocks or (640 // P + 8)
        self.raw, self.kc, self.vc = caches(layout, self.num_blocks, P, hkv, D, dtype)
        self.raw_p, self.kc_p, self.vc_p = caches(layout, self.num_blocks, P, hkv, D, dtype)
        for c in (self.kc, self.vc, self.kc_p, self.vc_p):  # slot 0, never a key: finite, so that the
            (c[0, 0] if c.dim() == 4 else c[0]).fill_(0.5)  # stand-in sees skipped tokens write equal bytes
        self.gen = torch.Generator().manual_seed(seed)
        self.free = (torch.randperm(self.num_blocks - 1, generator=self.gen) + 1).tolist()  # never block 0
        self.blocks: List[List[int]] = []
        self.hist_k: List[torch.Tensor] = []
        self.hist_v: List[torch.Tensor] = []

    def rand(self, *shape) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen).to(self.dtype)

    def slot(self, r: int, pos: int) -> int:
        while len(self.blocks) <= r:
            self.blocks.append([])
            self.hist_k.append(torch.zeros(0, self.hkv, self.D, dtype=torch.float64))
            self.hist_v.append(torch.zeros(0, self.hkv, self.D, dtype=torch.float64))
        while len(self.blocks[r]) <= pos // self.P:
            self.blocks[r].append(self.free.pop())
        return self.blocks[r][pos // self.P] * self.P + pos % self.P

    def inputs(self, reqs, new):
        """The step's k / v / q, slot mapping (3 padded tokens of slot -1), lengths and table."""
        T = sum(new)
        k, v = self.rand(T + 3, self.hkv, self.D), self.rand(T + 3, self.hkv, self.D)
        q = self.rand(T, self.H, self.D)
        slots, seq = [], []
        for r, n in zip(reqs, new):
            start = self.hist_k[r].shape[0] if r < len(self.hist_k) else 0
            slots += [self.slot(r, start + i) for i in range(n)]
            seq.append(start + n)
        table = padded_block_table([self.blocks[r] for r in reqs])
        qsl = torch.tensor([0] + torch.tensor(new).cumsum(0).tolist(), dtype=torch.int32)
        return k, v, q, torch.tensor(slots + [-1] * 3), qsl, torch.tensor(seq, dtype=torch.int32), table

    def plan(self, ops, qsl, seq, table, new, **kw):
        return ops.plan(
            qsl, seq, table, self.P, num_tokens=sum(new), max_query_len=max(new), max_seq_len=int(seq.max()), **kw
        )

    def step(self, reqs, new, *, window=None, sinks=None, softcap=None, scale=0.125, host=False):
        """Store and attend one step through both op layers; returns ``(out, portable, exact)``
        (float64) after checking the caches agree bit for bit."""
        k, v, q, slots, qsl, seq, table = self.inputs(reqs, new)
        self.ops.store_kv(k, v, self.kc, self.vc, slots)
        self.portable.store_kv(k, v, self.kc_p, self.vc_p, slots)
        for a, b in zip(bits(self.raw), bits(self.raw_p)):
            assert torch.equal(a, b), "the KV caches differ from the portable store's"
        extra = dict(query_start_loc_cpu=qsl.clone(), seq_lens_cpu=seq.tolist()) if host else {}
        step = self.plan(self.ops, qsl, seq, table, new, **extra)
        step_p = self.plan(self.portable, qsl, seq, table, new)
        kw = dict(scale=scale, window=window, softcap=softcap, sinks=sinks)
        out = self.ops.attend(q, self.kc, self.vc, step, **kw)
        ref = self.portable.attend(q, self.kc_p, self.vc_p, step_p, **kw)
        T = sum(new)
        for (r, n), lo in zip(zip(reqs, new), qsl[:-1].tolist()):
            self.hist_k[r] = torch.cat([self.hist_k[r], k[lo : lo + n].double()])
            self.hist_v[r] = torch.cat([self.hist_v[r], v[lo : lo + n].double()])
        K = int(seq.max())
        keys = torch.zeros(len(reqs), K, self.hkv, self.D, dtype=torch.float64)
        values = keys.clone()
        for i, r in enumerate(reqs):
            keys[i, : seq[i]], values[i, : seq[i]] = self.hist_k[r], self.hist_v[r]
        exact = exact_attention(
            q.double(), keys, values, seq.tolist(), new, window, scale, logit_softcap=softcap, sinks=sinks
        )
        assert out.shape == (T, self.H, self.D) and out.dtype == self.dtype
        return out.double(), ref.double(), exact


def assert_close(out, exact, dtype, what=""):
    assert torch.isfinite(out).all(), f"{what}: non-finite output (a read of a slot no request owns?)"
    err = (out - exact).norm(dim=-1) / exact.norm(dim=-1).clamp_min(1e-3 * exact.shape[-1] ** 0.5)
    assert float(err.max()) <= LONG_TOL[dtype], f"{what}: relative error {float(err.max()):.3g}"


def run_steps(t: Twin, **kw):
    for i, (reqs, new) in enumerate(STEPS):
        out, ref, exact = t.step(reqs, new, **kw)
        assert_close(out, exact, t.dtype, f"step {i}")
        assert_close(ref, exact, t.dtype, f"portable step {i}")


# ---------------------------------------------------------------------------- the fused path
@pytest.mark.parametrize(
    "layout,P,window",
    [
        ("separate", 128, None),
        ("separate", 256, 40),
        ("stacked", 128, 40),
        ("stacked", 512, None),
        ("flat", 128, 40),
        ("flat", 256, None),
    ],
)
def test_steps_run_the_fused_operators_and_match_portable_and_float64(layout, P, window):
    t = Twin(layout, P, seed=P)
    run_steps(t, window=window)
    att = t.standin.attention.calls
    assert att == len(STEPS), "every attend ran the fused attention"
    if layout == "flat":  # the KV store takes [blocks, block_size, Hkv, D] caches only
        assert t.standin.stores == 0
        (only,) = t.ops.fallbacks
        assert only.startswith("store_kv: caches that are not both [blocks, block_size, Hkv, D]")
    else:
        assert t.standin.stores == len(STEPS) and not t.ops.fallbacks
    assert t.ops.host_reads == len(STEPS)  # one device read a plan
    assert t.standin.poisoned == 0  # the padded tokens wrote slot 0's own bytes back


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (64, 1)])
def test_gqa_and_sinks_bfloat16(heads, kv_heads):
    t = Twin("separate", 128, H=heads, hkv=kv_heads, dtype=torch.bfloat16, seed=heads)
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(heads))
    run_steps(t, window=24, sinks=sinks)
    assert t.standin.attention.calls == len(STEPS) and not t.ops.fallbacks


def test_a_window_reads_only_its_blocks():
    """The window's table starts at the block of the first new token's window start, with the
    KV length counted from there, as the backend's SWA tables do."""
    t = Twin("separate", 128)
    seen = []
    real = t.ops.npu.attention

    def spy(q, k, v, kwargs):
        seen.append(kwargs)
        return real(q, k, v, kwargs)

    object.__setattr__(t.ops.npu, "attention", spy)  # NpuOps is frozen: patch the instance
    t.step([0, 1], [300, 5], window=40)
    t.step([0, 1], [1, 1], window=40)
    t.step([0, 1], [1, 1])
    prompt, decode, full = seen
    # a 300-token prompt: its first query's window starts at 0; the decode at position 300 sees
    # 261..300, in block 2 (256..), 45 keys from there; a full layer reads all 302 keys
    assert prompt["actual_seq_kvlen"] == [300, 5] and prompt["sparse_mode"] == 4 and prompt["pre_tokens"] == 39
    assert decode["actual_seq_kvlen"] == [45, 6] and decode["block_table"].shape == (2, 2)
    assert decode["block_table"][0, 0] == t.blocks[0][2]
    assert full["actual_seq_kvlen"] == [302, 7] and full["sparse_mode"] == 3


def test_host_lengths_are_read_once_a_step_and_shared_by_every_layer():
    t = Twin("separate", 128)
    t.step([0, 1], [30, 150])
    k, v, q, slots, qsl, seq, table = t.inputs([0, 1], [3, 1])
    t.ops.store_kv(k, v, t.kc, t.vc, slots)
    before = t.ops.host_reads
    step = t.plan(t.ops, qsl, seq, table, [3, 1])
    assert t.ops.host_reads == before + 1 and isinstance(step, AscendStep) and step.fused
    seen = []
    real = t.ops.npu.attention
    object.__setattr__(t.ops.npu, "attention", lambda q_, k_, v_, kw: seen.append(kw) or real(q_, k_, v_, kw))
    for window in (None, 16, None, 16):  # four layers of one step: full and windowed
        t.ops.attend(q, t.kc, t.vc, step, scale=0.1, window=window)
    assert t.ops.host_reads == before + 1
    assert len({id(kw["actual_seq_qlen"]) for kw in seen}) == 1
    assert len({id(kw["actual_seq_kvlen"]) for kw in seen}) == 2  # one list a window
    assert len({id(kw["block_table"]) for kw in seen}) == 2  # one table a window, built once
    # given the host lengths, a plan reads nothing from the device
    step = t.plan(t.ops, qsl, seq, table, [3, 1], query_start_loc_cpu=qsl, seq_lens_cpu=seq.tolist())
    assert t.ops.host_reads == before + 1 and step.q_cum == [3, 4] and step.kv_lens == seq.tolist()


def test_engine_host_lengths_give_the_same_outputs():
    t = Twin("stacked", 256, seed=3)
    for reqs, new in STEPS:
        out, _, exact = t.step(reqs, new, window=40, host=True)
        assert_close(out, exact, t.dtype)
    assert t.ops.host_reads == 0 and t.standin.attention.calls == len(STEPS)


# ---------------------------------------------------------------------------- the portable path
def test_interleaved_halves_run_the_portable_path_exactly():
    """The K and V halves of one interleaved cache are not contiguous: both ops run portable,
    bit for bit the portable ops' results."""
    t = Twin("interleaved", 128, seed=1)
    for reqs, new in STEPS:
        out, ref, exact = t.step(reqs, new, window=24)
        assert torch.equal(out, ref)
        assert_close(out, exact, t.dtype)
    assert t.standin.attention.calls == 0 and t.standin.stores == 0
    assert {r.split(":")[0] for r in t.ops.fallbacks} == {"store_kv", "attend"}
    assert all("not contiguous" in r for r in t.ops.fallbacks)


def test_an_undeclared_block_size_runs_portable_with_no_host_read():
    """A block size the fused attention does not serve (SGLang's 1, the suite's 16): the plan
    says why, reads nothing from the device, and every call is the portable one's."""
    for P in (1, 16):
        t = Twin("separate", P, seed=P)
        for reqs, new in STEPS:
            out, ref, _ = t.step(reqs, new, window=7)
            assert torch.equal(out, ref)
        k, v, q, slots, qsl, seq, table = t.inputs([0], [1])
        step = t.plan(t.ops, qsl, seq, table, [1])
        assert not step.fused and f"block size {P}" in step.portable_reason
        assert t.ops.host_reads == 0 and t.standin.attention.calls == 0 and t.standin.stores == 0


@pytest.mark.parametrize(
    "over,attend_kw,reason",
    [
        (dict(D=96), {}, "head_dim=96"),
        (dict(H=128, hkv=1), {}, "GQA: at most 64"),
        ({}, dict(softcap=5.0), "soft-cap"),
    ],
)
def test_what_the_fused_attention_cannot_serve_runs_portable(over, attend_kw, reason):
    t = Twin("separate", 128, seed=2, **over)
    for reqs, new in STEPS[:2]:
        out, ref, exact = t.step(reqs, new, window=24, **attend_kw)
        assert torch.equal(out, ref)
        assert_close(out, exact, t.dtype)
    assert t.standin.attention.calls == 0 and t.standin.stores == 2  # the store is still the operator's
    (only,) = t.ops.fallbacks
    assert only.startswith("attend: ") and reason in only


def test_a_v1_only_torch_npu_runs_sinks_on_the_portable_path():
    standin = npu_standin.fresh()
    standin.npu_fused_infer_attention_score_v2 = None
    t = Twin("separate", 128, ops=make_ops(standin), seed=4)
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(0))
    out, _, exact = t.step(*STEPS[0], window=24)  # no sinks: v1 serves it
    assert_close(out, exact, t.dtype)
    assert t.standin.attention.calls == 1
    out, ref, exact = t.step(*STEPS[1], sinks=sinks)
    assert torch.equal(out, ref) and t.standin.attention.calls == 1
    assert_close(out, exact, t.dtype)
    (only,) = t.ops.fallbacks
    assert "learnable_sink" in only


def test_a_graph_capture_plans_and_attends_on_the_portable_path(monkeypatch):
    """Under a capture the fused attention's host lengths would be baked into the graph: the
    plan takes the portable path without a host read, and so does attention of a step planned
    before the capture."""
    t = Twin("separate", 128)
    t.step(*STEPS[0])
    k, v, q, slots, qsl, seq, table = t.inputs([0, 1], [1, 1])
    t.ops.store_kv(k, v, t.kc, t.vc, slots)
    eager = t.plan(t.ops, qsl, seq, table, [1, 1])
    reads = t.ops.host_reads
    monkeypatch.setattr(t.ops.npu.runtime, "is_current_stream_capturing", lambda: True)
    captured = t.plan(t.ops, qsl, seq, table, [1, 1])
    assert not captured.fused and "graph capture" in captured.portable_reason and t.ops.host_reads == reads
    calls = t.standin.attention.calls
    a = t.ops.attend(q, t.kc, t.vc, captured, scale=0.1)
    b = t.ops.attend(q, t.kc, t.vc, eager, scale=0.1)
    assert torch.equal(a, b) and t.standin.attention.calls == calls
    assert all("graph capture" in r for r in t.ops.fallbacks)


# ---------------------------------------------------------------------------- refusals
def test_bad_arguments_are_refused_before_any_write():
    t = Twin("stacked", 128, seed=6)
    t.step(*STEPS[0])
    k, v, q, slots, qsl, seq, table = t.inputs([0, 1], [2, 1])
    n = slots.shape[0]
    before = bits(t.raw)

    def plan(**over):
        args = dict(query_start_loc=qsl, seq_lens=seq, block_table=table, block_size=128)
        host = dict(num_tokens=3, max_query_len=2, max_seq_len=int(seq.max()))
        for name, value in over.items():
            (host if name in host else args)[name] = value
        extra = {name: args.pop(name) for name in ("query_start_loc_cpu", "seq_lens_cpu") if name in args}
        return t.ops.plan(**args, **host, **extra)

    fp8 = torch.zeros(t.num_blocks, 128, 2, 64, dtype=torch.float8_e4m3fn)
    one = torch.ones(1, dtype=torch.float32)
    step = plan()
    bad = {
        "a float32 key": (lambda: t.ops.store_kv(k.float(), v.float(), t.kc, t.vc, slots), "key is torch.float32"),
        "a key of another head count": (lambda: t.ops.store_kv(k[:, :1], v[:, :1], t.kc, t.vc, slots), "key must be"),
        "a float slot mapping": (lambda: t.ops.store_kv(k, v, t.kc, t.vc, slots.float()), "slot_mapping"),
        "too few key rows": (lambda: t.ops.store_kv(k[: n - 1], v[: n - 1], t.kc, t.vc, slots), "rows for"),
        "an FP8 cache": (lambda: t.ops.store_kv(k, v, fp8, fp8, slots, k_scale=one, v_scale=one), "float8_e4m3fn"),
        "a query_start_loc not at 0": (lambda: plan(query_start_loc=qsl + 1), "start at 0"),
        "num_tokens past the queries": (lambda: plan(num_tokens=4), "num_tokens is 4"),
        "more new tokens than keys": (lambda: plan(seq_lens=torch.tensor([1, 18], dtype=torch.int32)), "seq_lens"),
        "a key past max_seq_len": (lambda: plan(max_seq_len=10), "max_seq_len=10"),
        "a narrow block table": (lambda: plan(block_table=table[:, :0]), "block_table has 0 blocks"),
        "a short seq_lens_cpu": (lambda: plan(query_start_loc_cpu=qsl, seq_lens_cpu=[1]), "seq_lens_cpu has 1"),
        "a query with too many rows": (lambda: t.ops.attend(torch.cat([q, q]), t.kc, t.vc, step, scale=0.1), "rows"),
        "a float32 query": (lambda: t.ops.attend(q.float(), t.kc, t.vc, step, scale=0.1), "query is torch.float32"),
        "a window of 0": (lambda: t.ops.attend(q, t.kc, t.vc, step, scale=0.1, window=0), "window"),
        "sinks of 4 heads": (lambda: t.ops.attend(q, t.kc, t.vc, step, scale=0.1, sinks=torch.zeros(4)), "sinks"),
    }
    for what, (call, needle) in bad.items():
        with pytest.raises(OpsInputError) as info:
            call()
        assert needle in str(info.value), (what, str(info.value))
        assert all(torch.equal(a, b) for a, b in zip(before, bits(t.raw))), f"{what} wrote into the cache"
    assert t.standin.poisoned == 0


# ---------------------------------------------------------------------------- the backend's op layer
def test_the_backend_names_its_fused_op_layer():
    ops = EmulatedAscendBackend.paged_ops("cpu")
    assert isinstance(ops, AscendOps) and ops.name == EmulatedAscendBackend.name
    assert ops.native_block_sizes == (128, 256, 512) and ops.fp8_kv_dtypes == ()
    assert ops.dtypes == (torch.float16, torch.bfloat16) and ops.head_dims == (64, 128, 256)
    assert ops.npu.source.startswith("emulated")
    with pytest.raises(ValueError, match="run on cpu devices"):
        EmulatedAscendBackend.paged_ops("meta")
    with pytest.raises(RuntimeError, match="torch_npu"):  # the real class resolves torch_npu, absent here
        AscendBackend.paged_ops("cpu")


@pytest.mark.slow  # the conformance check's cases in a pytest session of their own (about 10 s)
def test_the_conformance_check_reaches_the_fused_operators():
    """``check_paged_ops`` runs its cases at the declared block sizes (128 and 256): its
    separate-cache cases go through the fused operators, its interleaved ones the portable path."""
    calls, stores = npu_standin.STANDIN.attention.calls, npu_standin.STANDIN.stores
    results, _ = suite_runs.run_suite("emulated:EmulatedAscendBackend", "check_paged_ops and not kv_fp8")
    outcomes = {r.nodeid: r.outcome for r in results.values()}
    for case in ("bs1-separate", "bs16-separate"):
        assert [o for n, o in outcomes.items() if n.endswith(f"-{case}]")] == ["passed"], outcomes
    assert all(o in ("passed", "skipped") for o in outcomes.values()), outcomes
    assert npu_standin.STANDIN.attention.calls - calls >= 8  # 2 cases x 4 steps
    assert npu_standin.STANDIN.stores - stores >= 8
