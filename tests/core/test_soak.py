"""``attnplug soak``: the reference backend passes a short soak in both paths (graph replay
through the eager stand-in, and eager only), the run is deterministic for a seed, and the soak
catches deliberately broken backends with the failing step, reproducibly."""

from __future__ import annotations

import json

import pytest
import torch

from attnplug.backends.reference import ReferenceBackend
from attnplug.cli import main
from attnplug.soak import SoakConfig, command_line, run_soak


# ---------------------------------------------------------------------------- broken backends
class WindowOffByOne(ReferenceBackend):
    """SWA layers attend to ``p - W + 1 < j`` (one key short of the window)."""

    name = "broken-window-off-by-one"

    def _attend(self, q, keys, values, key_pos, window, md, *, sinks=None):
        return super()._attend(q, keys, values, key_pos, window - 1 if window else None, md, sinks=sinks)


class StoresOneSlotOff(ReferenceBackend):
    """Full layers store each new token's k/v one slot past its ``out_cache_loc``."""

    name = "broken-stores-one-slot-off"

    def _store_kv(self, layer_id, is_swa, k, v, md):
        if is_swa:
            return super()._store_kv(layer_id, is_swa, k, v, md)
        last = self.pool.num_slots(layer_id) - 1
        loc = torch.where(md.full_store_loc > 0, md.full_store_loc + 1, 0).clamp_max(last)
        self.pool.set_kv_buffer(layer_id, loc, k, v)


class SinkLeak(ReferenceBackend):
    """Masked key columns get weight 0 but are still multiplied in: 0 x NaN leaks whatever
    the sink and free slots hold into the output."""

    name = "broken-sink-leak"

    def _attend(self, q, keys, values, key_pos, window, md, *, sinks=None):
        T, H, D = q.shape
        bs, K, Hkv, _ = keys.shape
        G, Q = H // Hkv, md.q_len_max
        qp = torch.zeros(bs, Q, H, D, dtype=torch.float32)
        qp[md.token_req, md.token_idx] = q.float()
        q_pos = md.q_start[:, None] + torch.arange(Q)
        mask = key_pos[:, None, :] <= q_pos[:, :, None]
        if window is not None:
            mask = mask & (key_pos[:, None, :] > q_pos[:, :, None] - window)
        scores = torch.einsum("bqhgd,bkhd->bhgqk", qp.view(bs, Q, Hkv, G, D), keys.float()) * self.scaling
        p = torch.softmax(scores.masked_fill(~mask[:, None, None], float("-inf")), dim=-1).nan_to_num(0.0)
        out = torch.einsum("bhgqk,bkhd->bqhgd", p, values.float())
        return out.reshape(bs, Q, H, D)[md.token_req, md.token_idx].to(q.dtype)


def _soak(capsys, *args):
    rc = main(["soak", "--progress", "0", *args])
    return rc, capsys.readouterr().out


# ---------------------------------------------------------------------------- the reference passes
@pytest.mark.parametrize("page_size, graphs, steps", [(1, "--graphs", 300), (4, "--no-graphs", 120)])
def test_reference_backend_passes(tmp_path, capsys, page_size, graphs, steps):
    path = tmp_path / "soak.json"
    rc, out = _soak(
        capsys,
        "--backend",
        "reference",
        "--steps",
        str(steps),
        "--seed",
        "0",
        "--page-size",
        str(page_size),
        graphs,
        "--json",
        str(path),
    )
    assert rc == 0, out
    assert "failures" in out and "data lost" in out and "OK:" in out
    fig = json.loads(path.read_text())
    assert fig["ok"] and fig["failures"] == 0 and fig["data_lost"] == 0 and fig["first_failure"] is None
    assert fig["steps"] == steps and fig["invariant_checks"] == steps and fig["kv_checks"] == steps
    assert fig["device"] == "cpu" and fig["config"]["page_size"] == page_size
    # every part of the simulation happened
    for mode in ("EXTEND", "DECODE", "TARGET_VERIFY", "DRAFT_EXTEND"):
        assert fig["modes"][mode]["steps"] > 0, mode
    for key in (
        "out_of_kv_slots",
        "requests_finished",
        "requests_retracted",
        "tokens_rolled_back",
        "swa_slots_evicted",
        "slots_reused",
        "kv_slots_verified",
    ):
        assert fig[key] > 0, key
    assert 0 < fig["max_error"] <= fig["tolerance"]
    if graphs == "--graphs":
        assert fig["graph_kind"] == "eager stand-in"
        assert fig["replays"] > 0 and fig["eager_steps"] > 0
        for mode in ("DECODE", "TARGET_VERIFY", "DRAFT_EXTEND", "EXTEND"):  # EXTEND: token-count buckets
            assert fig["modes"][mode]["replays"] > 0, mode
        assert fig["modes"]["DECODE"]["eager"] + fig["modes"]["TARGET_VERIFY"]["eager"] > 0  # fallback
    else:
        assert fig["replays"] == 0 and fig["eager_steps"] == steps


