"""ModelRunner and Engine: one step through the model equals transformers eager over the full
sequence; backends lacking what a model needs are refused at load with the reason; the model
cannot run outside a step; bad requests are refused and a failing run leaves the pools empty."""

import dataclasses
import io

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed (pip install 'attnplug[hf]')")

from hf_helpers import hf_greedy, one_request_batch, one_request_logits, random_prompts  # noqa: E402

from attnplug import ForwardMode  # noqa: E402
from attnplug.backends.reference import ReferenceBackend  # noqa: E402
from attnplug.integrations.transformers import (  # noqa: E402
    Engine,
    ModelRunner,
    NoStepError,
    UnsupportedModelError,
    tiny_model,
)
from attnplug.integrations.transformers.progress import Progress  # noqa: E402


def lacking(**flags):
    """A reference backend whose declared capabilities lack ``flags``."""

    class Lacking(ReferenceBackend):
        name = "lacking"

        @classmethod
        def declared_capabilities(cls):
            return dataclasses.replace(super().declared_capabilities(), **flags)

    return Lacking


@pytest.mark.parametrize(
    "arch, flags, reason",
    [
        ("gemma2", {"logit_softcap": False}, "attention logit soft-capping 1.0"),
        ("gpt_oss", {"attention_sinks": False}, "attention sinks"),
        ("mistral", {"sliding_window": False}, "sliding-window layers [0, 1]"),
        ("llama", {"head_dims": (64, 128)}, "head_dim 16"),
        ("llama", {"dtypes": (torch.float16,)}, "dtype float32"),
    ],
)
def test_a_backend_lacking_a_capability_is_refused_with_the_reason(arch, flags, reason):
    model = tiny_model(arch)
    with pytest.raises(UnsupportedModelError, match="backend 'lacking' cannot run this") as err:
        ModelRunner(model, lacking(**flags), max_batch_size=2, max_context_len=16)
    assert reason in str(err.value)
    assert model.config._attn_implementation == "eager"


def test_an_unsupported_page_size_is_refused():
    with pytest.raises(UnsupportedModelError, match="page_size 3"):
        ModelRunner(tiny_model("llama"), "reference", max_batch_size=2, max_context_len=16, page_size=3)


def test_a_backend_of_another_device_or_an_unknown_name_is_refused():
    with pytest.raises(UnsupportedModelError, match="no-such-backend"):
        ModelRunner(tiny_model("llama"), "no-such-backend", max_batch_size=2, max_context_len=16)
    with pytest.raises(UnsupportedModelError, match="concrete AttentionBackend subclass"):
        ModelRunner(tiny_model("llama"), 3, max_batch_size=2, max_context_len=16)


def test_default_backend_serves_the_model_device():
    runner = ModelRunner(tiny_model("llama"), max_batch_size=2, max_context_len=16)
    assert runner.backend.device.type == "cpu"


@pytest.mark.parametrize("arch", ["gemma2", "gpt_oss"])
def test_step_logits_equal_eager_over_the_full_sequence(arch):
    model = tiny_model(arch)
    prompt = random_prompts([20])[0]
    with torch.no_grad():
        want = model(torch.tensor([prompt + [prompt[-1]]])).logits[0].float()
    runner = ModelRunner(model, "reference", max_batch_size=2, max_context_len=32)
    got = one_request_logits(runner, prompt, [7, 9, 4])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_logits_indices_and_forward_graph():
    runner = ModelRunner(tiny_model("qwen3"), "reference", max_batch_size=2, max_context_len=32)
    alloc, rows = runner.allocator, runner.req_to_token_pool
    row = rows.alloc()
    loc = alloc.alloc_extend([0], [6], [-1])
    rows.req_to_token[row, :6] = loc.to(torch.int32)
    ids, pos = torch.tensor([5, 9, 11, 40, 41, 7]), torch.arange(6)
    batch = one_request_batch(ForwardMode.EXTEND, row, 6, loc, pos, extend_len=6)
    full = runner.forward(batch, ids, pos)
    assert full.shape == (6, runner.vocab_size) and full.dtype == torch.float32
    picked = runner.forward(batch, ids, pos, logits_indices=torch.tensor([2, 5]))
    torch.testing.assert_close(picked, full[[2, 5]])
    with pytest.raises(ValueError, match=r"input_ids must be a \[T=6\] tensor"):
        runner.forward(batch, ids[:5], pos)

    dec = alloc.alloc_decode([7], [loc[-1].item()])
    rows.req_to_token[row, 6] = dec.to(torch.int32)
    step = one_request_batch(ForwardMode.DECODE, row, 7, dec, torch.tensor([6]))
    eager = runner.forward(step, torch.tensor([3]), torch.tensor([6])).clone()
    runner.enable_graphs()
    replayed = runner.forward_graph(step, torch.tensor([3]), torch.tensor([6]))
    assert runner.graphs.bucket_for(step) == 1
    torch.testing.assert_close(replayed, eager)


def test_the_model_outside_a_step_raises():
    model = tiny_model("mistral")
    ModelRunner(model, "reference", max_batch_size=2, max_context_len=16)
    with pytest.raises(NoStepError, match="outside an attnplug step"):
        model(torch.tensor([[1, 2, 3]]))
    model.set_attn_implementation("eager")
    assert model(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 256)


def _empty(engine):
    a = engine.runner.allocator
    return (
        a.full_available_size() == engine.runner.pool.size
        and a.swa_available_size() == engine.runner.pool.size_swa
        and engine.runner.req_to_token_pool.available_size() == engine.runner.max_batch_size
    )


