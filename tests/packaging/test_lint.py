"""Lint and format: ``ruff check`` and ``ruff format --check`` over the code, with the
configuration in pyproject.toml ([tool.ruff]). Run only these with ``pytest -m lint``; fix with
``ruff check --fix`` and ``ruff format``."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from child import HANG_LIMIT_S

ROOT = pathlib.Path(__file__).resolve().parents[2]
PATHS = ["core", "plugins", "conformance", "tests", "examples", "benchmarks"]

pytestmark = pytest.mark.lint


def _ruff(*args: str) -> subprocess.CompletedProcess:
    pytest.importorskip("ruff", reason="ruff is not installed (pip install -e '.[test]')")
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args, *PATHS], cwd=ROOT, capture_output=True, text=True, timeout=HANG_LIMIT_S
    )


def test_ruff_check():
    result = _ruff("check", "--no-cache", "--output-format", "concise")
    assert result.returncode == 0, f"ruff check found problems (fix: ruff check --fix):\n{result.stdout}{result.stderr}"


def test_ruff_format():
    result = _ruff("format", "--no-cache", "--check")
    assert result.returncode == 0, f"files need formatting (fix: ruff format):\n{result.stdout}{result.stderr}"


def test_the_configuration_is_the_one_in_pyproject():
    """The check above really reads [tool.ruff]: a line of 121 characters is refused, one of 120 is not."""
    pytest.importorskip("ruff", reason="ruff is not installed (pip install -e '.[test]')")
    probe = "x = " + repr("a" * 114) + "\n"  # 120 characters
    for text, ok in ((probe, True), (probe.replace("a", "aa", 1), False)):
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "ruff",
                "check",
                "--no-cache",
                "--stdin-filename",
                str(ROOT / "core" / "attnplug" / "_probe.py"),
                "-",
            ],
            input=text,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=HANG_LIMIT_S,
        )
        assert (result.returncode == 0) is ok, result.stdout
