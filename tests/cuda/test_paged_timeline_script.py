"""benchmarks/paged_timeline.py on the host: its stamps still fit ``paged_attention``'s source
(every anchor found, the stamped kernel takes a trace buffer) and its per-layer arithmetic
(the GPU run itself needs an sm_90 device)."""

import inspect

import pytest
import torch

from scripts import load_script

pytest.importorskip("triton")


def _script():
    return load_script("paged_timeline")


def test_the_stamps_fit_the_kernel_source():
    stamped = _script().instrumented_paged_attention()
    kernel = stamped._paged_attention_kernel
    assert "Trace" in kernel.arg_names and "TRACE" in kernel.arg_names
    source = inspect.getsource(kernel.fn)
    assert source.count("_stamp(") == 4 and source.count("_stamp_sm(") == 1
    assert "trace" in stamped.paged_attention.__code__.co_varnames


def test_a_missing_anchor_is_named(monkeypatch):
    script = _script()
    monkeypatch.setattr(script, "_EDITS", script._EDITS + (("no such line in the kernel", ""),))
    with pytest.raises(RuntimeError, match="no such line"):
        script.instrumented_paged_attention()


def _program(t0, wait, blocks, end, sm):
    return [t0, wait, wait + blocks, end, sm, 0, 0, 0]


def test_phases_from_stamps():
    script = _script()
    # three layers (SWA, full, SWA), two programs each, ns: entry, wait, blocks done, end, SM
    trace = torch.tensor(
        [
            [_program(100, 1000, 3000, 5000, 0), _program(200, 1000, 2000, 4000, 1)],
            [_program(4500, 5500, 6000, 12000, 0), _program(4800, 5500, 5000, 11000, 1)],
            [_program(11500, 12500, 3000, 16000, 0), _program(11600, 12600, 3000, 16500, 1)],
        ],
        dtype=torch.int64,
    )
    full = script.summary(trace, [True, False, True])["full"]
    assert full["layers"] == 1
    assert full["entry_med"] == pytest.approx(-0.5)  # median of 4500 and 4800 (torch: the lower) - 5000
    assert full["wait_first"] == pytest.approx(0.5)  # 5500 - the previous layer's last end (5000)
    assert full["blocks_med"] == pytest.approx(5.0)
    assert (full["end_first"], full["end_last"]) == (pytest.approx(5.5), pytest.approx(6.5))
    assert full["period"] == pytest.approx(7.0)  # the next layer's first wait (12500) - 5500


def test_end_spread_groups_programs_by_their_sm():
    script = _script()
    # one layer, four programs: SM 0 holds three (ends 3, 4, 5 us), SM 1 one (end 2 us)
    layer = [_program(100, 1000, 1000, 1000 + us * 1000, sm) for us, sm in ((3, 0), (4, 0), (5, 0), (2, 1))]
    other = [_program(100, 1000, 1000, 1000 + us * 1000, sm) for us, sm in ((6, 0), (6, 0), (6, 0), (1, 1))]
    trace = torch.tensor([layer, other], dtype=torch.int64)
    spread = script.end_spread(trace, [0, 1], num_sms=2)
    first = spread["layers"][0]
    assert first["end_quantiles"][0] == 2.0 and first["end_quantiles"][-1] == 5.0
    assert first["by_programs_an_sm"] == {1: dict(programs=1, mean_end=2.0), 3: dict(programs=3, mean_end=4.0)}
    assert spread["sm_mean_end_correlation"] == pytest.approx(1.0)  # SM 0 lags in both layers


def test_plan_keys_parse_as_ints():
    script = _script()
    assert script._parse(["TABLE=1", "BLOCK_N=32"]) == {"TABLE": 1, "BLOCK_N": 32}
    for bad in (["BLOCK_N"], ["BLOCK_N=x"], ["=3"]):
        with pytest.raises(ValueError, match="KEY=INT"):
            script._parse(bad)
