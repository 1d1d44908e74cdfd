"""The conformance suite's FP8 axis on its own parts (issue 38): the worlds' scales, the history
that records what an FP8 cache holds, the bit-level instruments (snapshots, poison, the mapping
poison), the configs and test ids the axis adds, the run order and the profiles, and the
sampled worlds over an FP8 cache."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from attnplug import Capabilities, ForwardMode
from attnplug.backends.reference import ReferenceBackend
from attnplug.memory.fp8 import FP8_KV_DTYPES, dequantize_kv, fp8_max, quantize_kv
from attnplug_conformance import config
from attnplug_conformance.config import base_config, fp8_model_dtype, kv_axis, kv_id
from attnplug_conformance.exact import LONG_TOL, dense_attention, row_errors
from attnplug_conformance.harness import FP8_SATURATING, FP8_WIDE, World, WorldSpec, kv_bits
from attnplug_conformance.instruments import MappingPoison, poison_free_rows
from attnplug_conformance.worlds import SampledWorld, run_world, world_spec
from suite_runs import collect_suite
from worlds import fp8_spec

KV_IDS = [str(d).replace("torch.", "") for d in FP8_KV_DTYPES]
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _world(kv=E4M3, seed=3, **overrides) -> World:
    return World(fp8_spec(kv, **overrides), ReferenceBackend, "cpu", seed=seed)


# ---------------------------------------------------------------------------- the world
@pytest.mark.parametrize("kv", FP8_KV_DTYPES, ids=KV_IDS)
def test_scales_saturate_part_of_the_heads_and_none_is_one(kv):
    world = _world(kv, num_layers=4, num_heads=6, num_kv_heads=3)
    pool = world.pool
    assert pool.dtype == kv and pool.k_scale.dtype == torch.float32
    m = torch.stack([pool.k_scale, pool.v_scale]).double() * fp8_max(kv)  # [2, L, Hkv] saturation magnitudes
    saturating = (m >= FP8_SATURATING[0] * (1 - 1e-6)) & (m <= FP8_SATURATING[1] * (1 + 1e-6))
    wide = (m >= FP8_WIDE[0] * (1 - 1e-6)) & (m <= FP8_WIDE[1] * (1 + 1e-6))
    assert bool((saturating ^ wide).all())  # each scale in one of the two ranges
    for layer in range(4):  # every layer has both kinds, K and V alternating by head
        assert saturating[:, layer].any() and wide[:, layer].any()
        for h in range(3):
            assert bool(saturating[0, layer, h]) == ((layer + h) % 2 == 0) != bool(saturating[1, layer, h])
    assert not bool((torch.stack([pool.k_scale, pool.v_scale]) == 1.0).any())
    assert torch.unique(pool.k_scale).numel() == pool.k_scale.numel()  # no two heads alike


def test_scales_are_seeded_and_leave_the_inputs_unchanged():
    a, b, c = _world(seed=3), _world(seed=3), _world(seed=4)
    assert torch.equal(a.pool.k_scale, b.pool.k_scale) and torch.equal(a.pool.v_scale, b.pool.v_scale)
    assert not torch.equal(a.pool.k_scale, c.pool.k_scale)
    plain = World(dataclasses.replace(fp8_spec(), kv_cache_dtype=None), ReferenceBackend, "cpu", seed=3)
    assert plain.pool.k_scale is None
    reqs = [[w.new_request() for _ in range(2)] for w in (a, plain)]
    steps = [w.plan(ForwardMode.EXTEND, r, [4, 6]) for w, r in zip((a, plain), reqs)]
    assert all(torch.equal(steps[0].inputs[n], steps[1].inputs[n]) for n in ("q", "k", "v"))


def test_a_spec_refuses_an_unquantised_cache_of_another_dtype():
    with pytest.raises(ValueError, match="kv_cache_dtype must be None, the model dtype"):
        WorldSpec(dtype=torch.float16, kv_cache_dtype=torch.float32)
    assert WorldSpec(dtype=torch.float16, kv_cache_dtype=torch.float16).kv_cache_dtype == torch.float16


@pytest.mark.parametrize("kv", FP8_KV_DTYPES, ids=KV_IDS)
def test_the_history_holds_what_the_cache_holds(kv):
    """After a step, each request's history equals its live rows dequantised (float64), which is
    what the rule makes of the inputs; and the oracle over it judges the reference exactly."""
    world = _world(kv)
    reqs = [world.new_request() for _ in range(2)]
    step = world.plan(ForwardMode.EXTEND, reqs, [5, 9])
    out = world.run_eager(step)
    exact = dense_attention(world, step)
    assert float(row_errors(out, exact).max()) <= LONG_TOL[torch.float16]
    world.advance(step)
    for layer in range(world.spec.num_layers):
        k_scale, v_scale = world.pool.kv_scales(layer)
        rule_k = dequantize_kv(quantize_kv(step.inputs["k"][:, layer], k_scale, kv), k_scale, torch.float64)
        assert torch.equal(torch.cat([r.history[layer][0] for r in reqs]), rule_k)
        loc = world.live_full_slots()
        if world.pool.is_swa_layer(layer):  # window 4: the SWA layers keep the last positions only
            continue
        held = dequantize_kv(world.pool.get_kv_buffer(layer)[1][loc], v_scale, torch.float64)
        assert torch.equal(torch.cat([r.history[layer][1] for r in reqs]), held)


def test_snapshots_restore_fp8_caches_bit_for_bit():
    world = _world(E5M2)
    poison_free_rows(world, seed=2, fill="mixed")
    snap = world.snapshot_kv()
    for layer in range(world.spec.num_layers):
        for buf in world.pool.get_kv_buffer(layer):
            kv_bits(buf).fill_(0)
    world.restore_kv(snap)
    for (k, v), (k0, v0) in zip(world.snapshot_kv(), snap):
        assert torch.equal(kv_bits(k), kv_bits(k0)) and torch.equal(kv_bits(v), kv_bits(v0))


@pytest.mark.parametrize("kv", FP8_KV_DTYPES, ids=KV_IDS)
def test_poison_writes_the_formats_specials(kv):
    """NaN bytes and ±max in both formats; ±Inf only in e5m2 (e4m3fn has no infinity)."""
    world = _world(kv)
    seen = {}
    for fill in ("nan", "inf", "mixed"):
        poison_free_rows(world, seed=5, fill=fill)
        values = world.pool.get_kv_buffer(0)[0][1:].float()
        seen[fill] = values
    assert seen["nan"].isnan().all()
    extremes = set(seen["inf"].unique().tolist())
    top = fp8_max(kv)
    assert extremes == ({math.inf, -math.inf, top, -top} if kv == E5M2 else {top, -top})
    mixed = seen["mixed"]
    assert mixed.isnan().any() and (mixed == top).any() and (mixed == -top).any()
    assert mixed.isinf().any() == (kv == E5M2)
    finite = mixed[mixed.isfinite() & (mixed.abs() < top)]
    assert finite.numel() > 0  # and noise


def test_the_mapping_poison_writes_fp8_bytes():
    world = _world(E4M3)
    reqs = world.prefill([5, 9], backend=world.reference_backend)
    step = world.plan(ForwardMode.DECODE, reqs)
    poison = MappingPoison(world, step)
    for layer in poison.swa_layers:
        pk, _ = poison.poison[layer]
        assert pk.dtype == E4M3
        assert torch.equal(kv_bits(world.pool.get_kv_buffer(layer)[0])[poison.targets], kv_bits(pk))


# ---------------------------------------------------------------------------- configs and ids
def _caps(**overrides) -> Capabilities:
    return dataclasses.replace(ReferenceBackend.declared_capabilities(), **overrides)


def test_an_fp8_config_takes_a_half_model_dtype():
    caps = _caps()
    assert base_config(caps).dtype == torch.float32 and base_config(caps).kv_cache_dtype is None
    cfg = base_config(caps, kv_cache_dtype=E5M2)
    assert (cfg.dtype, cfg.kv_cache_dtype) == (torch.float16, E5M2) and cfg.spec().kv_cache_dtype == E5M2
    assert base_config(caps, dtype=torch.bfloat16, kv_cache_dtype=E4M3).dtype == torch.bfloat16
    assert fp8_model_dtype((torch.bfloat16, torch.float32)) == torch.bfloat16
    assert fp8_model_dtype((torch.float32,)) == torch.float32


def test_an_undeclared_fp8_dtype_skips_naming_the_declaration():
    with pytest.raises(
        pytest.skip.Exception, match=r"fp8_kv_dtypes does not declare float8_e5m2 \(declared: float8_e4m3fn\)"
    ):
        base_config(_caps(fp8_kv_dtypes=(E4M3,)), kv_cache_dtype=E5M2)
    with pytest.raises(pytest.skip.Exception, match=r"\(declared: nothing\)"):
        base_config(_caps(fp8_kv_dtypes=()), kv_cache_dtype=E4M3)


def test_the_axis_keeps_the_ids_and_adds_one_per_fp8_dtype():
    assert [kv_id(d) for d in (None, E4M3, E5M2)] == ["kv_auto", "kv_fp8_e4m3", "kv_fp8_e5m2"]
    names, params = kv_axis(
        "path,mode", [("eager", 1), ("replay", 2)], ["eager-A", "replay-B"], fp8=lambda v: v[1] == 2
    )
    assert names == "path,mode,kv_cache_dtype"
    assert [p.id for p in params] == ["eager-A", "replay-B", "replay-B-kv_fp8_e4m3", "replay-B-kv_fp8_e5m2"]
    assert [p.values for p in params] == [
        ("eager", 1, None),
        ("replay", 2, None),
        ("replay", 2, E4M3),
        ("replay", 2, E5M2),
    ]
    names, params = kv_axis()
    assert names == "kv_cache_dtype" and [p.id for p in params] == ["kv_auto", "kv_fp8_e4m3", "kv_fp8_e5m2"]
    with pytest.raises(ValueError, match="2 values and 1 ids"):
        kv_axis("case", [1, 2], ["a"])


def test_the_default_run_serves_e4m3_everywhere_e5m2_first_and_quick_three_fp8_cases(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    code, default = collect_suite()
    assert code == 0
    e4 = [n for n in default if "-kv_fp8_e4m3]" in n]
    e5 = [n.split("::")[-1] for n in default if "-kv_fp8_e5m2]" in n]
    assert len(e4) > 100
    assert e5 == [  # the axis's first-round case, and the model check's own e5m2 case (it takes no axis)
        "check_attention_matches_reference[reference-DECODE-gqa4-window_smaller-kv_fp8_e5m2]",
        "check_matches_transformers[reference-gpt_oss-page4-kv_fp8_e5m2]",
    ]
    code, quick = collect_suite("--attnplug-quick")
    fp8_quick = [n.split("[reference-")[-1] for n in quick if "kv_fp8" in n]
    assert fp8_quick == [
        "DECODE-gqa4-window_smaller-kv_fp8_e4m3]",
        "DECODE-gqa4-window_smaller-kv_fp8_e5m2]",
        "bs16-interleaved-window-kv_fp8_e4m3]",
    ]
    code, thorough = collect_suite("--attnplug-thorough")
    e4 = [n for n in thorough if "-kv_fp8_e4m3]" in n]
    assert code == 0 and len([n for n in thorough if "-kv_fp8_e5m2]" in n]) == len(e4) > 100


def test_an_fp8_dtype_in_the_default_runs_in_every_case(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(config, "DEFAULT_FP8_KV_DTYPES", (E4M3, E5M2))
    code, default = collect_suite()
    e4, e5 = ([n for n in default if f"-{kv}]" in n] for kv in ("kv_fp8_e4m3", "kv_fp8_e5m2"))
    assert code == 0 and len(e4) > 100 and len(e5) == len(e4)


# ---------------------------------------------------------------------------- sampled worlds
def test_a_sampled_world_names_its_cache():
    world = SampledWorld(dtype="bfloat16", kv_cache_dtype="float8_e5m2", poison="mixed")
    assert eval(repr(world), {"SampledWorld": SampledWorld}) == world
    assert world_spec(world).kv_cache_dtype == E5M2
    with pytest.raises(ValueError, match="kv_cache_dtype 'float8_e4m3'"):
        SampledWorld(kv_cache_dtype="float8_e4m3")


@pytest.mark.parametrize("kv", KV_IDS)
def test_an_fp8_sampled_world_passes_the_reference(kv):
    world = SampledWorld(dtype="float16", kv_cache_dtype=kv, poison="mixed", requests=((0, 5), (7, 3)), accepted=(1, 2))
    run_world(world, lambda spec, seed: World(spec, ReferenceBackend, "cpu", seed=seed))
