"""`pip install .` (not only editable): the wheel holds every import package, the kernel
sources, and the entry points (backends, pytest11, console script), and installs and imports
from where it was installed."""

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from child import HANG_LIMIT_S

pytestmark = pytest.mark.slow  # builds and installs the wheel


ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for rel in files:  # build from a clean copy: no build/ or egg-info left in the checkout
        if (ROOT / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, src / rel)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-q",
            "-w",
            str(tmp / "dist"),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=HANG_LIMIT_S,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    (whl,) = (tmp / "dist").glob("attnplug-*.whl")
    return whl


def test_wheel_contents(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    for path in (
        "attnplug/__init__.py",
        "attnplug/memory/allocator.py",
        "attnplug/backends/reference.py",
        "attnplug/registry/hookspecs.py",
        "attnplug/cli.py",
        "attnplug/graphs/runner.py",
        "attnplug_cuda/backend.py",
        "attnplug_cuda/kernels/paged_attention.py",
        "attnplug_cuda/csrc/kv_store.cu",
        "attnplug_cuda/csrc/kv_store.h",
        "attnplug_cuda/csrc/kv_store_binding.cpp",
        "attnplug_ascend/plugin.py",
        "attnplug_xpu/plugin.py",
        "attnplug_conformance/plugin.py",
        "attnplug_conformance/checks/check_swa_buffer_contract.py",
    ):
        assert path in names, f"{path} missing from {wheel.name}"
    assert not any(n.startswith(("tests/", "benchmarks/", "examples/")) for n in names)
    (ep,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    text = zipfile.ZipFile(wheel).read(ep).decode()
    for line in (
        "[attnplug.backends]",
        "reference = attnplug.backends.reference_plugin",
        "cuda = attnplug_cuda.plugin",
        "ascend = attnplug_ascend.plugin",
        "xpu = attnplug_xpu.plugin",
        "[pytest11]",
        "attnplug_conformance = attnplug_conformance.plugin",
        "[console_scripts]",
        "attnplug = attnplug.cli:main",
    ):
        assert line in text, f"{line!r} not in entry_points.txt"


def test_wheel_installs_and_imports_from_its_target(wheel, tmp_path):
    target = tmp_path / "site"
    out = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(target), str(wheel)],
        capture_output=True,
        text=True,
        timeout=HANG_LIMIT_S,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    code = (
        "import json, importlib.metadata as md, attnplug, attnplug_cuda.plugin, attnplug_conformance.checks;"
        "d = md.distribution('attnplug');"
        "print(json.dumps({'file': attnplug.__file__, 'cuda': attnplug_cuda.plugin.__file__,"
        " 'groups': sorted({e.group for e in d.entry_points})}))"
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=HANG_LIMIT_S)
    assert res.returncode == 0, res.stderr
    info = json.loads(res.stdout.strip().splitlines()[-1])
    assert info["file"].startswith(str(target)) and info["cuda"].startswith(str(target))
    assert {"attnplug.backends", "pytest11", "console_scripts"} <= set(info["groups"])
