"""Fixtures of the registry tests (the helpers are in tests/plugin_dists.py)."""

import pytest

from attnplug import registry as R
from plugin_dists import DistTree


@pytest.fixture
def clean_registry(monkeypatch):
    """No ``ATTNPLUG_*`` selection flags from the caller's environment; the process-wide
    registry dropped afterwards (modules use it through ``pytestmark``)."""
    for name in ("ATTNPLUG_BACKEND", "ATTNPLUG_PLUGINS", "ATTNPLUG_PROBE_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    yield
    R.reset_registry()


@pytest.fixture
def tree(tmp_path, monkeypatch):
    """A site folder of plugin distributions, on sys.path (``tree.load()`` reads only it)."""
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    return DistTree(tmp_path / "site")
