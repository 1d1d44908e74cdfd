"""benchmarks/layer_skeleton.py on the host: the skeleton kernel computes what its reference says
(splits merged through the ticket, tickets back at zero), a ticket left over from a broken
launch is caught, and variants parse (the GPU run itself needs an sm_90 device)."""

import pytest
import torch

from scripts import load_script

pytest.importorskip("triton")


def _script():
    return load_script("layer_skeleton")


@pytest.mark.parametrize(
    "bs,variant",
    [
        (1, "s1 swa 1"),
        (1, "s8 swa 8"),
        (2, "s2 swa 2 entry=1"),
        (1, "s4 swa 4 early=1"),
        (1, "f16 full 16"),
        (2, "q none 1"),
        (1, "e none 1 noq=1"),
    ],
)
def test_one_launch_matches_its_reference(bs, variant):
    script = _script()
    _, kind, splits, opts = script.parse_variant(variant)
    layer = script.Layer(kind, bs, torch.device("cpu"), torch.Generator().manual_seed(0))
    diff = script.check(layer, splits, opts, torch.device("cpu"))
    assert diff < 0.05  # check() raised if the output was off its reference
    assert int(layer.tickets.sum()) == 0


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the early merge reads partials never written
def test_a_ticket_left_over_is_caught():
    script = _script()
    layer = script.Layer("swa", 1, torch.device("cpu"), torch.Generator().manual_seed(0))
    layer.tickets[3] = 1  # as if an earlier launch had not zeroed it: group 3 merges too early
    with pytest.raises(AssertionError, match="layer skeleton kernel off"):
        script.check(layer, 4, {}, torch.device("cpu"))


def test_variants_parse_and_bad_ones_are_named():
    script = _script()
    assert script.parse_variant("x swa 4 early=1 warps=8") == ("x", "swa", 4, {"early": 1, "warps": 8})
    for bad, match in (
        ("x swa", "LABEL KIND SPLITS"),
        ("x mid 2", "KIND"),
        ("x swa 3", "power of two"),
        ("x swa 32", "power of two"),
        ("x full 4 stages=2", "unknown option"),
        ("x full four", "integers"),
    ):
        with pytest.raises(ValueError, match=match):
            script.parse_variant(bad)
