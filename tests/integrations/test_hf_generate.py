"""Engine.generate through attnplug gives exactly transformers' own greedy tokens (eager
attention, float32) for every supported architecture: several prompts longer than the sliding
window, chunked prefill, requests joining as others finish, page sizes 1 and 4, and an SWA
pool so small that its slots are reused many times over."""

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed (pip install 'attnplug[hf]')")

from hf_helpers import hf_greedy, random_prompts  # noqa: E402

from attnplug.integrations.transformers import ARCHITECTURES, Engine, tiny_model  # noqa: E402

LENGTHS = (3, 11, 19, 26)  # the tiny models' window is 8
NEW = 12
PROMPTS = random_prompts(LENGTHS)

_REFERENCE = {}


def reference(arch):
    """transformers' greedy tokens of PROMPTS on the eager tiny model (computed once per arch)."""
    if arch not in _REFERENCE:
        model = tiny_model(arch)
        _REFERENCE[arch] = [hf_greedy(model, p, NEW) for p in PROMPTS]
    return _REFERENCE[arch]


def check_pools_empty(engine):
    runner = engine.runner
    assert runner.allocator.full_available_size() == runner.pool.size
    assert runner.allocator.swa_available_size() == runner.pool.size_swa
    assert runner.req_to_token_pool.available_size() == runner.req_to_token_pool.max_reqs - 1
    runner.allocator.check_invariants()


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_matches_transformers_page_size_1(arch):
    want = reference(arch)
    # two rows for four requests: the others join as the first ones finish; 10-token chunks
    engine = Engine(tiny_model(arch), "reference", max_batch_size=2, max_context_len=40, max_prefill_tokens=10)
    got = engine.generate(PROMPTS, NEW)
    assert got == want
    assert engine.last_run["steps"]["EXTEND"] > len(PROMPTS)  # the long prompts were chunked
    check_pools_empty(engine)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_matches_transformers_pages_and_small_swa_pool(arch):
    want = reference(arch)
    swa = 48  # the four requests store 103 positions: SWA slots are freed and handed out again
    engine = Engine(
        tiny_model(arch),
        "reference",
        max_batch_size=3,
        max_context_len=40,
        page_size=4,
        max_prefill_tokens=16,
        swa_pool_tokens=swa,
    )
    got = engine.generate(PROMPTS, NEW)
    assert got == want
    if engine.runner.spec.swa_layer_ids:
        assert sum(len(p) + NEW - 1 for p in PROMPTS) > swa
        assert engine.last_run["peak_swa_slots"] <= swa
    check_pools_empty(engine)


def test_eos_ends_each_request_at_its_first_eos():
    want = reference("gemma3_text")
    eos = want[2][4]  # a token prompt 2 generates midway
    engine = Engine(tiny_model("gemma3_text"), "reference", max_batch_size=4, max_context_len=40)
    got = engine.generate(PROMPTS, NEW, eos_token_id=[eos])
    assert got == [w[: w.index(eos) + 1] if eos in w else w for w in want]
    assert len(got[2]) == 5
    check_pools_empty(engine)


def test_a_wrong_window_changes_the_tokens(monkeypatch):
    """The parity tests can fail: attending over a window one key narrower than the model's
    gives other tokens for these prompts. (A wider one is refused: its window reaches keys
    whose SWA slots the engine has freed, which validation names.)"""
    from attnplug.backends.reference import ReferenceBackend

    class NarrowerWindow(ReferenceBackend):
        def __init__(self, *args, sliding_window=None, **kwargs):
            super().__init__(*args, sliding_window=sliding_window - 1, **kwargs)

    engine = Engine(tiny_model("gemma3_text"), NarrowerWindow, max_batch_size=4, max_context_len=40)
    assert engine.generate(PROMPTS, NEW) != reference("gemma3_text")


def test_generate_twice_and_zero_new_tokens():
    engine = Engine(tiny_model("qwen3"), "reference", max_batch_size=2, max_context_len=40)
    want = reference("qwen3")
    assert engine.generate(PROMPTS[:2], NEW) == want[:2]
    assert engine.generate([PROMPTS[1], PROMPTS[0]], NEW) == [want[1], want[0]]
    assert engine.generate(PROMPTS, 0) == [[]] * len(PROMPTS)
    check_pools_empty(engine)


def test_bfloat16_model_runs():
    """A bfloat16 model runs with a bfloat16 KV pool; its tokens are what transformers gives
    for most positions (bfloat16 rounding differs between the two attention paths)."""
    model = tiny_model("cohere2", dtype=torch.bfloat16)
    want = [hf_greedy(model, p, 4) for p in PROMPTS[:2]]
    engine = Engine(model, "reference", max_batch_size=2, max_context_len=40)
    assert engine.runner.pool.dtype == torch.bfloat16
    got = engine.generate(PROMPTS[:2], 4)
    assert [len(g) for g in got] == [4, 4]
    assert sum(a == b for g, w in zip(got, want) for a, b in zip(g, w)) >= 6


def test_decode_steps_overlap_the_host_with_the_device(monkeypatch):
    """DECODE step N + 1 is enqueued before the host reads step N's tokens (its input tokens
    are step N's, still on the device), every step's tokens are read exactly once, and the
    result is transformers' own, EOS included."""
    want = reference("gemma3_text")
    eos = want[2][4]
    engine = Engine(tiny_model("gemma3_text"), "reference", max_batch_size=4, max_context_len=40)
    events = []
    forward, collect = engine.runner.forward, engine._collect

    sizes = []

    def traced_forward(batch, *args, **kwargs):
        events.append(batch.forward_mode.name)
        sizes.append((batch.forward_mode.name, batch.batch_size))
        return forward(batch, *args, **kwargs)

    def traced_collect(pending):
        events.append("read")
        return collect(pending)

    monkeypatch.setattr(engine.runner, "forward", traced_forward)
    monkeypatch.setattr(engine, "_collect", traced_collect)
    got = engine.generate(PROMPTS, NEW, eos_token_id=eos)
    assert got == [w[: w.index(eos) + 1] if eos in w else w for w in want]
    first = events.index("DECODE")
    assert events[first : first + 4] == ["DECODE", "DECODE", "read", "DECODE"]
    assert events.count("read") == events.count("DECODE")
    # the EOS request left while a step was in flight: the next step took the others' tokens
    # from that step's device tensor, by index
    decode = [bs for mode, bs in sizes if mode == "DECODE"]
    assert any(b < a for a, b in zip(decode, decode[1:]))
    check_pools_empty(engine)
