"""The transformers model check over an FP8 KV cache (``attnplug_conformance.model_check``, the
``...-kv_fp8_*`` cases of ``check_matches_transformers``) has teeth and no false alarm.

* the reference backend passes both FP8 cases, in float32 and in bfloat16;
* FP8 bugs of a backend fail them with a message naming the rule: a scale ignored (store and
  read), every layer quantised with layer 0's scales, the KV heads' scales swapped, K's scales
  used for V, a store without saturation (e5m2: an infinity); in bfloat16 the layer-0 bug is
  caught by the cache's bytes, which the logits alone let through;
* the looser judgement against transformers' unquantised attention can fail too (scales that
  saturate nearly everything: the backend agrees with the reference, the model is lost);
* a backend that declares no FP8 cache is skipped naming the capability.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("transformers", reason="the model-level check needs transformers")

from attnplug.backends.reference import ReferenceBackend  # noqa: E402
from attnplug_conformance import model_check  # noqa: E402
from attnplug_conformance.rules import MODEL  # noqa: E402

E4M3 = model_check.ModelCase("gemma3_text", None, kv_dtype=torch.float8_e4m3fn)
E5M2 = model_check.ModelCase("gpt_oss", None, page_size=4, kv_dtype=torch.float8_e5m2)
CAPS = ReferenceBackend.declared_capabilities()


def test_the_fp8_cases_are_in_the_check():
    ids = [c.id for c in model_check.MODEL_CASES]
    assert E4M3.id == "gemma3_text-kv_fp8_e4m3" and E5M2.id == "gpt_oss-page4-kv_fp8_e5m2"
    assert E4M3 in model_check.MODEL_CASES and E5M2 in model_check.MODEL_CASES
    assert ids[-2:] == [E4M3.id, E5M2.id]  # after the unquantised cases: the mutants' first failures stay


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["default", "bfloat16"])
@pytest.mark.parametrize("case", [E4M3, E5M2], ids=lambda c: c.id)
def test_the_reference_backend_passes(case, dtype):
    case = dataclasses.replace(case, dtype=dtype)
    driver = model_check.run_model_case(case, ReferenceBackend, "cpu", CAPS)
    assert driver.runner.pool.dtype == case.kv_dtype
    assert driver.runner.dtype == (dtype or torch.float32)  # None: the default dtype, float32 here


class _Scales:
    """A pool seen through a mutant: every attribute the pool's, but ``kv_scales`` changed."""

    def __init__(self, pool, change):
        self._pool, self._change = pool, change

    def __getattr__(self, name):
        return getattr(self._pool, name)

    def kv_scales(self, layer_id):
        return self._change(self._pool, layer_id)


def _mutant(name, change):
    class Mutant(ReferenceBackend):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.pool = _Scales(self.pool, change)

    Mutant.__name__ = Mutant.name = name
    return Mutant


def _ones(pool, layer):
    k, v = pool.kv_scales(layer)
    return torch.ones_like(k), torch.ones_like(v)


MUTANTS = {
    "ScaleIgnored": _mutant("ScaleIgnored", _ones),
    "LayerZeroScales": _mutant("LayerZeroScales", lambda pool, layer: pool.kv_scales(0)),
    "HeadsSwapped": _mutant("HeadsSwapped", lambda pool, layer: tuple(s.flip(0) for s in pool.kv_scales(layer))),
    "KForV": _mutant("KForV", lambda pool, layer: pool.kv_scales(layer)[::-1]),
}


class NoSaturation(ReferenceBackend):
    """Stores ``fp8(x / s)`` without the clamp: a value past the format's range becomes an
    infinity in e5m2."""

    name = "nosaturation"

    def _store_kv(self, layer_id, is_swa, k, v, md, **kwargs):
        loc = (md.swa_store_loc if is_swa else md.full_store_loc).long()
        for cache, x, scale in zip(self.pool.get_kv_buffer(layer_id), (k, v), self.pool.kv_scales(layer_id)):
            keep = (loc >= 1) & (loc < cache.shape[0])
            idx = torch.where(keep, loc, 0)
            rows = (x.float() / scale[:, None]).to(cache.dtype).view(torch.uint8)
            raw = cache.view(torch.uint8)
            raw[idx] = torch.where(keep[:, None, None], rows, raw[0])


def _fails(case, backend_cls):
    with pytest.raises(pytest.fail.Exception) as err:
        model_check.run_model_case(case, backend_cls, "cpu", CAPS)
    message = str(err.value)
    assert message.startswith(MODEL) and case.id.split("-")[0] in message, message
    return message


@pytest.mark.parametrize("name", sorted(MUTANTS))
@pytest.mark.parametrize("case", [E4M3, E5M2], ids=lambda c: c.id)
def test_fp8_bugs_fail_the_check(case, name):
    message = _fails(case, MUTANTS[name])
    assert "the reference backend over the same FP8 KV cache" in message


def test_a_store_without_saturation_fails_in_e5m2():
    assert "non-finite logits" in _fails(E5M2, NoSaturation)


def test_in_bfloat16_the_cache_catches_what_the_logits_let_through():
    case = dataclasses.replace(E4M3, dtype=torch.bfloat16)
    message = _fails(case, MUTANTS["LayerZeroScales"])
    assert "are not on the reference's scale" in message and "layer 1" in message


class OtherRounding(ReferenceBackend):
    """Attention whose output rounds otherwise than the reference's (scaled by 1 + 2**-8 before
    rounding to bfloat16: about one step in many elements, as a kernel accumulating in another
    order does): every later layer's k/v moves across FP8 rounding boundaries here and there."""

    name = "otherrounding"

    def forward(self, q, k, v, layer_id, batch, save_kv_cache=True, **kwargs):
        out = super().forward(q, k, v, layer_id, batch, save_kv_cache, **kwargs)
        return (out.float() * (1 + 2**-8)).to(out.dtype)


def test_a_backend_that_rounds_otherwise_passes_in_bfloat16():
    """No false alarm: the later layers' bytes differ from the reference's (their k/v are not
    the same), the first layer's and every layer's scale do not."""
    case = dataclasses.replace(E4M3, dtype=torch.bfloat16)
    driver = model_check.run_model_case(case, OtherRounding, "cpu", CAPS)
    twin = model_check.run_model_case(case, ReferenceBackend, "cpu", CAPS)
    pool, ref = driver.runner.pool, twin.runner.pool
    assert model_check.same_bytes(pool, ref, 0) == 1.0
    assert min(model_check.same_bytes(pool, ref, layer) for layer in range(1, pool.num_layers)) < 0.95
    assert not model_check.norm_departures(pool, ref, model_check.FP8_NORM_TOL)


def test_the_looser_judgement_against_unquantised_attention_can_fail(monkeypatch):
    """Scales so small that nearly every value saturates: the backend still stores the
    reference's bytes (the strict judgement passes), but the logits are no longer the model's."""
    monkeypatch.setattr(model_check, "FP8_SATURATE_AT", 0.01)
    message = _fails(E4M3, ReferenceBackend)
    assert "with transformers eager float32 (unquantised)" in message and "minimum 0.96" in message


def test_a_backend_without_the_fp8_dtype_is_skipped_naming_the_capability():
    caps = dataclasses.replace(CAPS, fp8_kv_dtypes=(torch.float8_e4m3fn,))
    with pytest.raises(pytest.skip.Exception) as err:
        model_check.run_model_case(E5M2, ReferenceBackend, "cpu", caps)
    assert "an FP8 KV cache of float8_e5m2 (capabilities: fp8_kv_dtypes = float8_e4m3fn)" in str(err.value)
