"""The ascend backend through the EMULATED torch_npu operators (tests/ascend/npu_standin.py):
every mode, GQA, windows, sinks and page sizes against the reference backend (outputs within the
dtype's tolerance, KV caches bit for bit) and the float64 oracle; the refusals; the host lengths
built once per step for every layer; graph replay re-issuing each captured attention task with
the step's lengths; and the engine side (``decide_needs_cpu_seq_lens``, ``GraphRunner``,
``Engine``) with a backend that needs ``seq_lens_cpu``."""

from __future__ import annotations

import sys

import npu_standin
import pytest
import torch
from emulated import EmulatedAscendBackend, EmulatedAscendBackendSmallPages, EmulatedNpuDevice

from attnplug import ForwardMode, GraphRunner, decide_needs_cpu_seq_lens
from attnplug.backend import BackendConfigError, GraphSupport
from attnplug.backends.reference import ReferenceBackend
from attnplug.oracle import exact_attention
from attnplug_ascend import backend as ascend_backend
from attnplug_ascend.backend import AscendBackend
from attnplug_ascend.ops import load_ops
from attnplug_conformance.harness import World, WorldSpec
from attnplug_conformance.twins import Twins


def spec(page_size=128, **over) -> WorldSpec:
    pages = 48 if page_size >= 128 else max(1024 // page_size, 48)
    base = WorldSpec(
        num_layers=4,
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        dtype=torch.float16,
        sliding_window=8,
        page_size=page_size,
        size=pages * page_size,
        size_swa=pages // 2 * page_size,
        max_reqs=12,
        max_context_len=512,
        scramble_swa=True,
    )
    return WorldSpec(**{**base.__dict__, **over})


def twins(cls, s: WorldSpec, seed=0) -> Twins:
    return Twins(World(s, cls, "cpu", seed=seed), World(s, ReferenceBackend, "cpu", seed=seed))


CONFIGS = [
    (EmulatedAscendBackend, 128),
    (EmulatedAscendBackend, 256),
    (EmulatedAscendBackendSmallPages, 1),
    (EmulatedAscendBackendSmallPages, 4),
]


# ---------------------------------------------------------------------------- modes, shapes
@pytest.mark.parametrize("cls,page_size", CONFIGS, ids=[f"{c.name}-page{p}" for c, p in CONFIGS])
def test_every_mode_matches_the_reference(cls, page_size):
    """Prefill (one prompt past a 128-token page), a chunk on a cached prefix, decode, verify
    with rejected drafts rolled back, draft extend, IDLE: outputs and every KV cache."""
    t = twins(cls, spec(page_size), seed=page_size)
    t.add(3)
    t.step(ForwardMode.EXTEND, [0, 1, 2], [5, 17, 140])
    t.step(ForwardMode.EXTEND, [0, 2], [9, 3])
    t.step(ForwardMode.DECODE, [0, 1, 2])
    t.step(ForwardMode.TARGET_VERIFY, [0, 1, 2], num_draft_tokens=3, keep=None)
    t.step(ForwardMode.DECODE, [2, 0])
    reqs = t.reqs[0]
    keep = [reqs[0].seq_len + 3 - 2, reqs[1].seq_len + 3]  # request 0 rejects 2 of its 3 drafts
    t.step(ForwardMode.TARGET_VERIFY, [0, 1], num_draft_tokens=3, keep=keep)
    t.step(ForwardMode.DRAFT_EXTEND, [0, 1, 2], num_draft_tokens=2)
    t.step(ForwardMode.IDLE, [])
    t.finish(1)
    t.add(1)
    t.step(ForwardMode.EXTEND, [0, 3], [1, 30])
    t.step(ForwardMode.DECODE, [0, 2, 3])


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (64, 1)])
def test_gqa_ratios(heads, kv_heads):
    t = twins(EmulatedAscendBackend, spec(num_heads=heads, num_kv_heads=kv_heads), seed=heads)
    t.add(2)
    t.step(ForwardMode.EXTEND, [0, 1], [7, 130])
    t.step(ForwardMode.DECODE, [0, 1])
    t.step(ForwardMode.TARGET_VERIFY, [0, 1], num_draft_tokens=2)


