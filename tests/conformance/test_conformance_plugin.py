"""The conformance pytest plugin: inert unless asked, the one-line adoption, the documented
fixtures, backend selection errors. Each case runs pytest in-process on a scratch directory."""

from __future__ import annotations

import textwrap

import pytest

from suite_runs import collect_suite, run_pytest

ADOPTION_LINE = "from attnplug_conformance.suite import *  # noqa: F401,F403\n"


def run(path, *args, monkeypatch):
    monkeypatch.chdir(path)
    code, collector = run_pytest(str(path), *args)
    return code, collector.results


def test_inert_without_the_option(tmp_path, monkeypatch):
    (tmp_path / "test_plain_inert.py").write_text("def test_a():\n    pass\n")
    code, results = run(tmp_path, monkeypatch=monkeypatch)
    assert code == 0 and list(results) == ["test_plain_inert.py::test_a"]


def test_asked_with_explicit_paths_collects_only_those(tmp_path, monkeypatch):
    (tmp_path / "test_plain_asked.py").write_text("def test_a():\n    pass\n")
    code, results = run(tmp_path, "--attnplug-backend", "reference", monkeypatch=monkeypatch)
    assert code == 0 and list(results) == ["test_plain_asked.py::test_a"]


def test_one_line_adoption_with_ini_backend(tmp_path, monkeypatch):
    (tmp_path / "test_attnplug_conformance.py").write_text(ADOPTION_LINE)
    (tmp_path / "pytest.ini").write_text("[pytest]\nattnplug_backends = broken_backends:DirtyTail\n")
    code, results = run(tmp_path, "-k", "check_swa_buffer or check_capabilities", monkeypatch=monkeypatch)
    assert code == 1
    outcomes = {nodeid: r.outcome for nodeid, r in results.items()}
    assert (
        outcomes["test_attnplug_conformance.py::check_swa_buffer_contract[broken_backends:DirtyTail-DECODE]"]
        == "failed"
    )
    assert (
        outcomes["test_attnplug_conformance.py::check_capabilities_honest[broken_backends:DirtyTail-types]"] == "passed"
    )
    assert {r.check for r in results.values()} == {"check_swa_buffer_contract", "check_capabilities_honest"}

    # The command line overrides the ini option.
    code, results = run(tmp_path, "-k", "check_swa_buffer", "--attnplug-backend", "reference", monkeypatch=monkeypatch)
    assert code == 0 and results and all("[reference-" in nodeid for nodeid in results)


def test_documented_fixtures(tmp_path, monkeypatch):
    (tmp_path / "test_fixtures.py").write_text(
        textwrap.dedent("""
        import torch
        from attnplug import ForwardMode
        from attnplug.backends.reference import ReferenceBackend
        from attnplug_conformance import WorldSpec

        def test_twin_worlds(attnplug_backend_cls, attnplug_device, attnplug_capabilities,
                             attnplug_world, attnplug_reference_world):
            spec = WorldSpec(head_dim=64, dtype=torch.float32)
            world, ref = attnplug_world(spec=spec, seed=3), attnplug_reference_world(spec=spec, seed=3)
            assert type(world.backend) is attnplug_backend_cls and type(ref.backend) is ReferenceBackend
            assert world.device == ref.device == attnplug_device == torch.device("cpu")
            assert attnplug_capabilities.device_type == "cpu"
            outs = []
            for w in (world, ref):
                reqs = [w.new_request() for _ in range(2)]
                outs.append(w.run_eager(w.plan(ForwardMode.EXTEND, reqs, [3, 5])))
            torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)

        def test_env_around_construction(attnplug_world):
            world = attnplug_world(seed=1, env={"ATTNPLUG_DISABLE_PDL": "1"})
            assert world.backend.capabilities().pdl is False
    """)
    )
    code, results = run(
        tmp_path, "--attnplug-backend", "broken_backends:HonestPdl", "--attnplug-device", "cpu", monkeypatch=monkeypatch
    )
    assert code == 0, results
    assert set(results) == {
        "test_fixtures.py::test_twin_worlds[broken_backends:HonestPdl]",
        "test_fixtures.py::test_env_around_construction[broken_backends:HonestPdl]",
    }


def test_unknown_backend_is_a_usage_error_naming_the_alternatives(tmp_path, monkeypatch, capsys):
    (tmp_path / "test_plain_unknown.py").write_text("def test_a():\n    pass\n")
    code, _ = run(tmp_path, "--attnplug-backend", "no-such-backend", monkeypatch=monkeypatch)
    err = capsys.readouterr().err
    assert code == pytest.ExitCode.USAGE_ERROR
    assert "no backend named 'no-such-backend'" in err and "reference" in err

    code, _ = run(tmp_path, "--attnplug-backend", "broken_backends:NoSuchClass", monkeypatch=monkeypatch)
    err = capsys.readouterr().err
    assert code == pytest.ExitCode.USAGE_ERROR and "cannot import backend class" in err


def test_quick_profile_runs_the_first_round_and_every_shape_in_run_order(monkeypatch, tmp_path):
    from attnplug_conformance.plugin import check_names

    def collected(*args):
        code, nodeids = collect_suite(*args)
        assert code == 0
        return [nodeid.split("::")[-1] for nodeid in nodeids]

    monkeypatch.chdir(tmp_path)
    full, quick = collected(), collected("--attnplug-quick")
    assert quick == full[: len(quick)] and len(quick) < len(full) // 2  # a prefix of the run order
    assert {name.split("[")[0] for name in quick} == set(check_names())  # every check
    ids = [name.split("[reference-")[-1].rstrip("]") for name in quick]
    for case in ("tiles-31_32_33", "long_context-float16", "every_head_dim", "every_page_size", "pdl_env"):
        assert case in ids, case
    assert quick[-2:] == [
        f"check_attention_matches_reference[reference-{c}]" for c in ("every_head_dim", "every_page_size")
    ]
