"""Helpers for the registry tests: real distributions (``*.dist-info`` with ``entry_points.txt``)
written to a temporary directory, so plugins are found by ``importlib.metadata`` exactly as
installed ones are, plus stand-in backend classes.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import itertools
import os
import re
import subprocess
import sys
import textwrap
import types
from pathlib import Path
from typing import Dict, Iterable, List, Optional

from child import HANG_LIMIT_S

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = None

from attnplug.backend import AttentionBackend, Capabilities, GraphSupport

GROUP = "attnplug.backends"
ROOT = Path(__file__).resolve().parents[1]
#: the source folders the project's pyproject.toml maps to import packages
PROJECT_PATHS = [
    ROOT / "core",
    ROOT / "plugins" / "cuda",
    ROOT / "plugins" / "ascend",
    ROOT / "plugins" / "xpu",
    ROOT / "conformance",
]

_counter = itertools.count()


def unique(prefix: str) -> str:
    """A module name no other test uses (sys.modules keeps imported modules)."""
    return f"{prefix}_{os.getpid()}_{next(_counter)}"


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def write_dist_info(root: Path, dist: str, version: str, entry_points: Dict[str, str], group: str = GROUP) -> Path:
    """Write ``<dist>-<version>.dist-info`` (METADATA, entry_points.txt) under ``root``."""
    info = Path(root) / f"{_normalize(dist)}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    lines = [f"[{group}]"] + [f"{name} = {value}" for name, value in entry_points.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return info


def entry_points_in(*roots: Path, group: str = GROUP) -> List[importlib.metadata.EntryPoint]:
    """The entry points of ``group`` of the distributions under ``roots`` (each with its dist),
    sorted by (distribution, name)."""
    eps = []
    for dist in importlib.metadata.distributions(path=[str(r) for r in roots]):
        eps.extend(ep for ep in dist.entry_points if ep.group == group)
    return sorted(eps, key=lambda ep: (_normalize(ep.dist.name), ep.name))


def project_entry_points() -> Dict[str, str]:
    """``[project.entry-points."attnplug.backends"]`` of the project's pyproject.toml."""
    text = (ROOT / "pyproject.toml").read_text()
    if tomllib is not None:
        data = tomllib.loads(text)
        return dict(data["project"]["entry-points"][GROUP])
    section = text.split(f'[project.entry-points."{GROUP}"]', 1)[1].split("\n[", 1)[0]  # pragma: no cover
    return dict(re.findall(r'^(\S+)\s*=\s*"([^"]+)"', section, re.M))  # pragma: no cover


