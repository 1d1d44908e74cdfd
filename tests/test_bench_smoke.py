"""Smoke tests of the CUDA plugin's benchmark suite on a machine without a GPU.

* every bench module (and ``benchmarks/run_h200.py``) imports on the CPU;
* the "before" baseline (``BeforeBackend``) computes the same attention as the reference
  backend, eagerly through the harness and through the graph runner, under the Triton
  interpreter: the benchmarks compare two implementations of ONE function;
* the benchmark world / step / runner plumbing of ``hybrid_step`` runs on the CPU and gives
  the same outputs for the cuda backend and the before path;
* without CUDA, ``run_benchmarks`` and the command line say the suite needs a CUDA device.
"""

import dataclasses
import importlib
import importlib.util
import io
import os
from contextlib import redirect_stderr

import pytest
import torch

from attnplug_cuda.kernels.interpret import use_interpreter

if not torch.cuda.is_available():
    use_interpreter()  # before triton is imported (tests/conftest.py also arranges this)
pytest.importorskip("triton")

from attnplug import ForwardMode  # noqa: E402
from attnplug.backends.reference import ReferenceBackend  # noqa: E402
from attnplug_conformance.harness import World, WorldSpec  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH_MODULES = ["__init__", "__main__", "common", "timing", "before", "_world",
                 "kv_store", "step_metadata", "decode_attention", "hybrid_step"]
ON_CPU = not torch.cuda.is_available()
SPEC = WorldSpec(num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16, sliding_window=5, size=256, size_swa=128,
                 max_reqs=6, max_context_len=32)


