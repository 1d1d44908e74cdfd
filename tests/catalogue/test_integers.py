"""Trust II, integers: Python and numpy integers are integers; bools, floats and strings are
refused naming the argument, and nothing changes (issue 37: memory, graph runner, engine,
soak). Each case failed on the code before it: ``alloc(np.int64(4))`` and the pool sizes
raised, ``GraphRunner`` took a draft count of 0 and float bucket sizes, ``Engine.generate``
truncated 5.7 to token 5 and refused numpy ids, ``soak --tolerance inf`` passed any output."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from attnplug import ForwardMode, GraphRunner
from attnplug.backends.reference import ReferenceBackend
from attnplug.memory import KVSlotError, ReqToTokenPool, SWAKVPool, SWATokenAllocator
from attnplug.soak.config import SoakConfig
from memory_snapshot import assert_same, snapshot

CPU = torch.device("cpu")


def _pool(page_size=2):
    return SWAKVPool(64, 32, 2, [0], 2, 8, torch.float32, CPU, page_size=page_size)


@pytest.mark.parametrize("n", [np.int64(4), np.int32(4), torch.tensor(4), 4])
def test_alloc_takes_integer_scalars(n):
    alloc = SWATokenAllocator(_pool())
    assert alloc.alloc(n).shape == (4,)


@pytest.mark.parametrize(
    "n, needle",
    [
        (4.0, "must be an int"),
        (True, "bool"),
        ("4", "must be an int"),
        (-2, ">= 0"),
        (np.int64(3), "multiple of page_size"),
    ],
)
def test_alloc_refuses_what_is_not_a_whole_page_count(n, needle):
    alloc = SWATokenAllocator(_pool())
    before = snapshot(alloc)
    with pytest.raises(KVSlotError, match=needle):
        alloc.alloc(n)
    assert_same(before, snapshot(alloc))


def test_pool_sizes_take_integer_scalars_and_refuse_floats():
    pool = SWAKVPool(np.int64(64), np.int32(32), np.int64(2), [np.int64(0)], 2, 8, torch.float32, CPU, page_size=2)
    assert (pool.size, pool.size_swa) == (64, 32) and type(pool.size) is int and pool.is_swa_layer(0)
    for kw, needle in (
        (dict(size=64.0), "size must be an int"),
        (dict(size_swa=True), "size_swa"),
        (dict(swa=[2]), "are not layer ids"),
    ):
        args = dict(size=64, size_swa=32, swa=[0])
        args.update(kw)
        with pytest.raises(ValueError, match=needle):
            SWAKVPool(args["size"], args["size_swa"], 2, args["swa"], 2, 8, torch.float32, CPU, page_size=2)


def _runner(**kw):
    pool = _pool(page_size=1)
    rows = ReqToTokenPool(4, 32, CPU)
    backend = ReferenceBackend(pool, rows, num_heads=4, sliding_window=4)
    args = dict(max_bs=2, inputs={"q": ((4, 8), torch.float32)})
    args.update(kw)
    return GraphRunner(backend, lambda batch, inputs: inputs["q"], **args)


@pytest.mark.parametrize(
    "kw, needle",
    [
        (dict(num_draft_tokens=0, modes=[ForwardMode.TARGET_VERIFY]), "num_draft_tokens must be a positive int"),
        (dict(num_draft_tokens=-2), "num_draft_tokens must be a positive int"),
        (dict(num_draft_tokens=2.0), "num_draft_tokens must be an int"),
        (dict(bucket_sizes=[1.5, 2]), "bucket_sizes entry must be an int"),
        (dict(bucket_sizes=[True]), "bucket_sizes entry"),
        (dict(max_bs=2.5), "max_bs must be an int"),
        (dict(max_bs=0), "max_bs must be a positive int"),
    ],
)
def test_graph_runner_refuses_bad_sizes(kw, needle):
    with pytest.raises(ValueError, match=needle):
        _runner(**kw)


def test_graph_runner_takes_numpy_sizes():
    runner = _runner(max_bs=np.int64(2), bucket_sizes=[np.int32(1), np.int64(2)])
    assert runner.bucket_sizes == (1, 2)


@pytest.mark.parametrize("tol", [math.inf, math.nan, -1.0, 0.0, True])
def test_soak_tolerance_that_cannot_fail_is_refused(tol):
    with pytest.raises(ValueError, match="tolerance must be a finite number > 0"):
        SoakConfig(tolerance=tol).check()


def test_soak_cli_refuses_an_infinite_tolerance(capsys):
    from attnplug.cli import main

    assert main(["soak", "--backend", "reference", "--steps", "1", "--tolerance", "inf"]) == 2
    assert "tolerance must be a finite number > 0" in capsys.readouterr().err


@pytest.fixture(scope="module")
def engine():
    pytest.importorskip("transformers")
    from attnplug.integrations.transformers import Engine, tiny_model

    return Engine(tiny_model("llama"), "reference", max_batch_size=2, max_context_len=32, page_size=2)


@pytest.mark.parametrize(
    "prompt, needle",
    [
        ([5.7, 6], r"prompts\[0\]\[0\] must be an int, got 5.7"),
        ([5, True], r"prompts\[0\]\[1\] must be an int, got the bool"),
        (["5"], r"prompts\[0\]\[0\] must be an int"),
        ("hello", "must be a sequence of token ids"),
        (torch.tensor([5.0, 6.0]), "float32 tensor"),
    ],
)
def test_generate_refuses_what_is_not_a_token_id(engine, prompt, needle):
    with pytest.raises(ValueError, match=needle):
        engine.generate([prompt], 2)


def test_generate_takes_numpy_and_torch_integer_ids(engine):
    want = engine.generate([[5, 6, 7]], 3)
    assert engine.generate([np.array([5, 6, 7], dtype=np.int64)], np.int64(3)) == want
    assert engine.generate([[np.int32(5), torch.tensor(6), 7]], 3) == want
    assert engine.generate([[5, 6, 7]], 3, eos_token_id=np.int64(1000)) == want


def test_a_second_thread_is_refused_while_generate_runs(engine):
    """Trust II: two threads on one engine got unrelated errors (shared pools and EOS state);
    the second is refused clearly and the first finishes with the right tokens."""
    import threading

    want = engine.generate([[5, 6, 7]], 4)
    started, release, result = threading.Event(), threading.Event(), {}
    real = engine._admit

    def slow_admit(*args, **kwargs):
        started.set()
        release.wait(10)
        return real(*args, **kwargs)

    engine._admit = slow_admit
    try:
        t = threading.Thread(target=lambda: result.setdefault("tokens", engine.generate([[5, 6, 7]], 4)))
        t.start()
        assert started.wait(10)
        with pytest.raises(RuntimeError, match="already running on this engine"):
            engine.generate([[5, 6, 7]], 4)
        release.set()
        t.join(10)
    finally:
        del engine._admit
    assert result["tokens"] == want
    assert engine.generate([[5, 6, 7]], 4) == want  # the engine serves again


def test_plugins_allow_list_naming_no_plugin_says_so(monkeypatch):
    """Trust II: ATTNPLUG_PLUGINS=nosuch listed every plugin as disabled and named nothing wrong."""
    from attnplug.registry import load_registry

    monkeypatch.setenv("ATTNPLUG_PLUGINS", "reference,nosuch")
    registry = load_registry()
    unknown = [e for e in registry.load_errors() if e.kind == "unknown"]
    assert [e.plugin for e in unknown] == ["nosuch"]
    assert "ATTNPLUG_PLUGINS names 'nosuch', which no installed plugin is called" in unknown[0].reason
    assert "reference" in unknown[0].reason
    assert "reference" in registry.names()


def test_conformance_quick_and_thorough_together_are_refused(capsys):
    """Trust II: --quick --thorough silently ran the quick profile."""
    from attnplug.cli import main

    with pytest.raises(SystemExit) as info:
        main(["conformance", "--backend", "reference", "--quick", "--thorough"])
    assert info.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err