@pytest.mark.parametrize("window", [1, 16, 200, 300])
def test_windows_smaller_equal_and_larger_than_the_sequences(window):
    t = twins(EmulatedAscendBackend, spec(sliding_window=window), seed=window)
    t.add(2)
    t.step(ForwardMode.EXTEND, [0, 1], [200, 16])
    for _ in range(2):
        t.step(ForwardMode.DECODE, [0, 1])
    t.step(ForwardMode.TARGET_VERIFY, [0, 1], num_draft_tokens=4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sinks_and_a_long_prefix_match_the_float64_oracle(dtype):
    """A 700-key request and a short one, windowed and full layers, with sinks: each layer
    within the suite's long-context bound of float64 attention."""
    s = spec(dtype=dtype, sinks=True, sliding_window=300, max_context_len=1024)
    w = World(s, EmulatedAscendBackend, "cpu", seed=7)
    reqs = w.prefill([700, 9])
    for mode, kw in ((ForwardMode.DECODE, {}), (ForwardMode.TARGET_VERIFY, {"num_draft_tokens": 3})):
        step = w.plan(mode, reqs, **kw)
        out = w.run_eager(step).double()
        w.commit(step)
        for layer in range(4):
            window = 300 if w.pool.is_swa_layer(layer) else None
            K = max(r.seq_len for r in reqs)
            keys = torch.zeros(2, K, 2, 64, dtype=torch.float64)
            values = torch.zeros_like(keys)
            for i, r in enumerate(reqs):
                keys[i, : r.seq_len], values[i, : r.seq_len] = r.history[layer]
            want = exact_attention(
                step.inputs["q"][:, layer].double(),
                keys,
                values,
                [r.seq_len for r in reqs],
                step.new_tokens,
                window,
                w.backend.scaling,
                sinks=w.sinks[layer],
            )
            err = ((out[:, layer] - want).flatten(1).norm(dim=1) / want.flatten(1).norm(dim=1)).max().item()
            assert err < (2e-3 if dtype is torch.float16 else 1.2e-2), (mode, layer, err)
        for r in reqs:
            w.evict(r)


# ---------------------------------------------------------------------------- refusals
def test_construction_refuses_what_the_operators_cannot_serve():
    s = spec()
    for over, match in (
        (dict(dtype=torch.float32), "float32"),
        (dict(head_dim=72), "head_dim=72"),
        (dict(num_heads=128, num_kv_heads=1), "GQA: at most 64"),
        (dict(logit_softcap=30.0), "logit_softcap"),
    ):
        with pytest.raises(BackendConfigError, match=match):
            World(WorldSpec(**{**s.__dict__, **over}), EmulatedAscendBackend, "cpu")


def test_an_undeclared_page_size_is_refused_before_anything_is_written():
    w = World(spec(page_size=4), EmulatedAscendBackend, "cpu")  # the real declaration: 128, 256, 512
    step = w.plan(ForwardMode.EXTEND, [w.new_request()], [5])
    before = w.snapshot_kv()
    with pytest.raises(BackendConfigError, match="page_size=4"):
        w.run_eager(step)
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(before, w.snapshot_kv()))
    with pytest.raises(BackendConfigError, match="page_size=4"):
        w.backend.init_cuda_graph_state(2, 2)


def test_bad_sinks_leave_the_kv_cache_alone():
    w = World(spec(sinks=True), EmulatedAscendBackend, "cpu", seed=3)
    reqs = w.prefill([20, 3])
    step = w.plan(ForwardMode.DECODE, reqs)
    w.backend.init_forward_metadata(step.batch)
    before = w.snapshot_kv()
    q, k, v = (step.inputs[n][:, 0] for n in ("q", "k", "v"))
    for bad in (torch.zeros(8, dtype=torch.float16), torch.zeros(4), torch.zeros(8, dtype=torch.float64)):
        with pytest.raises(ValueError, match="sinks"):
            w.backend.forward(q, k, v, 0, step.batch, sinks=bad)
    assert all(torch.equal(a, b) and torch.equal(c, d) for (a, c), (b, d) in zip(before, w.snapshot_kv()))


def test_a_padded_replay_writes_the_steps_rows_only_not_even_the_sink():
    """Padded tokens (slot 0) write the sink's own value back: the operator takes no -1 and a
    replay cannot skip a token, so only the step's rows change, in every layer."""
    w = World(spec(page_size=4), EmulatedAscendBackendSmallPages, "cpu", seed=5)
    runner = w.graph_runner(max_bs=4, num_draft_tokens=2)
    reqs = w.prefill([9, 14, 3])
    for k, v in (w.pool.get_kv_buffer(layer) for layer in range(4)):
        k[0].fill_(7.0)
        v[0].fill_(-7.0)
    for mode, kw in ((ForwardMode.DECODE, {}), (ForwardMode.TARGET_VERIFY, {"num_draft_tokens": 2})):
        step = w.plan(mode, reqs, **kw)
        before = w.snapshot_kv()
        runner.run(step.batch, step.inputs)
        assert runner.bucket_for(step.batch) == 4  # one padded request
        loc = step.batch.out_cache_loc
        for layer, ((k0, v0), (k1, v1)) in enumerate(zip(before, w.snapshot_kv())):
            rows = w.pool.translate_loc_from_full_to_swa(loc).long() if w.pool.is_swa_layer(layer) else loc
            changed = ((k0 != k1) | (v0 != v1)).flatten(1).any(dim=1).nonzero().flatten()
            assert set(changed.tolist()) <= set(rows.tolist()) and 0 not in changed.tolist(), (mode, layer)
            assert torch.equal(k1[rows], step.inputs["k"][:, layer]) and torch.equal(
                v1[rows], step.inputs["v"][:, layer]
            )
        w.advance(step)


