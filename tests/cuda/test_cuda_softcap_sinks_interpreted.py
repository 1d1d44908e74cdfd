"""Logit soft-capping and attention sinks in the cuda backend, its Triton kernels under
TRITON_INTERPRET=1 on the CPU: every mode (SWA and full layers, eager and replayed) against
float64 attention, and bad inputs refused naming the argument with the KV cache untouched."""

import dataclasses
import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("needs the Triton interpreter (set by conftest without a GPU)", allow_module_level=True)
pytest.importorskip("triton")

import softcap_sinks_cases as cases  # noqa: E402
from attnplug import ForwardMode  # noqa: E402
from attnplug_cuda.backend import CudaBackend  # noqa: E402
from worlds import kernel_spec  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SPEC = kernel_spec(swa_layer_ids=(0,), sliding_window=4, scramble_swa=True)  # one SWA layer, one full


@pytest.mark.slow
def test_softcap_and_sinks_match_float64_eager_and_replayed():
    spec = dataclasses.replace(SPEC, logit_softcap=1.5, sinks=True)
    cases.check_matches_float64(spec, CudaBackend, DEVICE, runner_modes=(ForwardMode.DECODE,))


def test_bad_logit_softcap_is_refused_naming_it():
    cases.bad_construction(CudaBackend, SPEC, DEVICE)


def test_bad_sinks_are_refused_before_any_store():
    cases.bad_sinks(CudaBackend, SPEC, DEVICE)


def test_undeclared_features_are_refused():
    cases.undeclared_refused(CudaBackend, SPEC, DEVICE)
