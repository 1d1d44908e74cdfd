"""Catalogue of adversarial cases for the transformers integration's ``Engine`` (issue 37, Trust
II: the engine and the command).

Each case is either a clear refusal (``ValueError`` / ``RuntimeError`` naming the argument and
its value, raised before anything runs, the pools left whole) or a result checked against
transformers' own greedy generation:

* token ids of every bad kind: floats (whole or not), NaN, bools, strings, None, nested lists,
  complex numbers, out of the vocabulary (negative, the vocabulary size, huge), float and bool
  tensors; prompts that are no sequence of ids (a str, bytes, a bytearray, a set, a 0-d or 2-D
  tensor) and a prompt list that is no ordered list (an int, None, a str, a set, a dict, a 1-D
  tensor); integer ids of numpy and torch give the same tokens as ints;
* ``max_new_tokens`` of every bad kind (negative, float, bool, str, None, beyond the context);
  0 gives no tokens;
* empty prompts, no prompts at all;
* ``eos_token_id`` of every kind: an int, a list, a tuple, a set, a 0-d / 1-D tensor, a numpy
  scalar and array (each stops at the EOS, kept), an empty list (never stops), and refusals
  (float, str, bool, nested list, a mapping, a 2-D tensor);
* two threads on one engine: the second is refused, the first gives the right tokens, and the
  engine serves again afterwards;
* ``from_pretrained(path, attn_implementation="attnplug")`` and ``from_config`` right after
  ``import attnplug.integrations.transformers`` (fresh interpreters, either import order), with
  no ``register()`` call, and that importing the integration imports no transformers.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed (pip install 'attnplug[hf]')")

from attnplug.integrations.transformers import Engine, tiny_model  # noqa: E402
from child import HANG_LIMIT_S

PROMPT = [5, 6, 7, 8]
NEW = 5


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def engine(model):
    return Engine(model, "reference", max_batch_size=4, max_context_len=32, progress=False)


@pytest.fixture(scope="module")
def want(model):
    """transformers' own greedy tokens of PROMPT (eager attention, never stopping early)."""
    reference = tiny_model("llama")
    ids = torch.tensor([PROMPT])
    out = reference.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(PROMPT) :].tolist()


def _pools(engine):
    runner = engine.runner
    return (
        runner.allocator.available_size(),
        runner.allocator.swa_available_size(),
        runner.req_to_token_pool.available_size(),
    )


@pytest.fixture
def whole(engine):
    """Every refusal leaves every slot and request row free."""
    before = _pools(engine)
    yield
    assert _pools(engine) == before


# ---------------------------------------------------------------------------- token ids
@pytest.mark.parametrize(
    "prompt, needle",
    [
        ([5.0, 6], r"prompts\[0\]\[0\] must be an int, got 5.0"),
        ([5, 6.5], r"prompts\[0\]\[1\] must be an int, got 6.5"),
        ([float("nan")], r"prompts\[0\]\[0\] must be an int, got nan"),
        ([5, True], r"prompts\[0\]\[1\] must be an int, got the bool True"),
        (["5"], r"prompts\[0\]\[0\] must be an int, got '5'"),
        ([None], r"prompts\[0\]\[0\] must be an int, got None"),
        ([[5, 6]], r"prompts\[0\]\[0\] must be an int, got \[5, 6\]"),
        ([1j], r"prompts\[0\]\[0\] must be an int"),
        ([np.float64(5.0)], r"prompts\[0\]\[0\] must be an int"),
        ([torch.tensor(5.0)], r"prompts\[0\]\[0\] must be an int"),
        ([-1], r"prompts\[0\] holds token -1, outside the vocabulary \[0, 256\)"),
        ([256], r"prompts\[0\] holds token 256, outside the vocabulary \[0, 256\)"),
        ([10**30], r"prompts\[0\] holds token 1000000000000000000000000000000, outside the vocabulary"),
        (torch.tensor([5.0, 6.0]), r"prompts\[0\] must hold integer token ids, got a torch.float32 tensor"),
        (torch.tensor([True, False]), r"prompts\[0\] must hold integer token ids, got a torch.bool tensor"),
        ("hello", r"prompts\[0\] must be a sequence of token ids, got str"),
        (b"hello", r"prompts\[0\] must be a sequence of token ids, got bytes"),
        (bytearray(b"hi"), r"prompts\[0\] must be a sequence of token ids, got bytearray"),
        ({5, 6}, r"prompts\[0\] must be a sequence of token ids, got set"),
        (torch.tensor(5), r"prompts\[0\] must be a sequence of token ids, got Tensor of shape \(\)"),
        (torch.tensor([[5, 6]]), r"prompts\[0\] must be a sequence of token ids, got Tensor of shape \(1, 2\)"),
        (5, r"prompts\[0\] must be a sequence of token ids, got int"),
    ],
)
def test_a_bad_token_id_is_refused_naming_it(engine, whole, prompt, needle):
    with pytest.raises(ValueError, match=needle):
        engine.generate([prompt], NEW)


