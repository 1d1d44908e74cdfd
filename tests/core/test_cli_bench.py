"""`attnplug bench`: the one harness (attnplug.bench) runs any backend's benchmarks.

The reference backend ships none, so it runs the portable suite: whole hybrid steps through
GraphRunner against eager steps, on the host, writing JSON and PNG plots and printing a table.
"""

import json

import pytest

from attnplug import cli
from attnplug.backends.reference import ReferenceBackend
from attnplug.bench import Ctx, Suite, SuiteUnavailable, portable, row, run_suite, suite_for
from attnplug.bench.plots import plot_rows, write_plots
from attnplug.bench.suite import Benchmark
from child import HANG_LIMIT_S


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = cli.main(["bench", "--backend", "reference", "--quick", "--out", str(out)])
    return rc, out, buf.getvalue()


def test_reference_bench_runs_on_the_host_and_writes_json_png_table(reference_run):
    rc, out, printed = reference_run
    assert rc == 0, printed
    result = json.loads((out / "bench.json").read_text())
    assert result["suite"] == "portable" and result["backend"] == "reference" and result["device"] == "cpu"
    assert result["environment"]["timing"] == "wall clock" and result["summary"]["errors"] == []
    times = [r for r in result["rows"] if r["metric"] == "time per step"]
    # 2 modes x 2 batch sizes x 2 variants, each measured
    assert {(r["series"], r["bs"], r["variant"]) for r in times} == {
        (m, bs, v) for m in ("decode", "draft_extend") for bs in (1, 4) for v in ("graph", "eager")
    }
    assert all(r["value"] > 0 for r in times)
    agree = [r for r in result["rows"] if r["metric"].startswith("max |variant - eager|")]
    assert len(agree) == 1 and agree[0]["met"] is True and agree[0]["value"] <= 1e-4
    png = out / "hybrid_step.png"
    assert result["plots"] == [str(png)] and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = printed.rstrip().splitlines()
    assert any("benchmark" in line and "detail" in line for line in lines)  # the table's header
    assert any("speedup (eager / graph)" in line for line in lines)
    assert lines[-1].startswith("targets met: 1 / 1; errors: 0") and "hybrid_step" not in lines[-1]


def test_suite_lookup_by_package():
    assert suite_for(ReferenceBackend) is portable.SUITE  # attnplug.bench.SUITE

    class Local(ReferenceBackend):  # a module that is not a package ships nothing: portable
        pass

    assert suite_for(Local) is portable.SUITE


def test_bench_unknown_backend_names_alternatives(capsys):
    assert cli.main(["bench", "--backend", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("attnplug: error:") and "reference" in err


def test_bench_bad_arguments_are_one_clear_line(tmp_path, capsys):
    assert cli.main(["bench", "--backend", "reference", "--only", "nope", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "unknown benchmark(s) ['nope']" in err and "hybrid_step" in err and not list(tmp_path.iterdir())
    assert cli.main(["bench", "--backend", "reference", "--set", "colour=blue"]) == 2
    assert "has no option 'colour'" in capsys.readouterr().err
    assert cli.main(["bench", "--backend", "reference", "--set", "dtype"]) == 2
    assert "expected NAME=VALUE" in capsys.readouterr().err
    assert cli.main(["bench", "--backend", "reference", "--device", "no-such-device"]) == 2
    assert "--device 'no-such-device'" in capsys.readouterr().err


def test_options_are_typed():
    suite = Suite("s", __name__, [], options={"flag": False, "seconds": 1.5, "name": "x"})
    assert suite.parse_options(["flag=yes", "seconds=2", "name=y"]) == {"flag": True, "seconds": 2.0, "name": "y"}
    with pytest.raises(ValueError, match="expected a boolean"):
        suite.parse_options(["flag=maybe"])
    with pytest.raises(ValueError, match="expected a float"):
        suite.parse_options(["seconds=soon"])


def _failing(ctx: Ctx):
    ctx.rows.append(row("failing", "first case", "time", 1.0, "us", variant="a", bs=1, series="s"))
    raise RuntimeError("boom")


def _measured(ctx: Ctx):
    for v, scale in (("before", 2.0), ("new", 1.0)):
        for bs in (1, 2, 4):
            ctx.rows.append(
                row(
                    "measured",
                    f"bs={bs} {v}",
                    "time",
                    scale * bs,
                    "us",
                    variant=v,
                    bs=bs,
                    series="s",
                    floor=0.5 * bs if v == "new" else None,
                )
            )
    return ctx.rows


SUITE_UNDER_TEST = Suite(
    "under-test",
    __name__,
    [Benchmark("failing", f"{__name__}:_failing"), Benchmark("measured", f"{__name__}:_measured")],
)


def test_a_failing_benchmark_leaves_an_error_row_and_the_run_continues(tmp_path, capsys):
    result = run_suite(SUITE_UNDER_TEST, ReferenceBackend, "cpu", out_dir=str(tmp_path))
    errors = [r for r in result["rows"] if r.get("error")]
    assert [r["benchmark"] for r in errors] == ["failing"] and "RuntimeError: boom" in errors[0]["error"]
    assert len([r for r in result["rows"] if r["benchmark"] == "measured"]) == 6
    assert result["summary"]["errors"] == ["failing: (benchmark): RuntimeError: boom"]
    assert capsys.readouterr().out.rstrip().splitlines()[-1].startswith("targets met: 0 / 0; errors: 1")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json", "failing.png", "measured.png"]
    series = plot_rows(result["rows"])["measured"]["s"]
    assert series == {"before": {1: 2.0, 2: 4.0, 4: 8.0}, "new": {1: 1.0, 2: 2.0, 4: 4.0}}
    floors = [r for r in result["rows"] if r.get("floor") is not None]
    assert [r["pct_of_floor"] for r in floors] == [50.0, 50.0, 50.0]


def test_isolated_run_kills_a_benchmark_past_its_time_limit(tmp_path):
    """One child process per benchmark: its rows come back, and a child past its limit is
    killed and recorded."""
    from attnplug.bench import runner

    ctx = Ctx(backend_cls=ReferenceBackend, quick=True)
    killed = runner._run_in_child(portable.SUITE, portable.SUITE.get("hybrid_step"), ctx, timeout=0.5)
    assert "time limit" in killed[-1]["error"]
    ctx.options = {"dtype": "not-a-dtype"}
    failed = runner._run_in_child(portable.SUITE, portable.SUITE.get("hybrid_step"), ctx, timeout=HANG_LIMIT_S)
    assert "not a torch dtype" in failed[-1]["error"]


def test_unavailable_suite_stops_before_writing(tmp_path):
    def needs_device():
        raise SuiteUnavailable("needs a device this machine lacks")

    suite = Suite("needs-device", __name__, [Benchmark("measured", f"{__name__}:_measured")], requires=needs_device)
    with pytest.raises(SuiteUnavailable, match="lacks"):
        run_suite(suite, ReferenceBackend, "cpu", out_dir=str(tmp_path / "o"), json_path=str(tmp_path / "j.json"))
    assert not list(tmp_path.iterdir())


def test_plots_need_rows_with_plot_keys(tmp_path):
    assert write_plots([row("b", "c", "m", 1.0, "us")], str(tmp_path), "before") == []
