"""The FlashInfer peers' whole measurement on the host, against a stand-in ``flashinfer`` module
that implements the documented semantics of the two wrappers it uses in plain PyTorch
(``BatchDecodeWithPagedKVCacheWrapper``: paged K/V in NHD or HND pages, ``window_left``, the
FP8 ``k_scale`` folded into the logit scale and ``v_scale`` applied to the output;
``BatchPrefillWithPagedKVCacheWrapper``: causal over paged K/V). What the peers hand such a
library (pages, layouts, tables, scales, dtypes) must give the attention the backends compute;
the stand-in's configurations differ in speed, and one of them is wrong, so the search must
pick the fastest correct one and its check row must notice the wrong one."""

import math
import sys
import time
import types

import pytest
import torch

from attnplug import ForwardMode
from attnplug.bench import Ctx
from attnplug.bench.prefill import PrefillCase, build_prefill_world, causal_reference
from attnplug.bench.step_check import CHECK_TOLERANCE
from attnplug.bench.world import bench_kv_scales, build_world
from attnplug.memory.fp8 import is_fp8
from attnplug_cuda.bench import flashinfer_peer, flashinfer_prefill

FP8 = torch.float8_e4m3fn
WORLD = dict(num_layers=4, max_bs=3, context=40, window=20, num_draft=4, num_heads=4, num_kv_heads=2, head_dim=16)
#: the stand-in's fastest configuration (the others sleep), and a wrong one
FAST = flashinfer_peer.DecodeConfig(16, "HND", True, False)
WRONG = flashinfer_peer.DecodeConfig(1, "HND", False, True)
SLOW_S = 0.005


def _pages(cache, layout, pages, n):
    """Keys ``[n, Hkv, D]`` float32 of the pages, in order (NHD ``[P, Hkv, D]`` / HND ``[Hkv, P, D]``)."""
    blocks = [cache[p] if layout == "NHD" else cache[p].transpose(0, 1) for p in pages.tolist()]
    return torch.cat(blocks)[:n].float()


