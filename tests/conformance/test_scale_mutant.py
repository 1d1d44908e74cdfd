"""Issue 40, the scale dimension: layer KV buffers past 2**31 elements.

* the capability ``Capabilities.large_kv_buffers`` and the core constructor's rule: a backend
  that does not declare it refuses a pool whose largest layer buffer has more than
  ``2**31 - 1`` elements (pools on the ``meta`` device: no memory);
* the mutant ``mutants.scale:Int32SlotOffsets`` (keys and values read at 32-bit element
  offsets) is right below the boundary and (slow, where the host has the memory) wrong past it,
  against float64 attention, while the reference is right in the same world;
* (slow) ``check_large_kv_buffers`` fails it naming its rule, passes the reference, and its
  ``undeclared_refused`` case passes a backend that refuses the pool and fails one that accepts
  it. (The rest of the suite passes the mutant: shown once, 2026-12-06, by a whole-suite run
  without this check, too costly to repeat in every test run.)

The slow tests each build pools of about 8.7 GB on the host (``attnplug_conformance.scale``)
and skip, naming the bytes needed and free, where it has less than 1 / 0.6 of that free; run
them one at a time (``-p no:xdist``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import suite_runs
from attnplug import BackendConfigError, Capabilities, ForwardMode, GraphSupport, ReqToTokenPool, SWAKVPool
from attnplug.backends.reference import ReferenceBackend
from attnplug.input_checks import INT32_MAX_ELEMENTS, largest_kv_buffer_elements
from attnplug.registry.probing import capabilities_problem
from attnplug_conformance.exact import LONG_TOL, dense_attention, row_errors
from attnplug_conformance.harness import World
from attnplug_conformance.rules import SCALE
from attnplug_conformance.scale import PROMPTS, STEPS, hold_below, release, require_memory, scale_layout
from child import HANG_LIMIT_S
from mutants.scale import (
    AcceptsUndeclaredLargeKvBuffers,
    Int32SlotOffsets,
    UndeclaredLargeKvBuffers,
    int32_offsets,
)

CHECK = "check_large_kv_buffers"
HOST = torch.device("cpu")


def _target(cls) -> str:
    return f"mutants.scale:{cls.__name__}"


# ---------------------------------------------------------------------------- the capability
def test_capability_defaults_to_false_and_is_in_the_json():
    old_style = Capabilities("cpu", False, False, GraphSupport.NEVER, (torch.float32,), (64,), (1,), True)
    assert old_style.large_kv_buffers is False
    assert json.loads(json.dumps(old_style.to_json()))["large_kv_buffers"] is False
    assert dataclasses.replace(old_style, large_kv_buffers=True).to_json()["large_kv_buffers"] is True


def test_portable_backends_declare_it():
    """The reference and the plugins that run the portable PyTorch path (int64 slot tables);
    not ascend, whose fused attention needs each cache tensor's element count in int32."""
    from attnplug_ascend.backend import AscendBackend

    assert ReferenceBackend.declared_capabilities().large_kv_buffers is True
    assert ReferenceBackend.describe()["large_kv_buffers"] is True
    assert AscendBackend.declared_capabilities().large_kv_buffers is False


def test_probing_refuses_a_wrong_typed_flag():
    caps = dataclasses.replace(ReferenceBackend.declared_capabilities(), large_kv_buffers="yes")
    assert "large_kv_buffers='yes' (a str), expected True or False" in capabilities_problem(caps)


# ---------------------------------------------------------------------------- the constructor's rule
def _meta_pools(size: int, *, size_swa: int = 256, swa_layers=(0,), page_size: int = 64):
    """Pools of 8 KV heads x head_dim 16 (rows of 128 elements) on the ``meta`` device: shapes
    without memory."""
    pool = SWAKVPool(size, size_swa, 2, swa_layers, 8, 16, torch.float16, "meta", page_size=page_size)
    return pool, ReqToTokenPool(4, 64, "meta")


class _DeclaresNothing(ReferenceBackend):
    """A backend without a class-level declaration (``capabilities()`` only)."""

    @classmethod
    def declared_capabilities(cls):
        return None

    def capabilities(self):
        return ReferenceBackend.declared_capabilities().for_instance(device_type=self.device.type)


