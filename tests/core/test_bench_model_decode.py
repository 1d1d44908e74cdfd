"""The ``model_decode`` benchmark (``attnplug.bench.model_decode``): registered in both suites
(only run when named), skips cleanly, and its quick run on the host measures both paths on
the same prompts and gets the same greedy tokens from each; where the backend declares an FP8
KV cache, the same Engine run over one beside them (tokens/s, and the greedy tokens' agreement
with the model-dtype KV run, an information figure), and none where it does not; and the
prefill rows (Engine.generate(prompts, 1) against transformers' sdpa forward over the same
prompts, each shape)."""

from __future__ import annotations

import pytest
import torch

from attnplug.backends.reference import ReferenceBackend
from attnplug.bench import Ctx
from attnplug.bench import model_decode as md
from attnplug.bench.portable import SUITE as PORTABLE


def _ctx(quick: bool, **options) -> Ctx:
    return Ctx(backend_cls=ReferenceBackend, device=torch.device("cpu"), quick=quick, options=options)


@pytest.fixture(autouse=True)
def _traced_not_generated(monkeypatch):
    """The prefill rows' compiled Engine through ``aot_eager`` on the host: the graphs inductor
    would see, no code generated (seconds, not a minute)."""
    monkeypatch.setattr(md, "PREFILL_COMPILE", "aot_eager")


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
    assert set(speeds) == {"attnplug", "transformers", "attnplug fp8 kv"}  # the reference declares FP8 KV caches
    assert all(r["value"] > 0 and r["tn_s"] > r["t1_s"] for r in speeds.values())
    assert speeds["transformers"]["path"].startswith("static cache + sdpa")
    (ratio,) = [r for r in rows if r["metric"] == "attnplug / transformers"]
    assert ratio["value"] == pytest.approx(speeds["attnplug"]["value"] / speeds["transformers"]["value"])
    # float32 on the host: both greedy paths produce the same tokens
    assert ratio["token_agreement"] == 1.0
    # the FP8 run beside the float32-KV one
    fp8 = [r for r in rows if r.get("kv_cache_dtype") == "float8_e4m3fn"]
    (fp8_speed,) = [r for r in fp8 if r["metric"] == "decode tokens/s"]
    (fp8_ratio,) = [r for r in fp8 if r["metric"] == "fp8 KV / float32 KV"]
    assert fp8_speed is speeds["attnplug fp8 kv"] and "FP8 KV cache" in fp8_speed["detail"]
    assert fp8_ratio["value"] == pytest.approx(fp8_speed["value"] / speeds["attnplug"]["value"])
    assert 0.0 <= fp8_ratio["token_agreement_kv"] <= 1.0 and fp8_ratio["target"] is None  # information only
    assert "greedy tokens equal to the float32 KV run's at" in fp8_ratio["detail"]


def _stub_runs(monkeypatch):
    """Both timed paths stubbed (the rows' logic only): attnplug's tokens are [1, 2, ..., n]
    over a model-dtype KV cache and [1, 0, 3, 0, ...] over an FP8 one; returns the KV cache
    dtypes the Engine was asked for."""
    from types import SimpleNamespace

    asked = []

    def ours(ctx, model, prompts, prompt_len, n_new, kv_cache_dtype=None):
        asked.append(kv_cache_dtype)
        tokens = [i + 1 if kv_cache_dtype is None or i % 2 == 0 else 0 for i in range(n_new)]
        return [tokens] * len(prompts), 1.0, 3.0 if kv_cache_dtype else 2.0, {}, "eager steps", ""

    def theirs(ctx, model, prompts, n_new):
        return [list(range(1, n_new + 1))] * prompts.shape[0], 1.0, 2.0, SimpleNamespace(path="p", note="")

    monkeypatch.setattr(md, "_ours", ours)
    monkeypatch.setattr(md, "_theirs", theirs)
    monkeypatch.setattr(md, "_QUICK", {**md._QUICK, "batch_sizes": (2,), "new_tokens": 8})
    return asked


def test_fp8_rows_only_where_the_backend_declares_an_fp8_cache(monkeypatch):
    pytest.importorskip("transformers")
    import dataclasses

    class NoFp8(ReferenceBackend):
        name = "nofp8"

        @classmethod
        def declared_capabilities(cls):
            return dataclasses.replace(super().declared_capabilities(), fp8_kv_dtypes=())

    asked = _stub_runs(monkeypatch)
    rows = md.run(Ctx(backend_cls=NoFp8, device=torch.device("cpu"), quick=True))
    assert asked == [None] and not [r for r in rows if "kv_cache_dtype" in r]
    asked.clear()
    rows = md.run(_ctx(quick=True))
    assert asked == [None, "fp8"]
    (ratio,) = [r for r in rows if r["metric"] == "fp8 KV / float32 KV"]
    assert ratio["token_agreement_kv"] == 0.5  # every other position differs in the stub
    assert ratio["value"] == pytest.approx(0.5)  # t(n) - t(1): 2 s over FP8, 1 s over float32


