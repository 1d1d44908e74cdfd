import os
import sys

HERE = os.path.dirname(__file__)
sys.path.insert(0, HERE)  # tests/oracle.py and the deliberately broken backends

import pytest  # noqa: E402

# Without an accelerator, Triton kernels run in the interpreter. This must be decided before
# any kernel module is imported (the @triton.jit decorator reads it).
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Tests read printed tables as a pipe prints them. An xdist worker starts with COLUMNS=80 and
# LINES=24 in its environment, which would squeeze those tables (fixtures of any scope run later).
for _name in ("COLUMNS", "LINES"):
    os.environ.pop(_name, None)


def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (pyproject's addopts): one worker a CPU, at most 4 (each worker holds its
    own interpreter, torch and Triton)."""
    return max(1, min(4, os.cpu_count() or 1))


def _share_the_cpus_between_workers() -> None:
    """An xdist worker's torch (and the child processes its tests start, through
    ``OMP_NUM_THREADS``) takes its share of the CPUs, not all of them: with one worker a CPU,
    torch's default of a thread a CPU in every worker and child oversubscribes the machine."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers > 1:
        share = max(1, (os.cpu_count() or 1) // workers)
        os.environ.setdefault("OMP_NUM_THREADS", str(share))
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


_share_the_cpus_between_workers()


@pytest.fixture
def project_registry(tmp_path, monkeypatch):
    """A registry of exactly the attnplug distribution's entry points (what the docs list),
    made the process-wide one; no ``ATTNPLUG_*`` selection, KV-store or PDL flag of the caller."""
    from attnplug import registry as R
    from attnplug.registry import load_registry
    from plugin_dists import entry_points_in, write_project_metadata

    for name in ("ATTNPLUG_BACKEND", "ATTNPLUG_PLUGINS", "ATTNPLUG_KV_STORE", "ATTNPLUG_DISABLE_PDL"):
        monkeypatch.delenv(name, raising=False)
    write_project_metadata(tmp_path)
    registry = load_registry(entry_points=entry_points_in(tmp_path))
    R.reset_registry(registry)
    yield registry
    R.reset_registry()