@pytest.mark.parametrize("cls", [UndeclaredLargeKvBuffers, _DeclaresNothing], ids=["declares_false", "declares_none"])
def test_a_backend_without_the_flag_refuses_a_pool_past_the_limit(cls):
    pool, rows = _meta_pools(2**24 - 64)  # 2**24 rows of 128 elements: 2**31
    assert largest_kv_buffer_elements(pool) == 2**31 == INT32_MAX_ELEMENTS + 1
    with pytest.raises(BackendConfigError) as info:
        cls(pool, rows, num_heads=16, sliding_window=8)
    text = str(info.value)
    assert "2147483648 elements" in text and "large_kv_buffers" in text
    assert "16777216 slots x 8 KV heads x head_dim 16" in text


def test_a_backend_without_the_flag_accepts_a_pool_at_the_limit():
    pool, rows = _meta_pools(2**24 - 128)  # the largest multiple of the page: 2**31 - 8192 elements
    assert largest_kv_buffer_elements(pool) <= INT32_MAX_ELEMENTS
    UndeclaredLargeKvBuffers(pool, rows, num_heads=16, sliding_window=8)


def test_the_largest_buffer_counts_even_on_an_swa_layer():
    pool, rows = _meta_pools(256, size_swa=2**24 - 64)
    assert largest_kv_buffer_elements(pool) == 2**31
    with pytest.raises(BackendConfigError, match="large_kv_buffers"):
        UndeclaredLargeKvBuffers(pool, rows, num_heads=16, sliding_window=8)
    pool, rows = _meta_pools(2**24 - 64, swa_layers=(0, 1))  # no full layer: the full pool has no buffer
    UndeclaredLargeKvBuffers(pool, rows, num_heads=16, sliding_window=8)


def test_a_backend_declaring_the_flag_accepts_the_pool():
    pool, rows = _meta_pools(2**25)
    ReferenceBackend(pool, rows, num_heads=16, sliding_window=8)


# ---------------------------------------------------------------------------- the mutant
def test_int32_offsets_wrap_only_past_the_limit():
    slots = torch.tensor([0, 1, 2**24 - 1, 2**24, 2**24 + 1, 2**25])
    got = int32_offsets(slots, 128).tolist()
    assert got[:3] == [0, 128, 2**31 - 128]
    assert got[3:] == [-(2**31), -(2**31) + 128, 0]


def _step_errors(world: World, first_slot: int = 0):
    """Prompts ``PROMPTS`` stored directly, then ``STEPS`` on the world's backend and on the
    reference over the same pool: per step ``(mode, backend's worst relative error, reference's)``
    against float64 attention."""
    reqs = [world.new_request() for _ in PROMPTS]
    prompt = world.plan(ForwardMode.EXTEND, reqs, list(PROMPTS))
    assert int(prompt.batch.out_cache_loc.min()) >= first_slot
    world.store_kv(prompt)
    world.advance(prompt)
    errors = []
    for mode, new in STEPS:
        step = world.plan(mode, reqs, list(new) if new is not None else None)
        exact = dense_attention(world, step)
        out = world.run_eager(step)  # the backend stores the step's k/v, then attends
        ref = world.run_eager(step, world.reference_backend, save_kv_cache=False)
        errors.append((mode.name, float(row_errors(out, exact).max()), float(row_errors(ref, exact).max())))
        world.advance(step)
    return errors


def test_mutant_is_right_below_the_boundary():
    layout = scale_layout(Int32SlotOffsets.declared_capabilities())
    spec = dataclasses.replace(layout.spec, size=4096, size_swa=2048)  # the same world, a small pool
    world = World(spec, Int32SlotOffsets, HOST, seed=5)
    bound = LONG_TOL[spec.dtype]
    for mode, err, ref in _step_errors(world):
        assert err <= bound and ref <= bound, f"{mode}: mutant {err:.3g}, reference {ref:.3g} (bound {bound:g})"


@pytest.mark.slow
def test_mutant_is_wrong_past_the_boundary():
    """The scale world on the host: every request slot past element 2**31 of the full layer's
    buffers. The mutant is out of bounds in every step; the reference, over the same pool, within."""
    layout = scale_layout(Int32SlotOffsets.declared_capabilities())
    require_memory(layout, HOST)
    world = World(layout.spec, Int32SlotOffsets, HOST, seed=5)
    try:
        hold_below(world, layout.first_page)
        errors = _step_errors(world, layout.first_slot)
    finally:
        release(world.pool)
    bound = LONG_TOL[layout.spec.dtype]
    for mode, err, ref in errors:
        assert err > bound, f"{mode}: the mutant is within bounds past the boundary ({err:.3g} <= {bound:g})"
        assert ref <= bound, f"{mode}: the reference is out of bounds past the boundary ({ref:.3g} > {bound:g})"


