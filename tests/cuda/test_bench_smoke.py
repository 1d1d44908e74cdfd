"""Smoke tests of the CUDA plugin's benchmark suite on a machine without a GPU.

* every bench module imports on the CPU, and the suite is what ``attnplug bench --backend
  cuda`` (and ``python -m attnplug_cuda.bench``) finds;
* the "before" baseline (``BeforeBackend``) computes the same attention as the reference
  backend, eagerly through the harness and through the graph runner, under the Triton
  interpreter: the benchmarks compare two implementations of ONE function;
* the benchmark world / step / runner plumbing of ``hybrid_step`` runs on the CPU and gives
  the same outputs for the cuda backend and the before path;
* without CUDA, ``run_benchmarks`` and the command lines say the suite needs a CUDA device.
"""

import dataclasses
import importlib
import io
from contextlib import redirect_stderr

import pytest
import torch

from attnplug_cuda.kernels.interpret import use_interpreter

if not torch.cuda.is_available():
    use_interpreter()  # before triton is imported (tests/conftest.py also arranges this)
pytest.importorskip("triton")

from attnplug import ForwardMode  # noqa: E402
from attnplug.backends.reference import ReferenceBackend  # noqa: E402
from attnplug_conformance.harness import World  # noqa: E402
from worlds import tiny_spec  # noqa: E402

BENCH_MODULES = [
    "__init__",
    "__main__",
    "before",
    "kv_store",
    "step_metadata",
    "decode_attention",
    "hybrid_step",
    "kernels",
    "floor",
    "flashinfer_peer",
    "flashinfer_prefill",
    "prefill",
]
ON_CPU = not torch.cuda.is_available()
SPEC = tiny_spec(num_layers=4, sliding_window=5, max_reqs=6)


def _load_cli():
    return importlib.import_module("attnplug_cuda.bench.__main__")


def test_bench_modules_import_on_cpu():
    for name in BENCH_MODULES:
        mod = "attnplug_cuda.bench" if name == "__init__" else f"attnplug_cuda.bench.{name}"
        importlib.import_module(mod)
    from attnplug.bench import suite_for
    from attnplug_cuda import bench
    from attnplug_cuda.backend import CudaBackend

    assert suite_for(CudaBackend) is bench.SUITE and bench.SUITE.baseline == "before"
    assert bench.SUITE.names(default_only=True) == ["kv_store", "step_metadata", "decode_attention", "hybrid_step"]
    assert bench.SUITE.names() == [
        "kv_store",
        "step_metadata",
        "decode_attention",
        "hybrid_step",
        "kernels",
        "prefill",
        "model_decode",
        "batch_validation",
    ]
    for b in bench.SUITE.benchmarks:
        module = importlib.import_module(b.target.partition(":")[0])
        assert module.NAME == b.name and b.load() is module.run
    assert bench.SUITE.parse_options(["skip_cpp=1", "flex_budget_s=60"])["flex_budget_s"] == 60.0
    assert callable(_load_cli().main)


def test_before_backend_declares_the_before_path():
    from attnplug_cuda.bench.before import BeforeBackend

    world = World(SPEC, BeforeBackend, "cpu")
    caps = world.backend.capabilities()
    assert BeforeBackend.needs_cpu_seq_lens is True and caps.needs_cpu_seq_lens is True
    assert caps.pdl is False
    assert "contract" in BeforeBackend.__doc__ and "baseline" in BeforeBackend.__doc__


def _with_seq_lens_cpu(step, reqs):
    seq_after = [r.seq_len + n for r, n in zip(reqs, step.new_tokens)]
    return dataclasses.replace(step, batch=dataclasses.replace(step.batch, seq_lens_cpu=seq_after))


PLAN = [
    (ForwardMode.EXTEND, [7, 3, 9], None),
    (ForwardMode.DECODE, None, None),
    (ForwardMode.TARGET_VERIFY, None, 3),
    (ForwardMode.DECODE, None, None),
    (ForwardMode.DRAFT_EXTEND, None, 3),
    (ForwardMode.DECODE, None, None),
]


@pytest.mark.parametrize("use_graphs", [False, True], ids=["eager", "graph-runner"])
def test_before_backend_equals_reference(use_graphs):
    """Same seed, same allocations: the before path and the reference backend see identical
    steps; their outputs must agree for every mode, also after evictions."""
    from attnplug_cuda.bench.before import BeforeBackend

    worlds = {"ref": World(SPEC, ReferenceBackend, "cpu", seed=5), "before": World(SPEC, BeforeBackend, "cpu", seed=5)}
    reqs = {n: [w.new_request() for _ in range(3)] for n, w in worlds.items()}
    runners = {}
    for mode, new, ndt in PLAN:
        outs = {}
        for n, w in worlds.items():
            step = _with_seq_lens_cpu(w.plan(mode, reqs[n], new, num_draft_tokens=ndt), reqs[n])
            if use_graphs and mode is not ForwardMode.EXTEND:
                if n not in runners:  # bucket 4 for 3 requests: the graph path pads one request
                    runners[n] = w.graph_runner(max_bs=4, num_draft_tokens=3, bucket_sizes=[4])
                outs[n] = runners[n].run(step.batch, step.inputs)
            else:
                outs[n] = w.run_eager(step)
            w.commit(step)
            for r in reqs[n]:
                w.evict(r)
        assert outs["ref"].shape == outs["before"].shape
        torch.testing.assert_close(
            outs["before"], outs["ref"], rtol=1e-4, atol=1e-5, msg=lambda m, mode=mode: f"{mode.name}: {m}"
        )


