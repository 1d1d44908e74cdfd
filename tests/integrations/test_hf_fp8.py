"""Engine / ModelRunner with an FP8 KV cache (``kv_cache_dtype``, ``kv_scales``).

The tokens are exact: transformers' own greedy ``generate`` (eager attention, float32) whose
attention sees every key and value quantised and dequantised by ``attnplug.memory.fp8`` with
the same per-layer, per-head scales (``fake_quant``) gives the tokens ``Engine`` gives over an
FP8 pool on the reference backend, for scales that make some values saturate. A scale the
Engine dropped, or a layer's scales given to another, gives other tokens (the test can fail).
The refusals come before anything is allocated."""

import sys

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed (pip install 'attnplug[hf]')")

import transformers  # noqa: E402
from hf_helpers import hf_greedy, random_prompts  # noqa: E402
from transformers.masking_utils import eager_mask  # noqa: E402

from attnplug.backends.reference import ReferenceBackend  # noqa: E402
from attnplug.integrations.transformers import Engine, ModelRunner, UnsupportedModelError, tiny_model  # noqa: E402
from attnplug.memory.fp8 import dequantize_kv, fp8_max, quantize_kv  # noqa: E402

LENGTHS = (3, 11, 19, 26)  # the tiny models' window is 8
NEW = 10
PROMPTS = random_prompts(LENGTHS)
FAKE = "attnplug_test_fp8_fake_quant"


def kv_scales(arch, dtype, saturate_at=0.6):
    """Per layer and KV head of ``tiny_model(arch)``: the largest |k| / |v| a float32 run of
    PROMPTS[-1] stores, times ``saturate_at``, mapped to the format's largest value (larger
    values saturate); each layer and head its own scale."""
    engine = Engine(tiny_model(arch), "reference", max_batch_size=1, max_context_len=40)
    engine.generate([PROMPTS[-1]], 1)
    pool = engine.runner.pool
    top = saturate_at / fp8_max(dtype)
    return {
        layer: tuple((buf.abs().amax(dim=(0, 2)) * top).tolist() for buf in pool.get_kv_buffer(layer))
        for layer in range(pool.num_layers)
    }


def fake_quant(scales, dtype):
    """An attention implementation for transformers: the model's own eager attention over k and
    v quantised and dequantised per layer and KV head with ``scales`` (what an FP8 cache holds)."""

    def qdq(x, scale):  # x [1, Hkv, T, D]
        rows = x[0].transpose(0, 1)
        s = torch.tensor(scale, dtype=torch.float32)
        return dequantize_kv(quantize_kv(rows, s, dtype), s).to(x.dtype).transpose(0, 1)[None]

    def forward(module, query, key, value, attention_mask, **kwargs):
        k_scale, v_scale = scales[module.layer_idx]
        eager = sys.modules[type(module).__module__].eager_attention_forward
        return eager(module, query, qdq(key, k_scale), qdq(value, v_scale), attention_mask, **kwargs)

    transformers.AttentionInterface.register(FAKE, forward)
    transformers.AttentionMaskInterface.register(FAKE, eager_mask)


def saturated(pool):
    top = fp8_max(pool.dtype)
    return sum(
        int((b.float().abs() == top).sum()) for layer in range(pool.num_layers) for b in pool.get_kv_buffer(layer)
    )


@pytest.mark.parametrize(
    "arch, kv",
    [
        ("gemma3_text", "fp8"),  # sliding + full layers
        ("gemma2", "fp8_e4m3"),  # soft-cap
        ("gpt_oss", "fp8_e5m2"),  # sinks
        ("llama", torch.float8_e5m2),
    ],
)
def test_fp8_engine_gives_transformers_tokens_over_the_quantised_kv(arch, kv):
    model = tiny_model(arch)
    dtype = torch.float8_e5m2 if kv in ("fp8_e5m2", torch.float8_e5m2) else torch.float8_e4m3fn
    scales = kv_scales(arch, dtype)
    fake_quant(scales, dtype)
    reference = tiny_model(arch)
    reference.set_attn_implementation(FAKE)
    want = [hf_greedy(reference, p, NEW) for p in PROMPTS]
    engine = Engine(
        model,
        "reference",
        max_batch_size=2,
        max_context_len=40,
        max_prefill_tokens=10,
        kv_cache_dtype=kv,
        kv_scales=scales,
    )
    assert engine.runner.pool.dtype == dtype and engine.runner.kv_cache_dtype == dtype
    assert engine.runner.dtype == torch.float32  # the model's; q, k, v stay float32
    for layer, (k, v) in scales.items():
        got_k, got_v = engine.runner.pool.kv_scales(layer)
        assert got_k.tolist() == pytest.approx(k) and got_v.tolist() == pytest.approx(v)
    assert engine.generate(PROMPTS, NEW) == want
    assert saturated(engine.runner.pool) > 0  # the scales made some values saturate


