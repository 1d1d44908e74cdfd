"""The FP8 KV cache's mutants (``tests/mutants/fp8.py``, issue 38) against the conformance suite's
FP8 axis.

For every mutant:

1. it is really wrong over an FP8 cache, shown without the suite: the bytes it stores differ
   from what the rule (``attnplug.memory.fp8.quantize_kv``) writes, and its attention output
   is out of bounds against float64 attention over the cache the rule writes (or not finite);
   the reference backend passes the same witness (it is fair);
2. it is the reference over an unquantised cache (bit-identical outputs and caches in every
   mode), so only an FP8 cache can show it;
3. (slow) the default suite with ``-x`` fails it with a message naming a rule, within the quick
   profile, at the test ``mutants.fp8.CAUGHT_BY`` records;
4. (slow) the check that catches it, without FP8 caches (``suite_runs.WITHOUT_FP8_AXIS``),
   passes it in every case: the axis is what catches it.

And the declaration: a backend without FP8 passes (its FP8 pools refused, the axis skipped naming
``fp8_kv_dtypes``), one whose instances hide a dtype its class serves fails.
"""

from __future__ import annotations

import pytest
import torch

import suite_runs
from attnplug import ForwardMode
from attnplug.backends.reference import ReferenceBackend
from attnplug.memory.fp8 import FP8_KV_DTYPES, dequantize_kv, fp8_max, quantize_kv
from attnplug.oracle import exact_attention
from attnplug_conformance.exact import LONG_TOL, dense_attention, row_errors
from attnplug_conformance.harness import World, kv_bits
from attnplug_conformance.rules import ALL_RULES, CAPABILITIES
from mutants.fp8 import (
    CAUGHT_BY,
    FP8_MUTANTS,
    HidesServedFp8,
    WithoutFp8,
    non_saturating,
    toward_zero,
)
from worlds import drive_every_mode, fp8_spec

IDS = [cls.__name__ for cls in FP8_MUTANTS]
KV_IDS = [str(d).replace("torch.", "") for d in FP8_KV_DTYPES]


# ---------------------------------------------------------------------------- the witnesses
def _store_witness(cls, kv_cache_dtype) -> str:
    """Twin FP8 worlds (``cls``, the reference): a prompt of 5 and one of 9 tokens, then a DECODE
    step, on ``cls``. Returns why ``cls`` is wrong (its stored bytes are not the rule's, or its
    output is out of bounds against float64 attention over the rule's cache), or ''."""
    spec = fp8_spec(kv_cache_dtype)
    world, ref = (World(spec, c, "cpu", seed=3) for c in (cls, ReferenceBackend))
    reqs = [[w.new_request() for _ in range(2)] for w in (world, ref)]
    why = []
    for mode, new in ((ForwardMode.EXTEND, [5, 9]), (ForwardMode.DECODE, None)):
        step, ref_step = (w.plan(mode, rs, new) for w, rs in zip((world, ref), reqs))
        exact = dense_attention(ref, ref_step)  # the rule's cache, in float64
        out = world.run_eager(step)
        ref.run_eager(ref_step)
        worst = float(row_errors(out, exact).max())
        if worst > LONG_TOL[spec.dtype]:
            why.append(f"{mode.name}: relative error {worst:.3g} against float64 over the rule's cache")
        loc = step.batch.out_cache_loc
        for layer in range(spec.num_layers):
            slots = world.pool.translate_loc_from_full_to_swa(loc) if world.pool.is_swa_layer(layer) else loc
            k_scale, v_scale = world.pool.kv_scales(layer)
            for name, buf, x, scale in zip(
                "kv", world.pool.get_kv_buffer(layer), (step.inputs["k"], step.inputs["v"]), (k_scale, v_scale)
            ):
                rule = quantize_kv(x[:, layer], scale, kv_cache_dtype)
                wrong = int((kv_bits(buf)[slots.long()] != kv_bits(rule)).sum())
                if wrong:
                    why.append(
                        f"{mode.name}: layer {layer} {name}: {wrong} of {rule.numel()} stored bytes not the rule's"
                    )
        for w, s in ((world, step), (ref, ref_step)):
            w.advance(s)
    return "; ".join(why[:3])