def project_version() -> str:
    return re.search(r'^version\s*=\s*"([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)


def write_project_metadata(root: Path) -> Path:
    """The attnplug distribution's metadata as an install writes it (entry points from
    pyproject.toml), so the built-in plugins load through the same path as any other."""
    return write_dist_info(root, "attnplug", project_version(), project_entry_points())


def plugin_source(
    registrations: Iterable[str] = (),
    *,
    api: Optional[str] = "1.0",
    body: str = "",
    hook: bool = True,
    then: Iterable[str] = (),
) -> str:
    """Source of a plugin module. ``registrations`` are ``register(...)`` argument strings;
    ``then`` are statements run in the hook after them."""
    lines = ["from attnplug.registry import hookimpl, ProbeResult"]
    if api is not None:
        lines.append(f"PLUGIN_API_VERSION = {api!r}")
    lines.append(textwrap.dedent(body))
    if hook:
        lines.append("@hookimpl\ndef attnplug_register_backends(register):")
        regs = list(registrations)
        lines += [f"    register({r})" for r in regs] + [f"    {stmt}" for stmt in then] + ["    pass"]
    return "\n".join(lines) + "\n"


def reg(
    name: str,
    target: str = "plugin_dists:StandInBackend",
    priority: int = 0,
    available: bool = True,
    reason: str = "stand-in",
) -> str:
    """A ``register(...)`` argument string whose probe returns ``(available, reason)``."""
    return f"name={name!r}, backend={target!r}, probe=lambda: ({available!r}, {reason!r}), priority={priority}"


class DistTree:
    """A temporary site directory holding plugin distributions and their modules."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def add(self, dist: str, plugins: Dict[str, str], version: str = "1.0") -> Dict[str, str]:
        """Add distribution ``dist`` with one entry point per ``plugins`` item
        (entry-point name -> module source, or ``"=module:attr"`` to name an existing target).
        Returns entry-point name -> module name."""
        mapping, modules = {}, {}
        for ep_name, source in plugins.items():
            if source.startswith("="):
                mapping[ep_name] = source[1:]
                continue
            module = unique(f"plug_{_normalize(ep_name)}")
            (self.root / f"{module}.py").write_text(source)
            mapping[ep_name] = modules[ep_name] = module
        write_dist_info(self.root, dist, version, mapping)
        return modules

    def module(self, source: str, prefix: str = "mod") -> str:
        """Write a module (not an entry point) under the tree; returns its name."""
        module = unique(prefix)
        (self.root / f"{module}.py").write_text(source)
        return module

    def entry_points(self) -> List[importlib.metadata.EntryPoint]:
        return entry_points_in(self.root)

    def load(self, **kwargs):
        """``load_registry`` over this tree's entry points only."""
        from attnplug.registry import load_registry

        return load_registry(entry_points=self.entry_points(), **kwargs)


def one_error(registry, plugin: str):
    """The one load error ``registry`` records for ``plugin``."""
    matches = [e for e in registry.errors if e.plugin == plugin]
    assert len(matches) == 1, registry.errors
    return matches[0]


def plugin_module(*registrations: str, body: str = "") -> types.ModuleType:
    """A plugin as a module object (for ``extra_plugins``): ``plugin_source`` executed."""
    module = types.ModuleType(unique("plugin_module"))
    exec(plugin_source(registrations, body=body), module.__dict__)
    return module


# ---------------------------------------------------------------------------- stand-in backends
class StandInBackend(AttentionBackend):
    """Implements the contract's methods trivially: only used for selection tests."""

    name = "stand-in"
    needs_cpu_seq_lens = False

    def capabilities(self) -> Capabilities:  # pragma: no cover - never instantiated
        return Capabilities("cpu", False, False, GraphSupport.NEVER, (), (), (), False)

    def init_forward_metadata(self, batch):  # pragma: no cover
        raise NotImplementedError

    def init_cuda_graph_state(self, max_bs, max_num_tokens):  # pragma: no cover
        raise NotImplementedError

    def init_forward_metadata_capture_cuda_graph(self, batch):  # pragma: no cover
        raise NotImplementedError

    def init_forward_metadata_replay_cuda_graph(self, batch):  # pragma: no cover
        raise NotImplementedError

    def get_cuda_graph_seq_len_fill_value(self):  # pragma: no cover
        return 1

    def forward(self, q, k, v, layer_id, batch, save_kv_cache=True, *, sinks=None):  # pragma: no cover
        raise NotImplementedError


class OtherStandIn(StandInBackend):
    needs_cpu_seq_lens = True


class DescribedStandIn(StandInBackend):
    @classmethod
    def describe(cls):
        return {"pdl": True, "graphs": GraphSupport.UNIFORM, "dtypes": (__import__("torch").float16,)}


class BrokenDescribeStandIn(StandInBackend):
    @classmethod
    def describe(cls):
        raise RuntimeError("describe exploded")


class AbstractStandIn(AttentionBackend):
    """Does not implement the abstract methods."""


class NotABackend:
    pass


def _can_build_without_isolation() -> bool:
    """setuptools >= 70.1 builds wheels by itself; older ones need the wheel package."""
    from attnplug.versions import at_least, installed_version

    setuptools = installed_version("setuptools")
    return setuptools is not None and (at_least(setuptools, (70, 1)) or importlib.util.find_spec("wheel") is not None)


def subprocess_env(*paths) -> Dict[str, str]:
    """This process's environment without ``ATTNPLUG_*`` flags, with ``paths`` and then the
    project's source folders as the PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNPLUG_")}
    env["PYTHONPATH"] = os.pathsep.join([str(p) for p in paths] + [str(p) for p in PROJECT_PATHS])
    return env


def run_cli(env: Dict[str, str], *args: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """``python -m attnplug.cli ARGS`` as a user runs it, in ``env`` and ``cwd``."""
    return subprocess.run(
        [sys.executable, "-m", "attnplug.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=str(cwd),
    )


def install_plugins(sources: Iterable[Path], tmp: Path) -> Dict[str, str]:
    """``pip install --no-deps --target tmp/site`` the plugin source folders, write the attnplug
    distribution's own entry points into ``tmp/meta`` (as an install writes them) and return
    the environment (no ``ATTNPLUG_*`` flags) in which a subprocess sees both."""
    site, meta = tmp / "site", tmp / "meta"
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps"]
    cmd += ["--target", str(site)]
    if _can_build_without_isolation():
        cmd += ["--no-build-isolation", "--no-index"]
    out = subprocess.run(cmd + [str(p) for p in sources], capture_output=True, text=True, timeout=HANG_LIMIT_S)
    assert out.returncode == 0, out.stdout + out.stderr
    write_project_metadata(meta)
    return subprocess_env(site, meta)