def test_prefill_rows_time_both_paths_on_the_same_prompts(monkeypatch):
    """Per prefill shape: the compiled Engine's time (the held row) and the eager Engine's, each
    with its EXTEND steps (chunks of max_prefill_tokens), transformers' sdpa forward, and the
    ratio of transformers' time to each; float32 on the host: every path gives the same first
    tokens; no target on the host. (``aot_eager`` stands in for inductor on the host: the same
    traced graphs, no code generated: the autouse fixture.)"""
    pytest.importorskip("transformers")
    monkeypatch.setattr(md, "_QUICK", {**md._QUICK, "batch_sizes": (), "prefill_shapes": ((1, 600), (3, 20))})
    rows = md.run(_ctx(quick=True))
    prefill = [r for r in rows if r.get("series") == "prefill"]
    assert sorted({r["case"] for r in prefill}) == ["prefill 1x600", "prefill 3x20"]
    from attnplug.integrations.transformers.engine import DEFAULT_MAX_PREFILL_TOKENS as chunk

    for case, bs, steps in (("prefill 1x600", 1, -(-600 // chunk)), ("prefill 3x20", 3, 1)):
        times = {r["variant"]: r for r in prefill if r["case"] == case and r["metric"] == "prefill s"}
        assert set(times) == {"attnplug", "attnplug eager", "transformers"}
        assert all(r["value"] > 0 for r in times.values())
        assert times["attnplug"]["path"] == "compiled model" and times["attnplug eager"]["path"] == "eager model"
        for variant in ("attnplug", "attnplug eager"):
            assert times[variant]["extend_steps"] == steps  # the Engine's default chunks
            noun = "step" if steps == 1 else "steps"
            assert f"{steps} EXTEND {noun} of the {times[variant]['path']}" in times[variant]["detail"]
            (ratio,) = [r for r in prefill if r["case"] == case and r["metric"] == f"transformers / {variant} time"]
            assert ratio["bs"] == bs and ratio["prompt_len"] == int(case.split("x")[1])
            assert ratio["value"] == pytest.approx(times["transformers"]["value"] / times[variant]["value"])
            assert ratio["token_agreement"] == 1.0
            assert ratio["target"] is None and ratio["met"] is None  # held only on an accelerator
        assert times["transformers"]["detail"].startswith("transformers sdpa forward")


def test_prefill_rows_skip_when_time_runs_low(monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setattr(md, "_QUICK", {**md._QUICK, "batch_sizes": (), "prefill_shapes": ((1, 8), (2, 8))})
    monkeypatch.setattr(Ctx, "time_low", lambda self, need_s=30.0: True)
    rows = md.run(_ctx(quick=True))
    assert [(r["case"], r["value"], r["notes"]) for r in rows] == [
        ("prefill 1x8", None, "skipped: time budget"),
        ("prefill 2x8", None, "skipped: time budget"),
    ]


def test_series_option_runs_the_rows_it_names(monkeypatch):
    """``--set model_decode_series=prefill`` runs the prefill rows alone (``decode`` the decode
    rows alone); anything but a non-empty subset of the two is refused naming them."""
    pytest.importorskip("transformers")
    monkeypatch.setattr(md, "_QUICK", {**md._QUICK, "batch_sizes": (2,), "prefill_shapes": ((1, 8),)})
    ran = []

    def decode_rows(*args):
        ran.append("decode")
        raise StopIteration  # the decode rows began: enough

    monkeypatch.setattr(md, "_prefill_rows", lambda ctx, *args: ran.append("prefill"))
    monkeypatch.setattr(md, "_theirs", decode_rows)
    assert md.run(_ctx(quick=True, model_decode_series="prefill")) == [] and ran == ["prefill"]
    ran.clear()
    with pytest.raises(StopIteration):
        md.run(_ctx(quick=True, model_decode_series="decode"))
    assert ran == ["decode"]
    assert md.series("decode, prefill") == ("prefill", "decode") and md.series("DECODE") == ("decode",)
    for bad in ("", "prefil", "prefill,tokens", ","):
        with pytest.raises(ValueError, match="model_decode_series"):
            md.series(bad)
