"""model_spec: what each architecture needs from a backend, and every model attnplug cannot
express exactly refused with the reason."""

import math
import types

import pytest

pytest.importorskip("transformers", reason="transformers is not installed (pip install 'attnplug[hf]')")

from transformers import AutoConfig  # noqa: E402

from attnplug.integrations.transformers import (  # noqa: E402
    ARCHITECTURES,
    ModelRunner,
    UnsupportedModelError,
    model_spec,
    tiny_config,
    tiny_model,
)

#: arch -> (sliding layers, scaling, logit soft-cap, sinks) of its tiny config
EXPECTED = {
    "llama": (set(), 16**-0.5, None, False),
    "mistral": ({0, 1}, 16**-0.5, None, False),
    "qwen2": ({1, 2}, 16**-0.5, None, False),
    "qwen3": ({1, 2}, 16**-0.5, None, False),
    "gemma2": ({0}, 24**-0.5, 1.0, False),
    "gemma3_text": ({0, 1}, 24**-0.5, None, False),
    "cohere2": ({0}, 16**-0.5, None, False),
    "gpt_oss": ({0}, 16**-0.5, None, True),
}


def test_every_architecture_has_a_tiny_config_and_an_expectation():
    assert set(EXPECTED) == set(ARCHITECTURES)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_spec_of_each_architecture(arch):
    spec = model_spec(tiny_config(arch))
    swa, scaling, softcap, sinks = EXPECTED[arch]
    assert spec.model_type == arch
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (len(spec_layers(arch)), 4, 2, 16)
    assert spec.swa_layer_ids == frozenset(swa)
    assert spec.sliding_window == (8 if swa else None)
    assert math.isclose(spec.scaling, scaling, rel_tol=0, abs_tol=0)
    assert spec.logit_softcap == softcap
    assert spec.has_sinks is sinks


def spec_layers(arch):
    return range(tiny_config(arch).num_hidden_layers)


def test_hybrid_architectures_have_full_and_sliding_layers():
    for arch in ("qwen2", "qwen3", "gemma2", "gemma3_text", "cohere2", "gpt_oss"):
        spec = model_spec(tiny_config(arch))
        assert 0 < len(spec.swa_layer_ids) < spec.num_layers, arch


def test_gemma3_never_caps_logits_even_when_its_config_names_a_cap():
    # Gemma3's attention layers do not pass attn_logit_softcapping on: neither does attnplug
    assert model_spec(tiny_config("gemma3_text", attn_logit_softcapping=5.0)).logit_softcap is None


def _refused(config, *words):
    with pytest.raises(UnsupportedModelError) as err:
        model_spec(config)
    for word in words:
        assert word in str(err.value)


def test_unsupported_models_are_refused_with_the_reason():
    _refused(AutoConfig.for_model("t5"), "encoder-decoder")
    _refused(AutoConfig.for_model("gpt2", add_cross_attention=True), "cross-attention")
    _refused(AutoConfig.for_model("falcon", alibi=True), "ALiBi")
    _refused(tiny_config("gemma3_text", use_bidirectional_attention=True), "bidirectional")
    _refused(AutoConfig.for_model("gpt2"), "'gpt2' is not supported", "gemma3_text")
    chunked = tiny_config("qwen3")
    chunked.layer_types = ["full_attention", "chunked_attention", "sliding_attention"]
    _refused(chunked, "chunked_attention")
    short = tiny_config("gemma2")
    short.layer_types = ["sliding_attention"]
    _refused(short, "layer_types has 1 entries")
    no_window = tiny_config("cohere2")
    no_window.sliding_window = None
    _refused(no_window, "sliding_window is None")


def test_per_layer_windows_are_refused():
    config = types.SimpleNamespace(
        model_type="mistral", num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16
    )
    config.sliding_window = [4, 8]
    _refused(config, "per-layer sliding windows [4, 8]")


def test_a_layer_scaling_other_than_the_spec_is_refused_at_load():
    model = tiny_model("llama")
    model.model.layers[1].self_attn.scaling = 0.3
    with pytest.raises(UnsupportedModelError, match="layer 1 scales logits by 0.3"):
        ModelRunner(model, "reference", max_batch_size=2, max_context_len=16)
    assert model.config._attn_implementation == "eager"  # refused before anything changed