# ---------------------------------------------------------------------------- the suite
def _outcomes(target: str, keyword: str = f"{CHECK} and {suite_runs.WITHOUT_FP8_AXIS}"):
    """``{case id: TestResult}`` of the suite's tests matching ``keyword`` against ``target``
    (default: the check with the model's cache; an FP8 case's id ends in its cache,
    ``past_2_31-kv_fp8_e4m3``)."""
    results, _ = suite_runs.run_suite(target, keyword, large_buffers=True)
    return {nodeid.split("[", 1)[1].rstrip("]")[len(target) + 1 :]: r for nodeid, r in results.items()}


def _skip_when_short_of_memory(result) -> None:
    if result.outcome == "skipped" and ("bytes" in result.message and "free" in result.message):
        pytest.skip(f"{CHECK} could not build its pools here: {result.message}")


@pytest.mark.slow
def test_check_fails_the_mutant_naming_the_rule():
    cases = _outcomes(_target(Int32SlotOffsets))
    _skip_when_short_of_memory(cases["past_2_31"])
    assert cases["past_2_31"].outcome == "failed", cases["past_2_31"]
    message = cases["past_2_31"].message
    assert message.startswith(SCALE) and "relative error" in message and "32 bits" in message, message
    assert cases["undeclared_refused"].outcome == "skipped"
    assert "large_kv_buffers is True" in cases["undeclared_refused"].message


@pytest.mark.slow
def test_check_passes_the_reference():
    cases = _outcomes("reference")
    _skip_when_short_of_memory(cases["past_2_31"])
    assert cases["past_2_31"].outcome == "passed", cases["past_2_31"]
    assert cases["undeclared_refused"].outcome == "skipped"


@pytest.mark.slow
def test_check_passes_the_reference_over_an_fp8_cache():
    """The same element count at one byte an element (about 4.4 GB): the FP8 axis' case."""
    cases = _outcomes("reference", f"{CHECK} and kv_fp8_e4m3")
    _skip_when_short_of_memory(cases["past_2_31-kv_fp8_e4m3"])
    assert cases["past_2_31-kv_fp8_e4m3"].outcome == "passed", cases["past_2_31-kv_fp8_e4m3"]
    assert cases["undeclared_refused-kv_fp8_e4m3"].outcome == "skipped"


@pytest.mark.slow
def test_undeclared_refused_passes_a_backend_that_refuses_the_pool():
    cases = _outcomes(_target(UndeclaredLargeKvBuffers))
    _skip_when_short_of_memory(cases["undeclared_refused"])
    assert cases["undeclared_refused"].outcome == "passed", cases["undeclared_refused"]
    assert cases["past_2_31"].outcome == "skipped" and "large_kv_buffers is False" in cases["past_2_31"].message


@pytest.mark.slow
def test_undeclared_refused_fails_a_backend_that_accepts_the_pool():
    cases = _outcomes(_target(AcceptsUndeclaredLargeKvBuffers))
    _skip_when_short_of_memory(cases["undeclared_refused"])
    result = cases["undeclared_refused"]
    assert result.outcome == "failed" and result.message.startswith(SCALE), result
    assert "accepted a pool" in result.message


@pytest.mark.slow
def test_cuda_kernels_pass_the_check():
    """The cuda backend's kernels (on a GPU, or under the Triton interpreter on the host) in
    ``check_large_kv_buffers``' world, in a child process (a wrapped address can kill it). Here,
    beside the other tests that build the 8.7 GB world, so that one worker runs them one after
    another."""
    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs a GPU or the Triton interpreter")
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(repo / "tests"), os.environ.get("PYTHONPATH", "")]))
    args = ["--attnplug-backend", "attnplug_cuda.backend:CudaBackend", "--attnplug-device", device]
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", *args, "-rs"]
        + ["-k", "check_large_kv_buffers and past_2_31"],
        capture_output=True,
        text=True,
        timeout=HANG_LIMIT_S,
        env=env,
        cwd=repo,
    )
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert " passed" in res.stdout or " skipped" in res.stdout, res.stdout[-2000:]