def test_dropping_the_scales_changes_the_tokens():
    """The comparison has teeth: the same engine with every scale left at 1.0, or with the
    layers' scales given to each other, no longer gives the tokens of the quantised reference."""
    arch, dtype = "gemma3_text", torch.float8_e4m3fn
    scales = kv_scales(arch, dtype)
    fake_quant(scales, dtype)
    reference = tiny_model(arch)
    reference.set_attn_implementation(FAKE)
    want = [hf_greedy(reference, p, NEW) for p in PROMPTS]
    unit = Engine(tiny_model(arch), "reference", max_batch_size=4, max_context_len=40, kv_cache_dtype="fp8")
    assert unit.generate(PROMPTS, NEW) != want
    rotated = {layer: scales[(layer + 1) % len(scales)] for layer in scales}
    wrong = Engine(
        tiny_model(arch), "reference", max_batch_size=4, max_context_len=40, kv_cache_dtype="fp8", kv_scales=rotated
    )
    assert wrong.generate(PROMPTS, NEW) != want


def test_default_scales_are_one_and_auto_is_the_model_dtype():
    runner = ModelRunner(tiny_model("qwen3"), "reference", max_batch_size=2, max_context_len=16, kv_cache_dtype="fp8")
    k, v = runner.pool.kv_scales(0)
    assert (
        runner.pool.dtype == torch.float8_e4m3fn and k.tolist() == [1.0] * k.numel() and v.tolist() == [1.0] * v.numel()
    )
    for auto in (None, "auto", torch.float32):
        runner = ModelRunner(
            tiny_model("qwen3"), "reference", max_batch_size=2, max_context_len=16, kv_cache_dtype=auto
        )
        assert runner.pool.dtype == torch.float32 and runner.pool.kv_scales(0) == (None, None)


def test_bfloat16_model_over_an_fp8_cache_generates():
    model = tiny_model("gemma3_text", dtype=torch.bfloat16)
    engine = Engine(model, "reference", max_batch_size=2, max_context_len=40, kv_cache_dtype="fp8_e5m2")
    out = engine.generate(PROMPTS[:2], 4)
    assert [len(o) for o in out] == [4, 4] and engine.runner.pool.dtype == torch.float8_e5m2


def _no_pool(monkeypatch):
    """Fail the test if an SWAKVPool is built (a refusal must come before any allocation)."""
    from attnplug.integrations.transformers import runner as runner_module

    def refuse(*args, **kwargs):
        raise AssertionError("an SWAKVPool was allocated before the refusal")

    monkeypatch.setattr(runner_module, "SWAKVPool", refuse)


class _NoFp8(ReferenceBackend):
    name = "nofp8"

    @classmethod
    def declared_capabilities(cls):
        import dataclasses

        return dataclasses.replace(super().declared_capabilities(), fp8_kv_dtypes=(torch.float8_e4m3fn,))


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(kv_cache_dtype="fp9"), ValueError, "kv_cache_dtype must be one of"),
        (
            dict(kv_cache_dtype=torch.float16),
            ValueError,
            r"the KV cache stores the model's dtype \(float32\) or an FP8",
        ),
        (dict(kv_cache_dtype=torch.int8), ValueError, "the KV cache stores the model's dtype"),
        (dict(kv_scales={0: (0.5, 0.5)}), ValueError, "kv_scales apply to an FP8 KV cache; this one stores float32"),
        (
            dict(kv_cache_dtype="fp8", kv_scales={2: (0.5, 0.5)}),
            ValueError,
            r"2 is not a layer id of this model \(0 \.\. 1\)",
        ),
        (dict(kv_cache_dtype="fp8", kv_scales={0: 0.5}), ValueError, r"kv_scales\[0\] must be a pair"),
        (dict(kv_cache_dtype="fp8", kv_scales={0: (0.0, 1.0)}), ValueError, r"kv_scales\[0\] k_scale must hold finite"),
        (
            dict(kv_cache_dtype="fp8", kv_scales={1: (1.0, [1.0, 2.0, 3.0])}),
            ValueError,
            r"kv_scales\[1\] v_scale must be",
        ),
        (dict(kv_cache_dtype="fp8", kv_scales={0: (float("nan"), 1.0)}), ValueError, "finite floats > 0"),
        (dict(kv_cache_dtype="fp8", kv_scales=[(1.0, 1.0)]), ValueError, "kv_scales must be a mapping"),
    ],
)
def test_bad_kv_cache_arguments_are_refused_before_anything_is_allocated(kwargs, error, message, monkeypatch):
    model = tiny_model("llama")  # 2 layers, 2 KV heads
    _no_pool(monkeypatch)
    with pytest.raises(error, match=message):
        ModelRunner(model, "reference", max_batch_size=2, max_context_len=16, **kwargs)


