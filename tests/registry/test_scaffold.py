"""``attnplug new-plugin NAME`` writes a plugin in the one plugin shape; as generated it installs
(pip, into an isolated directory) and passes ``attnplug conformance --backend NAME``."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

from attnplug import cli
from attnplug.scaffold import TEMPLATES, ScaffoldError, plugin_names, write_plugin
from child import HANG_LIMIT_S
from plugin_dists import install_plugins

pytestmark = pytest.mark.slow  # builds, installs and certifies a generated plugin


NAME = "scaffolded"


def test_names_are_validated_before_anything_is_written(tmp_path, capsys):
    for bad in ("Bad", "1x", "my-dev", "", "class", "x" * 41):
        with pytest.raises(ScaffoldError, match="NAME must be"):
            write_plugin(bad, tmp_path / "p")
    with pytest.raises(ScaffoldError, match="registered by the attnplug distribution"):
        write_plugin("reference", tmp_path / "p")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(ScaffoldError, match="not an empty directory"):
        write_plugin(NAME, tmp_path / "full")
    assert not (tmp_path / "p").exists() and os.listdir(tmp_path / "full") == ["keep.txt"]
    assert cli.main(["new-plugin", "Bad", "--dir", str(tmp_path / "q")]) == 2
    assert capsys.readouterr().err.startswith("attnplug: error: new-plugin: NAME must be")


def test_the_generated_plugin_has_the_one_plugin_shape(tmp_path, capsys):
    root = tmp_path / "plugin"
    assert cli.main(["new-plugin", "my_dev", "--dir", str(root)]) == 0
    assert "attnplug conformance --backend my_dev" in capsys.readouterr().out
    names = plugin_names("my_dev")
    files = {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}
    assert files == {out.format(package=names.package) for out in TEMPLATES.values()}
    assert {"plugin.py", "backend.py", "device.py"} <= {p.name for p in (root / names.package).iterdir()}
    for path in root.rglob("*.py"):
        ast.parse(path.read_text(), str(path))  # every template rendered to valid Python
    pyproject = (root / "pyproject.toml").read_text()
    assert '[project.entry-points."attnplug.backends"]\nmy_dev = "attnplug_my_dev.plugin"' in pyproject
    assert 'name = "attnplug-my-dev"' in pyproject
    backend = (root / names.package / "backend.py").read_text()
    assert "class MyDevBackend(PortableBackend):" in backend and "device_part = MyDevDevice()" in backend
    assert "ReferenceBackend" not in backend  # the portable base, never the oracle
    assert (root / "tests" / "test_conformance.py").read_text().count("\n") == 1


def test_the_generated_plugin_installs_and_passes_conformance(tmp_path):
    root = tmp_path / "src"
    write_plugin(NAME, root)
    env = install_plugins([root], tmp_path)
    # The suite as a user runs it on the generated plugin, in its quick profile (every check's
    # first round, every declared shape): as generated the plugin is the portable path, whose
    # whole suite the reference's run covers.
    res = subprocess.run(
        [sys.executable, "-m", "attnplug.cli", "conformance", "--backend", NAME, "--quick"],
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_LIMIT_S,
    )
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert NAME in res.stdout and "conformance (quick profile): PASSED" in res.stdout
