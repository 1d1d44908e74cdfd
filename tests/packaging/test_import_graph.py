"""Layers without circles: no first-party module imports itself back, directly or through others.

The graph is read from source (``tests/import_graph.py``): every import statement of core,
the conformance suite and the plugins, at module level or inside a function (a lazy import
is still a dependency), except under ``if TYPE_CHECKING:``.
"""

from __future__ import annotations

import pathlib
import textwrap

import pytest

from import_graph import cycles, import_graph, module_files

ROOT = pathlib.Path(__file__).resolve().parents[2]
ROOTS = [
    ROOT / "core" / "attnplug",
    ROOT / "conformance" / "attnplug_conformance",
    *sorted(ROOT.glob("plugins/*/attnplug_*")),
]


def test_the_packages_import_no_circle():
    assert {root.name for root in ROOTS} >= {"attnplug", "attnplug_conformance", "attnplug_cuda"}
    found = cycles(import_graph(module_files(ROOTS)))
    if found:
        pytest.fail("import circles (break each: a leaf module both sides import, or pass it in):\n" + "\n".join(found))


def test_cycles_of_a_synthetic_graph():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert cycles({"b": {"a"}, "a": {"b"}}) == ["a -> b -> a"]
    assert cycles({"c": {"a"}, "a": {"b"}, "b": {"c", "d"}, "d": set()}) == ["a -> b -> c -> a"]
    # two circles through one module, and a separate one: each named
    graph = {"x": {"y", "z"}, "y": {"x"}, "z": {"x"}, "p": {"q"}, "q": {"p"}, "r": {"x"}}
    assert cycles(graph) == ["p -> q -> p", "x -> y -> x", "x -> z -> x"]


def _package(tmp_path: pathlib.Path, files: dict) -> pathlib.Path:
    root = tmp_path / "pkg"
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text), encoding="utf-8")
    return root


def test_a_planted_circle_is_found(tmp_path):
    """A lazy import inside a function closes a circle; ``from . import x`` of a submodule
    points at the submodule; a package importing its parent's ``__init__`` counts."""
    root = _package(
        tmp_path,
        {
            "__init__.py": "from .sub import helper\n",
            "cli.py": "from .sub import command\n\ndef fail():\n    pass\n",
            "sub/__init__.py": "def helper():\n    from .. import VERSION\n",
            "sub/command.py": "def run():\n    from ..cli import fail\n    return fail()\n",
        },
    )
    assert module_files([root]).keys() == {"pkg", "pkg.cli", "pkg.sub", "pkg.sub.command"}
    graph = import_graph(module_files([root]))
    assert graph == {
        "pkg": {"pkg.sub"},
        "pkg.cli": {"pkg.sub.command"},
        "pkg.sub": {"pkg"},
        "pkg.sub.command": {"pkg.cli"},
    }
    assert cycles(graph) == ["pkg -> pkg.sub -> pkg", "pkg.cli -> pkg.sub.command -> pkg.cli"]


def test_type_checking_imports_and_outside_modules_are_no_edges(tmp_path):
    root = _package(
        tmp_path,
        {
            "__init__.py": "",
            "a.py": """\
                from typing import TYPE_CHECKING

                import os.path
                import pkg.b.c

                if TYPE_CHECKING:
                    from pkg import z
                else:
                    from . import b
                """,
            "b/__init__.py": "",
            "b/c.py": "",
            "z.py": "import pkg.a\n",
        },
    )
    graph = import_graph(module_files([root]))
    assert graph["pkg.a"] == {"pkg.b", "pkg.b.c"}
    assert cycles(graph) == []
