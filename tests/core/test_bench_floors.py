"""Whole-step floors, ratios, peers and the replay-preparation row of ``attnplug.bench.step_case``,
on the host with the reference backend (the device parts are fakes with known answers)."""

import dataclasses

import pytest
import torch

from attnplug import ForwardMode
from attnplug.backends.reference import ReferenceBackend
from attnplug.bench import Ctx
from attnplug.bench.floors import StepFloor, keys_reached, step_bytes
from attnplug.bench.step_case import PeerUnavailable, PrepCheck, StepPeer, StepRatio, StepVariant
from bench_runs import quick_step_benchmark, small_step_shape

SHAPE = small_step_shape()


def test_step_bytes_of_the_hybrid_step_shape():
    """48 layers (36 SWA, W 256), context 1024, 8 KV heads x 128, bf16: a bs-1 decode reads
    36 * 256 + 12 * 1021 keys of K and V (about 88 MB), plus q, out and the new K/V."""
    kw = dict(
        num_layers=48, swa_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, window=256
    )
    kv = (36 * 256 + 12 * 1021) * 2 * 8 * 128 * 2
    tokens = 48 * (2 * 32 * 128 * 2 + 2 * 2 * 8 * 128 * 2)
    assert step_bytes(bs=1, q_len=1, seq_len=1021, **kw) == kv + tokens
    assert step_bytes(bs=64, q_len=1, seq_len=1021, **kw) == 64 * (kv + tokens)
    # draft-extend (4 tokens): each SWA layer reaches W + 3 keys
    assert step_bytes(bs=1, q_len=4, seq_len=1024, **kw) == (36 * 259 + 12 * 1024) * 4096 + 4 * tokens
    assert keys_reached(100, 1, None) == 100 and keys_reached(100, 4, 8) == 11 and keys_reached(5, 1, 8) == 5
    with pytest.raises(ValueError, match="q_len=0"):
        step_bytes(bs=1, q_len=0, seq_len=10, **kw)


def test_step_floor_takes_the_larger_floor():
    bw = StepFloor(nbytes=88_000_000, copy_tb_s=4.4, launches=97, launch_us=66.0)
    assert bw.bandwidth_us == pytest.approx(20.0) and bw.floor_us == 66.0 and bw.bound == "launch"
    big = dataclasses.replace(bw, nbytes=88_000_000 * 64)
    assert big.floor_us == pytest.approx(1280.0) and big.bound == "bandwidth"
    blind = StepFloor(nbytes=4_400_000, copy_tb_s=4.4, launch_note="no profiler")
    assert blind.floor_us == pytest.approx(1.0) and "no profiler" in blind.describe()
    assert bw.fields()["launches"] == 97 and "97 launches" in bw.describe()


class FakeLaunchFloor:
    """Counts one 'launch' per layer forward; an empty launch costs 1 us."""

    def __init__(self):
        self.graphs = []

    def count(self, run_step):
        calls = []
        real = ReferenceBackend.forward

        def counting(self, *a, **k):
            calls.append(1)
            return real(self, *a, **k)

        ReferenceBackend.forward = counting
        try:
            run_step()
        finally:
            ReferenceBackend.forward = real
        return len(calls), "counted layer forwards"

    def empty_graph_us(self, launches, pdl):
        self.graphs.append((launches, pdl))
        return float(launches)


def _scaled(*args, **kwargs):
    return ReferenceBackend(*args, scaling=0.5, **kwargs)


def _run(variants, **kw):
    ctx = Ctx(backend_cls=ReferenceBackend)
    return quick_step_benchmark(ctx, name="t", shape=SHAPE, variants=variants, baseline="base", sizes=(1, 2), **kw)


