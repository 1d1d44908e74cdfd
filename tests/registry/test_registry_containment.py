"""The plugin registry contains slow and concurrent probes (time limits, no lock held while a
probe runs, one probe for concurrent callers), lets Ctrl-C through, and reports copies of the
attnplug distribution that differ."""

from __future__ import annotations

import sys

import pytest

from attnplug import registry as R
from attnplug.registry import BackendUnavailable, ProbeResult, RegistryError, load_registry
from plugin_dists import OtherStandIn, StandInBackend, plugin_source, reg, write_dist_info, write_project_metadata

pytestmark = pytest.mark.usefixtures("clean_registry")


# ---------------------------------------------------------------------------- containment, time limits, threads
def test_slow_probe_does_not_delay_selection_of_a_known_backend(tree, monkeypatch):
    """The registry lock is not held while a probe runs: another thread selects a backend whose
    probe already ran while the slow probe is still running."""
    import threading
    import time

    monkeypatch.setenv("ATTNPLUG_PROBE_TIMEOUT", "30")
    tree.add(
        "d",
        {
            "p": plugin_source(
                [reg("known"), "name='slow', backend='plugin_dists:OtherStandIn', probe=probe"],
                body="""
        import threading, time
        STARTED, RELEASE = threading.Event(), threading.Event()
        def probe():
            STARTED.set()
            RELEASE.wait(20)
            return True, 'slow but fine'
        """,
            )
        },
    )
    registry = tree.load()
    module = sys.modules[registry.records[0].entry_point]
    assert registry.get_backend("known") is StandInBackend  # probed once, before the slow one starts
    slow = threading.Thread(target=lambda: registry.get_backend("slow"), daemon=True)
    slow.start()
    assert module.STARTED.wait(10)
    try:
        t0 = time.monotonic()
        assert registry.get_backend("known") is StandInBackend
        assert registry.probe("known").available and registry.select("known") == ("known", StandInBackend)
        assert time.monotonic() - t0 < 1.0
    finally:
        module.RELEASE.set()
    slow.join(10)
    assert registry.get_backend("slow") is OtherStandIn


def test_probe_runs_once_for_concurrent_callers(tree, monkeypatch):
    import threading

    monkeypatch.setenv("ATTNPLUG_PROBE_TIMEOUT", "30")
    tree.add(
        "d",
        {
            "p": plugin_source(
                ["name='once', backend='plugin_dists:StandInBackend', probe=probe"],
                body="""
        import time
        CALLS = []
        def probe():
            CALLS.append(1)
            time.sleep(0.2)
            return True, 'ok'
        """,
            )
        },
    )
    registry = tree.load()
    module = sys.modules[registry.records[0].entry_point]
    results = []
    threads = [threading.Thread(target=lambda: results.append(registry.probe("once"))) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert module.CALLS == [1] and len(results) == 6 and len({id(r) for r in results}) == 1


def test_probe_time_limit_is_configurable_and_validated(tree, monkeypatch):
    import time

    tree.add(
        "d",
        {
            "p": plugin_source(
                ["name='slow', backend='plugin_dists:StandInBackend', probe=probe", reg("ok")],
                body="import time\ndef probe():\n    time.sleep(0.6)\n    return True, 'late'",
            )
        },
    )
    monkeypatch.setenv("ATTNPLUG_PROBE_TIMEOUT", "0.2")
    registry = tree.load()
    t0 = time.monotonic()
    result = registry.probe("slow")
    assert time.monotonic() - t0 < 0.55
    assert result == ProbeResult(False, "probe timed out after 0.2 s")
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


def test_keyboard_interrupt_in_the_calling_thread_still_stops_loading(tree):
    """Ctrl-C while a plugin's hook runs must reach the user; SystemExit from the same place is
    contained (test_plugin_faults)."""
    tree.add("d", {"p": plugin_source([reg("p")], then=["raise KeyboardInterrupt"])})
    with pytest.raises(KeyboardInterrupt):
        tree.load()


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
