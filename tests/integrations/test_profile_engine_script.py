"""benchmarks/profile_engine.py on the host (--quick): it runs Engine, reports a decode step's
time and the host functions of the run (the device part needs CUDA)."""

import pytest

from scripts import load_script

pytest.importorskip("transformers", reason="transformers is not installed (pip install 'attnplug[hf]')")


def test_quick_profile_reports_the_step_and_the_host_functions(capsys):
    module = load_script("profile_engine")
    module.profile(bs=2, compile_model=False, new_tokens=4, quick=True, top=20)
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("=== bs=2"))
    assert "step" in header and "tok/s" in header
    assert "engine.py" in out  # the cumulative host profile names the engine