def test_bad_requests_are_refused_before_anything_runs():
    engine = Engine(tiny_model("gemma3_text"), "reference", max_batch_size=2, max_context_len=16)
    with pytest.raises(ValueError, match=r"prompts\[1\] is empty"):
        engine.generate([[5, 6], []], 4)
    with pytest.raises(ValueError, match=r"prompts\[0\] holds token 256, outside the vocabulary \[0, 256\)"):
        engine.generate([[5, 256]], 4)
    with pytest.raises(ValueError, match=r"prompts\[0\]: 14 prompt tokens \+ max_new_tokens=4 = 18 exceed"):
        engine.generate([list(range(3, 17))], 4)
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 0"):
        engine.generate([[5]], -1)
    with pytest.raises(ValueError, match="eos_token_id must be None, an int or a list of ints"):
        engine.generate([[5]], 2, eos_token_id="2")
    assert _empty(engine)
    with pytest.raises(ValueError, match="max_prefill_tokens must be an int >= 1, got 0"):
        Engine(tiny_model("llama"), "reference", max_prefill_tokens=0)
    with pytest.raises(ValueError, match="max_batch_size must be an int >= 1, got 2.5"):
        Engine(tiny_model("llama"), "reference", max_batch_size=2.5)
    small = Engine(tiny_model("gemma3_text"), "reference", max_batch_size=2, max_context_len=16, full_pool_tokens=8)
    with pytest.raises(ValueError, match=r"prompts\[0\] needs 14 full and .* SWA slots, the pools have 8"):
        small.generate([list(range(3, 13))], 4)


def test_a_failing_step_gives_every_slot_back(monkeypatch):
    engine = Engine(tiny_model("gpt_oss"), "reference", max_batch_size=2, max_context_len=40, max_prefill_tokens=6)
    real, calls = engine.runner.forward, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("device fault")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "forward", failing)
    with pytest.raises(RuntimeError, match="device fault"):
        engine.generate(random_prompts([9, 13, 5]), 6)
    assert _empty(engine)
    engine.runner.allocator.check_invariants()
    monkeypatch.setattr(engine.runner, "forward", real)
    prompts = random_prompts([9, 13, 5])
    model = tiny_model("gpt_oss")
    assert engine.generate(prompts, 6) == [hf_greedy(model, p, 6) for p in prompts]


def test_graph_decode_through_the_eager_stand_in_matches():
    prompts = random_prompts([4, 12, 9])
    want = [hf_greedy(tiny_model("qwen2"), p, 6) for p in prompts]
    engine = Engine(tiny_model("qwen2"), "reference", max_batch_size=2, max_context_len=24, cuda_graphs=True)
    assert engine.generate(prompts, 6) == want
    run = engine.last_run  # the DECODE steps and, in token-count buckets, the EXTEND ones
    assert run["graph_steps"] == run["steps"]["DECODE"] + run["steps"]["EXTEND"] and run["steps"]["DECODE"] > 0
    assert Engine(tiny_model("qwen2"), "reference", max_batch_size=2, max_context_len=24).graphs is None


def test_graph_extend_steps_through_the_eager_stand_in_match():
    """EXTEND steps (chunks of 16 tokens) replayed in token-count buckets, a graph's logits a
    row per request: the tokens of greedy generation are transformers' own."""
    prompts = random_prompts([4, 12, 9, 30])
    for name in ("qwen2", "gemma3_text"):
        want = [hf_greedy(tiny_model(name), p, 5) for p in prompts]
        engine = Engine(
            tiny_model(name), "reference", max_batch_size=2, max_context_len=48, cuda_graphs=True, max_prefill_tokens=16
        )
        assert engine.graphs.extend_tokens == (16,) and ForwardMode.EXTEND in engine.graphs.modes
        assert engine.generate(prompts, 5) == want
        run = engine.last_run
        assert run["graph_steps"] == run["steps"]["EXTEND"] + run["steps"]["DECODE"]
        assert "EXTEND/tokens=16" in engine.graphs.status()["captured"]


def test_extend_graphs_can_be_turned_off_and_are_refused_where_they_cannot_run():
    model = tiny_model("qwen2")
    engine = Engine(model, "reference", max_batch_size=2, max_context_len=24, cuda_graphs=True, extend_graphs=False)
    assert engine.graphs.modes == (ForwardMode.DECODE,)
    with pytest.raises(ValueError, match="extend_graphs=True but cuda_graphs=False"):
        Engine(model, "reference", max_batch_size=2, max_context_len=24, cuda_graphs=False, extend_graphs=True)
    with pytest.raises(ValueError, match="extend_graphs must be None, True or False"):
        Engine(model, "reference", max_batch_size=2, max_context_len=24, extend_graphs="yes")


def test_progress_line_when_asked(capsys):
    engine = Engine(tiny_model("llama"), "reference", max_batch_size=2, max_context_len=24, progress=True)
    engine.generate(random_prompts([4, 6, 5]), 3)
    err = capsys.readouterr().err
    assert "generate: 3/3 requests, 9 tokens" in err and err.endswith("\n")
    quiet = Progress(3, enabled=None, stream=io.StringIO())  # not a terminal: nothing
    quiet.update(done=1, tokens=3, running=1, waiting=1, steps=2, force=True)
    quiet.close(done=3, tokens=9, running=0, waiting=0, steps=5)
    assert quiet.stream.getvalue() == ""
