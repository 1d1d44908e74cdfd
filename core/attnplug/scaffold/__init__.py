"""``attnplug new-plugin NAME [--dir D]``: write a new plugin in the shape every plugin has.

The generated distribution (``attnplug-NAME``, import package ``attnplug_NAME``)::

    pyproject.toml               the entry point in the group attnplug.backends
    README.md
    attnplug_NAME/__init__.py
    attnplug_NAME/plugin.py      PLUGIN_API_VERSION, the probe, the registration hook
    attnplug_NAME/backend.py     the backend, on the portable PyTorch base
    attnplug_NAME/device.py      its device part (graphs, sync guard, synchronize, info facts)
    tests/test_conformance.py    one line: the whole conformance suite

As generated it installs (``pip install .``) and passes ``attnplug conformance --backend
NAME``. The files come from ``templates/`` (``string.Template``: ``$name``, ``$package``, ...).
"""

from __future__ import annotations

import keyword
import re
import string
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Dict, List, Optional

__all__ = ["ScaffoldError", "PluginNames", "plugin_names", "write_plugin", "TEMPLATES"]

#: template file -> path in the generated project (``{package}`` is the import package)
TEMPLATES: Dict[str, str] = {
    "pyproject.toml.tmpl": "pyproject.toml",
    "README.md.tmpl": "README.md",
    "init.py.tmpl": "{package}/__init__.py",
    "plugin.py.tmpl": "{package}/plugin.py",
    "backend.py.tmpl": "{package}/backend.py",
    "device.py.tmpl": "{package}/device.py",
    "test_conformance.py.tmpl": "tests/test_conformance.py",
}

_NAME = re.compile(r"^[a-z][a-z0-9_]{0,39}$")


class ScaffoldError(ValueError):
    """The plugin cannot be written (names the argument and the value)."""


@dataclass(frozen=True)
class PluginNames:
    """Every name the generated plugin uses, derived from the backend name."""

    name: str  # backend name and entry point name, e.g. "my_dev"
    package: str  # import package, "attnplug_my_dev"
    distribution: str  # distribution, "attnplug-my-dev"
    backend_class: str  # "MyDevBackend"
    device_class: str  # "MyDevDevice"


def plugin_names(name: str) -> PluginNames:
    """Validate ``name`` (lowercase letters, digits and ``_``, starting with a letter, at most
    40 characters; not a name the attnplug distribution registers) and derive the rest."""
    if not isinstance(name, str) or not _NAME.match(name) or keyword.iskeyword(name):
        raise ScaffoldError(
            f"NAME must be lowercase letters, digits and '_', starting with a letter "
            f"(at most 40 characters), got {name!r}"
        )
    reserved = _reserved_names()
    if name in reserved:
        raise ScaffoldError(
            f"NAME {name!r} is registered by the attnplug distribution itself "
            f"({', '.join(sorted(reserved))}); choose another"
        )
    camel = "".join(part.capitalize() for part in name.split("_") if part)
    return PluginNames(
        name=name,
        package=f"attnplug_{name}",
        distribution=f"attnplug-{name.replace('_', '-')}",
        backend_class=f"{camel}Backend",
        device_class=f"{camel}Device",
    )


def _reserved_names() -> frozenset:
    """The entry-point names of the installed attnplug distribution (``reference`` always)."""
    from ..registry.discovery import ENTRY_POINT_GROUP, core_distributions

    names = {"reference"}
    for dist in core_distributions():
        names.update(ep.name for ep in dist.entry_points if ep.group == ENTRY_POINT_GROUP)
    return frozenset(names)


def _render(template: str, names: PluginNames) -> str:
    from ..registry import PLUGIN_API_VERSION

    text = resources.files(__package__).joinpath("templates", template).read_text(encoding="utf-8")
    return string.Template(text).substitute(
        name=names.name,
        package=names.package,
        distribution=names.distribution,
        backend_class=names.backend_class,
        device_class=names.device_class,
        api_version=PLUGIN_API_VERSION,
    )


def write_plugin(name: str, directory: Optional[Path] = None) -> List[Path]:
    """Write the plugin ``name`` into ``directory`` (default: ``./attnplug-NAME``), which must
    not exist or be empty; returns the files written. Raises ``ScaffoldError`` before writing
    anything when the name or the directory is refused."""
    names = plugin_names(name)
    root = Path(directory) if directory is not None else Path.cwd() / names.distribution
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise ScaffoldError(f"--dir {str(root)!r} exists and is not an empty directory")
    rendered = {root / out.format(package=names.package): _render(tmpl, names) for tmpl, out in TEMPLATES.items()}
    for path, text in rendered.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return list(rendered)