def test_a_bad_prompt_after_a_good_one_is_refused_before_anything_runs(engine, whole):
    with pytest.raises(ValueError, match=r"prompts\[1\]\[2\] must be an int, got 7.5"):
        engine.generate([PROMPT, [5, 6, 7.5]], NEW)


@pytest.mark.parametrize(
    "prompts, needle",
    [
        (5, "got int"),
        (None, "got NoneType"),
        ("5,6,7", "got str"),
        ({(5, 6)}, r"got set \(unordered"),
        ({0: [5, 6]}, r"got dict \(unordered"),
        (torch.tensor([5, 6]), "or a 2-D tensor, got a 1-D Tensor"),
    ],
)
def test_a_prompt_list_that_is_no_ordered_list_is_refused(engine, whole, prompts, needle):
    with pytest.raises(ValueError, match="prompts must be a list of prompts .*" + needle):
        engine.generate(prompts, NEW)


@pytest.mark.parametrize(
    "prompts",
    [
        [PROMPT],
        [tuple(PROMPT)],
        [np.array(PROMPT, dtype=np.int32)],
        [torch.tensor(PROMPT)],
        [[np.int64(t) for t in PROMPT]],
        [[torch.tensor(t) for t in PROMPT]],
        np.array([PROMPT]),
        torch.tensor([PROMPT]),
        (p for p in [PROMPT]),
    ],
    ids=["list", "tuple", "numpy", "tensor", "numpy-ints", "tensor-ints", "numpy-2d", "tensor-2d", "generator"],
)
def test_integer_ids_of_any_kind_give_transformers_tokens(engine, want, prompts):
    assert engine.generate(prompts, NEW) == [want]


# ---------------------------------------------------------------------------- max_new_tokens
@pytest.mark.parametrize(
    "value, needle",
    [
        (-1, "max_new_tokens must be an int >= 0, got -1"),
        (2.0, "max_new_tokens must be an int, got 2.0"),
        (1.5, "max_new_tokens must be an int, got 1.5"),
        (True, "max_new_tokens must be an int, got the bool True"),
        ("3", "max_new_tokens must be an int, got '3'"),
        (None, "max_new_tokens must be an int, got None"),
        (10**6, r"4 prompt tokens \+ max_new_tokens=1000000 = 1000004 exceed max_context_len=32"),
    ],
)
def test_a_bad_max_new_tokens_is_refused(engine, whole, value, needle):
    with pytest.raises(ValueError, match=needle):
        engine.generate([PROMPT], value)


def test_zero_new_tokens_and_integer_scalars(engine, want):
    assert engine.generate([PROMPT, [9]], 0) == [[], []]
    assert engine.generate([PROMPT], np.int64(NEW)) == [want]
    assert engine.generate([PROMPT], torch.tensor(NEW)) == [want]


# ---------------------------------------------------------------------------- empty prompts
def test_empty_prompts(engine, whole):
    assert engine.generate([], NEW) == []
    for prompts in ([[]], [PROMPT, []], [torch.tensor([], dtype=torch.int64)]):
        with pytest.raises(ValueError, match=r"prompts\[\d\] is empty \(a prompt needs at least one token\)"):
            engine.generate(prompts, NEW)


