"""Engine prefill (EXTEND steps): the host reads the device only when a chunk completes a
prompt (once per such chunk, never per chunk), and the cuda backend's kernel plans of the
EXTEND steps an Engine issues do not grow with the prompt length (each distinct plan is a
Triton compile)."""

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed (pip install 'attnplug[hf]')")

from hf_helpers import random_prompts  # noqa: E402

from attnplug.integrations.transformers import Engine, tiny_model  # noqa: E402
from attnplug.integrations.transformers.engine import DEFAULT_MAX_PREFILL_TOKENS  # noqa: E402

# the reads a tensor's value makes on the host (each waits for the device where one exists)
_READS = {"tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "__array__"}


class _Counted(torch.Tensor):
    """Logits whose host reads are counted (``_Counted.reads``); every tensor derived from
    them (argmax, views) counts too."""

    reads = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in _READS:
            cls.reads += 1
        if name == "to" and any(isinstance(a, (str, torch.device)) and torch.device(a).type == "cpu" for a in args[1:]):
            cls.reads += 1
        return super().__torch_function__(func, types, args, kwargs or {})


def _counting(engine, monkeypatch):
    """The runner's forward returning counted logits; returns the list of (mode, tokens, reads
    after the step) of each step."""
    forward, steps = engine.runner.forward, []

    def counted(batch, *args, **kwargs):
        out = forward(batch, *args, **kwargs).as_subclass(_Counted)
        steps.append([batch.forward_mode.name, batch.num_tokens, None])
        return out

    def after(*args, **kwargs):
        if steps and steps[-1][2] is None:
            steps[-1][2] = _Counted.reads
        return advance(*args, **kwargs)

    advance = engine._advance
    monkeypatch.setattr(engine.runner, "forward", counted)
    monkeypatch.setattr(engine, "_advance", after)
    _Counted.reads = 0
    return steps


def test_a_long_prompt_reads_the_device_once_over_its_chunks(monkeypatch):
    """A 45-token prompt in chunks of 8: six EXTEND steps complete nothing and read nothing; the
    seventh completes the prompt and reads its token, once. The tokens are those of an engine
    prefilling the whole prompt in one step."""
    (prompt,) = random_prompts([45], seed=3)
    whole = Engine(tiny_model("gemma3_text"), "reference", max_batch_size=1, max_context_len=64, max_prefill_tokens=64)
    want = whole.generate([prompt], 3)
    engine = Engine(tiny_model("gemma3_text"), "reference", max_batch_size=1, max_context_len=64, max_prefill_tokens=8)
    steps = _counting(engine, monkeypatch)
    assert engine.generate([prompt], 1) == [want[0][:1]]
    assert [(m, n) for m, n, _ in steps] == [("EXTEND", 8)] * 5 + [("EXTEND", 5)]
    assert [reads for _, _, reads in steps] == [0, 0, 0, 0, 0, 1]
    assert _Counted.reads == 1
    # the tokens are right whatever the chunks
    steps.clear()
    _Counted.reads = 0
    assert engine.generate([prompt], 3) == want


def test_several_prompts_read_once_per_chunk_completing_some(monkeypatch):
    """Prompts of 5, 30 and 12 tokens in steps of 16 tokens: the first step completes the
    5-token prompt (one read), the next completes none (no read), the third completes the
    30-token prompt and the 12-token one together (one read for both)."""
    prompts = random_prompts([5, 30, 12], seed=4)
    engine = Engine(tiny_model("gemma3_text"), "reference", max_batch_size=3, max_context_len=40, max_prefill_tokens=16)
    steps = _counting(engine, monkeypatch)
    out = engine.generate(prompts, 1)
    assert [len(o) for o in out] == [1, 1, 1]
    assert [(m, n) for m, n, _ in steps] == [("EXTEND", 16), ("EXTEND", 16), ("EXTEND", 15)]
    assert [reads for _, _, reads in steps] == [1, 1, 2]
    want = [
        Engine(tiny_model("gemma3_text"), "reference", max_batch_size=1, max_context_len=40).generate([p], 1)[0]
        for p in prompts
    ]
    assert out == want


# ----------------------------------------------------------------------------- kernel plans
def _chunks(length: int, max_prefill_tokens: int):
    """The EXTEND chunks of one prompt of ``length`` tokens (the Engine's rule)."""
    return [min(max_prefill_tokens, length - off) for off in range(0, length, max_prefill_tokens)]


def test_the_engine_chunks_a_prompt_as_the_plan_sweep_assumes(monkeypatch):
    """The sweep below plans ``_chunks``: one request a step, ``max_prefill_tokens`` tokens until
    the last chunk. Checked on the Engine itself (its forward stubbed: the steps only)."""
    engine = Engine(tiny_model("gemma3_text"), "reference", max_batch_size=1, max_context_len=80, max_prefill_tokens=16)
    seen = []

    def stub(batch, input_ids, positions, *, logits_indices=None):
        seen.append((batch.batch_size, batch.num_tokens, max(batch.extend_seq_lens_cpu)))
        return torch.zeros(len(logits_indices), engine.runner.vocab_size)

    monkeypatch.setattr(engine.runner, "forward", stub)
    for length in (1, 15, 16, 17, 33, 64, 79):
        seen.clear()
        engine.generate([[1] * length], 1)
        assert seen == [(1, n, n) for n in _chunks(length, 16)]


GEMMA3_1B_SHAPE = dict(num_heads=4, num_kv_heads=1, head_dim=256, window=512)


@pytest.mark.parametrize("max_prefill", [512, DEFAULT_MAX_PREFILL_TOKENS])
@pytest.mark.parametrize("num_sms", [132, 114])  # SMs of sm_90 parts (SXM, PCIe): the plans use them
def test_extend_plans_do_not_grow_with_the_prompt_length(num_sms, max_prefill):
    """Every prompt length 1..4 x ``max_prefill`` of the 1B-class Gemma3 shape, chunked by a
    ``max_prefill_tokens`` of 512 and the Engine's default, planned by the cuda backend's
    planner (pure Python): each distinct (path, full plan, SWA plan) is one compile of the
    step's kernels. The plans are
    a function of the chunk, never of the prompt length: a prompt longer than a chunk adds no
    plan, and each plan serves one contiguous range of chunk lengths (the planner's pow2 tiles
    and split thresholds), so their number is bounded by the thresholds, not by the lengths
    (on 132 SMs when this was written: 12 for chunks of 512, 64 for chunks of 8,192, most of
    them the KV split counts of chunks too short to cover the SMs; printed with ``-s``)."""
    planner = pytest.importorskip("attnplug_cuda.planner")
    from attnplug_cuda.tuning import CudaTuning

    tuning = CudaTuning()
    longest = 4 * max_prefill
    shape = planner.AttentionShape(max_context_len=longest + 64, num_sms=num_sms, **GEMMA3_1B_SHAPE)
    plans_of = {}  # plan -> chunk lengths it serves
    for length in range(1, longest + 1):
        for n in _chunks(length, max_prefill):
            plan = planner.plan_step(shape, 1, n, n, tuning, True)
            plans_of.setdefault(plan, set()).add(n)
    short = {planner.plan_step(shape, 1, n, n, tuning, True) for n in range(1, max_prefill + 1)}
    assert set(plans_of) == short  # lengths beyond one chunk add no plan
    for plan, ns in plans_of.items():  # one contiguous range of chunk lengths each
        assert max(ns) - min(ns) + 1 == len(ns), (plan, sorted(ns))
    kernels = {p.full.kernel for p in plans_of} | {p.swa.kernel for p in plans_of}
    print(f"\n{num_sms} SMs: {len(plans_of)} step plans, {len(kernels)} kernel plans, prompts of 1..{longest} tokens")
    assert len(plans_of) < max_prefill  # far from one per length (the number is reported, not pinned)
