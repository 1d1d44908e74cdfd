"""The cuda backend end to end on the CPU, its Triton kernels under TRITON_INTERPRET=1 (PDL
off): every mode eager and replayed through the graph runner equals the reference backend,
the KV it writes equals the reference's, and a step makes ONE metadata launch."""

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("needs the Triton interpreter (set by conftest without a GPU)", allow_module_level=True)
pytest.importorskip("triton")

from attnplug import ForwardMode  # noqa: E402
from attnplug.backends.reference import ReferenceBackend  # noqa: E402
from attnplug_conformance.harness import World  # noqa: E402
from attnplug_cuda.backend import CudaBackend  # noqa: E402
from child import HANG_LIMIT_S
from worlds import drive_every_mode, kernel_spec  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SPEC = kernel_spec()


def _drive(cls, use_graphs):
    outs, caches, _ = drive_every_mode(cls, DEVICE, use_graphs=use_graphs)
    return outs, caches


@pytest.mark.parametrize("use_graphs", [False, True], ids=["eager", "replay"])
def test_cuda_backend_matches_reference(use_graphs):
    ref_outs, ref_caches = _drive(ReferenceBackend, use_graphs)
    outs, caches = _drive(CudaBackend, use_graphs)
    for i, (a, b) in enumerate(zip(outs, ref_outs)):
        err = (a.double() - b.double()).norm() / b.double().norm()
        assert err < 2e-3, f"step {i}: relative error {err:.2e}"
    for a, b in zip(caches, ref_caches):
        assert torch.equal(a, b), "KV caches differ"


def test_one_metadata_launch_per_step(monkeypatch):
    world = World(SPEC, CudaBackend, DEVICE, seed=1)
    reqs = [world.new_request() for _ in range(2)]
    step = world.plan(ForwardMode.EXTEND, reqs, [4, 7])
    world.run_eager(step)
    world.commit(step)
    launches = []
    real = world.backend._step_metadata
    monkeypatch.setattr(world.backend, "_step_metadata", lambda *a, **k: launches.append(1) or real(*a, **k))
    translations = []
    real_t = world.pool.translate_loc_from_full_to_swa
    monkeypatch.setattr(world.pool, "translate_loc_from_full_to_swa", lambda loc: translations.append(1) or real_t(loc))
    step = world.plan(ForwardMode.DECODE, reqs)
    world.run_eager(step)
    assert len(launches) == 1 and not translations


@pytest.mark.slow
def test_whole_conformance_suite_passes_on_the_cuda_kernels():
    """The shared suite against the cuda backend: the whole suite on a GPU; through the Triton
    interpreter (PDL off) its quick profile (``--attnplug-quick``: every check's first round,
    a tile boundary, a long context, every declared head dim and page size), since the whole
    suite takes minutes there. Runs in a subprocess so the suite's own pytest session is clean."""
    import subprocess
    import sys

    quick = [] if torch.cuda.is_available() else ["--attnplug-quick"]
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--attnplug-backend",
            "attnplug_cuda.backend:CudaBackend",
            "--attnplug-device",
            DEVICE,
            *quick,
        ],
        capture_output=True,
        text=True,
        timeout=HANG_LIMIT_S,
    )
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert " passed" in res.stdout and " failed" not in res.stdout


def test_window_table_rows_cover_padded_buckets_larger_than_the_request_table():
    """A graph bucket may hold more (padded) requests than the request table has rows; the
    SWA layers index the window table by request, so every padded request needs a row."""
    world = World(SPEC, CudaBackend, DEVICE, seed=2)  # max_reqs = 6
    world.backend.init_cuda_graph_state(16, 16)
    assert world.backend._table_rows.shape[0] >= 16
    assert torch.equal(world.backend._table_rows[:16].cpu(), torch.arange(16, dtype=torch.int32))


@pytest.mark.skipif(torch.cuda.is_available(), reason="host tensors reach the cuda backend only in the interpreter")
def test_extend_without_host_extend_lens_on_host_tensors():
    """EXTEND on CPU tensors with extend_seq_lens_cpu=None (allowed: the lens are host data)
    sizes the window table from the host tensor, not for one token: equals the reference."""
    import dataclasses

    outs = []
    for cls in (ReferenceBackend, CudaBackend):
        world = World(SPEC, cls, "cpu", seed=9)
        reqs = [world.new_request() for _ in range(3)]
        for lens in ([5, 9, 13], [7, 2, 11]):  # the second: chunked prefill over a prefix
            step = world.plan(ForwardMode.EXTEND, reqs, lens)
            step = dataclasses.replace(step, batch=dataclasses.replace(step.batch, extend_seq_lens_cpu=None))
            assert step.batch.extend_seq_lens.device.type == "cpu"
            out = world.run_eager(step)
            world.commit(step)
        outs.append(out.double())
    err = (outs[1] - outs[0]).norm() / outs[0].norm()
    assert err < 2e-3, f"relative error {err:.2e}"