def test_a_v1_only_torch_npu_has_no_sinks():
    class NoV2(npu_standin.StandIn):
        npu_fused_infer_attention_score_v2 = None

        def __init__(self):
            super().__init__()
            self.npu_fused_infer_attention_score_v2 = None

    class V1Only(EmulatedAscendBackend):
        ops_module = staticmethod(NoV2)

    w = World(spec(), V1Only, "cpu", seed=1)
    assert w.backend.capabilities().attention_sinks is False
    reqs = w.prefill([5, 9])
    step = w.plan(ForwardMode.DECODE, reqs)
    w.backend.init_forward_metadata(step.batch)
    with pytest.raises(ValueError, match="sinks"):
        w.backend.forward(*(step.inputs[n][:, 0] for n in "qkv"), 0, step.batch, sinks=torch.zeros(8))


def test_missing_operators_are_named():
    fake = npu_standin.fresh()
    fake.npu_scatter_pa_kv_cache = None
    with pytest.raises(RuntimeError, match="npu_scatter_pa_kv_cache"):
        load_ops(fake)


# ---------------------------------------------------------------------------- host lengths, once a step
class Spy:
    """Counts ``_host_lengths`` calls and records the length lists every attention call got."""

    def __init__(self, monkeypatch, backend):
        self.host_calls = 0
        self.calls = []
        real_host = backend._host_lengths

        def host(*a):
            self.host_calls += 1
            return real_host(*a)

        monkeypatch.setattr(backend, "_host_lengths", host)
        ops = backend.ops
        real_run, real_out = ops.attention, ops.attention_out

        def run(q, k, v, kwargs):
            self.calls.append(kwargs)
            return real_run(q, k, v, kwargs)

        def out(q, k, v, kwargs, **kw):
            self.calls.append(kwargs)
            return real_out(q, k, v, kwargs, **kw)

        object.__setattr__(ops, "attention", run)  # NpuOps is frozen: patch the instance
        object.__setattr__(ops, "attention_out", out)


def test_host_lengths_are_built_once_per_step_for_every_layer(monkeypatch):
    w = World(spec(num_layers=6), EmulatedAscendBackend, "cpu", seed=2)
    reqs = w.prefill([30, 150, 4])
    spy = Spy(monkeypatch, w.backend)
    translations = []
    real_t = w.pool.translate_loc_from_full_to_swa
    monkeypatch.setattr(w.pool, "translate_loc_from_full_to_swa", lambda loc: translations.append(1) or real_t(loc))
    for mode, kw in ((ForwardMode.EXTEND, {"new_tokens": [3, 1, 8]}), (ForwardMode.DECODE, {})):
        spy.host_calls, spy.calls[:] = 0, []
        translations.clear()
        step = w.plan(mode, reqs, **kw)
        w.run_eager(step)
        w.advance(step)
        assert spy.host_calls == 1 and len(translations) == 1
        assert len(spy.calls) == 6
        q_lists = {id(c.get("actual_seq_qlen")) for c in spy.calls}
        kv_lists = {id(c.get("actual_seq_kvlen")) for c in spy.calls}
        assert len(q_lists) == 1 and len(kv_lists) == 2  # one list for full layers, one for SWA layers
        seq = [r.seq_len for r in reqs]
        full = [c for c in spy.calls if c["sparse_mode"] == 3]
        assert full and all(c["actual_seq_kvlen"] == seq for c in full)
        swa = [c for c in spy.calls if c["sparse_mode"] == 4]
        assert swa and all(c["pre_tokens"] == 7 and c["next_tokens"] == 0 for c in swa)


# ---------------------------------------------------------------------------- graphs
def _graph_twins(seed=0, **over):
    t = twins(EmulatedAscendBackendSmallPages, spec(page_size=4, **over), seed=seed)
    runner = t.world.graph_runner(max_bs=4, num_draft_tokens=3)
    return t, runner


def test_graph_replay_re_issues_every_attention_task_with_the_steps_lengths(monkeypatch):
    t, runner = _graph_twins()
    backend = t.world.backend
    rt = npu_standin.RELAXED.runtime
    assert runner.status()["device_graphs"] and not runner.capture_failures
    t.add(3)
    t.step(ForwardMode.EXTEND, [0, 1, 2], [5, 17, 9])
    seen = []
    real = backend.init_forward_metadata_replay_cuda_graph

    def replay_metadata(batch):
        seen.append(list(batch.seq_lens_cpu))
        return real(batch)

    monkeypatch.setattr(backend, "init_forward_metadata_replay_cuda_graph", replay_metadata)
    for _ in range(3):
        for mode, kw in ((ForwardMode.DECODE, {}), (ForwardMode.TARGET_VERIFY, {"num_draft_tokens": 3})):
            before = rt.updates
            sw, _ = t.step(mode, [0, 1, 2], runner=runner, **kw)
            assert rt.updates - before == 4  # one task update per layer, every replay
            # the runner hands replay metadata the host mirror, padded to the bucket
            assert seen[-1] == sw.batch.seq_lens_cpu + [1] and runner.bucket_for(sw.batch) == 4
    assert rt.updates >= 24