def test_floor_ratio_peer_and_prep_rows():
    floor = FakeLaunchFloor()
    measured = []

    def peer(ctx, world, mode, bs):
        measured.append(bs)
        return 1e6, "one second"

    variants = {
        "base": StepVariant(make=ReferenceBackend, graph=False),
        "new": StepVariant(make=ReferenceBackend, floor=True),
        "same": StepVariant(make=ReferenceBackend, sizes=(1,), vs_baseline=False),
        "other": StepVariant(make=_scaled, sizes=(1,), vs_baseline=False),
    }
    rows = _run(
        variants,
        time_targets={(ForwardMode.DECODE, 1): 1e9},
        launch_floor=floor,
        ratios=[StepRatio("same", "new", target=1e-9, identical=True), StepRatio("other", "new", identical=True)],
        peers=[StepPeer("peer", peer, against="new", target=lambda mode, bs: 1e-9 if bs == 1 else None)],
        prep=PrepCheck(variant="new", bs=2, target_us=1e9, iters=5),
    )
    assert not [r for r in rows if r.get("error")], [r["error"] for r in rows if r.get("error")]
    copy = [r for r in rows if r["metric"] == "bandwidth"]
    assert len(copy) == 1 and copy[0]["value"] > 0
    new = {r["bs"]: r for r in rows if r["metric"] == "time per step" and r.get("variant") == "new"}
    for bs, r in new.items():
        assert r["launches"] == SHAPE.num_layers  # one replay runs every layer once
        assert r["floor_bytes"] == SHAPE.step_bytes(ForwardMode.DECODE, bs)
        assert r["floor"] == pytest.approx(max(r["launch_floor_us"], r["bandwidth_floor_us"]))
        assert r["pct_of_floor"] == pytest.approx(100 * r["floor"] / r["value"]) and r["key"]
    assert new[1]["target"] == "<= 1e+09 us" and new[1]["met"] is True and new[2]["target"] is None
    assert floor.graphs == [(SHAPE.num_layers, False)]  # one empty graph per launch count
    assert not any(r.get("variant") == "base" and "floor" in r for r in rows)
    ident = {r["metric"]: r for r in rows if r["metric"].endswith(": outputs")}
    assert ident["same vs new: outputs"]["met"] is True
    assert ident["other vs new: outputs"]["met"] is False  # another scaling: the check notices
    ratios = [r for r in rows if r["metric"] == "speedup (same / new)"]
    assert len(ratios) == 1 and ratios[0]["bs"] == 1 and ratios[0]["met"] is True
    assert not [r for r in rows if r["metric"] in ("speedup (base / same)", "speedup (base / other)")]
    assert measured == [1, 2]
    peer_ratio = {r["bs"]: r for r in rows if r["metric"] == "speedup (peer / new)"}
    assert peer_ratio[1]["met"] is True and peer_ratio[2]["target"] is None
    assert peer_ratio[1]["value"] == pytest.approx(1e6 / new[1]["value"])
    prep = [r for r in rows if r["metric"] == "host replay preparation"]
    assert len(prep) == 1 and prep[0]["case"] == "decode bs=2 new" and prep[0]["value"] > 0 and prep[0]["met"]


def test_an_unavailable_peer_leaves_one_row_and_a_failing_peer_an_error():
    asked = []

    def missing(ctx, world, mode, bs):
        asked.append(bs)
        raise PeerUnavailable("peerlib not installed")

    def broken(ctx, world, mode, bs):
        raise RuntimeError("boom")

    variants = {"base": StepVariant(make=ReferenceBackend, graph=False), "new": StepVariant(make=ReferenceBackend)}
    rows = _run(
        variants, peers=[StepPeer("missing", missing, against="new"), StepPeer("broken", broken, against="new")]
    )
    assert asked == [1]
    missing_rows = [r for r in rows if "missing" in r["case"]]
    assert len(missing_rows) == 1 and missing_rows[0]["notes"] == "peerlib not installed" and missing_rows[0]["key"]
    errors = [r for r in rows if r.get("error")]
    assert [r["case"] for r in errors] == ["decode bs=1 broken", "decode bs=2 broken"]
    assert not [r for r in rows if r["metric"] == "bandwidth"]  # no floor variant: no copy measured


def test_report_prints_one_benchmark_of_a_written_run(tmp_path, capsys):
    import json

    from attnplug.bench import report, row

    rows = [
        row("hybrid_step", "decode bs=1 new", "time per step", 200.0, "us", floor=100.0, key=True),
        row("kv_store", "61 layers", "time", 1.0, "us", key=True),
    ]
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"rows": rows, "backend": "cuda", "device": "cuda:0"}))
    assert report.main([str(path), "--only", "hybrid_step"]) == 0
    out = capsys.readouterr().out
    assert "decode bs=1 new" in out and "50%" in out and "61 layers" not in out
    assert report.main([str(tmp_path / "missing.json")]) == 2
    assert "cannot read" in capsys.readouterr().err