def _load_cli():
    spec = importlib.util.spec_from_file_location("run_h200", os.path.join(REPO, "benchmarks", "run_h200.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_modules_import_on_cpu():
    for name in BENCH_MODULES:
        mod = "attnplug_cuda.bench" if name == "__init__" else f"attnplug_cuda.bench.{name}"
        importlib.import_module(mod)
    from attnplug_cuda import bench

    assert list(bench.BENCHMARKS) == ["kv_store", "step_metadata", "decode_attention", "hybrid_step"]
    for name in bench.BENCHMARKS:
        module = importlib.import_module(f"attnplug_cuda.bench.{name}")
        assert module.NAME == name and callable(module.run)
    cli = _load_cli()
    args = cli.build_parser().parse_args(["--quick", "--only", "kv_store", "hybrid_step", "--json", "x.json"])
    assert args.quick and args.only == ["kv_store", "hybrid_step"] and args.json == "x.json"


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


PLAN = [(ForwardMode.EXTEND, [7, 3, 9], None), (ForwardMode.DECODE, None, None), (ForwardMode.TARGET_VERIFY, None, 3),
        (ForwardMode.DECODE, None, None), (ForwardMode.DRAFT_EXTEND, None, 3), (ForwardMode.DECODE, None, None)]


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
        torch.testing.assert_close(outs["before"], outs["ref"], rtol=1e-4, atol=1e-5, msg=lambda m: f"{mode.name}: {m}")


@pytest.mark.skipif(not ON_CPU, reason="CPU plumbing check (the GPU runs the real benchmark)")
def test_hybrid_world_and_runner_plumbing_on_cpu():
    """The hybrid benchmark's world, step and graph-runner path, shrunk to CPU size: the cuda
    backend (interpreted) and the before path give the same step outputs."""
    from attnplug_cuda.backend import CudaBackend
    from attnplug_cuda.bench import hybrid_step
    from attnplug_cuda.bench._world import build_world
    from attnplug_cuda.bench.before import BeforeBackend

    world = build_world(num_layers=4, max_bs=3, context=16, window=5, num_draft=hybrid_step.NUM_DRAFT,
                        num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32, device="cpu")
    assert world.alloc.swa_available_size() >= 0
    world.alloc.check_invariants()
    backends = {
        "new": CudaBackend(world.pool, world.rows, num_heads=4, sliding_window=5),
        "before": BeforeBackend(world.pool, world.rows, num_heads=4, sliding_window=5),
    }
    for mode, bs in ((ForwardMode.DECODE, 3), (ForwardMode.DRAFT_EXTEND, 2)):
        outs = {}
        for path, backend in backends.items():
            us, outs[path] = hybrid_step._run_path(world, backend, mode, bs, steps=1, repeats=1,
                                                   with_cpu=(path == "before"), warmup=0)
            assert us > 0
        q = 1 if mode is ForwardMode.DECODE else hybrid_step.NUM_DRAFT
        assert outs["new"].shape == (bs * q, 4, 16)
        torch.testing.assert_close(outs["before"], outs["new"], rtol=1e-4, atol=1e-5)


def test_table_and_summary():
    from attnplug_cuda.bench import _summary, format_table
    from attnplug_cuda.bench.common import row

    rows = [
        row("kv_store", "triton pdl", "time per layer", 0.9, "us", target="<= 1.2 us", met=True),
        row("kv_store", "cpp pdl", "time per layer", None, "us", notes="not run: nvcc not found", key=True),
        row("hybrid_step", "decode bs=1", "speedup", 1.2, "x", target=">= 1.5x", met=False, detail="new 1 us"),
        row("hybrid_step", "decode bs=8 new", "time per step", None, "us", error="RuntimeError: boom\nmore"),
        row("hybrid_step", "decode bs=8 new", "detail only", 3.0, "us"),
    ]
    table = format_table(rows)
    lines = table.splitlines()
    assert lines[0].split() == ["benchmark", "case", "metric", "value", "target", "met", "detail"]
    assert len(lines) == 2 + 4 and "detail only" not in table  # detail rows go to the JSON only
    assert "0.9000 us" in table and "yes" in lines[2] and "NO" in lines[4] and "ERROR" in lines[5]
    assert "nvcc not found" in table and "new 1 us" in table and "boom" in table and "more" not in table
    assert "detail only" in format_table(rows, all_rows=True)
    s = _summary(rows)
    assert (s["targets"], s["met"], len(s["errors"])) == (2, 1, 1)


@pytest.mark.skipif(not ON_CPU, reason="checks the message given without a CUDA device")
def test_run_benchmarks_needs_a_cuda_device(tmp_path):
    from attnplug_cuda.bench import NeedsCudaDevice, run_benchmarks

    with pytest.raises(NeedsCudaDevice, match="needs a CUDA device"):
        run_benchmarks(quick=True, json_path=str(tmp_path / "out.json"))
    assert not (tmp_path / "out.json").exists()
    with pytest.raises(ValueError, match="unknown benchmark"):
        run_benchmarks(only=["nope"])
    err = io.StringIO()
    with redirect_stderr(err):
        assert _load_cli().main(["--quick", "--json", str(tmp_path / "cli.json")]) == 2
    assert "needs a CUDA device" in err.getvalue()


@pytest.mark.skipif(not ON_CPU, reason="drives the runner with benchmarks that fail fast without CUDA")
def test_runner_isolates_benchmarks_and_writes_json(tmp_path, monkeypatch, capsys):
    """The run's plumbing: one child process per benchmark, each failure kept as an error row,
    a child past its time limit killed, the table printed last and the JSON written."""
    import json

    from attnplug_cuda import bench
    from attnplug_cuda.bench.common import Ctx

    monkeypatch.setattr(bench, "_require_cuda", lambda: None)  # let the children fail on their own
    out = tmp_path / "r" / "bench.json"
    result = bench.run_benchmarks(only=["kv_store", "hybrid_step"], quick=True, json_path=str(out))
    assert [r["benchmark"] for r in result["rows"]] == ["kv_store", "hybrid_step"]
    assert all(r["error"] for r in result["rows"])
    saved = json.loads(out.read_text())
    assert saved["summary"]["errors"] and saved["environment"]["torch"] == torch.__version__
    printed = capsys.readouterr().out.rstrip().splitlines()
    assert printed[-1].startswith("targets met: 0 / 0; errors: 2")
    assert any(line.startswith("benchmark") and "detail" in line for line in printed)

    killed = bench._run_in_child("hybrid_step", Ctx(quick=True), timeout=0.3)
    assert "time limit" in killed[-1]["error"]
