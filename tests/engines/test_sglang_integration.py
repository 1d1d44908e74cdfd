"""attnplug.integrations.sglang against SGLang's own code (needs SGLang; .ci/run's engine job
installs it without its GPU dependencies).

* the plugin: SGLang's own loader (``load_plugins``) registers the backend and the
  ``--attention-backend attnplug`` choice, which SGLang's argument parser then accepts (and
  refuses without the plugin);
* a smoke run, not a run of SGLang's engine (its CPU engine needs packages with no CPU build
  here: docs/engines.md): SGLang's ``ReqToTokenPool``, ``SWAKVPool`` and ``RadixAttention``
  layers driven through attnplug's SGLang backend for an EXTEND (one prompt on a cached prefix)
  and a DECODE step, against SGLang's ``torch_native`` backend on twin pools and against
  float64 attention; the hoisted SWA translation, the legacy graph hooks' replay into the
  captured tensors, and the soft-cap and sinks;
* FP8 pools (SGLang's ``SWAKVPool`` of ``float8_e4m3fn`` / ``float8_e5m2``): the same bytes and
  outputs as ``torch_native`` without scales, and with the layers' ``k_scale`` / ``v_scale``
  (a tensor, a float, None) the bytes of ``attnplug.memory.fp8.quantize_kv`` at the hoisted
  slots and float64 attention over the dequantised cache.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

from child import HANG_LIMIT_S

sglang = pytest.importorskip("sglang", reason="needs SGLang: .ci/run's engine job")

from sglang.srt.layers.radix_attention import RadixAttention  # noqa: E402
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402

from attnplug.integrations.sglang.backend import AttnplugSGLangBackend  # noqa: E402
from attnplug.memory.fp8 import dequantize_kv, quantize_kv  # noqa: E402
from attnplug.oracle import exact_attention  # noqa: E402

H, HKV, D, WINDOW = 4, 2, 32, 5  # SGLang's sliding_window_size: keys p - 5 .. p (6 keys)


def test_plugin_loads_and_the_option_is_accepted():
    script = textwrap.dedent(
        """
        import argparse
        from sglang.srt.server_args import ServerArgs

        def parses():
            parser = argparse.ArgumentParser()
            ServerArgs.add_cli_args(parser)
            try:
                parser.parse_args(["--model-path", "m", "--attention-backend", "attnplug"])
                return True
            except SystemExit:
                return False

        before = parses()
        from sglang.srt.plugins import load_plugins
        load_plugins()
        from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
        from attnplug.integrations.sglang.backend import create_backend
        print("RESULT", before, parses(), ATTENTION_BACKENDS.get("attnplug") is create_backend)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=HANG_LIMIT_S)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")]
    assert line, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert line[0].split()[1:] == ["False", "True", "True"]


class _World:
    """SGLang's pools for one SWA layer (0) and one full layer (1), two requests."""

    def __init__(self, seed=0, scrambled=True, dtype=torch.float32):
        torch.manual_seed(seed)
        self.req = ReqToTokenPool(size=4, max_context_len=64, device="cpu", enable_memory_saver=False)
        self.pool = SWAKVPool(
            size=128,
            size_swa=96,
            page_size=1,
            dtype=dtype,
            head_num=HKV,
            head_dim=D,
            swa_attention_layer_ids=[0],
            full_attention_layer_ids=[1],
            device="cpu",
        )
        mapping = torch.zeros(129 + 1, dtype=torch.int64)
        # scrambled: SWA slots differ from full slots; else the identity
        mapping[1:96] = torch.randperm(95) + 1 if scrambled else torch.arange(1, 96)
        mapping[-1] = -1  # SGLang's sentinel: -1 translates to -1
        self.pool.register_mapping(mapping)
        self.runner = SimpleNamespace(device="cpu", req_to_token_pool=self.req, token_to_kv_pool=self.pool)
        self.next = 1

    def alloc(self, row, start, n):
        slots = torch.arange(self.next, self.next + n)
        self.next += n
        self.req.req_to_token[row, start : start + n] = slots.to(torch.int32)
        return slots