class _Decode:
    made = []

    def __init__(self, workspace, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False, **buffers):
        assert kv_layout in ("NHD", "HND") and workspace.dtype == torch.uint8
        if use_cuda_graph:
            assert set(buffers) == {
                "paged_kv_indptr_buffer",
                "paged_kv_indices_buffer",
                "paged_kv_last_page_len_buffer",
            }
        self.layout, self.graph, self.cores = kv_layout, use_cuda_graph, use_tensor_cores
        _Decode.made.append(self)

    def plan(self, indptr, indices, last, H, Hkv, D, page_size, pos_encoding_mode="NONE", window_left=-1,
             q_data_type=None, kv_data_type=None, sm_scale=None):  # fmt: skip
        assert indptr.dtype == indices.dtype == last.dtype == torch.int32 and pos_encoding_mode == "NONE"
        self.table = (indptr.tolist(), indices, last.tolist())
        self.heads, self.page_size, self.window_left = (H, Hkv, D), page_size, window_left
        self.dtypes, self.sm_scale = (q_data_type, kv_data_type), sm_scale
        self.config = flashinfer_peer.DecodeConfig(page_size, self.layout, self.cores, self.graph)

    def run(self, q, paged_kv_cache, *, out, k_scale=None, v_scale=None):
        k_cache, v_cache = paged_kv_cache
        assert (q.dtype, k_cache.dtype) == self.dtypes and out.shape == q.shape
        assert (k_scale is not None) == is_fp8(k_cache.dtype) == (v_scale is not None)
        size = k_cache.shape[1] if self.layout == "NHD" else k_cache.shape[2]
        assert size == self.page_size
        indptr, indices, last = self.table
        H, Hkv, D = self.heads
        for b in range(q.shape[0]):
            pages = indices[indptr[b] : indptr[b + 1]]
            n = (len(pages) - 1) * size + last[b]
            k = _pages(k_cache, self.layout, pages, n) * (k_scale or 1.0)
            v = _pages(v_cache, self.layout, pages, n) * (v_scale or 1.0)
            if self.window_left >= 0:
                k, v = k[-(self.window_left + 1) :], v[-(self.window_left + 1) :]
            qg = q[b].float().view(Hkv, H // Hkv, D)
            p = torch.softmax(torch.einsum("kgd,nkd->kgn", qg, k) * self.sm_scale, -1)
            o = torch.einsum("kgn,nkd->kgd", p, v).reshape(H, D)
            out[b] = (o + 1.0 if self.config == WRONG else o).to(out.dtype)
        if self.config != FAST:
            time.sleep(SLOW_S)
        return out


class _Prefill:
    def __init__(self, workspace, kv_layout="NHD", backend="auto"):
        assert kv_layout == "NHD" and backend in ("fa2", "fa3")
        self.backend = backend

    def plan(self, qo_indptr, indptr, indices, last, H, Hkv, D, page_size, causal=False, sm_scale=None,
             q_data_type=None, kv_data_type=None):  # fmt: skip
        assert causal
        self.qo, self.table = qo_indptr.tolist(), (indptr.tolist(), indices, last.tolist())
        self.page_size, self.sm_scale, self.dtypes = (
            page_size,
            sm_scale or 1 / math.sqrt(D),
            (q_data_type, kv_data_type),
        )

    def run(self, q, paged_kv_cache, *, out):
        k_cache, v_cache = paged_kv_cache
        assert (q.dtype, k_cache.dtype) == self.dtypes and k_cache.shape[1] == self.page_size
        indptr, indices, last = self.table
        for b in range(len(last)):
            pages = indices[indptr[b] : indptr[b + 1]]
            n = (len(pages) - 1) * self.page_size + last[b]
            k, v = _pages(k_cache, "NHD", pages, n), _pages(v_cache, "NHD", pages, n)
            lo, hi = self.qo[b], self.qo[b + 1]
            out[lo:hi] = causal_reference(q[lo:hi], k, v, torch.arange(hi - lo), self.sm_scale).to(out.dtype)
        if self.backend == "fa2":
            time.sleep(SLOW_S)
        return out


@pytest.fixture
def stand_in(monkeypatch):
    """The stand-in as ``flashinfer``, the peers' timings shortened (a median of three samples of
    two replays: the slow configurations' sleeps decide), one torch thread (tiny tensors)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    module = types.ModuleType("flashinfer")
    module.__version__ = "stand-in"
    module.BatchDecodeWithPagedKVCacheWrapper = _Decode
    module.BatchPrefillWithPagedKVCacheWrapper = _Prefill
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    monkeypatch.setattr(flashinfer_peer, "SEARCH", {False: (2, 3), True: (2, 3)})
    monkeypatch.setattr(flashinfer_peer, "FINAL", {False: (3, 1), True: (3, 1)})
    monkeypatch.setattr(flashinfer_peer, "WORKSPACE_BYTES", 1 << 10)
    monkeypatch.setattr(flashinfer_prefill, "WORKSPACE_BYTES", 1 << 10)
    _Decode.made.clear()
    yield module
    torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_the_decode_peer_reports_its_fastest_correct_configuration(stand_in, fp8):
    kw = dict(kv_cache_dtype=FP8, kv_scales=bench_kv_scales(4)) if fp8 else {}
    world = build_world(**WORLD, dtype=torch.bfloat16, **kw)
    ctx = Ctx()
    us, detail, fields = flashinfer_peer.measure(ctx, world, ForwardMode.DECODE, 3, kv_cache_dtypes=(FP8,))
    name = flashinfer_peer.FP8_NAME if fp8 else flashinfer_peer.NAME
    assert fields["config"] == FAST.to_json() and us > 0
    assert detail.startswith(f"best of 15/16: {FAST.describe()};"), detail
    configs = {(c["page_size"], c["layout"], c["tensor_cores"], c["use_cuda_graph"]): c for c in fields["configs"]}
    assert len(configs) == 16 and all(c["error"] is None for c in configs.values())
    right = [c["max_abs_out_diff"] for key, c in configs.items() if key != tuple(WRONG.to_json().values())]
    assert max(right) <= CHECK_TOLERANCE  # pages, layouts, tables and scales give the backends' attention
    assert configs[tuple(WRONG.to_json().values())]["max_abs_out_diff"] > 0.5
    (check,) = [r for r in ctx.rows if r["metric"] == "max |out diff|"]
    assert check["case"] == f"decode bs=3 {name} vs float32 torch (same keys)" and check["met"] is False
    assert {made.config for made in _Decode.made if hasattr(made, "config")} >= set(flashinfer_peer.CONFIGS)
    kinds = {(m.window_left, m.page_size) for m in _Decode.made if hasattr(m, "table")}
    assert (world.window - 1, 16) in kinds and (-1, 1) in kinds


def test_the_decode_peer_without_a_correct_configuration_fails(stand_in, monkeypatch):
    monkeypatch.setattr(flashinfer_peer, "CONFIGS", (WRONG,))
    with pytest.raises(RuntimeError, match="no configuration of flashinfer ran and computed the right attention"):
        flashinfer_peer.measure(Ctx(), build_world(**WORLD, dtype=torch.bfloat16), ForwardMode.DECODE, 1)


def test_the_prefill_peer_reads_the_pools_pages_and_picks_the_faster_backend(stand_in):
    world = build_prefill_world(
        PrefillCase(16, (21, 9), 4), num_heads=4, num_kv_heads=2, dtype=torch.bfloat16, device="cpu"
    )
    us, out, detail, fields = flashinfer_prefill.peer([16]).measure(Ctx(), world)
    assert fields["config"] == {"backend": "fa3", "layout": "NHD", "page_size": 4} and us > 0
    assert detail.startswith("backend fa3 (NHD, page 4)") and "fa2" in detail
    assert [c["backend"] for c in fields["configs"]] == ["fa3", "fa2"]
    offset = 0
    for t in (21, 9):
        k, v = world.k[offset : offset + t].float(), world.v[offset : offset + t].float()
        ref = causal_reference(world.q[offset : offset + t], k, v, torch.arange(t), world.scaling)
        torch.testing.assert_close(out[offset : offset + t].float(), ref, rtol=2e-2, atol=2e-2)
        offset += t
