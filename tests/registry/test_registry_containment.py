"""The plugin registry contains slow and concurrent probes (time limits, no lock held while a
probe runs, one probe for concurrent callers), lets the user's Ctrl-C through, and reports copies
of the attnplug distribution that differ. Probes of these (third-party) plugins run in the
probe process: they count their calls in files, not in module state. The adversarial cases
(a probe that exits, hangs, leaves a thread or changes the process) are in
tests/catalogue/test_registry.py."""

from __future__ import annotations

import os
import sys

import pytest

from attnplug import registry as R
from attnplug.registry import BackendUnavailable, ProbeResult, RegistryError, load_registry
from child import HANG_LIMIT_S
from plugin_dists import (
    OtherStandIn,
    StandInBackend,
    one_error,
    plugin_source,
    reg,
    write_dist_info,
    write_project_metadata,
)

pytestmark = pytest.mark.usefixtures("clean_registry")


# ---------------------------------------------------------------------------- containment, time limits, threads
def test_slow_probe_does_not_delay_selection_of_a_known_backend(tree, monkeypatch, tmp_path):
    """The registry lock is not held while a probe runs: another thread selects a backend whose
    probe already ran while the slow probe is still running (in the probe process)."""
    import threading
    import time

    started, release = tmp_path / "started", tmp_path / "release"
    monkeypatch.setenv("ATTNPLUG_PROBE_TIMEOUT", "30")
    tree.add(
        "d",
        {
            "p": plugin_source(
                [reg("known"), "name='slow', backend='plugin_dists:OtherStandIn', probe=probe"],
                body=f"""
        import pathlib, time
        def probe():
            pathlib.Path({str(started)!r}).write_text('1')
            deadline = time.monotonic() + 20
            while not pathlib.Path({str(release)!r}).exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            return True, 'slow but fine'
        """,
            )
        },
    )
    registry = tree.load()
    assert registry.get_backend("known") is StandInBackend  # probed once, before the slow one starts
    slow = threading.Thread(target=lambda: registry.get_backend("slow"), daemon=True)
    slow.start()
    deadline = time.monotonic() + 20
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert started.exists()
    try:
        t0 = time.monotonic()
        assert registry.get_backend("known") is StandInBackend
        assert registry.probe("known").available and registry.select("known") == ("known", StandInBackend)
        assert time.monotonic() - t0 < 1.0
    finally:
        release.write_text("1")
    slow.join(20)
    assert registry.get_backend("slow") is OtherStandIn


