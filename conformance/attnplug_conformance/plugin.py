"""The pytest plugin of the attnplug conformance suite (entry point ``pytest11``:
``attnplug_conformance = "attnplug_conformance.plugin"``).

Inert unless asked: without ``--attnplug-backend`` it collects nothing and changes nothing;
it only defines the fixtures below (which nothing in an ordinary test run requests).

Asked with ``--attnplug-backend=NAME`` (repeatable; a registry name or ``module:Class``):

* when no test paths are given on the command line, the session collects the suite's check
  modules (``attnplug_conformance/checks/check_*.py``) instead of ``testpaths``; given paths
  are collected as usual (and the check modules among them are collected too);
* every test that uses the backend fixtures is parametrised over the named backends (the
  backend is the first component of the test id: ``check_x[reference-DECODE]``);
* the suite's tests run cheapest-and-sharpest first (``run_order``), so ``-x`` stops early on
  a broken backend; ``--attnplug-quick`` runs only the first round and the cases covering
  every declared shape;
* the FP8 axis (``config.kv_axis``: tests ``...-kv_fp8_e4m3``, ``...-kv_fp8_e5m2``): a cache
  dtype outside ``config.DEFAULT_FP8_KV_DTYPES`` runs in the first round only unless
  ``--attnplug-thorough`` is given (its other tests are deselected).

A third-party plugin adopts the suite with one line in a test file (docs/conformance.md)::

    from attnplug_conformance.suite import *  # noqa: F401,F403

and names its backend with ``--attnplug-backend`` or the ini option ``attnplug_backends``
(default when neither is given: every available registered backend).

Expected failures: a backend class may declare ``conformance_xfail = {"check_name": "reason"}``
(keys: a check name such as ``check_swa_buffer_contract``, optionally narrowed with a glob on
the rest of the test id: ``check_replay_equals_eager[TARGET_VERIFY*]``). Matching tests are
marked ``xfail(strict=True)``: they must fail, and an unexpected pass is a failure.
"""

from __future__ import annotations

import fnmatch
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

import pytest
import torch

from .selection import ResolvedBackend, SelectionError, resolve_backend

CHECKS_DIR = Path(__file__).resolve().parent / "checks"
BACKEND_PARAM = "attnplug_backend_name"
XFAIL_ATTR = "conformance_xfail"

__all__ = ["CHECKS_DIR", "check_name_of", "check_names"]


# ---------------------------------------------------------------------------- state
@dataclass
class _State:
    cli: List[str] = field(default_factory=list)
    ini: List[str] = field(default_factory=list)
    device: Optional[str] = None
    resolved: Dict[str, ResolvedBackend] = field(default_factory=dict)
    errors: Dict[str, str] = field(default_factory=dict)

    @property
    def asked(self) -> bool:
        """The command line asked for the suite (``--attnplug-backend``)."""
        return bool(self.cli)

    def backends(self) -> List[str]:
        if self.cli:
            return list(self.cli)
        if self.ini:
            return list(self.ini)
        from attnplug import registry

        return [info.name for info in registry.available_backends() if info.available]

    def resolve(self, spec: str) -> ResolvedBackend:
        if spec in self.errors:
            raise SelectionError(self.errors[spec])
        if spec not in self.resolved:
            try:
                self.resolved[spec] = resolve_backend(spec, self.device)
            except SelectionError as exc:
                self.errors[spec] = str(exc)
                raise
        return self.resolved[spec]


_STATE = pytest.StashKey[_State]()
#: the ``workerinput`` key that carries this process's ``sys.path`` to pytest-xdist workers
_WORKER_SYS_PATH = "attnplug_sys_path"


def _state(config) -> _State:
    state = config.stash.get(_STATE, None)
    if state is None:  # a fixture used before configure (should not happen): inert defaults
        state = config.stash[_STATE] = _State()
    return state