def _layers(softcap=0.0):
    return [
        RadixAttention(H, D, 0.2, HKV, layer_id=0, logit_cap=softcap, sliding_window_size=WINDOW),
        RadixAttention(H, D, 0.2, HKV, layer_id=1, logit_cap=softcap),
    ]


def _batch(mode, rows, seq, new, loc):
    return SimpleNamespace(
        forward_mode=mode,
        batch_size=len(rows),
        req_pool_indices=torch.tensor(rows),
        seq_lens=torch.tensor(seq),
        seq_lens_cpu=None,
        seq_lens_sum=sum(seq),
        out_cache_loc=loc,
        extend_seq_lens=torch.tensor(new),
        extend_prefix_lens=torch.tensor([s - n for s, n in zip(seq, new)]),
        extend_seq_lens_cpu=list(new),
        extend_prefix_lens_cpu=[s - n for s, n in zip(seq, new)],
        encoder_lens=None,
        spec_info=None,
    )


def _steps(world):
    """An EXTEND of two prompts (7 and 12 tokens), then an EXTEND of 4 on request 0's prefix
    beside a decode-length chunk, then a DECODE."""
    out = []
    seq = [0, 0]
    for mode, new in ((ForwardMode.EXTEND, [7, 12]), (ForwardMode.EXTEND, [4, 1]), (ForwardMode.DECODE, [1, 1])):
        loc = torch.cat([world.alloc(r, seq[r], n) for r, n in enumerate(new)])
        seq = [s + n for s, n in zip(seq, new)]
        out.append(_batch(mode, [0, 1], list(seq), new, loc))
    return out


def _run(backend, layers, batches, qkv, sinks=None):
    outs = []
    for fb, (q, k, v) in zip(batches, qkv):
        backend.init_forward_metadata(fb)
        kw = {} if sinks is None else {"sinks": sinks}
        k, v = k.view(-1, HKV, D), v.view(-1, HKV, D)  # as RadixAttention.forward hands them on
        step = [backend.forward(q, k, v, layer, fb, **kw) for layer in layers]
        outs.append(step)
    return outs


def _inputs(batches, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(fb.out_cache_loc.shape[0], h * D, generator=g) for h in (H, HKV, HKV)) for fb in batches]


