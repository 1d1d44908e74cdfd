"""The engine checks' children that run side by side on the host take a share of its cores."""

from attnplug.integrations import engine_check


def test_side_by_side_children_take_their_share_of_the_cores(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(engine_check.os, "cpu_count", lambda: 16)
    assert engine_check.side_by_side_env()["OMP_NUM_THREADS"] == "8"
    assert engine_check.side_by_side_env(children=3)["OMP_NUM_THREADS"] == "5"
    monkeypatch.setattr(engine_check.os, "cpu_count", lambda: 1)
    assert engine_check.side_by_side_env()["OMP_NUM_THREADS"] == "1"


def test_a_thread_count_the_caller_set_is_kept(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.setenv("ATTNPLUG_SOMETHING", "kept")
    env = engine_check.side_by_side_env()
    assert env["OMP_NUM_THREADS"] == "3" and env["ATTNPLUG_SOMETHING"] == "kept"