def test_same_seed_same_run_other_seed_other_run():
    def figures(seed):
        data = run_soak(SoakConfig(steps=40, seed=seed, progress_every=0), log=None).to_json()
        return {k: v for k, v in data.items() if k not in ("wall_s", "steps_per_s")}

    assert figures(7) == figures(7)
    assert figures(7) != figures(8)


# ---------------------------------------------------------------------------- broken backends fail
@pytest.mark.parametrize("cls, check", [(WindowOffByOne, "attention"), (StoresOneSlotOff, "kv")])
def test_broken_backend_fails_with_the_step(capsys, cls, check):
    spec = f"{__name__}:{cls.__name__}"
    rc, out = _soak(capsys, "--backend", spec, "--steps", "200", "--seed", "3")
    assert rc == 1, out
    assert "FAILED" in out and f"check {check}" in out and "seed 3, step " in out, out
    report = run_soak(SoakConfig(backend=spec, steps=200, seed=3, progress_every=0), backend_cls=cls, log=None)
    first = report.first_failure
    assert first is not None and first.check == check and first.seed == 3
    if check == "kv":
        assert report.data_lost > 0
    # the printed command reproduces it: same seed, stops at the same step
    assert f"--steps {first.step + 1}" in out
    again = run_soak(
        SoakConfig(backend=spec, steps=first.step + 1, seed=3, progress_every=0), backend_cls=cls, log=None
    )
    assert again.first_failure == first


def test_nan_poison_is_what_catches_a_sink_leak():
    """Without NaN in the free slots and the sink a multiply-by-zero mask looks correct; with
    it the soak fails — the poison is what makes such a leak visible."""
    clean = run_soak(SoakConfig(steps=60, seed=1, poison="none", progress_every=0), backend_cls=SinkLeak, log=None)
    assert clean.ok, clean.first_failure
    poisoned = run_soak(SoakConfig(steps=60, seed=1, progress_every=0), backend_cls=SinkLeak, log=None)
    assert not poisoned.ok
    assert poisoned.first_failure.check == "attention" and "non-finite" in poisoned.first_failure.message


def test_reproducing_command_repeats_non_default_options():
    cfg = SoakConfig(backend="reference", seed=4, page_size=2, graphs=False, buckets=(1, 3), max_context=80).to_json()
    cmd = command_line(cfg, 17)
    assert cmd.startswith("attnplug soak --backend reference --steps 17 --seed 4")
    for part in ("--page-size 2", "--no-graphs", "--buckets 1,3", "--max-context 80"):
        assert part in cmd
    assert "--sliding-window" not in cmd  # defaults are not repeated


@pytest.mark.parametrize(
    "args, message",
    [
        (["--backend", "no-such-backend"], "no-such-backend"),
        (["--page-size", "3"], "--page-size 3"),
        (["--num-heads", "3"], "num_heads"),
        (["--steps", "0"], "steps"),
    ],
)
def test_bad_options_exit_2_naming_the_option(capsys, args, message):
    rc = main(["soak", "--progress", "0", *args])
    err = capsys.readouterr().err
    assert rc == 2 and message in err, err