def test_a_backend_without_the_fp8_dtype_is_refused_with_the_reason(monkeypatch):
    _no_pool(monkeypatch)
    with pytest.raises(UnsupportedModelError, match="backend 'nofp8' cannot run this") as err:
        Engine(tiny_model("llama"), _NoFp8, max_batch_size=2, max_context_len=16, kv_cache_dtype="fp8_e5m2")
    assert "an FP8 KV cache of float8_e5m2 (capabilities: fp8_kv_dtypes = float8_e4m3fn)" in str(err.value)


def test_per_head_scales_as_a_tensor_and_set_later_through_the_pool():
    scales = {0: (torch.tensor([0.01, 0.02]), [0.03, 0.04]), 1: (0.5, torch.tensor(0.25))}
    runner = ModelRunner(
        tiny_model("llama"), "reference", max_batch_size=2, max_context_len=16, kv_cache_dtype="fp8", kv_scales=scales
    )
    k0, v0 = runner.pool.kv_scales(0)
    k1, v1 = runner.pool.kv_scales(1)
    assert k0.tolist() == pytest.approx([0.01, 0.02]) and v0.tolist() == pytest.approx([0.03, 0.04])
    assert k1.tolist() == [0.5, 0.5] and v1.tolist() == [0.25, 0.25]
    runner.pool.set_kv_scales(1, 2.0, 4.0)
    assert runner.pool.kv_scales(1)[0].tolist() == [2.0, 2.0]


def _generate(argv, capsys):
    from attnplug import cli

    try:
        code = cli.main(["generate", *argv])
    except SystemExit as exc:  # argparse
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_generate_command_takes_the_kv_cache_dtype(capsys):
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]
    argv = [
        "--tiny",
        "gemma3_text",
        "--backend",
        "reference",
        "--max-new-tokens",
        "6",
        "--tokens",
        "5,6,7,8,9,10,11,12,13,14,15",
    ]
    code, out, err = _generate(argv + ["--kv-cache-dtype", "fp8_e5m2"], capsys)
    assert code == 0, err
    engine = Engine(
        tiny_model("gemma3_text"), "reference", max_batch_size=1, max_context_len=17, kv_cache_dtype="fp8_e5m2"
    )
    assert out.splitlines() == ["[0] " + " ".join(map(str, engine.generate([prompt], 6)[0]))]
    assert err.strip().splitlines()[-1].endswith("KV cache float8_e5m2")
    code, out, err = _generate(argv, capsys)
    assert code == 0 and err.strip().splitlines()[-1].endswith("KV cache float32")
    code, _out, err = _generate(argv + ["--kv-cache-dtype", "int8"], capsys)
    assert code == 2 and "argument --kv-cache-dtype: invalid choice: 'int8'" in err


def test_generate_command_refuses_an_fp8_cache_the_backend_does_not_serve(capsys):
    code, _out, err = _generate(
        ["--tiny", "llama", "--backend", f"{__name__}:_NoFp8", "--tokens", "1,2", "--kv-cache-dtype", "fp8_e5m2"],
        capsys,
    )
    last = err.strip().splitlines()[-1]
    assert code == 2 and last.startswith("attnplug: error: generate: backend 'nofp8' cannot run this llama model")
    assert "an FP8 KV cache of float8_e5m2 (capabilities: fp8_kv_dtypes = float8_e4m3fn)" in last


def test_fp8_decode_through_the_graph_runner_gives_the_eager_tokens():
    """DECODE steps replayed through the GraphRunner (the eager stand-in on the host) over an
    FP8 pool with per-layer scales give the eager steps' tokens."""
    scales = {0: (0.01, 0.02), 1: ([0.004, 0.008], 0.03), 2: (0.02, [0.01, 0.05])}

    def engine(graphs):
        return Engine(
            tiny_model("gemma3_text"),
            "reference",
            max_batch_size=3,
            max_context_len=40,
            cuda_graphs=graphs,
            kv_cache_dtype="fp8_e5m2",
            kv_scales=scales,
        )

    eager, graphed = engine(False), engine(True)
    want = eager.generate(PROMPTS, NEW)
    assert graphed.generate(PROMPTS, NEW) == want
    assert graphed.last_run["graph_steps"] > 0 and eager.last_run["graph_steps"] == 0
