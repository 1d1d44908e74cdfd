"""The ``model_decode`` benchmark (``attnplug.bench.model_decode``): registered in both suites
(only run when named), skips cleanly, and its quick run on the host measures both paths on
the same prompts and gets the same greedy tokens from each."""

from __future__ import annotations

import pytest
import torch

from attnplug.backends.reference import ReferenceBackend
from attnplug.bench import Ctx
from attnplug.bench import model_decode as md
from attnplug.bench.portable import SUITE as PORTABLE


def _ctx(quick: bool) -> Ctx:
    return Ctx(backend_cls=ReferenceBackend, device=torch.device("cpu"), quick=quick)


def test_registered_but_not_default():
    assert PORTABLE.get("model_decode") is md.BENCHMARK
    assert "model_decode" not in PORTABLE.names(default_only=True)
    assert md.BENCHMARK.load() is md.run


def test_skips_without_transformers(monkeypatch):
    monkeypatch.setattr(md, "transformers_missing", lambda: "transformers is not installed")
    rows = md.run(_ctx(quick=True))
    assert len(rows) == 1 and rows[0]["value"] is None and rows[0]["error"] is None
    assert rows[0]["notes"] == "skipped: transformers is not installed"


def test_full_config_skips_on_the_host():
    rows = md.run(_ctx(quick=False))
    assert len(rows) == 1 and rows[0]["value"] is None and rows[0]["error"] is None
    assert "needs an accelerator" in rows[0]["notes"]


def test_quick_run_measures_both_paths(monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setattr(md, "_QUICK", {**md._QUICK, "batch_sizes": (2,)})
    rows = md.run(_ctx(quick=True))
    speeds = {r["variant"]: r for r in rows if r["metric"] == "decode tokens/s"}
    assert set(speeds) == {"attnplug", "transformers"}
    assert all(r["value"] > 0 and r["tn_s"] > r["t1_s"] for r in speeds.values())
    assert speeds["transformers"]["path"].startswith("static cache + sdpa")
    (ratio,) = [r for r in rows if r["metric"] == "attnplug / transformers"]
    assert ratio["value"] == pytest.approx(speeds["attnplug"]["value"] / speeds["transformers"]["value"])
    # float32 on the host: both greedy paths produce the same tokens
    assert ratio["token_agreement"] == 1.0