def test_without_the_task_updates_a_replay_is_stale(monkeypatch):
    """What the updates are for: skipping them (but recording the events, so nothing hangs)
    replays the lengths of the capture, and the outputs go wrong."""
    t, runner = _graph_twins(seed=4)
    t.add(2)
    t.step(ForwardMode.EXTEND, [0, 1], [12, 30])
    t.step(ForwardMode.DECODE, [0, 1], runner=runner)  # correct with the updates
    rt = t.world.backend.ops.runtime
    monkeypatch.setattr(rt, "graph_task_update_begin", lambda *a: None)
    monkeypatch.setattr(rt, "graph_task_update_end", lambda *a: None)
    with pytest.raises(pytest.fail.Exception, match=r"values outside atol"):
        for _ in range(3):
            t.step(ForwardMode.DECODE, [0, 1], runner=runner)


def test_the_runner_refuses_a_step_without_seq_lens_cpu():
    import dataclasses

    t, runner = _graph_twins()
    t.add(1)
    t.step(ForwardMode.EXTEND, [0], [6])
    step = t.world.plan(ForwardMode.DECODE, t.reqs[0][:1])
    with pytest.raises(ValueError, match="seq_lens_cpu"):
        runner.run(dataclasses.replace(step.batch, seq_lens_cpu=None), step.inputs)


def test_engines_decide_they_need_seq_lens_cpu():
    assert decide_needs_cpu_seq_lens([ReferenceBackend, EmulatedAscendBackend]) is True
    assert decide_needs_cpu_seq_lens([AscendBackend]) is True
    w = World(spec(), EmulatedAscendBackend, "cpu")
    assert decide_needs_cpu_seq_lens([w.backend, w.reference_backend]) is True
    runner = GraphRunner(w.backend, w.step_fn, max_bs=2, inputs=w.input_shapes())
    assert runner.needs_cpu_seq_lens is True


@pytest.mark.slow
def test_engine_generates_the_reference_tokens_through_graphs():
    pytest.importorskip("transformers", reason="transformers is not installed")
    from attnplug.integrations.transformers import Engine, tiny_model

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 250, (n,), generator=g).tolist() for n in (6, 13, 9)]
    runs = []
    for backend in ("reference", EmulatedAscendBackendSmallPages):
        model = tiny_model("gemma3_text", head_dim=64, dtype=torch.float16)
        engine = Engine(model, backend, max_batch_size=2, max_context_len=40, page_size=4, max_prefill_tokens=8)
        runs.append(engine.generate(prompts, 6))
        if backend != "reference":  # the emulated NPU graph: DECODE steps replay, host lengths and all
            assert engine.graphs is not None and engine.last_run["graph_steps"] > 0
    assert runs[0] == runs[1]


# ---------------------------------------------------------------------------- what it says
def test_capabilities_and_description():
    caps = AscendBackend.declared_capabilities()
    assert caps.needs_cpu_seq_lens and not caps.pdl and caps.graphs is GraphSupport.UNIFORM
    assert caps.dtypes == (torch.float16, torch.bfloat16) and caps.page_sizes == (128, 256, 512)
    assert caps.attention_sinks and not caps.logit_softcap and not caps.large_kv_buffers
    facts = AscendBackend.describe()
    assert "npu_fused_infer_attention_score_v2" in facts["attention"]
    assert facts["verified"] == "emulated on the host (tests/ascend), not yet run on Ascend hardware"
    emulated = EmulatedAscendBackend.describe()
    assert "emulated" in emulated["operators"] and "emulated" in emulated["graph_class"]
    assert "emulated" in EmulatedAscendBackend.name
    w = World(spec(), EmulatedAscendBackend, "cpu")
    inst = w.backend.capabilities()
    assert inst.device_type == "cpu" and inst.graphs is GraphSupport.UNIFORM and inst.needs_cpu_seq_lens
    assert w.backend.ops.source.startswith("emulated")
    assert isinstance(EmulatedAscendBackend.device_part, EmulatedNpuDevice)


def test_importing_the_backend_imports_no_torch_npu():
    assert "torch_npu" not in sys.modules
    assert ascend_backend.AscendBackend.ops_module is None  # the real class: torch_npu when constructed