@pytest.mark.skipif(not ON_CPU, reason="CPU plumbing check (the GPU runs the real benchmark)")
@pytest.mark.slow
def test_hybrid_world_and_runner_plumbing_on_cpu():
    """The hybrid benchmark's world, step and graph-runner path, shrunk to CPU size: the cuda
    backend (interpreted) and the before path give the same step outputs."""
    from attnplug.bench import Ctx
    from attnplug.bench.step_case import time_variant
    from attnplug.bench.world import build_world
    from attnplug_cuda.bench import hybrid_step

    model = dict(num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    world = build_world(**model, max_bs=3, context=16, window=5, num_draft=hybrid_step.NUM_DRAFT, device="cpu")
    assert world.alloc.swa_available_size() >= 0
    world.alloc.check_invariants()
    # the variants over the model's dtype (new-fp8's FP8 world: test_bench_flashinfer_configs)
    variants = {k: v for k, v in hybrid_step.variants().items() if v.kv_cache_dtype is None}
    assert set(hybrid_step.variants()) - set(variants) == {"new-fp8"}
    backends = {path: v.make(world.pool, world.rows, num_heads=4, sliding_window=5) for path, v in variants.items()}
    ctx = Ctx(device=torch.device("cpu"))
    for mode, bs in ((ForwardMode.DECODE, 3), (ForwardMode.DRAFT_EXTEND, 2)):
        outs = {}
        for path, backend in backends.items():
            us, outs[path] = time_variant(ctx, world, variants[path], backend, mode, bs, steps=1, repeats=1, warmup=0)
            assert us > 0
        q = 1 if mode is ForwardMode.DECODE else hybrid_step.NUM_DRAFT
        assert outs["new"].shape == (bs * q, 4, 16)
        torch.testing.assert_close(outs["before"], outs["new"], rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not ON_CPU, reason="checks the message given without a CUDA device")
def test_run_benchmarks_needs_a_cuda_device(tmp_path, capsys):
    from attnplug import cli
    from attnplug_cuda.bench import NeedsCudaDevice, run_benchmarks

    with pytest.raises(NeedsCudaDevice, match="need a CUDA device"):
        run_benchmarks(quick=True, json_path=str(tmp_path / "out.json"))
    assert not (tmp_path / "out.json").exists()
    with pytest.raises(ValueError, match="unknown benchmark"):
        run_benchmarks(only=["nope"])
    with pytest.raises(ValueError, match="unknown option"):
        run_benchmarks(colour="blue")
    err = io.StringIO()
    with redirect_stderr(err):
        assert _load_cli().main(["--quick", "--out", str(tmp_path / "cli")]) == 2
    assert "no cuda device is available here" in err.getvalue() and not (tmp_path / "cli").exists()
    assert cli.main(["bench", "--backend", "attnplug_cuda.backend:CudaBackend", "--only", "kernels"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("attnplug: error: ") and "the cuda benchmarks need a CUDA device" in err


@pytest.mark.skipif(not ON_CPU, reason="drives the runner with benchmarks that fail fast without CUDA")
def test_cuda_suite_runs_through_the_harness_and_keeps_failures(tmp_path, capsys):
    """The cuda suite in the one harness: a child process per benchmark (the suite's
    default), each failure kept as an error row, the table printed last and the JSON written."""
    import json

    from attnplug.bench import run_suite
    from attnplug_cuda import bench
    from attnplug_cuda.backend import CudaBackend

    suite = dataclasses.replace(bench.SUITE, requires=None)  # let the children fail on their own
    result = run_suite(suite, CudaBackend, "cpu", only=["kv_store"], quick=True, out_dir=str(tmp_path / "r"))
    assert result["isolated"] is True and result["benchmarks"] == ["kv_store"]
    assert [r["benchmark"] for r in result["rows"] if r.get("error")] == ["kv_store"]
    saved = json.loads((tmp_path / "r" / "bench.json").read_text())
    assert saved["summary"]["errors"] and saved["environment"]["torch"] == torch.__version__
    assert "torch_cuda" in saved["environment"]  # the suite's own environment keys
    printed = capsys.readouterr().out.rstrip().splitlines()
    assert printed[-1].startswith("targets met: 0 / ") and "errors: " in printed[-1]


@pytest.mark.parametrize("window,layer", [(8, "swa"), (None, "full")])
def test_kernels_benchmark_cases_match_their_reference(window, layer):
    """The ``kernels`` benchmark's tables, launches and float32 reference, shrunk to CPU size:
    the paged attention it times computes what its check compares against (interpreted)."""
    from attnplug_cuda.bench import kernels

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    c = kernels._case(2, 1, 16, window, 4, 2, 16, torch.float32, dev, layer)
    out = kernels._attention_fn(c, 1, window)()
    ref = kernels._reference(c, 1, window)
    assert float((out.float() - ref).norm() / ref.norm()) < 1e-4
    c["v_cache"].add_(1.0)  # the check must notice a wrong result
    assert float((out.float() - kernels._reference(c, 1, window)).norm() / ref.norm()) > 1e-2
