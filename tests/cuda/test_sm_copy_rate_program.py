"""benchmarks/sm_copy_rate on the host: the program compiles for sm_90a with a bare nvcc, each
of its five gather kernels is assembled without spills, and its PTX holds the copies each way
names (the GPU run itself needs an sm_90 GPU: ``benchmarks/README.md``)."""

import re
import subprocess

import pytest

from attnplug_cuda.cpp_ext import find_nvcc
from scripts import BENCHMARKS

NVCC = find_nvcc()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH (nor in CUDA_HOME)")
CU = f"{BENCHMARKS}/sm_copy_rate/sm_copy_rate.cu"


@needs_nvcc
def test_program_compiles_for_sm90a(tmp_path):
    cmd = [NVCC, "-O3", "-arch=sm_90a", "-std=c++17", "--resource-usage", "-o", str(tmp_path / "scr"), CU]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)}:\n{proc.stdout}\n{proc.stderr}"
    log = proc.stdout + proc.stderr
    assert len(re.findall(r"Compiling entry function '\S*gather\S*' for 'sm_90a'", log)) == 5, log
    assert "bytes spill" in log and not re.search(r"[1-9]\d* bytes spill", log), log


@needs_nvcc
def test_each_gather_uses_its_copy(tmp_path):
    out = tmp_path / "scr.ptx"
    proc = subprocess.run(
        [NVCC, "-arch=sm_90a", "-std=c++17", "-ptx", "-o", str(out), CU], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr
    ptx = out.read_text()
    bodies = {}
    for part in ptx.split(".entry")[1:]:
        mode = re.match(r"\s+\S*gatherILi(\d)E", part)
        if mode:
            bodies[mode.group(1)] = part
    assert sorted(bodies) == ["0", "1", "2", "3", "4"], sorted(bodies)
    assert "cp.async.cg.shared.global" in bodies["0"]
    assert "ld.global.nc.v4" in bodies["1"] and "ld.global.cg.v4" in bodies["2"]
    for m in ("3", "4"):
        assert "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes" in bodies[m]
        assert "mbarrier.try_wait.parity" in bodies[m]