# ---------------------------------------------------------------------------- options
def pytest_addoption(parser) -> None:
    group = parser.getgroup("attnplug", "attnplug conformance suite")
    group.addoption(
        "--attnplug-backend",
        action="append",
        default=[],
        dest="attnplug_backends",
        metavar="NAME",
        help="run the attnplug conformance suite against backend NAME (a registry name, or module:Class "
        "for a class that is not registered yet); repeatable. Without it the plugin is inert.",
    )
    group.addoption(
        "--attnplug-device",
        default=None,
        dest="attnplug_device",
        metavar="DEVICE",
        help="torch device for the backends under test (default: from the registry probe; 'cpu' for "
        "module:Class backends)",
    )
    group.addoption(
        "--attnplug-thorough",
        action="store_true",
        default=False,
        dest="attnplug_thorough",
        help="attnplug conformance: also run every combination of the declared dtypes, head dims and page sizes",
    )
    group.addoption(
        "--attnplug-quick",
        action="store_true",
        default=False,
        dest="attnplug_quick",
        help="attnplug conformance: run only the first round (a cheap case of every check and bug class) and "
        "the cases covering every declared head dim and page size; a fast look, not a full result",
    )
    parser.addini(
        "attnplug_backends",
        type="args",
        default=[],
        help="attnplug conformance: backends the adopted suite runs against when "
        "--attnplug-backend is not given (default: every available backend)",
    )
    parser.addini("attnplug_device", default="", help="attnplug conformance: default for --attnplug-device")


def pytest_configure(config) -> None:
    controller_path = getattr(config, "workerinput", {}).get(_WORKER_SYS_PATH)
    if controller_path:  # a pytest-xdist worker: import what the controller imports
        sys.path[:0] = [p for p in controller_path if p not in sys.path]
    state = _State(
        cli=list(config.getoption("attnplug_backends") or []),
        ini=list(config.getini("attnplug_backends") or []),
        device=config.getoption("attnplug_device") or config.getini("attnplug_device") or None,
    )
    config.stash[_STATE] = state
    if not state.asked:
        return
    problems = []
    for spec in state.cli:
        try:
            state.resolve(spec)
        except SelectionError as exc:
            problems.append(str(exc))
    if problems:
        raise pytest.UsageError("attnplug conformance: " + "\n".join(problems))
    args_source = getattr(config, "args_source", None)
    if args_source is not None and args_source != config.ArgsSource.ARGS:
        # No paths on the command line: run the suite instead of testpaths / the current dir.
        config.args = [str(CHECKS_DIR)]


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    """Spread over pytest-xdist workers (``attnplug conformance --jobs``), each worker gets
    this process's ``sys.path``: a ``module:Class`` backend found on a path added here (a
    test directory, a script's folder) imports there too."""
    if _state(node.config).asked:
        node.workerinput[_WORKER_SYS_PATH] = list(sys.path)


# ---------------------------------------------------------------------------- collection
def _is_check_module(path: Path) -> bool:
    return path.suffix == ".py" and path.name.startswith("check_") and path.resolve().parent == CHECKS_DIR


def pytest_collect_file(file_path: Path, parent):
    if not _state(parent.config).asked or not _is_check_module(file_path):
        return None
    patterns = parent.config.getini("python_files") or []
    if any(fnmatch.fnmatch(file_path.name, p) for p in patterns):
        return None  # the python plugin collects it already
    return pytest.Module.from_parent(parent, path=file_path)


def pytest_report_header(config) -> Optional[List[str]]:
    state = _state(config)
    if not state.asked:
        return None
    lines = []
    for spec in state.cli:
        r = state.resolved[spec]
        lines.append(f"attnplug conformance: backend {spec} ({r.target}) on {r.device}")
    return lines


@pytest.hookimpl(tryfirst=True)
def pytest_generate_tests(metafunc) -> None:
    if BACKEND_PARAM not in metafunc.fixturenames:
        return
    names = _state(metafunc.config).backends()
    metafunc.parametrize(BACKEND_PARAM, names, ids=names, indirect=True)


