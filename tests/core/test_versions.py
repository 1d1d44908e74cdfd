"""``attnplug.versions``: the one parser of package and plugin API versions."""

from __future__ import annotations

import pytest

from attnplug.versions import api_version, at_least, dotted, installed_version, release


@pytest.mark.parametrize(
    "text, expected",
    [
        ("3.5.0", (3, 5, 0)),
        ("3.5", (3, 5)),
        ("3.5.0+git1234", (3, 5, 0)),
        ("2.13.0+cpu", (2, 13, 0)),
        ("2.13.0.dev20250101", (2, 13, 0)),
        ("3.5rc1", (3, 5)),
        ("3.10.1.post2", (3, 10, 1)),
        ("v1.2", (1, 2)),
        (" 12 ", (12,)),
        ("?", ()),
        ("unknown", ()),
        ("", ()),
        (None, ()),
    ],
)
def test_release(text, expected):
    assert release(text) == expected


def test_at_least_compares_numbers_not_text():
    assert at_least("3.10.0", (3, 5)) and at_least("3.5.0+git", (3, 5)) and at_least("3.5", (3, 5))
    assert not at_least("3.4.1", (3, 5)) and not at_least("2.99", (3, 5)) and not at_least("?", (3, 5))
    assert at_least("3.5rc1", (3, 5)) and not at_least("3", (3, 5))
    assert dotted((3, 5)) == "3.5" and dotted((2, 13, 0)) == "2.13.0"


def test_api_version_is_exactly_major_dot_minor():
    assert api_version("1.0") == (1, 0) and api_version("12.34") == (12, 34)
    for bad in ("1", "1.0.0", " 1.0", "1.0\n", "v1.0", "1.x", 1.0, 1, None, b"1.0"):
        assert api_version(bad) is None, bad


def test_installed_version():
    import pytest as _pytest

    assert installed_version("pytest") == _pytest.__version__
    assert installed_version("attnplug-no-such-distribution") is None
