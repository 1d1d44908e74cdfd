"""benchmarks/cluster_merge.py on the host: its kernel compiles for sm_90 with a bare nvcc (plain
and with the phase stamps) and its PTX holds what the design says (cluster barriers and peer
mapping, tensor-core MMAs, async copies, the PDL wait before any global store); its split
plan; and it stops with status 2 without an sm_90 GPU (the GPU run itself needs one)."""

import re
import subprocess

import pytest
import torch

from attnplug_cuda.cpp_ext import CSRC_DIR, find_nvcc, nvcc_compile_command
from scripts import BENCHMARKS, load_script

NVCC = find_nvcc()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH (nor in CUDA_HOME)")
CU = f"{BENCHMARKS}/cluster_merge/cluster_attend.cu"


@needs_nvcc
@pytest.mark.parametrize("stamps", [False, True])
def test_kernel_compiles_for_sm90_without_torch(tmp_path, stamps):
    flags = ["--resource-usage", f"-I{CSRC_DIR}"] + (["-DCLUSTER_ATTEND_STAMPS"] if stamps else [])
    cmd = nvcc_compile_command(tmp_path / "k.o", CU, extra_flags=flags)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)}:\n{proc.stdout}\n{proc.stderr}"
    log = proc.stdout + proc.stderr
    # fp16 / bf16 x head dim 64 / 128, and the launch probe
    assert len(re.findall(r"Compiling entry function '\S*cluster_attend_kernel\S*' for 'sm_90'", log)) == 4, log
    assert re.search(r"Compiling entry function '\S*cluster_launch_probe_kernel\S*' for 'sm_90'", log), log


@needs_nvcc
def test_ptx_has_the_cluster_merge_and_waits_before_any_store(tmp_path):
    out = tmp_path / "k.ptx"
    proc = subprocess.run(
        [NVCC, "-arch=sm_90", "-O3", "-std=c++17", f"-I{CSRC_DIR}", "-ptx", CU, "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    entries = [e for e in re.findall(r"\.entry\s+(\S+)\((.*?)\n\}", out.read_text(), flags=re.S) if "attend" in e[0]]
    assert len(entries) == 4, [e[0] for e in entries]
    for name, body in entries:
        lines = [line.strip() for line in body.splitlines()]
        idx = lambda prefix, lines=lines: [i for i, line in enumerate(lines) if line.startswith(prefix)]  # noqa: E731
        waits, stores = idx("griddepcontrol.wait"), idx("st.global")
        assert waits and stores and max(waits) < min(stores), f"{name}: a global store precedes a PDL wait"
        assert idx("griddepcontrol.launch_dependents"), name
        assert idx("barrier.cluster.arrive") and idx("barrier.cluster.wait") and idx("mapa"), (
            f"{name}: no cluster merge"
        )
        assert idx("mma.sync.aligned.m16n8k16") and idx("ldmatrix.sync.aligned.m8n8.x4.trans"), name
        assert idx("cp.async.cg.shared.global"), name


def test_split_plan_and_no_gpu_exit():
    script = load_script("cluster_merge")
    # bs 1 on 132 SMs: 16 CTAs over 1,024 keys, 8 over a 256-key window (>= 32 keys a CTA); bs 8: 4
    assert script.plan_splits(1, 1, 1024, None, 132) == 16
    assert script.plan_splits(1, 1, 1024, 256, 132) == 8
    assert script.plan_splits(8, 1, 1024, None, 132) == 4
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        assert script.main([]) == 2