def check_name_of(item) -> str:
    """The check a test item belongs to: the name of the suite module that defines its
    function (``check_attention_matches_reference``), else the function's name."""
    function = getattr(item, "function", None)
    module = getattr(function, "__module__", "") or ""
    if module.startswith("attnplug_conformance.checks."):
        return module.rsplit(".", 1)[-1]
    return getattr(item, "originalname", None) or item.name.split("[")[0]


def check_names() -> List[str]:
    """Every check of the suite (the module names under ``checks/``)."""
    return sorted(p.stem for p in CHECKS_DIR.glob("check_*.py"))


def _param_id(item, backend: str) -> str:
    name = item.name
    if "[" not in name:
        return ""
    ident = name[name.index("[") + 1 : -1]
    if ident == backend:
        return ""
    if ident.startswith(backend + "-"):
        return ident[len(backend) + 1 :]
    return ident


def _xfail_reason(declared: dict, item, backend: str) -> Optional[str]:
    check = check_name_of(item)
    func = getattr(item, "originalname", None) or check
    params = _param_id(item, backend)
    for key, reason in declared.items():
        base, _, pattern = str(key).partition("[")
        if base not in (check, func):
            continue
        if not pattern or fnmatch.fnmatchcase(params, pattern.rstrip("]")):
            return str(reason)
    return None


#: the order the suite's tests run in, so that a run with ``-x`` stops early on a broken
#: backend:
#:
#: 0. the first round: a cheap representative of every check and of the attention check's
#:    bug classes (``_FIRST_ROUND_CASES``: each mode, batch sizes 1 and 10, an explicit
#:    scaling, a half-precision output, a tile boundary, a long context, a DECODE step over
#:    each FP8 cache, the op layer over an FP8 cache), check by check in ``_CHECK_ORDER``; a
#:    check without cases contributes its first ``_FIRST_ROUND_COUNT`` parametrizations
#:    (default 1) with the model's cache dtype;
#: 1. the costly cases that cover every declared shape (every head dim, every page size);
#: 2. the rest, check by check;
#: 3. the remaining costly cases (longer tiles, scenarios, the other long context, the FP8
#:    cases of every head dim and every page size).
_CHECK_ORDER = {
    "check_capabilities_honest": 0,
    "check_pdl_on_off_identical": 1,
    "check_swa_buffer_contract": 2,
    "check_replay_metadata_sync_free": 3,
    "check_translates_once_per_step": 4,
    "check_kv_written_only_at_step_slots": 5,
    "check_attention_matches_reference": 6,
    "check_softcap_and_sinks": 6.5,
    "check_sampled_worlds": 6.7,
    "check_replay_equals_eager": 7,
    "check_accepts_seq_lens_cpu_none": 8,
    "check_matches_transformers": 9,
    "check_paged_ops": 9.5,
    "check_large_kv_buffers": 10,
}
_FIRST_ROUND_CASES = {
    "EXTEND_no_prefix-gqa4-window_smaller",
    "EXTEND_prefix-gqa4-window_smaller",
    "DECODE-gqa4-window_smaller",
    "TARGET_VERIFY-gqa4-window_smaller",
    "DRAFT_EXTEND-gqa4-window_smaller",
    "IDLE-gqa4-window_smaller",
    "DECODE-bs1",
    "DECODE-bs10",
    "EXTEND_prefix-bs1",
    "DECODE-scaling0.3",
    "DECODE-bfloat16",
    "tiles-31_32_33",
    "long_context-float16",
    "softcap-modes",
    "bs16-interleaved-window",
    "sinks-modes",
    "softcap_sinks-kv_split",
    "undeclared_refused",
    # the FP8 axis (a case id, then the cache's part of the test id: config.kv_id)
    "DECODE-gqa4-window_smaller-kv_fp8_e4m3",
    "DECODE-gqa4-window_smaller-kv_fp8_e5m2",
    "bs16-interleaved-window-kv_fp8_e4m3",
}
#: tests of the first round per check without cases (their first parametrizations); default 1
_FIRST_ROUND_COUNT = {"check_capabilities_honest": 4, "check_kv_written_only_at_step_slots": 2}
#: the costly attention kinds, in the order they run after the first round (cheapest first)
_COSTLY_KINDS = {
    "long_context": 0,
    "tiles": 1,
    "every_head_dim": 2,
    "every_page_size": 3,
    "scenario": 4,
    "every_combination": 5,
}
_COSTLY_FIRST = {"every_head_dim", "every_page_size"}
#: ``--attnplug-quick`` runs ranks 0 and 1 (the first round and every declared shape)
QUICK_LAST_RANK = 1


