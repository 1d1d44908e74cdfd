"""``compile``: the DECODE graphs replay a ``torch.compile``-d model whose attention is the
opaque op ``attnplug::attention``. On the host the ``aot_eager`` compiler backend traces the
model exactly as inductor would see it (graph breaks, the op's fake implementation) without
generating code; the tokens must be transformers' own."""

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed (pip install 'attnplug[hf]')")

from hf_helpers import hf_greedy  # noqa: E402

from attnplug.integrations.transformers import Engine, ModelRunner, NoStepError, tiny_model  # noqa: E402
from attnplug.integrations.transformers.attention import attention_op  # noqa: E402

pytestmark = pytest.mark.slow  # torch.compile of tiny models


PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [40, 41, 42]]


@pytest.mark.parametrize("arch", ["gemma3_text", "gpt_oss"])  # a window + scalar, and sinks
def test_compiled_decode_graphs_give_transformers_tokens(arch):
    torch._dynamo.reset()
    reference = tiny_model(arch)
    want = [hf_greedy(reference, p, 8) for p in PROMPTS]
    engine = Engine(
        tiny_model(arch), "reference", max_batch_size=2, max_context_len=64, cuda_graphs=True, compile="aot_eager"
    )
    assert engine.generate(PROMPTS, 8) == want
    run = engine.last_run
    # the DECODE steps and the EXTEND ones (token-count graphs of the model compiled for any length)
    assert run["graph_steps"] == run["steps"]["DECODE"] + run["steps"]["EXTEND"] and run["steps"]["DECODE"] > 0
    assert engine.graphs.extend_tokens == (128,)  # 2 requests of at most 64 tokens
    assert engine.runner.compile == "aot_eager"


def test_bad_compile_values_are_refused():
    for bad in (1, "", None):
        with pytest.raises(ValueError, match="compile"):
            ModelRunner(tiny_model("llama"), "reference", max_batch_size=1, max_context_len=16, compile=bad)


def test_the_attention_op_needs_a_bound_step():
    q = torch.zeros(1, 4, 16)
    with pytest.raises(NoStepError):
        attention_op(q, q[:, :2], q[:, :2], 0, None)


def test_generate_command_compiles_on_request(capsys, monkeypatch):
    """``attnplug generate --compile`` builds its Engine with ``compile=True``."""
    from attnplug import cli
    from attnplug.integrations.transformers import engine as engine_module

    seen = {}

    class Recording(Engine):
        def __init__(self, *args, **kwargs):
            seen.update(kwargs)
            kwargs["compile"] = False  # inductor is not needed to check the wiring
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(engine_module, "Engine", Recording)  # the command imports it when it runs
    code = cli.main(["generate", "--tiny", "llama", "--backend", "reference", "--tokens", "5,6,7", "--compile"])
    assert code == 0 and seen["compile"] is True


def test_compiled_extend_steps_serve_every_length_without_recompiling():
    """With ``compile``, eager steps (EXTEND chunks of any length, and here the DECODE steps:
    no graphs) run the model compiled once for a symbolic token count: after one step of a
    single prompt and one of two (the sizes 1 that ``torch.compile`` specialises), prompts of
    new lengths and counts compile nothing more, and the tokens are transformers' own."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    reference = tiny_model("gemma3_text")
    engine = Engine(
        tiny_model("gemma3_text"), "reference", max_batch_size=3, max_context_len=64, cuda_graphs=False,
        compile="aot_eager",
    )  # fmt: skip
    for warm in ([[5, 6, 7, 8, 9, 10, 11]], [[40, 41, 42], [12, 13, 14, 15]]):
        assert engine.generate(warm, 3) == [hf_greedy(reference, p, 3) for p in warm]
    compiled = counters["stats"]["unique_graphs"]
    assert compiled > 0  # the eager steps ran a compiled model
    for prompts in (
        [[7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]],
        [[3, 4, 5, 6, 7], [8, 9], [20, 21, 22, 23, 24, 25, 26, 27, 28]],
        [list(range(20, 45)), [50, 51, 52, 53, 54, 55]],
    ):
        assert engine.generate(prompts, 3) == [hf_greedy(reference, p, 3) for p in prompts]
    assert counters["stats"]["unique_graphs"] == compiled, "a new prompt length recompiled the model"