# ---------------------------------------------------------------------------- eos_token_id
@pytest.mark.parametrize(
    "make",
    [
        lambda eos: eos,
        lambda eos: [eos],
        lambda eos: (eos, 255),
        lambda eos: {eos, 255},
        lambda eos: torch.tensor(eos),
        lambda eos: torch.tensor([eos, 255]),
        lambda eos: np.int64(eos),
        lambda eos: np.array([eos]),
    ],
    ids=["int", "list", "tuple", "set", "tensor-0d", "tensor-1d", "numpy-int", "numpy-array"],
)
def test_every_eos_kind_stops_at_the_eos_and_keeps_it(engine, want, make):
    stop = next(i for i in range(1, NEW) if want[i] not in want[:i] and want[i] != 255)  # a new value
    assert engine.generate([PROMPT], NEW, eos_token_id=make(want[stop])) == [want[: stop + 1]]


def test_no_eos_never_stops(engine, want):
    assert engine.generate([PROMPT], NEW, eos_token_id=[]) == [want]
    assert engine.generate([PROMPT], NEW, eos_token_id=None) == [want]


@pytest.mark.parametrize(
    "eos",
    [2.0, "2", True, [2.5], [[2]], {2: 1}, torch.tensor([[2]]), torch.tensor(2.0)],
    ids=["float", "str", "bool", "float-list", "nested", "dict", "tensor-2d", "float-tensor"],
)
def test_a_bad_eos_is_refused(engine, whole, eos):
    with pytest.raises(ValueError, match="eos_token_id must be None, an int or a list of ints"):
        engine.generate([PROMPT], NEW, eos_token_id=eos)


# ---------------------------------------------------------------------------- one generate at a time
def test_a_concurrent_generate_is_refused_and_the_first_one_is_right(engine, want):
    runner = engine.runner
    inside, release, result = threading.Event(), threading.Event(), {}
    real = runner.forward

    def held_forward(*args, **kwargs):
        inside.set()
        assert release.wait(30)
        return real(*args, **kwargs)

    def first():
        try:
            result["tokens"] = engine.generate([PROMPT], NEW)
        except BaseException as exc:  # pragma: no cover - reported below
            result["error"] = exc

    runner.forward = held_forward
    try:
        thread = threading.Thread(target=first)
        thread.start()
        assert inside.wait(30)
        with pytest.raises(RuntimeError, match="Engine.generate is already running on this engine"):
            engine.generate([[9, 10]], 2)
    finally:
        release.set()
        thread.join(60)
        del runner.forward
    assert "error" not in result, result.get("error")
    assert result["tokens"] == [want]
    assert engine.generate([PROMPT], NEW) == [want]  # the engine serves again


# ---------------------------------------------------------------------------- from_pretrained after the import only
def _python(script: str, tmp_path) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=HANG_LIMIT_S,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-gemma2")
    tiny_model("gemma2").save_pretrained(path)
    return path


@pytest.mark.slow
def test_from_pretrained_needs_only_the_import(saved_model, tmp_path):
    """No ``register()`` call: the import registers ``"attnplug"`` the moment transformers'
    modeling module is loaded, and importing the integration (or the command) loads none of
    transformers."""
    out = _python(
        f"""
        import sys
        import attnplug.cli
        import attnplug.integrations.transformers as integration
        attnplug.cli.build_parser()
        print("transformers imported:", "transformers" in sys.modules)
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(saved_model)!r}, attn_implementation="attnplug")
        print("implementation:", model.config._attn_implementation)
        print(integration.Engine(model, "reference", max_batch_size=1, max_context_len=16).generate([[5, 6]], 3))
        """,
        tmp_path,
    )
    lines = out.strip().splitlines()
    assert lines[0] == "transformers imported: False"
    assert lines[1] == "implementation: attnplug"
    assert lines[2].startswith("[[") and len(eval(lines[2])[0]) == 3


@pytest.mark.slow
def test_from_config_after_transformers_was_imported_first(tmp_path):
    out = _python(
        """
        import transformers
        from transformers import AutoModelForCausalLM
        import attnplug.integrations.transformers as integration
        config = integration.tiny_config("qwen3")
        model = AutoModelForCausalLM.from_config(config, attn_implementation="attnplug")
        print(model.config._attn_implementation)
        """,
        tmp_path,
    )
    assert out.strip() == "attnplug"