def _kv_cache_dtype(item):
    """The item's FP8 axis value (``config.KV_PARAM``): None or an FP8 dtype."""
    from .config import KV_PARAM

    return getattr(getattr(item, "callspec", None), "params", {}).get(KV_PARAM)


def run_order(item) -> tuple:
    """Sort key of a test in the run order (non-suite tests first, in their order). A test of
    the FP8 axis is in the first round only when ``_FIRST_ROUND_CASES`` names its case with the
    cache (``DECODE-gqa4-window_smaller-kv_fp8_e4m3``); its costly cases run last."""
    from .config import kv_id

    check = check_name_of(item)
    if check not in _CHECK_ORDER:
        return (-1, 0)
    callspec = getattr(item, "callspec", None)
    params = getattr(callspec, "params", {})
    case = params.get("case")
    kv = _kv_cache_dtype(item)
    if case is not None:
        if (case.id if kv is None else f"{case.id}-{kv_id(kv)}") in _FIRST_ROUND_CASES:
            return (0, _CHECK_ORDER[check])
        if case.kind in _COSTLY_KINDS:
            return (1 if kv is None and case.id in _COSTLY_FIRST else 3, _COSTLY_KINDS[case.kind])
        return (2, _CHECK_ORDER[check])
    indices = getattr(callspec, "indices", {})
    first = kv is None and all(
        i < _FIRST_ROUND_COUNT.get(check, 1) for name, i in indices.items() if name != BACKEND_PARAM
    )
    return (0 if first else 2, _CHECK_ORDER[check])


def _deselect(config, items, drop) -> None:
    """Remove the items ``drop(item)`` is true for, reporting them as deselected."""
    deselected = [i for i in items if drop(i)]
    if deselected:
        items[:] = [i for i in items if not drop(i)]
        config.hook.pytest_deselected(items=deselected)


def pytest_collection_modifyitems(session, config, items) -> None:
    state = _state(config)
    if state.asked or any(BACKEND_PARAM in getattr(getattr(i, "callspec", None), "params", {}) for i in items):
        items[:] = sorted(items, key=run_order)  # stable: the order inside a rank is kept
        if not config.getoption("attnplug_thorough", False):
            from .config import DEFAULT_FP8_KV_DTYPES

            def thorough_only(item) -> bool:  # an FP8 cache of the thorough profile, past the first round
                kv = _kv_cache_dtype(item)
                return kv is not None and kv not in DEFAULT_FP8_KV_DTYPES and run_order(item)[0] > 0

            _deselect(config, items, thorough_only)
        if config.getoption("attnplug_quick", False):
            _deselect(config, items, lambda item: run_order(item)[0] > QUICK_LAST_RANK)
    known = set(check_names())
    warned = set()
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is None or BACKEND_PARAM not in callspec.params:
            continue
        backend = callspec.params[BACKEND_PARAM]
        try:
            cls = state.resolve(backend).cls
        except SelectionError:
            continue  # reported by the fixture at setup
        declared = getattr(cls, XFAIL_ATTR, None) or {}
        if not declared:
            continue
        if not isinstance(declared, dict):
            raise pytest.UsageError(
                f"{cls.__name__}.{XFAIL_ATTR} must be a dict {{check name: reason}}, got {type(declared).__name__}"
            )
        if cls not in warned:
            warned.add(cls)
            for key in declared:
                base = str(key).partition("[")[0]
                if base not in known:
                    warnings.warn(
                        pytest.PytestConfigWarning(
                            f"{cls.__name__}.{XFAIL_ATTR}: {key!r} names no check (checks: {', '.join(sorted(known))})"
                        ),
                        stacklevel=2,
                    )
        reason = _xfail_reason(declared, item, backend)
        if reason is not None:
            item.add_marker(pytest.mark.xfail(reason=f"{cls.__name__}.{XFAIL_ATTR}: {reason}", strict=True))