def test_probe_runs_once_for_concurrent_callers(tree, monkeypatch, tmp_path):
    import threading

    calls = tmp_path / "calls"
    monkeypatch.setenv("ATTNPLUG_PROBE_TIMEOUT", "30")
    tree.add(
        "d",
        {
            "p": plugin_source(
                ["name='once', backend='plugin_dists:StandInBackend', probe=probe"],
                body=f"""
        import time
        def probe():
            with open({str(calls)!r}, 'a') as f:
                f.write('call\\n')
            time.sleep(0.2)
            return True, 'ok'
        """,
            )
        },
    )
    registry = tree.load()
    results = []
    threads = [threading.Thread(target=lambda: results.append(registry.probe("once"))) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert calls.read_text().splitlines() == ["call"] and len(results) == 6 and len({id(r) for r in results}) == 1


def test_probe_time_limit_is_configurable_and_validated(tree, monkeypatch):
    import time

    tree.add(
        "d",
        {
            "p": plugin_source(
                ["name='slow', backend='plugin_dists:StandInBackend', probe=probe", reg("ok")],
                body="import time\ndef probe():\n    time.sleep(1.5)\n    return True, 'late'",
            )
        },
    )
    monkeypatch.setenv("ATTNPLUG_PROBE_TIMEOUT", "0.2")
    registry = tree.load()
    assert registry.probe("ok").available  # the probe process is up: its start is not the probe's time
    t0 = time.monotonic()
    result = registry.probe("slow")
    assert time.monotonic() - t0 < 1.2
    assert result == ProbeResult(False, "probe timed out after 0.2 s; its process was killed")
    with pytest.raises(BackendUnavailable, match="probe timed out after 0.2 s"):
        registry.get_backend("slow")
    time.sleep(0.6)
    assert registry.probe("slow") is result  # the late answer does not replace the verdict
    monkeypatch.setenv("ATTNPLUG_PROBE_TIMEOUT", "inf")
    assert tree.load().probe("slow").available
    for bad in ("0", "-1", "soon", "nan"):
        monkeypatch.setenv("ATTNPLUG_PROBE_TIMEOUT", bad)
        with pytest.raises(RegistryError, match=f"ATTNPLUG_PROBE_TIMEOUT='{bad}': expected a positive number"):
            tree.load().get_backend("ok")
    monkeypatch.delenv("ATTNPLUG_PROBE_TIMEOUT")
    assert R.containment.probe_timeout() == R.DEFAULT_PROBE_TIMEOUT == 5.0


def test_ctrl_c_while_a_plugin_hook_runs_still_stops_loading(tmp_path):
    """Ctrl-C (SIGINT to the main thread) while a plugin's hook runs must reach the user: the
    hook runs in a worker thread and the caller waits interruptibly. Run in a subprocess, where
    the main thread is known to be the caller's."""
    import subprocess
    import textwrap

    from plugin_dists import ROOT, subprocess_env

    code = textwrap.dedent(f"""
        import sys, time
        sys.path[:0] = [{str(ROOT / "tests")!r}, {str(tmp_path)!r}]
        from plugin_dists import DistTree, plugin_source, reg
        tree = DistTree({str(tmp_path)!r})
        tree.add("d", {{"p": plugin_source([reg("p")], body="import signal, threading, time", then=[
            "signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)", "time.sleep(20)"])}})
        t0 = time.monotonic()
        try:
            tree.load()
        except KeyboardInterrupt:
            print("interrupted after", round(time.monotonic() - t0, 1))
    """)
    out = subprocess.run(
        [sys.executable, "-c", code], env=subprocess_env(), capture_output=True, text=True, timeout=HANG_LIMIT_S
    )
    assert out.returncode == 0, out.stderr
    assert "interrupted after" in out.stdout and float(out.stdout.split()[-1]) < 10, out.stdout


def test_keyboard_interrupt_raised_by_a_hook_is_its_own_failure(tree):
    """A ``KeyboardInterrupt`` the plugin raises itself (no signal: in its worker thread it can
    only come from the plugin) fails that plugin, like any exception."""
    tree.add("d", {"p": plugin_source([reg("p")], then=["raise KeyboardInterrupt('from the plugin')"])})
    registry = tree.load()
    error = one_error(registry, "p")
    assert error.kind == "hook" and "KeyboardInterrupt: from the plugin" in error.reason


def test_identical_copies_of_the_attnplug_distribution_are_not_reported(tmp_path, monkeypatch):
    """Two copies with the same version and entry points (an editable install next to its
    source-tree metadata) are one distribution; copies that differ are reported (fault matrix)."""
    for folder in ("one", "two"):
        write_project_metadata(tmp_path / folder)
        monkeypatch.syspath_prepend(str(tmp_path / folder))
    registry = load_registry()
    assert not [e for e in registry.errors if e.kind == "distribution"], registry.errors
    assert {"reference", "cuda", "ascend", "xpu"} <= set(registry.names())
    write_dist_info(tmp_path / "two", "attnplug", "0.0.1", {})
    monkeypatch.syspath_prepend(str(tmp_path / "two"))
    registry = load_registry()
    (error,) = [e for e in registry.errors if e.kind == "distribution"]
    assert "0.0.1 at" in error.reason and "copies of distribution 'attnplug'" in error.reason
    assert registry.get_backend("reference").__name__ == "ReferenceBackend"


# ---------------------------------------------------------------------------- the probe process
def test_without_a_probe_process_plugin_code_runs_here_guarded_and_says_so(tree, monkeypatch):
    """Where no child can start (no usable interpreter), third-party probes run in-process in a
    guarded thread, under the time limit, and the notes say so; the failure is remembered."""
    from attnplug.registry.sandbox import sandbox

    box = sandbox()
    box.close()
    monkeypatch.setattr(box, "_broken", None)
    monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    monkeypatch.setenv("ATTNPLUG_PROBE_TIMEOUT", "5")
    tree.add(
        "d",
        {
            "p": plugin_source(
                ["name='p', backend='plugin_dists:StandInBackend', probe=probe"],
                body="import os\ndef probe():\n    os.environ['ATTNPLUG_FALLBACK_MARK'] = '1'\n    return True, 'ok'",
            )
        },
    )
    registry = tree.load()
    (info,) = registry.available_backends()
    assert info.available and info.reason == "ok"
    assert "ATTNPLUG_FALLBACK_MARK" not in os.environ  # undone
    assert "the probe changed os.environ ATTNPLUG_FALLBACK_MARK (undone)" in info.notes
    assert any(n.startswith("the probe ran in this process: cannot start /nonexistent/python") for n in info.notes)
    started = box.started
    assert tree.load().probe("p").available and box.started == started  # no second try within RETRY_S


def test_the_probe_process_is_stopped_when_idle_and_restarted_on_demand(tree, monkeypatch):
    import time

    from attnplug.registry import sandbox as S

    monkeypatch.setattr(S, "IDLE_S", 0.3)
    tree.add("d", {"p": plugin_source([reg("p")])})
    registry = tree.load()
    assert registry.probe("p").available
    box = S.sandbox()
    assert box._child is not None
    pid = box._child.proc.pid
    deadline = time.monotonic() + 10
    while box._child is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert box._child is None  # stopped after IDLE_S without a request
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break  # ended and reaped
        time.sleep(0.05)
    else:
        pytest.fail(f"the idle probe process {pid} still runs")
    assert tree.load().probe("p").available  # a new one starts for the next request
