"""Logit soft-capping and attention sinks in the reference and portable backends: every mode
(SWA and full layers, eager and replayed) against float64 attention, the capability flags,
and bad inputs refused naming the argument with the KV cache untouched."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import softcap_sinks_cases as cases
from attnplug import Capabilities, ForwardMode, GraphSupport
from attnplug.backends.portable import PortableBackend
from attnplug.backends.reference import ReferenceBackend
from worlds import small_spec

SPEC = small_spec(scramble_swa=True)  # 3 SWA layers (window 4, smaller than the sequences) + 1 full
BACKENDS = [ReferenceBackend, PortableBackend]


@pytest.mark.parametrize("cls", BACKENDS, ids=lambda c: c.name)
@pytest.mark.parametrize(
    "features",
    [dict(logit_softcap=1.5), dict(sinks=True), dict(logit_softcap=30.0, sinks=True, scaling=4.0)],
    ids=["softcap", "sinks", "both-large-logits"],
)
def test_matches_float64(cls, features):
    cases.check_matches_float64(dataclasses.replace(SPEC, **features), cls, "cpu")


def test_graph_replay_matches_float64():
    spec = dataclasses.replace(SPEC, logit_softcap=1.5, sinks=True)
    modes = (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY)
    worst = cases.errors_against_float64(spec, ReferenceBackend, "cpu", runner_modes=modes)
    assert max(worst) <= cases.TOL[spec.dtype], worst


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype):
    spec = dataclasses.replace(SPEC, dtype=dtype, logit_softcap=1.5, sinks=True)
    assert max(cases.errors_against_float64(spec, ReferenceBackend, "cpu")) <= cases.TOL[dtype]


@pytest.mark.parametrize("cls", BACKENDS, ids=lambda c: c.name)
def test_bad_logit_softcap_is_refused_naming_it(cls):
    cases.bad_construction(cls, SPEC, "cpu")


@pytest.mark.parametrize("cls", BACKENDS, ids=lambda c: c.name)
def test_bad_sinks_are_refused_before_any_store(cls):
    cases.bad_sinks(cls, SPEC, "cpu")


def test_undeclared_features_are_refused():
    cases.undeclared_refused(ReferenceBackend, SPEC, "cpu")


def test_capability_flags_default_false_and_show_in_json():
    old_style = Capabilities("cpu", False, False, GraphSupport.NEVER, (torch.float32,), (64,), (1,), True)
    assert old_style.logit_softcap is False and old_style.attention_sinks is False
    data = ReferenceBackend.declared_capabilities().to_json()
    assert data["logit_softcap"] is True and data["attention_sinks"] is True
    json.dumps(data)
    narrowed = ReferenceBackend.declared_capabilities().for_instance(device_type="cpu")
    assert narrowed.logit_softcap and narrowed.attention_sinks
    assert ReferenceBackend.describe()["attention_sinks"] is True


def test_softcap_is_stored_and_defaults_to_none():
    from attnplug_conformance.harness import World

    assert World(SPEC, ReferenceBackend, "cpu").backend.logit_softcap is None
    world = World(dataclasses.replace(SPEC, logit_softcap=50), ReferenceBackend, "cpu")
    assert world.backend.logit_softcap == 50.0 and isinstance(world.backend.logit_softcap, float)
