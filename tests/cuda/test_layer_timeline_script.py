"""benchmarks/layer_timeline.py on the host: its stamps still fit the kernel's source (every
anchor found, the stamped kernel takes a trace buffer) and its per-layer arithmetic (the GPU
run itself needs an sm_90 device)."""

import inspect

import pytest
import torch

from scripts import load_script

pytest.importorskip("triton")


def _script():
    return load_script("layer_timeline")


def test_the_stamps_fit_the_kernel_source():
    stamped = _script().instrumented_store_attend()
    kernel = stamped._store_attend_kernel
    assert "Trace" in kernel.arg_names and "TRACE" in kernel.arg_names
    assert inspect.getsource(kernel.fn).count("_stamp(") == 6
    assert "trace" in stamped.store_attend.__code__.co_varnames


def test_a_missing_anchor_is_named(monkeypatch):
    script = _script()
    monkeypatch.setattr(script, "_EDITS", script._EDITS + (("no such line in the kernel", ""),))
    with pytest.raises(RuntimeError, match="no such line"):
        script.instrumented_store_attend()


def test_phases_and_period_from_stamps():
    script = _script()
    # three layers (SWA, full, SWA), two programs each; stamps in ns: entry, prologue done,
    # wait returned, blocks done, ticket taken, merge done (0: this program did not merge)
    layer = lambda t0: [  # noqa: E731
        [t0, t0 + 100, t0 + 1000, t0 + 1600, t0 + 2400, 0, 0, 0],
        [t0 + 50, t0 + 150, t0 + 1000, t0 + 1800, t0 + 2600, t0 + 3300, 0, 0],
    ]
    trace = torch.tensor([layer(0), layer(4000), layer(9000)], dtype=torch.int64)
    layers = script._layers(trace)
    assert layers[1]["wait"] == 5000 and layers[1]["end"] == 7300 and layers[1]["merge"] == 700
    full = script.summary(layers, [True, False, True])["full"]
    assert full["programs"] == 2
    assert full["period"] == 5000  # the next layer's first wait (10000) - this one's (5000)
    assert full["end_to_next_wait"] == 2700


def test_variants_parse_into_every_layer_full_and_swa_keys():
    script = _script()
    label, (every, full, swa) = script.parse_variant("regs128 maxnreg=128 full.num_splits=4 swa.BLOCK_N=64")
    assert label == "regs128"
    assert every == {"maxnreg": 128} and full == {"num_splits": 4} and swa == {"BLOCK_N": 64}
    # a variant stacks on the --config* plan: its keys win, the others stay
    stacked = script._stacked(({"num_stages": 1}, {"num_splits": 2}, {}), (every, full, swa))
    assert stacked == ({"num_stages": 1, "maxnreg": 128}, {"num_splits": 4}, {"BLOCK_N": 64})
    for bad in ("maxnreg=128", "w4 num_warps=four", "w4 num_warps"):
        with pytest.raises(ValueError, match="KEY=INT|label"):
            script.parse_variant(bad)
