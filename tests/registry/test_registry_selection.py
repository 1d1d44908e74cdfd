"""Selecting a backend: priorities, an explicit name, ``ATTNPLUG_BACKEND``, the errors for an
unavailable, unknown or ambiguous choice, and the ``ATTNPLUG_PLUGINS`` allow-list."""

from __future__ import annotations

import sys

import pytest

from attnplug.registry import AmbiguousBackend, BackendNotFound, BackendUnavailable, RegistryError, load_registry
from plugin_dists import OtherStandIn, StandInBackend, one_error, plugin_source, reg

pytestmark = pytest.mark.usefixtures("clean_registry")


# ---------------------------------------------------------------------------- selection
@pytest.fixture
def three(tree):
    tree.add(
        "d",
        {
            "fast": plugin_source([reg("fast", priority=100, available=False, reason="no accelerator visible")]),
            "mid": plugin_source([reg("mid", target="plugin_dists:OtherStandIn", priority=50)]),
            "ref": plugin_source([reg("ref", priority=0)]),
        },
    )
    return tree


def test_priority_explicit_and_env(three, monkeypatch):
    registry = three.load()
    assert registry.get_backend() is OtherStandIn  # fast is unavailable: mid has the top available priority
    assert registry.select() == ("mid", OtherStandIn)
    assert registry.get_backend("ref") is StandInBackend
    monkeypatch.setenv("ATTNPLUG_BACKEND", "ref")
    assert registry.get_backend() is StandInBackend
    assert registry.get_backend("mid") is OtherStandIn  # explicit beats the environment
    monkeypatch.setenv("ATTNPLUG_BACKEND", "  ")
    assert registry.get_backend() is OtherStandIn  # blank means unset


def test_unavailable_backend_error_carries_reason_and_alternatives(three, monkeypatch):
    registry = three.load()
    with pytest.raises(BackendUnavailable) as exc:
        registry.get_backend("fast")
    message = str(exc.value)
    assert "'fast'" in message and "no accelerator visible" in message and "Available backends: mid, ref" in message
    assert exc.value.alternatives == ("mid", "ref") and exc.value.reason == "no accelerator visible"
    monkeypatch.setenv("ATTNPLUG_BACKEND", "fast")
    with pytest.raises(BackendUnavailable, match="selected by ATTNPLUG_BACKEND=fast"):
        registry.get_backend()


def test_unknown_backend_error_lists_known_names(three, monkeypatch):
    registry = three.load()
    with pytest.raises(BackendNotFound) as exc:
        registry.get_backend("nope")
    assert "registered backends: fast, mid, ref" in str(exc.value)
    assert exc.value.known == ("fast", "mid", "ref") and exc.value.name == "nope"
    monkeypatch.setenv("ATTNPLUG_BACKEND", "typo")
    with pytest.raises(BackendNotFound, match="ATTNPLUG_BACKEND=typo"):
        registry.get_backend()
    assert issubclass(BackendNotFound, RegistryError) and issubclass(BackendUnavailable, RegistryError)
    assert issubclass(AmbiguousBackend, RegistryError) and issubclass(RegistryError, LookupError)


def test_tie_at_the_top_is_an_error_naming_the_candidates(tree):
    tree.add(
        "d",
        {
            "p": plugin_source(
                [
                    reg("b", priority=100),
                    reg("a", priority=100),
                    reg("c", priority=100, available=False),
                    reg("low", priority=1),
                ]
            )
        },
    )
    registry = tree.load()
    with pytest.raises(AmbiguousBackend) as exc:
        registry.get_backend()
    assert exc.value.candidates == ("a", "b") and exc.value.priority == 100
    assert "a, b" in str(exc.value) and "ATTNPLUG_BACKEND" in str(exc.value)
    assert registry.get_backend("a") is StandInBackend  # a name settles it


def test_tie_below_the_top_does_not_matter(tree):
    tree.add("d", {"p": plugin_source([reg("top", priority=2), reg("x", priority=1), reg("y", priority=1)])})
    assert tree.load().select()[0] == "top"


def test_nothing_available(tree):
    tree.add(
        "d",
        {
            "p": plugin_source([reg("off", available=False, reason="no device")]),
            "broken": plugin_source(body="raise ImportError('nope')"),
        },
    )
    with pytest.raises(BackendUnavailable) as exc:
        tree.load().get_backend()
    assert "no attention backend is available" in str(exc.value)
    assert "off: no device" in str(exc.value) and "nope" in str(exc.value)
    with pytest.raises(BackendUnavailable, match="no plugin registered one"):
        load_registry(entry_points=[]).get_backend()


# ---------------------------------------------------------------------------- allow-list
def test_allow_list_from_environment(tree, monkeypatch):
    modules = tree.add(
        "d",
        {"a": plugin_source([reg("a")]), "b": plugin_source([reg("b", priority=9)]), "c": plugin_source([reg("c")])},
    )
    monkeypatch.setenv("ATTNPLUG_PLUGINS", " a , c,")
    registry = tree.load()
    assert registry.names() == ("a", "c")
    assert registry.allow == ("a", "c")
    error = one_error(registry, "b")
    assert error.kind == "disabled" and error.reason == "not in ATTNPLUG_PLUGINS=a,c"
    assert modules["b"] not in sys.modules  # not even imported
    with pytest.raises(BackendUnavailable, match="was not loaded: not in ATTNPLUG_PLUGINS=a,c"):
        registry.get_backend("b")
    with pytest.raises(AmbiguousBackend):  # a and c tie once b is gone
        registry.get_backend()


def test_allow_argument_overrides_environment(tree, monkeypatch):
    tree.add("d", {"a": plugin_source([reg("a")]), "b": plugin_source([reg("b")])})
    monkeypatch.setenv("ATTNPLUG_PLUGINS", "a")
    assert tree.load(allow=["b"]).names() == ("b",)
    monkeypatch.setenv("ATTNPLUG_PLUGINS", "")
    assert tree.load().names() == ("a", "b")  # empty means no allow-list