def _ops_witness(cls, kv_cache_dtype, *, per_head: bool = True) -> str:
    """An engine's paged FP8 caches (4 blocks of 4 slots, block 0 the null block) through
    ``cls.paged_ops``: a prompt of 11 tokens stored with a scale per KV head (or one a layer, a
    0-dim tensor, ``per_head=False``) and attended causally. Returns why the ops are wrong
    (stored bytes not the rule's, output out of bounds against float64 attention over the rule's
    cache), or ''."""
    g = torch.Generator().manual_seed(5)
    ops = cls.paged_ops("cpu")
    P, hkv, D, H, n = 4, 2, 32, 4, 11
    top = fp8_max(kv_cache_dtype)
    scale = torch.tensor([1.5 / top, 9.0 / top]) if per_head else torch.tensor(1.5 / top)
    heads = scale.reshape(-1).expand(hkv)
    kc = torch.zeros(4, P, hkv, D, dtype=kv_cache_dtype)
    vc = torch.zeros_like(kc)
    k, v = (torch.randn(n, hkv, D, generator=g).to(torch.float16) for _ in range(2))
    q = torch.randn(n, H, D, generator=g).to(torch.float16)
    blocks = [2, 3, 1]
    slots = torch.tensor([blocks[i // P] * P + i % P for i in range(n)])
    ops.store_kv(k, v, kc, vc, slots, k_scale=scale, v_scale=scale)
    why = []
    for name, cache, x in (("key", kc, k), ("value", vc, v)):
        wrong = int((kv_bits(cache.flatten(0, 1))[slots] != kv_bits(quantize_kv(x, heads, kv_cache_dtype))).sum())
        if wrong:
            why.append(f"{wrong} stored {name} bytes not the rule's")
    step = ops.plan(
        torch.tensor([0, n], dtype=torch.int32),
        torch.tensor([n], dtype=torch.int32),
        torch.tensor([blocks + [0]], dtype=torch.int32),
        P,
        num_tokens=n,
        max_query_len=n,
        max_seq_len=n,
    )
    out = ops.attend(q, kc, vc, step, scale=0.2, k_scale=scale, v_scale=scale)
    keys, values = (dequantize_kv(quantize_kv(x, heads, kv_cache_dtype), heads, torch.float64) for x in (k, v))
    exact = exact_attention(q.double(), keys[None], values[None], [n], [n], None, 0.2)
    worst = float(row_errors(out[:, None], exact[:, None]).max())
    if worst > LONG_TOL[torch.float16]:
        why.append(f"relative error {worst:.3g} against float64 over the rule's cache")
    return "; ".join(why)


def witness(cls, kv_cache_dtype) -> str:
    """Why ``cls`` is wrong over a ``kv_cache_dtype`` cache ('' when nothing shows)."""
    if cls.WITNESS[0] == "ops":
        return _ops_witness(cls, kv_cache_dtype)
    return _store_witness(cls, kv_cache_dtype)


@pytest.mark.parametrize("kv_cache_dtype", FP8_KV_DTYPES, ids=KV_IDS)
@pytest.mark.parametrize("cls", FP8_MUTANTS, ids=IDS)
def test_mutant_is_wrong_over_an_fp8_cache(cls, kv_cache_dtype):
    assert witness(cls, kv_cache_dtype), f"{cls.__name__}: its witness shows nothing wrong over {kv_cache_dtype}"


@pytest.mark.parametrize("kv_cache_dtype", FP8_KV_DTYPES, ids=KV_IDS)
def test_witnesses_pass_the_reference(kv_cache_dtype):
    assert _store_witness(ReferenceBackend, kv_cache_dtype) == ""
    assert _ops_witness(ReferenceBackend, kv_cache_dtype) == ""
    assert _ops_witness(ReferenceBackend, kv_cache_dtype, per_head=False) == ""


def test_ops_mutant_is_right_with_one_scale_a_layer():
    """The op-layer mutant reads one value a layer: right where the engine passes one."""
    (ops_mutant,) = [cls for cls in FP8_MUTANTS if cls.WITNESS[0] == "ops"]
    for kv in FP8_KV_DTYPES:
        assert _ops_witness(ops_mutant, kv, per_head=False) == ""


@pytest.mark.parametrize("cls", FP8_MUTANTS, ids=IDS)
def test_mutant_is_the_reference_over_an_unquantised_cache(cls):
    """Every mode, eager and replayed, in a float16 world: outputs and caches bit-identical."""
    for use_graphs in (False, True):
        outs, caches, _ = drive_every_mode(cls, "cpu", use_graphs=use_graphs)
        ref_outs, ref_caches, _ = drive_every_mode(ReferenceBackend, "cpu", use_graphs=use_graphs)
        assert all(torch.equal(a, b) for a, b in zip(outs, ref_outs))
        assert all(torch.equal(a, b) for a, b in zip(caches, ref_caches))
    ops, ref_ops = cls.paged_ops("cpu"), ReferenceBackend.paged_ops("cpu")
    cache = torch.zeros(8, 2, 16, dtype=torch.float16)
    assert ops.check_scales(None, None, cache) == ref_ops.check_scales(None, None, cache) == (None, None)


# ---------------------------------------------------------------------------- the conversions
def test_the_non_saturating_conversion_overflows_past_the_largest_finite():
    """Up to the midpoint above the largest finite the conversion rounds like the rule; past it
    (at it, where ties to even round up: e5m2) it overflows: NaN in e4m3fn, ±Inf in e5m2."""
    one = torch.ones(1)
    e4 = non_saturating(torch.tensor([[[448.0, 464.0, 465.0, -500.0, 3.0]]]), one, torch.float8_e4m3fn).flatten()
    assert e4.float()[:2].tolist() == [448.0, 448.0] and e4.float()[2:4].isnan().all() and e4.float()[4] == 3.0
    e5 = non_saturating(torch.tensor([[[57344.0, 61439.0, 61440.0, -70000.0]]]), one, torch.float8_e5m2).flatten()
    assert e5.float().tolist() == [57344.0, 57344.0, float("inf"), float("-inf")]


@pytest.mark.parametrize("kv_cache_dtype", FP8_KV_DTYPES, ids=KV_IDS)
def test_rounding_toward_zero_never_rounds_away(kv_cache_dtype):
    x = torch.randn(64, 2, 32, generator=torch.Generator().manual_seed(1)) * 3
    scale = torch.tensor([0.01, 0.002])
    y = (x / scale[:, None]).clamp(-fp8_max(kv_cache_dtype), fp8_max(kv_cache_dtype))
    rtz, rne = toward_zero(x, scale, kv_cache_dtype).float(), quantize_kv(x, scale, kv_cache_dtype).float()
    assert (rtz.abs() <= y.abs()).all() and (rtz.sign() * y.sign() >= 0).all()
    assert (rtz != rne).float().mean() > 0.2  # about half the values round away from zero


# ---------------------------------------------------------------------------- the suite catches each
def _param_id(result, target: str) -> str:
    """``check[params]`` of a suite result, without the backend (``target``) in the brackets."""
    params = result.nodeid.split("[", 1)[1][: -len("]")]
    return f"{result.check}[{params[len(target) + 1 :]}]"


@pytest.mark.slow  # the default suite with -x on each mutant, in this process
@pytest.mark.parametrize("cls", FP8_MUTANTS, ids=IDS)
def test_default_suite_fails_mutant_naming_the_rule(cls):
    target = f"mutants.fp8:{cls.__name__}"
    results, elapsed = suite_runs.run_suite(target, "", True)
    failed = [r for r in results.values() if r.outcome in ("failed", "error")]
    assert failed, f"the suite passed {cls.__name__} ({len(results)} tests in {elapsed:.0f} s)"
    first = failed[0]
    assert first.message.startswith(ALL_RULES), f"{first.nodeid}: {first.message!r} names no rule"
    assert _param_id(first, target) == CAUGHT_BY[cls.__name__], first.message
    position = list(results).index(first.nodeid)
    assert position < suite_runs.quick_profile_size(), f"{cls.__name__} caught only by test {position + 1}"


@pytest.mark.slow  # the catching check without its FP8 axis on each mutant, in this process
@pytest.mark.parametrize("cls", FP8_MUTANTS, ids=IDS)
def test_the_catching_check_without_the_fp8_axis_passes_mutant(cls):
    """The check that catches the mutant over an FP8 cache (``CAUGHT_BY``) passes it in every
    one of its cases with the model's cache: the axis is what catches it. (The whole suite
    without the axis passed each mutant too when they were written: ``suite_runs.run_suite(
    target, suite_runs.WITHOUT_FP8_AXIS)``, about a minute a mutant on two cores.)"""
    check = CAUGHT_BY[cls.__name__].split("[", 1)[0]
    results, _ = suite_runs.run_suite(f"mutants.fp8:{cls.__name__}", f"{check} and {suite_runs.WITHOUT_FP8_AXIS}")
    bad = {r.nodeid: r.message for r in results.values() if r.outcome not in ("passed", "skipped")}
    assert not bad, bad
    assert sum(r.outcome == "passed" for r in results.values()) >= 3, list(results)
    assert all(r.check == check and "kv_fp8" not in r.nodeid for r in results.values())


# ---------------------------------------------------------------------------- the declaration
def test_a_backend_without_fp8_refuses_fp8_pools_and_skips_the_axis():
    target = f"mutants.fp8:{WithoutFp8.__name__}"
    results, _ = suite_runs.run_suite(
        target, "check_capabilities_honest or check_attention_matches_reference and DECODE-bs1"
    )
    by_id = {r.nodeid.split("[", 1)[1][len(target) + 1 : -1]: r for r in results.values()}
    assert {by_id[i].outcome for i in ("kv_cache_dtypes", "types", "DECODE-bs1")} == {"passed"}
    fp8 = [r for ident, r in by_id.items() if "kv_fp8" in ident]
    assert fp8 and all(r.outcome == "skipped" for r in fp8)
    for r in fp8:
        kv = "float8_e5m2" if "kv_fp8_e5m2" in r.nodeid else "float8_e4m3fn"
        assert f"capabilities().fp8_kv_dtypes does not declare {kv} (declared: nothing)" in r.message, r.message


def test_instances_hiding_a_served_fp8_dtype_fail_the_declaration():
    target = f"mutants.fp8:{HidesServedFp8.__name__}"
    results, _ = suite_runs.run_suite(target, "check_capabilities_honest and kv_cache_dtypes")
    [result] = results.values()
    assert result.outcome == "failed" and result.message.startswith(CAPABILITIES)
    assert "does not declare float8_e4m3fn but the backend accepted a float8_e4m3fn KV pool" in result.message