def test_smoke_matches_sglangs_torch_native_backend():
    """torch_native reads a SWA layer's buffer at full-pool slots (it never translates the
    window), so the twins use an identity full->SWA mapping; the scrambled mapping is checked
    against float64 below."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    worlds = [_World(scrambled=False), _World(scrambled=False)]
    ours, theirs = AttnplugSGLangBackend(worlds[0].runner), TorchNativeAttnBackend(worlds[1].runner)
    batches = [_steps(w) for w in worlds]
    qkv = _inputs(batches[0])
    a = _run(ours, _layers(), batches[0], qkv)
    b = _run(theirs, _layers(), batches[1], qkv)
    for step_a, step_b in zip(a, b):
        for out_a, out_b in zip(step_a, step_b):
            assert torch.allclose(out_a, out_b.view_as(out_a), atol=1e-5, rtol=1e-5)
    for layer in (0, 1):  # the same KV at the same slots (SWA layer: the translated ones)
        assert torch.equal(worlds[0].pool.get_key_buffer(layer), worlds[1].pool.get_key_buffer(layer))


def test_smoke_softcap_and_sinks_match_float64():
    world = _World()
    backend = AttnplugSGLangBackend(world.runner)
    batches = _steps(world)
    qkv = _inputs(batches)
    sinks = torch.randn(H)
    outs = _run(backend, _layers(softcap=1.5), batches, qkv, sinks=sinks)
    hist = {0: [], 1: []}
    for fb, (q, k, v), step_out in zip(batches, qkv, outs):
        new = fb.extend_seq_lens_cpu
        lo = 0
        for r, n in enumerate(new):
            hist[r].append((k[lo : lo + n].view(n, HKV, D), v[lo : lo + n].view(n, HKV, D)))
            lo += n
        seq = [sum(x[0].shape[0] for x in hist[r]) for r in (0, 1)]
        keys = torch.zeros(2, max(seq), HKV, D, dtype=torch.float64)
        values = keys.clone()
        for r in (0, 1):
            keys[r, : seq[r]] = torch.cat([x[0] for x in hist[r]]).double()
            values[r, : seq[r]] = torch.cat([x[1] for x in hist[r]]).double()
        for layer, window in ((0, WINDOW + 1), (1, None)):
            exact = exact_attention(
                q.view(-1, H, D).double(), keys, values, seq, new, window, 0.2, logit_softcap=1.5, sinks=sinks.double()
            )
            assert float((step_out[layer].view(-1, H, D).double() - exact).abs().max()) < 1e-5


def test_translation_is_hoisted_and_legacy_replay_reuses_captured_tensors(monkeypatch):
    world = _World()
    backend = AttnplugSGLangBackend(world.runner)
    batches = _steps(world)
    calls = []
    real = world.pool.translate_loc_from_full_to_swa
    monkeypatch.setattr(world.pool, "translate_loc_from_full_to_swa", lambda x: calls.append(1) or real(x))
    qkv = _inputs(batches)
    _run(backend, _layers(), batches[:2], qkv[:2])
    assert len(calls) == 2  # once a step, whatever the layers
    # legacy hooks: capture the decode shape, then replay a decode with other lengths
    backend.init_cuda_graph_state(max_bs=2, max_num_tokens=8)
    decode = batches[2]
    backend.init_forward_metadata_capture_cuda_graph(forward_batch=decode)
    captured = backend.forward_metadata
    world.alloc(0, 12, 1)
    loc = torch.tensor([world.next - 1, 1])
    nxt = _batch(ForwardMode.DECODE, [0, 1], [13, 14], [1, 1], loc)
    backend.init_forward_metadata_replay_cuda_graph(forward_batch=nxt)
    assert backend.forward_metadata is captured
    assert captured.full.seq_lens.tolist() == [13, 14]
    assert torch.equal(backend.cuda_graph_swa_out_cache_loc[:2], real(loc).to(torch.int32))
    assert int(backend.cuda_graph_swa_out_cache_loc[2:].abs().sum()) == 0


def test_unsupported_mode_is_refused_by_name():
    world = _World()
    backend = AttnplugSGLangBackend(world.runner)
    fb = _batch(ForwardMode.DECODE, [0], [1], [1], torch.tensor([1]))
    fb.forward_mode = ForwardMode.IDLE
    with pytest.raises(NotImplementedError, match="IDLE"):
        backend.init_forward_metadata(fb)


FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("kv", FP8, ids=str)
def test_fp8_pools_match_sglangs_torch_native_backend(kv):
    """Without scales (SGLang's default: 1.0) both backends store the same FP8 bytes (SGLang's
    pool casts k / v to its dtype, attnplug quantises by its rule: the same float32 rounding)
    and attend over the same values."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    worlds = [_World(scrambled=False, dtype=kv), _World(scrambled=False, dtype=kv)]
    ours, theirs = AttnplugSGLangBackend(worlds[0].runner), TorchNativeAttnBackend(worlds[1].runner)
    batches = [_steps(w) for w in worlds]
    qkv = _inputs(batches[0])
    a = _run(ours, _layers(), batches[0], qkv)
    b = _run(theirs, _layers(), batches[1], qkv)
    for step_a, step_b in zip(a, b):
        for out_a, out_b in zip(step_a, step_b):
            assert torch.allclose(out_a, out_b.view_as(out_a), atol=1e-5, rtol=1e-5)
    for layer in (0, 1):
        mine, other = worlds[0].pool.get_key_buffer(layer), worlds[1].pool.get_key_buffer(layer)
        assert mine.dtype == kv and torch.equal(mine.view(torch.uint8), other.view(torch.uint8))


