"""check_softcap_and_sinks — logit soft-capping and attention sinks follow their formulas.

Logits are ``s = scaling * q.k``. A backend built with ``logit_softcap=c`` caps them to
``c * tanh(s / c)`` before masking and softmax; ``forward(..., sinks=...)`` (float32
``[num_heads]``, natural-log units) adds ``exp(sink_h - m)`` to head ``h``'s softmax
denominator and nothing to the numerator. Every step the backend runs here is compared with
attention computed in float64 from the tokens' history (``attnplug.oracle.exact_attention``,
the same formula written independently of any backend): relative error
``||out - exact|| / max(||exact||, 1e-3 * sqrt(head_dim))`` per (token, layer, head) within
``LONG_TOL`` of the dtype (the floor: a sink that takes nearly all of a head's weight leaves an
output far below the values' size, which a half-precision output may round to zero).

Cases, each skipped only when the backend declares it lacks a feature it uses
(``capabilities().logit_softcap`` / ``capabilities().attention_sinks``):

* ``modes``: EXTEND (prompts), DECODE, EXTEND on a cached prefix (chunked prefill),
  TARGET_VERIFY and DRAFT_EXTEND on a 4-layer world (3 SWA layers with a window smaller than
  the sequences, 1 full layer), a cap of 1.5 (comparable to the logits: a cap taken in the
  wrong units or skipped on some key blocks shows) and sinks of the size of real ones;
* ``large_logits``: both features with ``scaling=4`` and a cap of 30 (Gemma2's value), where
  the uncapped softmax would be nearly one-hot;
* ``kv_split``: both features, DECODE and TARGET_VERIFY of one request over 700 keys and a
  short one, window 300: long enough that a kernel splits the KV range (flash-decoding), so
  a sink added once per split instead of once per head shows;
* ``graphs``: both features, every mode of the declared graph level replayed through
  ``GraphRunner`` (a batch padded up to its bucket, two consecutive steps);
* ``undeclared_refused``: where a backend declares a feature False it must refuse it — the
  constructor raises ``BackendConfigError`` for ``logit_softcap``, ``forward`` raises naming
  ``sinks`` and leaves the KV cache untouched — never ignore it silently.

Every case also runs over each declared FP8 cache (``...-kv_fp8_e4m3``), judged against float64
attention over the dequantised cache with the model dtype's bound.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import pytest
import torch

from attnplug import BackendConfigError, ForwardMode
from attnplug_conformance.exact import LONG_TOL, assert_matches_exact, dense_attention
from attnplug_conformance.long_context import long_context_world
from attnplug_conformance.rules import FEATURES
from attnplug_conformance.support import (
    base_config,
    conformance_check,
    dtype_name,
    graph_modes,
    kv_axis,
    new_tokens_of,
    require,
    same_bits,
)

__all__ = ["check_softcap_and_sinks", "CASES"]

#: a cap comparable to the logits of the suite's random inputs (about N(0, 1))
SMALL_CAP = 1.5
#: Gemma2's ``attn_logit_softcapping``, with ``LARGE_SCALING`` making logits of its size
LARGE_CAP, LARGE_SCALING = 30.0, 4.0


@dataclass(frozen=True)
class Case:
    id: str
    kind: str  # modes / large_logits / kv_split / graphs / undeclared_refused
    softcap: bool = False
    sinks: bool = False


CASES = [
    Case("softcap-modes", "modes", softcap=True),
    Case("sinks-modes", "modes", sinks=True),
    Case("softcap_sinks-kv_split", "kv_split", softcap=True, sinks=True),
    Case("softcap_sinks-large_logits", "large_logits", softcap=True, sinks=True),
    Case("softcap_sinks-graphs", "graphs", softcap=True, sinks=True),
    Case("undeclared_refused", "undeclared_refused"),
]


def _require_features(caps, case: Case) -> None:
    if case.softcap:
        require(caps.logit_softcap, "capabilities().logit_softcap is False: logit soft-capping is not claimed")
    if case.sinks:
        require(caps.attention_sinks, "capabilities().attention_sinks is False: attention sinks are not claimed")


def _features(case: Case) -> str:
    return " + ".join(n for n, on in (("soft-cap", case.softcap), ("sinks", case.sinks)) if on)


def _compare(out: torch.Tensor, exact: torch.Tensor, world, what: str) -> None:
    assert_matches_exact(
        out,
        exact,
        world,
        what,
        rule=FEATURES,
        hint=f"logits c * tanh(scaling * q.k / c) with c = {world.spec.logit_softcap}, sinks "
        f"{'in each head denominator, once' if world.sinks is not None else 'none'}",
    )


def _run(world, reqs, plan: Sequence, what: str, runner=None) -> None:
    """Run ``plan`` (``(mode, new tokens or drafts)`` pairs) on the backend, each step compared
    with float64 attention, then committed and evicted."""
    for mode, arg in plan:
        step = world.plan(
            mode,
            reqs,
            arg if mode is ForwardMode.EXTEND else None,
            num_draft_tokens=arg if mode.is_speculative else None,
        )
        exact = dense_attention(world, step)
        out = runner.run(step.batch, step.inputs).clone() if runner is not None else world.run_eager(step)
        world.backend.synchronize(world.device)
        path = "replayed" if runner is not None and runner.bucket_for(step.batch) is not None else "eager"
        _compare(out, exact, world, f"{mode.name} step ({what}, {path})")
        world.advance(step)


def _modes(cfg, make_world, case: Case, *, scaling: Optional[float] = None, cap: float = SMALL_CAP) -> None:
    spec = cfg.spec(
        logit_softcap=cap if case.softcap else None,
        sinks=case.sinks,
        scaling=scaling,
    )
    world = make_world(spec, 61)
    reqs = [world.new_request() for _ in range(3)]
    plan = [
        (ForwardMode.EXTEND, [5, 12, 9]),
        (ForwardMode.DECODE, None),
        (ForwardMode.EXTEND, [3, 1, 6]),
        (ForwardMode.TARGET_VERIFY, 3),
        (ForwardMode.DRAFT_EXTEND, 2),
    ]
    _run(world, reqs, plan, _features(case))


def _kv_split(cfg, make_world, case: Case) -> None:
    lengths = (700, 23)
    world, reqs = long_context_world(cfg, make_world, lengths, seed=67, window=300, logit_softcap=SMALL_CAP, sinks=True)
    plan = [(ForwardMode.DECODE, None), (ForwardMode.TARGET_VERIFY, 3)]
    _run(world, reqs, plan, f"{_features(case)} over {lengths[0]} keys")


def _graphs(cfg, make_world, case: Case, caps) -> None:
    modes = graph_modes(caps.graphs)
    require(bool(modes), f"capabilities().graphs is {caps.graphs.name}: nothing is replayed")
    for mode in modes:
        world = make_world(cfg.spec(logit_softcap=SMALL_CAP, sinks=True), 71)
        reqs = world.prefill([5, 12, 9])
        _, ndt = new_tokens_of(mode, 3)
        runner = world.graph_runner(max_bs=4, num_draft_tokens=ndt, bucket_sizes=[1, 2, 4], modes=[mode])
        _run(world, reqs, [(mode, ndt)] * 2, f"{_features(case)}, 3 requests padded to a bucket of 4", runner)


def _undeclared_refused(cfg, make_world, caps) -> None:
    require(
        not (caps.logit_softcap and caps.attention_sinks),
        "the backend declares logit_softcap and attention_sinks: nothing to refuse",
    )
    if not caps.logit_softcap:
        try:
            make_world(cfg.spec(logit_softcap=SMALL_CAP), 73)
        except BackendConfigError as exc:
            if "logit_softcap" not in str(exc):
                pytest.fail(f"{FEATURES}: the BackendConfigError for logit_softcap does not name it: {exc}")
        else:
            pytest.fail(
                f"{FEATURES}: capabilities().logit_softcap is False but the backend accepted "
                f"logit_softcap={SMALL_CAP} (it must raise BackendConfigError, never ignore the cap)"
            )
    if not caps.attention_sinks:
        world = make_world(cfg.spec(), 73)
        reqs = [world.new_request() for _ in range(2)]
        step = world.plan(ForwardMode.EXTEND, reqs, [5, 9])
        world.backend.init_forward_metadata(step.batch)
        before = world.snapshot_kv()
        sinks = torch.zeros(world.spec.num_heads, dtype=torch.float32, device=world.device)
        inputs = step.inputs
        try:
            world.backend.forward(inputs["q"][:, 0], inputs["k"][:, 0], inputs["v"][:, 0], 0, step.batch, sinks=sinks)
        except (ValueError, TypeError) as exc:
            if "sinks" not in str(exc):
                pytest.fail(f"{FEATURES}: refusing sinks, the error does not name them: {exc}")
        else:
            pytest.fail(
                f"{FEATURES}: capabilities().attention_sinks is False but forward(..., sinks=...) was accepted "
                "(it must refuse them, never ignore them)"
            )
        world.backend.synchronize(world.device)
        for layer, ((k0, v0), (k1, v1)) in enumerate(zip(before, world.snapshot_kv())):
            if not (same_bits(k0, k1) and same_bits(v0, v1)):
                pytest.fail(f"{FEATURES}: forward refused sinks but wrote layer {layer}'s KV cache first")


@conformance_check(rule=FEATURES)
@pytest.mark.parametrize(*kv_axis("case", CASES, [c.id for c in CASES]))
def check_softcap_and_sinks(case, kv_cache_dtype, attnplug_capabilities, attnplug_world):
    """Soft-capped logits and sink logits against float64 attention, or refused when undeclared."""
    caps = attnplug_capabilities
    cfg = base_config(caps, kv_cache_dtype=kv_cache_dtype)
    require(cfg.dtype in LONG_TOL, f"no float64 bound for {dtype_name(cfg.dtype)}")
    if case.kind == "undeclared_refused":
        _undeclared_refused(cfg, attnplug_world, caps)
        return
    _require_features(caps, case)
    if case.kind == "modes":
        _modes(cfg, attnplug_world, case)
    elif case.kind == "large_logits":
        _modes(cfg, attnplug_world, case, scaling=LARGE_SCALING, cap=LARGE_CAP)
    elif case.kind == "kv_split":
        _kv_split(cfg, attnplug_world, case)
    else:
        _graphs(cfg, attnplug_world, case, caps)
