"""What is tested: the suite's dtypes, head dims, page sizes and tolerances, a backend's declared
capabilities (probed once over a small pool), the ``TestConfig`` a check runs in, and the skips
of a check whose needs the capabilities do not declare.

Also the environment a check may set (``env``; ``DISABLE_PDL_ENV``).
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass, replace
from typing import Dict, Iterator, Mapping, Optional, Sequence, Tuple, Type

import pytest
import torch

from attnplug import AttentionBackend, Capabilities, ForwardMode, GraphSupport
from attnplug.env import DISABLE_PDL
from attnplug.graphs import captured_modes

from .harness import World, WorldSpec

__all__ = [
    "SUITE_DTYPES",
    "SUITE_HEAD_DIMS",
    "SUITE_PAGE_SIZES",
    "ATTENTION_TOL",
    "REPLAY_TOL",
    "BackendConstructionError",
    "probe_capabilities",
    "TestConfig",
    "base_config",
    "require",
    "graph_modes",
    "require_graph_mode",
    "env",
    "dtype_name",
    "spec_sizes",
    "DISABLE_PDL_ENV",
]

DISABLE_PDL_ENV = DISABLE_PDL.name

# ---------------------------------------------------------------------------- what is tested
#: dtypes the suite knows a tolerance for, most precise first (the base config takes the first declared)
SUITE_DTYPES: Tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)
SUITE_HEAD_DIMS: Tuple[int, ...] = (64, 128, 256)
SUITE_PAGE_SIZES: Tuple[int, ...] = (1, 4)

#: backend vs reference: elementwise ``|out - ref| <= atol + rtol * |ref|``. float32 allows
#: TF32-class matmuls; half types allow the probabilities to be rounded before P @ V.
ATTENTION_TOL: Dict[torch.dtype, Tuple[float, float]] = {
    torch.float32: (1e-3, 1e-3),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (3e-2, 3e-2),
}
#: replay vs eager of the same backend: about one unit in the last place of the dtype
REPLAY_TOL: Dict[torch.dtype, Tuple[float, float]] = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (8e-3, 8e-3),
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# ---------------------------------------------------------------------------- capabilities
class BackendConstructionError(RuntimeError):
    """The backend could not be constructed over any small pool the suite tried."""


_PROBE_SPECS = [
    dict(dtype=dtype, head_dim=hd, sliding_window=w)
    for w in (8, None)
    for dtype in (torch.float16, torch.bfloat16, torch.float32)
    for hd in (64, 128, 256)
]


@functools.lru_cache(maxsize=None)
def _probe(backend_cls: type, device: str) -> Capabilities:
    errors = []
    for kw in _PROBE_SPECS:
        spec = WorldSpec(
            num_layers=2, num_heads=4, num_kv_heads=2, size=64, size_swa=64, max_reqs=4, max_context_len=32, **kw
        )
        try:
            return World(spec, backend_cls, device).backend.capabilities()
        except Exception as exc:  # try the next shape; all failures are reported together
            errors.append(
                f"{dtype_name(kw['dtype'])}/head_dim {kw['head_dim']}/window {kw['sliding_window']}: "
                f"{type(exc).__name__}: {exc}"
            )
    raise BackendConstructionError(
        f"{backend_cls.__name__} could not be constructed on {device} over any small pool: "
        + "; ".join(errors[:4])
        + (f" (+{len(errors) - 4} more)" if len(errors) > 4 else "")
    )


def probe_capabilities(backend_cls: Type[AttentionBackend], device) -> Capabilities:
    """``capabilities()`` of ``backend_cls`` built over a small pool on ``device`` (cached
    per class and device). Raises ``BackendConstructionError`` listing what was tried."""
    return _probe(backend_cls, str(torch.device(device)))


@dataclass(frozen=True)
class TestConfig:
    """The shapes one check runs a backend in (chosen from its declared capabilities)."""

    __test__ = False  # not a test class

    dtype: torch.dtype
    head_dim: int
    page_size: int
    sliding_window: bool  # the backend supports SWA layers
    graphs: GraphSupport

    def spec(self, **overrides) -> WorldSpec:
        """A small ``WorldSpec`` in this config (4 layers: 3 SWA + 1 full when SWA is
        supported), updated with ``overrides``. The SWA pool is half the full pool and its
        free list is scrambled (``WorldSpec.scramble_swa``), so translation is never the
        identity."""
        size, size_swa = spec_sizes(self.page_size)
        base = WorldSpec(
            num_layers=4,
            num_heads=8,
            num_kv_heads=2,
            head_dim=self.head_dim,
            dtype=self.dtype,
            sliding_window=4 if self.sliding_window else None,
            page_size=self.page_size,
            size=size,
            size_swa=size_swa,
            max_reqs=12,
            max_context_len=64,
            scramble_swa=True,
        )
        if not self.sliding_window:
            overrides.pop("sliding_window", None)
        return replace(base, **overrides)


def spec_sizes(page_size: int, min_swa: int = 512) -> Tuple[int, int]:
    """``(size, size_swa)`` of a suite world: at least ``min_swa`` SWA slots and 24 SWA
    pages, the full pool twice as large (so SWA slots differ from full slots)."""
    pages = max(-(-min_swa // page_size), 24)
    return 2 * pages * page_size, pages * page_size


def require(condition: bool, reason: str) -> None:
    """Skip the running check unless ``condition`` (reason: what the capabilities declare)."""
    if not condition:
        pytest.skip(reason)


def _first_declared(wanted: Sequence, declared: Sequence, what: str, fmt=str):
    for value in wanted:
        if value in declared:
            return value
    pytest.skip(
        f"capabilities().{what} declares none of {', '.join(fmt(v) for v in wanted)} "
        f"(declared: {', '.join(fmt(v) for v in declared) or 'nothing'})"
    )


def base_config(caps: Capabilities, *, dtype=None, head_dim=None, page_size=None) -> TestConfig:
    """The config most checks use: the most precise declared dtype, the smallest declared
    head dim of {64, 128, 256} and the smallest declared page size of {1, 4} (the smallest
    declared page size when neither is declared). An explicit
    value must be declared (else the check is skipped, naming the capability)."""
    if dtype is not None:
        require(dtype in caps.dtypes, f"capabilities().dtypes does not declare {dtype_name(dtype)}")
    else:
        dtype = _first_declared(SUITE_DTYPES, caps.dtypes, "dtypes", dtype_name)
    if head_dim is not None:
        require(head_dim in caps.head_dims, f"capabilities().head_dims does not declare {head_dim}")
    else:
        head_dim = _first_declared(SUITE_HEAD_DIMS, caps.head_dims, "head_dims")
    if page_size is not None:
        require(page_size in caps.page_sizes, f"capabilities().page_sizes does not declare {page_size}")
    else:
        # a backend whose pages are larger (an operator's block of 128, say) runs in its smallest
        wanted = [p for p in SUITE_PAGE_SIZES if p in caps.page_sizes] or sorted(caps.page_sizes)[:1]
        page_size = _first_declared(wanted, caps.page_sizes, "page_sizes")
    return TestConfig(dtype, head_dim, page_size, bool(caps.sliding_window), caps.graphs)


def graph_modes(level: GraphSupport) -> Tuple[ForwardMode, ...]:
    """The modes a ``GraphRunner`` captures for a backend of this ``GraphSupport`` level."""
    return captured_modes(GraphSupport(level))


def require_graph_mode(caps: Capabilities, mode: ForwardMode) -> None:
    require(
        mode in graph_modes(caps.graphs),
        f"capabilities().graphs is {GraphSupport(caps.graphs).name}: {mode.name} steps are not captured",
    )


@contextlib.contextmanager
def env(values: Optional[Mapping[str, Optional[str]]]) -> Iterator[None]:
    """Set (or, for None, remove) environment variables inside the block, restore after."""
    values = dict(values or {})
    saved = {k: os.environ.get(k) for k in values}
    try:
        _set_environ(values)
        yield
    finally:
        _set_environ(saved)


def _set_environ(values: Mapping[str, Optional[str]]) -> None:
    """``os.environ[k] = v`` for each item; ``None`` removes ``k``."""
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
