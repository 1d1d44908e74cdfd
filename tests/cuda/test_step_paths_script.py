"""benchmarks/step_paths.py on the host: its path syntax, how a path routes the backend's
layers (plan keys per kind of layer, PDL flags) and the per-layer periods it reads from a
profile (the timed graphs themselves need a CUDA GPU)."""

import pytest

from scripts import load_script

pytest.importorskip("triton")


def _script():
    return load_script("step_paths")


def test_parse_path():
    script = _script()
    label, path, (every, full, swa) = script.parse_path("n128 one BLOCK_N=128 swa.num_stages=1 prologue=0")
    assert (label, path) == ("n128", "one")
    assert every == {"BLOCK_N": 128, "prologue": 0} and full == {} and swa == {"num_stages": 1}
    for bad in ("one", "x nowhere", "BLOCK_N=1 one"):
        with pytest.raises(ValueError, match="LABEL PATH"):
            script.parse_path(bad)


class _Backend:
    pdl_prologue = True
    pdl_release_early = True
    paged_attention_stores = True
    kv_store_impl = "triton"

    def __init__(self):
        self.calls = []
        self._paged_attention = lambda *a, config=None, **kw: self.calls.append(("two", kw["window"], config))
        self._store_attend = lambda *a, config=None, **kw: self.calls.append(("one", kw["window"], config))


def test_route_sets_plan_keys_per_kind_of_layer_and_the_pdl_flags():
    script = _script()
    path = "x two BLOCK_N=32 swa.num_splits=2 full.num_warps=8 prologue=0 release_early=0 paged_store=0"
    configs = script.parse_path(path)[2]
    backend = _Backend()
    script.route(backend, "two", configs)
    assert backend.pdl_prologue is False and backend.pdl_release_early is False
    assert backend.paged_attention_stores is False
    # the parsed path is left as it was
    assert configs[0] == {"BLOCK_N": 32, "prologue": 0, "release_early": 0, "paged_store": 0}
    assert backend._fused_eligible() is False
    backend._paged_attention(window=None)
    backend._paged_attention(window=256)
    assert backend.calls == [
        ("two", None, {"BLOCK_N": 32, "num_warps": 8}),
        ("two", 256, {"BLOCK_N": 32, "num_splits": 2}),
    ]
    plain = _Backend()
    script.route(plain, "store+one", script.parse_path("y store+one")[2])
    assert plain.pdl_prologue is True and plain.kv_store_impl == "triton-separate"
    assert plain.paged_attention_stores is True
    assert plain._fused_eligible() is True
    plain._store_attend(window=None)
    assert plain.calls == [("one", None, None)]  # no keys: the kernel's own plan


def test_layer_periods():
    script = _script()
    # four layers (SWA, full, SWA, full): store, attention (and a combine on full layers)
    kernels, t = [], 0.0
    for swa in (True, False, True, False):
        kernels.append(("kv_store_kernel", t, 2.0))
        kernels.append(("_paged_attention_kernel", t + 2.0, 10.0 if swa else 30.0))
        if not swa:
            kernels.append(("_combine_kernel", t + 32.0, 3.0))
        t += 13.0 if swa else 36.0
    periods = script.layer_periods(kernels, [True, False, True, False])
    assert periods["swa"]["period_us"] == 13.0  # layer 2 only: the first and last are left out
    assert periods["full"]["period_us"] == 36.0  # layer 1
    assert periods["full"]["kernels_us"] == {
        "kv_store_kernel": 2.0,
        "_paged_attention_kernel": 30.0,
        "_combine_kernel": 3.0,
    }
    with pytest.raises(RuntimeError, match="4 layers in the profile, the step has 3"):
        script.layer_periods(kernels, [True, False, True])
