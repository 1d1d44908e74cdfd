"""The CUDA C++ FP8 decode kernel (``csrc/fp8_decode.cu``, ``cpp_ext.fp8_decode``) and where the
cuda backend runs it.

Without a GPU (CI): the planner's rule (``fp8_decode_serves``: FP8, one token a request, head
dim 128, groups of 1 / 2 / 4 / 8, enough groups an SM, the kernel loaded) and the paths and PDL
schedules it gives; the device part's choice and its reasons; the wrapper's refusals; the
kernel's PTX keeps every access to what the previous launch writes after its PDL wait (the
compile itself, sm_90 machine code without spills and no PDL below sm_90: test_cuda_csrc_build).

With a CUDA device where the extension loads: against ``paged_attention`` storing the step
over clones of the same cache (the Triton kernel this one replaces), the stored bytes are equal
and the outputs within float16 products' error, over ragged lengths, a sink slot and a slot
outside the cache in the table, NaN in the sink row, windows, groups 1 / 2 / 4 / 8, both FP8
formats, float16 and bfloat16 q, a table start, int32 and int64 indices, rows outside the table,
empty requests, a soft cap and sinks; chained PDL launches and a captured graph give the eager
results; bad arguments are refused naming them, the cache untouched; the backend's decode
steps through the kernel equal the reference backend's, eager and replayed.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess

import pytest
import torch

from attnplug_cuda import cpp_ext
from attnplug_cuda.device import CudaDevice
from attnplug_cuda.kernels.pdl import EARLY, PLAIN, PROLOGUE, PROLOGUE_ENTRY
from attnplug_cuda.planner import AttentionShape, LaunchShape, Path, fp8_decode_serves, plan_step
from attnplug_cuda.triton_part import TritonDevicePart
from attnplug_cuda.tuning import CudaTuning
from child import HANG_LIMIT_S

CPP = CudaTuning(fp8_decode="cpp")
#: hybrid_step's heads: 32 q over 8 kv heads of 128, on an H100's 132 SMs
SHAPE = AttentionShape(
    num_heads=32, num_kv_heads=8, head_dim=128, max_context_len=1024, window=256, num_sms=132, kv_fp8=True
)


def launch(bs=64, group=4, head_dim=128, q_len=1, kv_fp8=True, tile_map=False, num_tokens=None):
    return LaunchShape(
        bs,
        bs * q_len if num_tokens is None else num_tokens,
        8,
        group,
        head_dim,
        q_len,
        1024,
        None,
        132,
        kv_fp8,
        tile_map,
    )


# ----------------------------------------------------------------------------- the planner
def test_serves_fp8_decode_steps_of_its_shapes_only():
    assert fp8_decode_serves(launch(), CPP)
    for group in (1, 2, 8):
        assert fp8_decode_serves(launch(group=group), CPP)
    refused = {
        "triton asked": (launch(), CudaTuning(fp8_decode="triton")),
        "16-bit cache": (launch(kv_fp8=False), CPP),
        "head dim 64": (launch(head_dim=64), CPP),
        "head dim 256": (launch(head_dim=256), CPP),
        "group 3": (launch(group=3), CPP),
        "group 16": (launch(group=16), CPP),
        "a draft step": (launch(q_len=2), CPP),
        "a ragged step": (launch(num_tokens=65), CPP),
        "a tile map": (launch(tile_map=True), CPP),
        "under two groups an SM": (launch(bs=32), CPP),  # 256 groups < 2 x 132
    }
    for why, (shape, tuning) in refused.items():
        assert not fp8_decode_serves(shape, tuning), why
    assert fp8_decode_serves(launch(bs=33), CPP)  # 264 groups = 2 x 132
    assert fp8_decode_serves(launch(bs=17), dataclasses.replace(CPP, fp8_decode_groups_per_sm=1))


def test_plan_step_runs_it_where_paged_attention_would_store_the_step():
    """Large decode steps over an FP8 cache: ``FP8_DECODE``, both kinds of layer, no kernel
    plan, ``paged_attention``'s storing schedules (the first launch after the metadata waits at
    entry, later ones after their metadata reads, each releasing at its wait); small steps keep
    ``store_attend``, drafts and extends their paths, and so does a tuning without the paged
    store (the before path's)."""
    for bs in (64, 128):
        plan = plan_step(SHAPE, bs, bs, 1, CPP, True)
        assert plan.path is Path.FP8_DECODE
        for layer in (plan.full, plan.swa):
            assert layer.kernel is None and (layer.first, layer.later) == (EARLY, PROLOGUE)
        off = plan_step(SHAPE, bs, bs, 1, CPP, False)
        assert off.path is Path.FP8_DECODE and off.full.first is None and off.swa.later is None
    assert plan_step(SHAPE, 8, 8, 1, CPP, True).path is Path.ONE_LAUNCH
    assert plan_step(SHAPE, 64, 128, 2, CPP, True).path is Path.PAGED_STORE
    assert plan_step(SHAPE, 64, 640, 10, CPP, True).path is Path.TWO_LAUNCH
    assert plan_step(SHAPE, 64, 64, 1, CudaTuning(fp8_decode="triton"), True).path is Path.PAGED_STORE
    assert plan_step(SHAPE, 64, 64, 1, dataclasses.replace(CPP, paged_store=False), True).path is Path.TWO_LAUNCH
    bf16 = dataclasses.replace(SHAPE, kv_fp8=False)
    assert plan_step(bf16, 64, 64, 1, CPP, True).path is Path.PAGED_STORE


def test_device_parts_say_which_kernel_and_why(monkeypatch):
    part = CudaDevice()
    kernel, why = part.fp8_decode_choice("triton", torch.device("cpu"))
    assert kernel == "triton" and "fp8_decode='triton'" in why
    kernel, why = part.fp8_decode_choice("cpp", torch.device("cpu"))
    assert kernel == "triton" and "needs a CUDA device" in why
    kernel, why = TritonDevicePart().fp8_decode_choice("cpp", torch.device("cpu"))
    assert kernel == "triton" and "CUDA-only" in why
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    kernel, why = part.fp8_decode_choice("cpp", torch.device("cuda", 0))
    assert kernel == "triton" and "compute capability >= 9.0, got 8.9" in why
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(cpp_ext, "cpp_ext_status", lambda build=True: (False, "nvcc not found"))
    kernel, why = part.fp8_decode_choice("cpp", torch.device("cuda", 0))
    assert kernel == "triton" and "unavailable: nvcc not found" in why
    monkeypatch.setattr(cpp_ext, "cpp_ext_status", lambda build=True: (True, "loaded"))
    assert part.fp8_decode_choice("cpp", torch.device("cuda", 0))[0] == "cpp"
    monkeypatch.setattr(torch.version, "hip", "6.2.0", raising=False)
    kernel, why = part.fp8_decode_choice("cpp", torch.device("cuda", 0))
    assert kernel == "triton" and "ROCm 6.2.0" in why


def test_tuning_names_the_kernels():
    with pytest.raises(ValueError, match="fp8_decode must be one of"):
        CudaTuning(fp8_decode="cuda")
    with pytest.raises(ValueError, match="fp8_decode_groups_per_sm"):
        CudaTuning(fp8_decode_groups_per_sm=0)
    assert CudaTuning().fp8_decode == "triton"  # opt-in until it has run on a GPU


def _inputs(max_q_len=1, scales=True):
    from attnplug_cuda.kernels.common import AttentionInputs, KeyTable, KVScales

    one = torch.ones(2)
    keys = KeyTable.of(torch.zeros(2, 4, dtype=torch.int32), torch.arange(2, dtype=torch.int32))
    return AttentionInputs(
        torch.arange(3, dtype=torch.int32),
        torch.ones(2, dtype=torch.int32),
        keys,
        max_q_len,
        kv_scales=KVScales.of(one, one) if scales else None,
    )


def test_wrapper_refuses_what_the_kernel_does_not_compute():
    """Refused on the host before the extension is loaded (so also where it cannot be)."""
    q = torch.zeros(2, 8, 128, dtype=torch.bfloat16)
    cache = torch.zeros(8, 2, 128, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="one new token a request, got max_q_len=2"):
        cpp_ext.fp8_decode(q, cache, cache, q, _inputs(max_q_len=2))
    with pytest.raises(ValueError, match="scales"):
        cpp_ext.fp8_decode(q, cache, cache, q, _inputs(scales=False))
    for schedule in (PROLOGUE_ENTRY, PLAIN):
        with pytest.raises(ValueError, match="releases the next launch at its wait"):
            cpp_ext.fp8_decode(q, cache, cache, q, _inputs(), pdl=schedule)


def test_engine_ops_ask_once_and_fall_back_to_paged_attention(monkeypatch):
    """Asked for (``fp8_decode="cpp"``) where the C++ kernel is not chosen (here: the part says
    so), ``CudaOps`` asks once, at the first FP8 decode step it would serve, says why, and runs
    ``paged_attention``; by default it never asks."""
    import attnplug_cuda.kernels.common as common
    from attnplug.ops.portable import PortableOps
    from attnplug_cuda.backend import CudaBackend

    asked = []

    def choice(self, wanted, device):
        asked.append(wanted)
        return "triton", "a stand-in reason"

    monkeypatch.setattr(common, "num_sms", lambda device: 1)
    monkeypatch.setattr(CudaDevice, "fp8_decode_choice", choice)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda, portable, default = CudaBackend.paged_ops(device, CPP), PortableOps(device), CudaBackend.paged_ops(device)
    g = torch.Generator().manual_seed(7)
    inter = (torch.randn(6, 4, 2, 256, generator=g) * 4).to(device).to(torch.float8_e4m3fn)
    table = torch.tensor([[3, 1, 5], [2, 4, 0]], dtype=torch.int32, device=device)
    seq, qsl = torch.tensor([10, 6], device=device), torch.arange(3, dtype=torch.int32, device=device)
    q = torch.randn(2, 4, 128, generator=g).to(device, torch.float16)
    scale = torch.tensor([0.05], device=device)
    outs = []
    for ops in (cuda, portable, cuda, default):
        step = ops.plan(qsl, seq, table, 4, num_tokens=2, max_query_len=1, max_seq_len=10)
        outs.append(ops.attend(q, inter[..., :128], inter[..., 128:], step, scale=0.09, k_scale=scale, v_scale=scale))
    assert asked == ["cpp"] and cuda.fp8_decode_reason == "a stand-in reason" and cuda.tuning.fp8_decode == "triton"
    assert default.fp8_decode_reason is None
    for out in (outs[0], outs[2], outs[3]):
        err = (out.double() - outs[1].double()).norm() / outs[1].double().norm()
        assert err < 5e-3, err


# ----------------------------------------------------------------------------- the PTX
NVCC = cpp_ext.find_nvcc()


@pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH (nor in CUDA_HOME)")
def test_ptx_reads_what_the_last_launch_wrote_after_the_pdl_wait(tmp_path):
    """In each kernel's PTX (sm_90): two PDL waits (at entry, or after the metadata reads),
    each followed by the release; before the second only scalar global loads (the step's
    metadata and the first tile's slots: no 16-byte load, no cp.async, no store)."""
    out = tmp_path / "fp8_decode.ptx"
    cmd = [NVCC, "-arch=sm_90", "-O3", "-std=c++17", "-ptx", str(cpp_ext.FP8_DECODE_CU), "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_LIMIT_S)
    assert proc.returncode == 0, proc.stderr
    entries = re.findall(r"\.entry\s+(\S+)\((.*?)\n\}", out.read_text(), flags=re.S)
    assert len(entries) == 2 and all("fp8_decode_kernel" in name for name, _ in entries)
    for name, body in entries:
        lines = [line.strip() for line in body.splitlines()]
        waits = [i for i, s in enumerate(lines) if s.startswith("griddepcontrol.wait")]
        releases = [i for i, s in enumerate(lines) if s.startswith("griddepcontrol.launch_dependents")]
        assert len(waits) == 2 and len(releases) == 2, name
        assert all(
            w < r and not any(lines[j] and not lines[j].startswith("//") for j in range(w + 1, r))
            for w, r in zip(waits, releases)
        ), f"{name}: a release does not follow its wait"
        before = lines[: waits[1]]
        assert any(s.startswith("ld.global") for s in before), name  # the metadata, read early
        for s in before:
            assert not s.startswith(("st.", "cp.async", "ld.global.v", "ld.shared", "mma")), f"{name}: {s}"
        after = lines[waits[1] :]
        assert any(s.startswith("cp.async") for s in after) and any(s.startswith("st.global") for s in after)


# ----------------------------------------------------------------------------- on a GPU
@pytest.fixture(scope="module")
def ext():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("needs a CUDA device of compute capability >= 9.0")
    module = cpp_ext.try_load_ext()
    if module is None:
        pytest.skip(f"the C++ extension is unavailable: {cpp_ext.cpp_ext_status()[1]}")
    return module


def _world(group, fp8, q_dtype, start, *, seed=0, index_dtype=torch.int32):
    """Five requests (300, 77, 13, 1 and 0 keys) over two kv heads of a 4,000-slot cache,
    scrambled slots; the table holds the sink slot 0 and a slot outside the cache among the
    keys, the sink row of V holds NaN; ``start``: the table's column 0 is position 20 for one
    request (its lengths grow by it). The step's new rows (large values: saturation) go to the
    last position of each request."""
    from attnplug_cuda.kernels.common import AttentionInputs, KeyTable, KVScales, NewRows

    g = torch.Generator(device="cpu").manual_seed(seed)
    dev, bs, hkv, width, S = "cuda", 5, 2, 300, 4000
    table = (torch.randperm(S - 1, generator=g)[: bs * width] + 1).view(bs, width).to(torch.int32).to(dev)
    table[1, 7] = 0
    table[2, 5] = S + 5
    seq = torch.tensor([300, 77, 13, 1, 0], dtype=torch.int64, device=dev)
    first = torch.tensor([0, 20, 0, 0, 0], dtype=torch.int64, device=dev) if start else None
    if start:
        seq = seq + first
    pos = (seq - 1 - (first if start else 0)).clamp(min=0)
    loc = torch.where(seq > 0, table[torch.arange(bs, device=dev), pos].long(), torch.zeros_like(pos))
    kc = (torch.randn(S, hkv, 128, generator=g) * 2).to(fp8).to(dev)
    vc = (torch.randn(S, hkv, 128, generator=g) * 2).to(fp8).to(dev)
    vc[0] = float("nan")
    q = torch.randn(bs, hkv * group, 128, generator=g).to(q_dtype).to(dev)
    new_k = (torch.randn(bs, hkv, 128, generator=g) * 40).to(q_dtype).to(dev)
    new_v = (torch.randn(bs, hkv, 128, generator=g) * 3).to(q_dtype).to(dev)
    scales = KVScales.of(
        (torch.rand(hkv, generator=g) * 0.1 + 0.02).to(dev), (torch.rand(hkv, generator=g) * 0.1 + 0.02).to(dev)
    )
    keys = KeyTable.of(
        table, torch.arange(bs, device=dev).to(index_dtype), None if first is None else first.to(index_dtype)
    )
    inputs = AttentionInputs(
        torch.arange(bs + 1, dtype=torch.int32, device=dev), seq.to(index_dtype), keys, 1, kv_scales=scales
    )
    return q, kc, vc, inputs, NewRows.of(new_k, new_v, loc.to(index_dtype))


def _triton(q, kc, vc, inputs, new, pdl=PROLOGUE):
    from attnplug_cuda.kernels.paged_attention import paged_attention
    from attnplug_cuda.planner import plan_paged

    hkv = kc.shape[1]
    max_kv = inputs.keys.width if inputs.window is None else inputs.window
    shape = LaunchShape(
        q.shape[0],
        q.shape[0],
        hkv,
        q.shape[1] // hkv,
        128,
        1,
        max_kv,
        inputs.window,
        torch.cuda.get_device_properties(0).multi_processor_count,
        True,
    )
    out = torch.empty_like(q)
    paged_attention(q, kc, vc, out, inputs, plan_paged(shape, CudaTuning()), new=new, pdl=pdl)
    return out


CASES = {  # name: (group, FP8 dtype, q dtype, table start, window, soft cap, sinks, index dtype)
    "g4": (4, torch.float8_e4m3fn, torch.bfloat16, False, None, None, False, torch.int32),
    "g4-window40": (4, torch.float8_e4m3fn, torch.bfloat16, False, 40, None, False, torch.int32),
    "g4-window16": (4, torch.float8_e4m3fn, torch.bfloat16, False, 16, None, False, torch.int64),
    "g8": (8, torch.float8_e4m3fn, torch.bfloat16, False, None, None, False, torch.int32),
    "g1-fp16-window64": (1, torch.float8_e4m3fn, torch.float16, False, 64, None, False, torch.int32),
    "g2-e5m2": (2, torch.float8_e5m2, torch.bfloat16, False, None, None, False, torch.int64),
    "g4-start-window50": (4, torch.float8_e4m3fn, torch.bfloat16, True, 50, None, False, torch.int32),
    "g4-softcap-sinks": (4, torch.float8_e4m3fn, torch.bfloat16, False, None, 30.0, True, torch.int32),
    "g8-e5m2-fp16-start-window-softcap-sinks": (
        8,
        torch.float8_e5m2,
        torch.float16,
        True,
        100,
        20.0,
        True,
        torch.int64,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_stores_and_attends_as_paged_attention(ext, case):
    group, fp8, q_dtype, start, window, softcap, use_sinks, index_dtype = CASES[case]
    q, kc, vc, inputs, new = _world(group, fp8, q_dtype, start, index_dtype=index_dtype)
    sinks = torch.randn(q.shape[1], device="cuda") * 2 if use_sinks else None
    inputs = inputs._replace(window=window, softcap=softcap, sinks=sinks)
    kt, vt = kc.clone(), vc.clone()
    want = _triton(q, kt, vt, inputs, new)
    out = torch.full_like(q, float("nan"))
    assert cpp_ext.fp8_decode(q, kc, vc, out, inputs, new=new, pdl=PROLOGUE) is True
    torch.cuda.synchronize()
    assert torch.equal(kc.view(torch.uint8), kt.view(torch.uint8)) and torch.equal(
        vc.view(torch.uint8), vt.view(torch.uint8)
    )
    assert torch.isfinite(out.float()).all()
    assert not out[4].any()  # the request without keys (its sink alone: zeros too)
    torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_rows_outside_the_table_read_row_0_and_nothing_is_stored_outside_the_cache(ext):
    q, kc, vc, inputs, new = _world(4, torch.float8_e4m3fn, torch.bfloat16, False, seed=1)
    rows = torch.tensor([0, 9, -3, 3, 4], dtype=torch.int32, device="cuda")  # 9, -3: row 0's keys
    inputs = inputs._replace(keys=inputs.keys._replace(rows=rows))
    new = new._replace(loc=torch.tensor([-1, 0, 4000, 4005, 7], device="cuda"))  # only slot 7 is stored
    kt, vt = kc.clone(), vc.clone()
    want = _triton(q, kt, vt, inputs, new)
    before = kc.clone()
    out = torch.empty_like(q)
    cpp_ext.fp8_decode(q, kc, vc, out, inputs, new=new, pdl=None)
    torch.cuda.synchronize()
    changed = (kc.view(torch.uint8) != before.view(torch.uint8)).any(dim=2).any(dim=1).nonzero().flatten().tolist()
    assert set(changed) <= {7}
    assert torch.equal(kc.view(torch.uint8), kt.view(torch.uint8))
    torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_chained_pdl_launches_and_a_graph_give_the_eager_results(ext):
    """Each launch attends over what the previous stored (a request's new row is the key at its
    last position): chained with PDL, and replayed from a graph, the results are the
    sequential ones, bit for bit."""
    q, kc, vc, inputs, new = _world(4, torch.float8_e4m3fn, torch.bfloat16, False, seed=2)
    n = 6
    caches = [(kc.clone(), vc.clone()) for _ in range(n)]
    outs = [torch.empty_like(q) for _ in range(n)]

    def chain(schedules):
        for i, ((k, v), out) in enumerate(zip(caches, outs)):
            src = (
                new if i == 0 else new._replace(k=outs[i - 1][:, ::4].contiguous(), v=outs[i - 1][:, 1::4].contiguous())
            )
            cpp_ext.fp8_decode(q, k, v, out, inputs, new=src, pdl=schedules[i])

    def reset():
        for k, v in caches:
            k.copy_(kc)
            v.copy_(vc)

    reset()
    chain([None] * n)
    torch.cuda.synchronize()
    want = [o.clone() for o in outs]
    reset()
    chain([EARLY] + [PROLOGUE] * (n - 1))
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(outs, want))

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chain([EARLY] + [PROLOGUE] * (n - 1))
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain([EARLY] + [PROLOGUE] * (n - 1))
    reset()
    for o in outs:
        o.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(outs, want))


def test_bad_arguments_are_refused_naming_them(ext):
    q, kc, vc, inputs, new = _world(4, torch.float8_e4m3fn, torch.bfloat16, False, seed=3)
    before = (kc.clone(), vc.clone())
    out = torch.empty_like(q)

    def shifted(cache):  # the same rows one byte further: none 16-byte aligned
        return cache.view(-1)[1 : 1 + cache.numel() - 256].view(-1, 2, 128)

    bad = {
        "k_cache must be float8": lambda: cpp_ext.fp8_decode(q, kc.float(), vc, out, inputs, new=new),
        "q must be bfloat16 or float16": lambda: cpp_ext.fp8_decode(q.float(), kc, vc, out.float(), inputs, new=new),
        "group": lambda: cpp_ext.fp8_decode(q[:, :6], kc, vc, out[:, :6], inputs, new=new),
        "seq_lens has 3 entries": lambda: cpp_ext.fp8_decode(
            q, kc, vc, out, inputs._replace(seq_lens=inputs.seq_lens[:3]), new=new
        ),
        "new_k, new_v and loc": lambda: ext.fp8_decode(
            q,
            kc,
            vc,
            out,
            inputs.keys.table,
            inputs.keys.rows,
            None,
            inputs.seq_lens,
            inputs.kv_scales.k,
            inputs.kv_scales.v,
            None,
            new.k,
            None,
            None,
            0,
            0.1,
            0.0,
        ),
        "16-byte aligned": lambda: cpp_ext.fp8_decode(q, shifted(kc), shifted(vc), out, inputs, new=new),
        "new_k must be": lambda: cpp_ext.fp8_decode(q, kc, vc, out, inputs, new=new._replace(k=new.k.float())),
    }
    for message, call in bad.items():
        with pytest.raises(RuntimeError, match=re.escape(message)):
            call()
    torch.cuda.synchronize()
    assert torch.equal(kc.view(torch.uint8), before[0].view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), before[1].view(torch.uint8))


@pytest.mark.parametrize("use_graphs", [False, True], ids=["eager", "replayed"])
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3fn", "e5m2"])
def test_backend_decode_steps_through_the_kernel_match_the_reference(ext, monkeypatch, kv_dtype, use_graphs):
    """The conformance harness's FP8 world at head dim 128 (one SWA and one full layer, per-head
    scales, part of the heads saturating) on one stand-in SM, so its decode steps (6 groups)
    take ``FP8_DECODE``: every mode's outputs within the reference's tolerance and the KV
    buffers bit for bit, the decode steps through the C++ kernel."""
    from test_cuda_fp8_backend import assert_like_reference, drive, tuned

    import attnplug_cuda.kernels.common as common
    from attnplug.backends.reference import ReferenceBackend
    from attnplug_cuda.backend import CudaBackend
    from worlds import kernel_spec

    monkeypatch.setattr(common, "num_sms", lambda device: 1)
    spec = kernel_spec(swa_layer_ids=(0,), head_dim=128, num_heads=8)
    seen = []
    original = CudaBackend.forward

    def spy(self, q, k, v, layer_id, batch, *a, **kw):
        seen.append(self.forward_metadata.plan.path)
        assert self.fp8_decode_impl == "cpp", self.fp8_decode_reason
        return original(self, q, k, v, layer_id, batch, *a, **kw)

    monkeypatch.setattr(CudaBackend, "forward", spy)
    got = drive(tuned(fp8_decode="cpp", fp8_decode_groups_per_sm=1), kv_dtype, use_graphs=use_graphs, spec=spec)
    assert Path.FP8_DECODE in seen
    assert_like_reference(got, drive(ReferenceBackend, kv_dtype, use_graphs=use_graphs, spec=spec))


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3fn", "e5m2"])
def test_engine_ops_decode_through_the_kernel_as_the_portable_ops(ext, monkeypatch, kv_dtype):
    """``CudaOps.attend`` of a decode step over the K / V halves of an interleaved FP8 cache
    (vLLM's layout, pages of 4) with one scale a layer, on one stand-in SM: the C++ kernel runs
    (``fp8_decode_reason``) and matches the portable op layer, with and without a window."""
    import attnplug_cuda.kernels.common as common
    from attnplug.ops.portable import PortableOps
    from attnplug_cuda.backend import CudaBackend

    monkeypatch.setattr(common, "num_sms", lambda device: 1)
    device = torch.device("cuda")
    cuda, portable = CudaBackend.paged_ops(device, CPP), PortableOps(device)
    g = torch.Generator().manual_seed(6)
    P, hkv, D, H, blocks = 4, 2, 128, 8, 40
    k_scale, v_scale = torch.tensor([0.05], device=device), torch.tensor([0.02], device=device)
    inter = (torch.randn(blocks, P, hkv, 2 * D, generator=g) * 4).to(device).to(kv_dtype)
    table = torch.tensor([[3, 1, 5, 7, 9], [2, 11, 0, 0, 0], [13, 15, 17, 19, 21]], dtype=torch.int32, device=device)
    seq = torch.tensor([19, 6, 20], device=device)
    qsl = torch.arange(4, dtype=torch.int32, device=device)
    q = torch.randn(3, H, D, generator=g).to(device, torch.bfloat16)
    for window in (None, 7):
        outs = []
        for ops in (cuda, portable):
            step = ops.plan(qsl, seq, table, P, num_tokens=3, max_query_len=1, max_seq_len=20)
            out = ops.attend(
                q, inter[..., :D], inter[..., D:], step, scale=0.09, window=window, k_scale=k_scale, v_scale=v_scale
            )
            outs.append(out)
        assert cuda.fp8_decode_reason and "C++ FP8 decode kernel (csrc" in cuda.fp8_decode_reason
        err = (outs[0].double() - outs[1].double()).norm() / outs[1].double().norm()
        assert err < 2e-2, f"window {window}: relative error {err:.2e}"
