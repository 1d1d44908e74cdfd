"""The CUDA C++ kernel (plugins/cuda/attnplug_cuda/csrc: the KV store) and its build module.

Without a GPU (CI): each kernel compiles with a bare ``nvcc -arch=sm_90 -c``, carries sm_90
machine code, orders its PDL calls around its memory accesses, contains no inline
griddepcontrol asm and no torch header; ``cpp_ext_status()`` names why the extension is
unavailable and never raises; importing the module is cheap.

With a CUDA device and a CUDA build of torch (run on the GPU machine): the extension builds,
matches ``index_put`` for every dtype, index dtype and layout, skips out-of-range slots,
and gives the same results with and without PDL, across chained PDL launches and inside a
captured CUDA graph.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attnplug_cuda import cpp_ext
from attnplug_cuda.cpp_ext import (
    CSRC_DIR,
    KERNEL_SOURCES,
    KV_STORE_CU,
    CppExtensionUnavailable,
    cpp_ext_status,
    ext_build_dir,
    find_nvcc,
    load_ext,
    nvcc_compile_command,
    try_load_ext,
)
from child import HANG_LIMIT_S

REPO = Path(__file__).resolve().parents[2]
NVCC = find_nvcc()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH (nor in CUDA_HOME)")


def _cuobjdump() -> str | None:
    found = shutil.which("cuobjdump")
    if found:
        return found
    if NVCC:
        candidate = Path(NVCC).parent / "cuobjdump"
        if candidate.is_file():
            return str(candidate)
    return None


def _run(cmd):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_LIMIT_S)


# --------------------------------------------------------------------------- static checks


@needs_nvcc
@pytest.mark.parametrize("source", KERNEL_SOURCES, ids=lambda p: p.stem)
def test_kernel_compiles_for_sm90_without_torch(tmp_path, source):
    out = tmp_path / f"{source.stem}.o"
    cmd = nvcc_compile_command(out, source, extra_flags=["--resource-usage"])
    assert "-arch=sm_90" in cmd and "-c" in cmd and str(source) in cmd
    proc = _run(cmd)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"
    assert out.is_file() and out.stat().st_size > 0
    # ptxas reports every kernel it assembled, with its target, and no spill
    log = proc.stdout + proc.stderr
    assert re.search(rf"Compiling entry function '\S*{source.stem}_kernel\S*' for 'sm_90'", log), log
    assert "bytes spill" in log and not re.search(r"[1-9]\d* bytes spill", log), log

    cuobjdump = _cuobjdump()
    if cuobjdump is not None:
        listing = _run([cuobjdump, "--list-elf", str(out)])
        assert listing.returncode == 0, listing.stderr
        assert "sm_90" in listing.stdout, listing.stdout


def _ptx(tmp_path: Path, arch: str, source: Path = KV_STORE_CU) -> str:
    out = tmp_path / f"{source.stem}_{arch}.ptx"
    cmd = [NVCC, f"-arch={arch}", "-O3", "-std=c++17", "-ptx", str(source), "-o", str(out)]
    proc = _run(cmd)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stderr}"
    return out.read_text()


def _entries(ptx: str):
    """{entry name: [instruction lines]} for every kernel of a PTX file."""
    entries = {}
    for match in re.finditer(r"\.entry\s+(\S+)\((.*?)\n\}", ptx, flags=re.S):
        entries[match.group(1)] = match.group(2).splitlines()
    return entries


@needs_nvcc
def test_pdl_wait_precedes_loads_and_trigger_follows_stores(tmp_path):
    entries = _entries(_ptx(tmp_path, "sm_90"))
    # 5 vector widths x 2 index dtypes
    assert len(entries) == 10, sorted(entries)
    for name, lines in entries.items():

        def idx(pred, lines=lines):
            return [i for i, line in enumerate(lines) if pred(line.strip())]

        waits = idx(lambda s: s.startswith("griddepcontrol.wait"))
        triggers = idx(lambda s: s.startswith("griddepcontrol.launch_dependents"))
        loads = idx(lambda s: s.startswith("ld.global"))
        stores = idx(lambda s: s.startswith("st.global"))
        assert len(waits) == 1 and len(triggers) == 1, name
        assert loads and stores, name
        assert waits[0] < min(loads), f"{name}: a global load precedes the PDL wait"
        assert triggers[0] > max(stores), f"{name}: a global store follows the PDL trigger"


@needs_nvcc
@pytest.mark.parametrize("source", KERNEL_SOURCES, ids=lambda p: p.stem)
def test_pre_hopper_build_has_no_pdl_instructions(tmp_path, source):
    assert "griddepcontrol" not in _ptx(tmp_path, "sm_80", source)


def test_sources_have_no_griddepcontrol_asm():
    files = sorted(p for p in CSRC_DIR.iterdir() if p.suffix in {".cu", ".cuh", ".h", ".cpp"})
    assert KV_STORE_CU in files
    for path in files:
        text = path.read_text()
        assert "griddepcontrol" not in text.lower(), f"{path.name} names griddepcontrol"
    cu = KV_STORE_CU.read_text()
    assert "cudaGridDependencySynchronize()" in cu
    assert "cudaTriggerProgrammaticLaunchCompletion()" in cu
    assert "__CUDA_ARCH__ >= 900" in cu
    assert "cudaLaunchKernelEx" in cu
    assert "cudaLaunchAttributeProgrammaticStreamSerialization" in cu


def test_kernel_source_includes_no_torch_header():
    for path in (*KERNEL_SOURCES, CSRC_DIR / "kv_store.h"):
        includes = re.findall(r"^\s*#\s*include\s*[<\"]([^>\"]+)", path.read_text(), flags=re.M)
        bad = [inc for inc in includes if inc.split("/")[0] in {"torch", "ATen", "c10"}]
        assert not bad, f"{path.name} includes {bad}"


# --------------------------------------------------------------------------- build module


def test_import_does_not_load_cpp_extension():
    code = (
        "import sys\n"
        "import attnplug_cuda.cpp_ext as m\n"
        "print('torch.utils.cpp_extension' in sys.modules, 'torch' in sys.modules)\n"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "core"), str(REPO / "plugins" / "cuda"), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=HANG_LIMIT_S)
    assert proc.returncode == 0, proc.stderr
    cpp_loaded, torch_loaded = proc.stdout.split()
    assert cpp_loaded == "False", "importing attnplug_cuda.cpp_ext imported torch.utils.cpp_extension"
    # torch itself may be imported by attnplug_cuda/__init__.py; cpp_ext never needs it.


def test_nvcc_compile_command_shape(tmp_path):
    cmd = nvcc_compile_command(tmp_path / "x.o", nvcc="/opt/cuda/bin/nvcc")
    assert cmd[0] == "/opt/cuda/bin/nvcc"
    assert cmd[1] == "-arch=sm_90"
    assert cmd[-4:] == ["-c", str(KV_STORE_CU), "-o", str(tmp_path / "x.o")]


def test_build_dir_is_keyed_and_honours_cache_env(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNPLUG_CACHE_DIR", str(tmp_path))
    a = ext_build_dir()
    assert a.parent == tmp_path / "cpp_ext"
    assert a.name.startswith("kernels-")
    assert ext_build_dir() == a  # stable
    assert ext_build_dir([cpp_ext.SM90_GENCODE, "-O2"]) != a  # flags are in the key


def test_disable_env_wins(monkeypatch):
    monkeypatch.setenv("ATTNPLUG_DISABLE_CPP", "1")
    ok, reason = cpp_ext_status()
    assert not ok and "ATTNPLUG_DISABLE_CPP=1" in reason
    with pytest.raises(CppExtensionUnavailable, match="ATTNPLUG_DISABLE_CPP"):
        load_ext()
    assert try_load_ext() is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="this test is for machines without a GPU")
def test_status_names_the_cause_without_gpu(monkeypatch):
    monkeypatch.delenv("ATTNPLUG_DISABLE_CPP", raising=False)
    ok, reason = cpp_ext_status()
    assert ok is False
    assert isinstance(reason, str) and reason
    if torch.version.cuda is None:
        assert "without CUDA" in reason, reason
    else:
        causes = ("nvcc", "ninja", "no CUDA device", "without CUDA")
        assert any(c in reason for c in causes), reason
    assert cpp_ext_status(build=False) == (False, reason)
    assert try_load_ext() is None
    with pytest.raises(CppExtensionUnavailable):
        load_ext()


# --------------------------------------------------------------------------- on a GPU


@pytest.fixture(scope="module")
def ext():
    module = try_load_ext()
    if module is None:
        pytest.skip(f"C++ kv_store extension unavailable: {cpp_ext_status()[1]}")
    return module


DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def _reference(k, v, k_cache, v_cache, loc):
    """index_put oracle; slots outside [1, S) are skipped (the sink 0 too), as the kernel does."""
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    keep = (loc >= 1) & (loc < k_cache.shape[0])
    idx = loc[keep].long()
    ref_k.index_put_((idx,), k[keep])
    ref_v.index_put_((idx,), v[keep])
    return ref_k, ref_v


def _slots(num_tokens, num_slots, index_dtype, device, pad=2):
    """Distinct slots in [1, S) for the real tokens, then `pad` padded tokens at the sink 0."""
    real = torch.randperm(num_slots - 1, device=device)[: num_tokens - pad] + 1
    sink = torch.zeros(pad, dtype=real.dtype, device=device)
    return torch.cat([real, sink]).to(index_dtype)


def _check(k_cache, v_cache, ref_k, ref_v):
    # slot 0 (the sink) is never written: padded tokens there are skipped
    torch.testing.assert_close(k_cache, ref_k, rtol=0, atol=0)
    torch.testing.assert_close(v_cache, ref_v, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("num_tokens,heads,head_dim", [(1, 8, 128), (37, 8, 128), (300, 2, 64), (5, 1, 3), (9, 4, 96)])
def test_matches_index_put(ext, dtype, index_dtype, pdl, num_tokens, heads, head_dim):
    dev = "cuda"
    S = 512
    pad = min(2, num_tokens - 1)
    k = torch.randn(num_tokens, heads, head_dim, device=dev).to(dtype)
    v = torch.randn(num_tokens, heads, head_dim, device=dev).to(dtype)
    k_cache = torch.randn(S, heads, head_dim, device=dev).to(dtype)
    v_cache = torch.randn(S, heads, head_dim, device=dev).to(dtype)
    loc = _slots(num_tokens, S, index_dtype, dev, pad=pad)
    ref_k, ref_v = _reference(k, v, k_cache, v_cache, loc)
    used = ext.kv_store(k, v, k_cache, v_cache, loc, pdl)
    torch.cuda.synchronize()
    _check(k_cache, v_cache, ref_k, ref_v)
    major, _ = torch.cuda.get_device_capability()
    assert used == (pdl and major >= 9)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_strided_and_unaligned_layouts(ext, dtype):
    dev, T, H, D, S = "cuda", 23, 4, 64, 128
    row = H * D
    # k and v as views of a fused qkv projection: token stride 3 * row
    qkv = torch.randn(T, 3 * row, device=dev).to(dtype)
    k = qkv[:, row : 2 * row].view(T, H, D)
    v = qkv[:, 2 * row :].view(T, H, D)
    # caches as slices of one [S, 2, H, D] buffer: slot stride 2 * row
    kv = torch.randn(S, 2, H, D, device=dev).to(dtype)
    k_cache, v_cache = kv[:, 0], kv[:, 1]
    assert ext.vec_bytes(k, v, k_cache, v_cache) == 16
    loc = _slots(T, S, torch.int64, dev)
    ref_k, ref_v = _reference(k, v, k_cache, v_cache, loc)
    for pdl in (False, True):
        ext.kv_store(k, v, k_cache, v_cache, loc, pdl)
    _check(k_cache, v_cache, ref_k, ref_v)

    # rows shifted by one element: no 16-byte alignment, the scalar fallback path
    flat = torch.randn(T * row + 1, device=dev).to(dtype)
    k_odd = flat[1:].view(T, H, D)
    cache_flat = torch.randn(S * row + 1, device=dev).to(dtype)
    k_cache_odd = cache_flat[1:].view(S, H, D)
    v_cache2 = torch.randn(S, H, D, device=dev).to(dtype)
    v2 = torch.randn(T, H, D, device=dev).to(dtype)
    assert ext.vec_bytes(k_odd, v2, k_cache_odd, v_cache2) == 2
    ref_k, ref_v = _reference(k_odd, v2, k_cache_odd, v_cache2, loc)
    ext.kv_store(k_odd, v2, k_cache_odd, v_cache2, loc, True)
    _check(k_cache_odd, v_cache2, ref_k, ref_v)


def test_out_of_range_slots_are_skipped(ext):
    """Same rule as the Triton store: only [1, S) is written (the sink 0 and -1 are skipped)."""
    dev, T, H, D, S = "cuda", 7, 2, 16, 32
    k = torch.randn(T, H, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn(T, H, D, device=dev, dtype=torch.bfloat16)
    k_cache = torch.zeros(S, H, D, device=dev, dtype=torch.bfloat16)
    v_cache = torch.zeros(S, H, D, device=dev, dtype=torch.bfloat16)
    loc = torch.tensor([3, -1, S, 7, -5, S + 100, 0], device=dev, dtype=torch.int64)
    ext.kv_store(k, v, k_cache, v_cache, loc, True)
    touched = (k_cache.abs().sum(dim=(1, 2)) != 0).nonzero().flatten().tolist()
    assert touched == [3, 7]
    from attnplug_cuda.kernels.kv_store import kv_store as triton_kv_store

    k2, v2 = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    triton_kv_store(k, v, k2, v2, loc)
    torch.testing.assert_close(k2, k_cache, rtol=0, atol=0)
    torch.testing.assert_close(v2, v_cache, rtol=0, atol=0)
    torch.testing.assert_close(k_cache[3], k[0], rtol=0, atol=0)
    torch.testing.assert_close(v_cache[7], v[3], rtol=0, atol=0)


def test_chained_pdl_launches_see_predecessor_stores(ext):
    """Each store reads what the previous store just wrote: only a correct wait/trigger pair
    makes the last cache equal to the first input."""
    dev, T, H, D, n = "cuda", 4096, 8, 128, 12
    # T + 1 rows: row 0 is the padding sink, which a store never writes (slots 1..T are used)
    caches = [torch.zeros(T + 1, H, D, device=dev, dtype=torch.bfloat16) for _ in range(n)]
    src = torch.randn(T, H, D, device=dev, dtype=torch.bfloat16)
    dummy_v = [torch.empty(T + 1, H, D, device=dev, dtype=torch.bfloat16) for _ in range(n)]
    loc = torch.arange(1, T + 1, device=dev, dtype=torch.int32)
    for _ in range(3):
        for c in caches:
            c.zero_()
        src.mul_(-1)  # a producer kernel right before the first PDL launch
        prev = src
        for c, dv in zip(caches, dummy_v):
            assert ext.kv_store(prev, prev, c, dv, loc, True) is True
            prev = c[1:]
        torch.testing.assert_close(caches[-1][1:], src, rtol=0, atol=0)


def test_cuda_graph_replay_matches_eager(ext):
    dev, T, H, D, S = "cuda", 64, 8, 128, 1024
    k = torch.randn(T, H, D, device=dev, dtype=torch.float16)
    v = torch.randn(T, H, D, device=dev, dtype=torch.float16)
    k_cache = torch.zeros(S, H, D, device=dev, dtype=torch.float16)
    v_cache = torch.zeros(S, H, D, device=dev, dtype=torch.float16)
    mid = torch.zeros(S, H, D, device=dev, dtype=torch.float16)
    loc = torch.zeros(T, device=dev, dtype=torch.int32)

    def step():
        ext.kv_store(k, v, k_cache, v_cache, loc, True)
        # a second PDL store that depends on the first (reads k_cache rows)
        ext.kv_store(k_cache[:T], v, mid, v_cache, loc, True)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        k.normal_()
        v.normal_()
        loc.copy_(_slots(T, S, torch.int32, dev, pad=0))  # no shared sink: no write race
        for c in (k_cache, v_cache, mid):
            c.zero_()
        graph.replay()
        torch.cuda.synchronize()
        got = (k_cache.clone(), v_cache.clone(), mid.clone())
        for c in (k_cache, v_cache, mid):
            c.zero_()
        step()
        torch.cuda.synchronize()
        for a, b in zip(got, (k_cache, v_cache, mid)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_argument_errors_name_the_argument(ext):
    dev = "cuda"
    k = torch.randn(4, 2, 8, device=dev, dtype=torch.float16)
    cache = torch.zeros(16, 2, 8, device=dev, dtype=torch.float16)
    loc = torch.arange(4, device=dev, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="k_cache"):
        ext.kv_store(k, k, cache.float(), cache, loc, False)
    with pytest.raises(RuntimeError, match="loc"):
        ext.kv_store(k, k, cache, cache.clone(), loc.float(), False)
    with pytest.raises(RuntimeError, match="loc"):
        ext.kv_store(k, k, cache, cache.clone(), loc[:3], False)
    with pytest.raises(RuntimeError, match="rows of v"):
        ext.kv_store(k, k.transpose(1, 2).contiguous().transpose(1, 2), cache, cache.clone(), loc, False)
    with pytest.raises(RuntimeError, match="CUDA tensor"):
        ext.kv_store(k.cpu(), k, cache, cache.clone(), loc, False)
    with pytest.raises(RuntimeError, match="v_cache"):
        ext.kv_store(k, k, cache, torch.zeros(16, 2, 4, device=dev, dtype=torch.float16), loc, False)