@pytest.mark.parametrize("kv", FP8, ids=str)
def test_fp8_layer_scales_and_saturation_match_float64(kv):
    """Each layer's own scales (layer 0: float32 tensors as SGLang loads them from a checkpoint;
    layer 1: a float k_scale and no v_scale, i.e. 1.0), a value beyond the format's range that
    saturates, a scrambled full->SWA mapping: the pools hold ``quantize_kv`` of the inputs at
    the step's slots (the SWA layer at the hoisted translated ones), and every output is float64
    attention over the dequantised history."""
    world = _World(dtype=kv)
    backend = AttnplugSGLangBackend(world.runner)
    layers = _layers()
    layers[0].k_scale = torch.nn.Parameter(torch.tensor(0.004), requires_grad=False)
    layers[0].v_scale = torch.nn.Parameter(torch.tensor(0.02), requires_grad=False)
    layers[1].k_scale, layers[1].v_scale = 0.05, None
    scales = {0: (torch.full((HKV,), 0.004), torch.full((HKV,), 0.02)), 1: (torch.full((HKV,), 0.05), torch.ones(HKV))}
    batches = _steps(world)
    qkv = _inputs(batches)
    qkv[0][1][0, :3] = torch.tensor([1e6, -1e6, 300.0])  # beyond 57344 * 0.004 and 448 * 0.05
    outs = _run(backend, layers, batches, qkv)
    pool = world.pool
    hist = {0: [], 1: []}
    for fb, (q, k, v), step_out in zip(batches, qkv, outs):
        k, v = k.view(-1, HKV, D), v.view(-1, HKV, D)
        swa_loc = pool.translate_loc_from_full_to_swa(fb.out_cache_loc)
        for layer, loc in ((0, swa_loc), (1, fb.out_cache_loc)):
            ks, vs = scales[layer]
            assert torch.equal(
                pool.get_key_buffer(layer)[loc].view(torch.uint8), quantize_kv(k, ks, kv).view(torch.uint8)
            )
            assert torch.equal(
                pool.get_value_buffer(layer)[loc].view(torch.uint8), quantize_kv(v, vs, kv).view(torch.uint8)
            )
        new = fb.extend_seq_lens_cpu
        lo = 0
        for r, n in enumerate(new):
            hist[r].append((k[lo : lo + n], v[lo : lo + n]))
            lo += n
        seq = [sum(x[0].shape[0] for x in hist[r]) for r in (0, 1)]
        for layer, window in ((0, WINDOW + 1), (1, None)):
            ks, vs = scales[layer]
            keys = torch.zeros(2, max(seq), HKV, D, dtype=torch.float64)
            values = keys.clone()
            for r in (0, 1):
                kr, vr = torch.cat([x[0] for x in hist[r]]), torch.cat([x[1] for x in hist[r]])
                keys[r, : seq[r]] = dequantize_kv(quantize_kv(kr, ks, kv), ks, torch.float64)
                values[r, : seq[r]] = dequantize_kv(quantize_kv(vr, vs, kv), vs, torch.float64)
            exact = exact_attention(q.view(-1, H, D).double(), keys, values, seq, new, window, 0.2)
            got = step_out[layer].view(-1, H, D).double()
            assert bool(torch.isfinite(got).all())
            assert float((got - exact).abs().max()) < 1e-5
    top = torch.finfo(kv).max
    assert (
        float(pool.get_key_buffer(0).float().abs().max()) == top
        or float(pool.get_key_buffer(1).float().abs().max()) == top
    )


def test_a_pool_dtype_the_op_layer_does_not_serve_is_refused():
    world = _World()
    odd = SimpleNamespace(dtype=torch.float8_e4m3fnuz)  # ROCm's FP8 (not attnplug's)
    runner = SimpleNamespace(device="cpu", req_to_token_pool=world.req, token_to_kv_pool=odd)
    with pytest.raises(NotImplementedError, match="KV cache dtype torch.float8_e4m3fnuz is not served"):
        AttnplugSGLangBackend(runner)


def test_a_bad_float_scale_is_refused_by_name():
    world = _World(dtype=torch.float8_e4m3fn)
    backend = AttnplugSGLangBackend(world.runner)
    layers = _layers()
    layers[1].k_scale = -1.0
    batches = _steps(world)
    with pytest.raises(ValueError, match="layer 1's k_scale must hold finite floats > 0"):
        _run(backend, layers, batches[:1], _inputs(batches[:1]))
