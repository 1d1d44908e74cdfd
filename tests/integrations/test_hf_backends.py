"""Other backends through the same Engine: the portable backend (passed as a class, decode
through GraphRunner) gives transformers' tokens; the cuda backend's Triton kernels, run on the
host under the Triton interpreter, give the reference backend's tokens on a hybrid model and
its logits (float16) on a model with sinks (whose mixture-of-experts routing turns float16
rounding differences into other tokens, so tokens are not compared there)."""

import os

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed (pip install 'attnplug[hf]')")

from hf_helpers import hf_greedy, one_request_logits, random_prompts  # noqa: E402

from attnplug.backends.portable import PortableBackend  # noqa: E402
from attnplug.device_part import DevicePart  # noqa: E402
from attnplug.integrations.transformers import Engine, ModelRunner, tiny_model  # noqa: E402

PROMPTS = random_prompts([5, 14, 10])


def test_portable_backend_matches_transformers():
    want = [hf_greedy(tiny_model("gemma2"), p, 8) for p in PROMPTS]
    engine = Engine(
        tiny_model("gemma2"), PortableBackend, max_batch_size=2, max_context_len=32, page_size=2, cuda_graphs=True
    )
    assert engine.runner.backend.name == "portable"
    assert engine.generate(PROMPTS, 8) == want
    assert engine.last_run["graph_steps"] > 0


def _cuda_on_host():
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("needs the Triton interpreter (set by conftest without a GPU)")
    pytest.importorskip("triton")
    from attnplug_cuda.backend import CudaBackend

    if torch.cuda.is_available():
        return CudaBackend, "cuda"

    class CudaKernelsOnHost(CudaBackend):
        """The cuda backend's kernels on host tensors (interpreted); the default device part."""

        device_part = DevicePart()

    return CudaKernelsOnHost, "cpu"


@pytest.mark.slow
@pytest.mark.parametrize("compile", [False, "aot_eager"])
def test_cuda_kernels_give_the_reference_tokens(compile):
    """Also with the cuda Engine's steps compiled (its EXTEND chunks of 8, 8 and 3 tokens
    through the model traced once with a symbolic token count, each layer's attention the
    ``attnplug::attention`` op)."""
    cls, device = _cuda_on_host()
    prompts = random_prompts([6, 13])
    runs = []
    for backend, compiled in (("reference", False), (cls, compile)):
        model = tiny_model("gemma3_text", head_dim=64, dtype=torch.float16, device=device)
        engine = Engine(
            model, backend, max_batch_size=2, max_context_len=24, page_size=2, max_prefill_tokens=8, compile=compiled
        )
        runs.append(engine.generate(prompts, 5))
    assert runs[0] == runs[1]


def test_cuda_kernels_give_the_reference_logits_with_sinks():
    cls, device = _cuda_on_host()
    prompt = random_prompts([13])[0]
    logits = []
    for backend in ("reference", cls):
        model = tiny_model("gpt_oss", head_dim=64, dtype=torch.float16, device=device)
        runner = ModelRunner(model, backend, max_batch_size=2, max_context_len=24, page_size=2)
        logits.append(one_request_logits(runner, prompt, [5, 8]).double())
    want, got = logits
    assert ((got - want).norm() / want.norm()).item() < 5e-3