# ---------------------------------------------------------------------------- fixtures
@pytest.fixture
def attnplug_backend_name(request) -> str:
    """The backend under test as it was named: a registry name (``reference``) or a
    ``module:Class`` path. Parametrised by the plugin over ``--attnplug-backend`` (or the
    ini option ``attnplug_backends``, or every available backend)."""
    param = getattr(request, "param", None)
    if param is None:
        pytest.fail(
            "attnplug_backend_name is parametrised by the attnplug_conformance plugin; "
            "it was not (is the plugin loaded?)"
        )
    return param


@pytest.fixture
def attnplug_backend(request, attnplug_backend_name) -> ResolvedBackend:
    """The resolved backend under test: ``.cls``, ``.device``, ``.target`` ("module:Class"),
    ``.source`` ("registry" or "class"), ``.distribution``."""
    try:
        return _state(request.config).resolve(attnplug_backend_name)
    except SelectionError as exc:
        pytest.fail(f"attnplug conformance: {exc}", pytrace=False)


@pytest.fixture
def attnplug_backend_cls(attnplug_backend):
    """The class of the backend under test (an ``attnplug.AttentionBackend`` subclass)."""
    return attnplug_backend.cls


@pytest.fixture
def attnplug_device(attnplug_backend) -> torch.device:
    """The ``torch.device`` the backend under test runs on: ``--attnplug-device`` if given,
    else the device its registry probe reports, else the host (``module:Class`` backends)."""
    return attnplug_backend.device


@pytest.fixture
def attnplug_capabilities(attnplug_backend_cls, attnplug_device):
    """``capabilities()`` of the backend under test, built over a small pool on
    ``attnplug_device`` (cached). Checks skip only from these."""
    from .support import BackendConstructionError, probe_capabilities

    try:
        return probe_capabilities(attnplug_backend_cls, attnplug_device)
    except BackendConstructionError as exc:
        pytest.fail(f"attnplug conformance: {exc}", pytrace=False)


def _world_factory(backend_cls, device) -> Callable:
    from .harness import World, WorldSpec
    from .support import env as env_context

    def make(spec: Optional["WorldSpec"] = None, seed: int = 0, *, env: Optional[dict] = None) -> "World":
        with env_context(env):
            return World(spec if spec is not None else WorldSpec(), backend_cls, device, seed=seed)

    return make


@pytest.fixture
def attnplug_world(attnplug_backend_cls, attnplug_device):
    """Factory ``attnplug_world(spec=WorldSpec(...), seed=0, env=None) -> World``: a KV pool,
    allocator, request table and the backend under test on ``attnplug_device``
    (``attnplug_conformance.harness.World``). ``env`` sets environment variables only while
    the backend is constructed (e.g. ``{"ATTNPLUG_DISABLE_PDL": "1"}``)."""
    return _world_factory(attnplug_backend_cls, attnplug_device)


@pytest.fixture
def attnplug_thorough(request) -> bool:
    """True with ``--attnplug-thorough`` (``attnplug conformance --thorough``): checks add
    their costly combinations (every declared dtype x head dim x page size)."""
    return bool(request.config.getoption("attnplug_thorough", False))


@pytest.fixture
def attnplug_reference_world(attnplug_device):
    """Factory with the same signature as ``attnplug_world`` whose backend is the
    ``ReferenceBackend``: called with the same ``spec`` and ``seed`` it yields a twin world
    (same inputs, same slots) for comparison."""
    from attnplug.backends.reference import ReferenceBackend

    return _world_factory(ReferenceBackend, attnplug_device)
