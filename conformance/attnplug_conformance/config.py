"""What is tested: the suite's dtypes, head dims, page sizes and tolerances, a backend's declared
capabilities (probed once over a small pool), the ``TestConfig`` a check runs in, and the skips
of a check whose needs the capabilities do not declare.

The FP8 axis: every check also runs with each FP8 KV cache dtype (``SUITE_FP8_KV_DTYPES``)
where the backend declares it (``Capabilities.fp8_kv_dtypes``). ``kv_axis`` adds the parameter
``kv_cache_dtype`` to a check's own (test ids ``...-kv_fp8_e4m3``); ``base_config`` then gives
the world an FP8 cache under a half-precision model dtype (``fp8_model_dtype``), or skips
naming the declaration. The default run serves ``DEFAULT_FP8_KV_DTYPES`` (today every FP8
dtype) in every case; an FP8 dtype left out of it runs in the first round only unless
``--attnplug-thorough`` is given (the plugin deselects its other tests): the lever for a
backend whose FP8 cases cost too much.

Also the environment a check may set (``env``; ``DISABLE_PDL_ENV``).
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass, replace
from typing import Callable, Dict, Iterator, Mapping, Optional, Sequence, Tuple, Type

import pytest
import torch

from attnplug import AttentionBackend, Capabilities, ForwardMode, GraphSupport
from attnplug.env import DISABLE_PDL
from attnplug.graphs import captured_modes
from attnplug.memory.fp8 import FP8_KV_DTYPES, KV_CACHE_DTYPE_NAMES

from .harness import World, WorldSpec

__all__ = [
    "SUITE_DTYPES",
    "SUITE_HEAD_DIMS",
    "SUITE_PAGE_SIZES",
    "SUITE_FP8_KV_DTYPES",
    "DEFAULT_FP8_KV_DTYPES",
    "KV_PARAM",
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
    "kv_id",
    "kv_axis",
    "fp8_model_dtype",
    "spec_sizes",
    "DISABLE_PDL_ENV",
]

DISABLE_PDL_ENV = DISABLE_PDL.name

# ---------------------------------------------------------------------------- what is tested
#: dtypes the suite knows a tolerance for, most precise first (the base config takes the first declared)
SUITE_DTYPES: Tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)
SUITE_HEAD_DIMS: Tuple[int, ...] = (64, 128, 256)
SUITE_PAGE_SIZES: Tuple[int, ...] = (1, 4)
#: the FP8 KV cache dtypes every check also runs with, where a backend declares them
SUITE_FP8_KV_DTYPES: Tuple[torch.dtype, ...] = FP8_KV_DTYPES
#: the FP8 dtypes every case of the default run serves: float8_e4m3fn, the one engines serve
#: (``kv_cache_dtype="fp8"``). float8_e5m2 runs in the first round, and in every case with
#: ``--attnplug-thorough`` (plugin.py deselects it): each FP8 dtype is a second compile of every
#: kernel variant a check asks for on a GPU, and half again the reference run's time on the host
DEFAULT_FP8_KV_DTYPES: Tuple[torch.dtype, ...] = (torch.float8_e4m3fn,)
#: the parameter ``kv_axis`` adds to a check: None (the model's dtype) or an FP8 dtype
KV_PARAM = "kv_cache_dtype"

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


def kv_id(kv_cache_dtype: Optional[torch.dtype]) -> str:
    """The test-id part of a cache dtype, in the engines' names
    (``attnplug.memory.fp8.KV_CACHE_DTYPE_NAMES``): ``kv_auto`` (the model's dtype, None),
    ``kv_fp8_e4m3``, ``kv_fp8_e5m2``."""
    names = [n for n, d in KV_CACHE_DTYPE_NAMES.items() if d == kv_cache_dtype]
    if not names:
        raise ValueError(f"{kv_cache_dtype!r} has no kv_cache_dtype name ({', '.join(KV_CACHE_DTYPE_NAMES)})")
    return "kv_" + max(names, key=len)  # "fp8_e4m3", not its alias "fp8"


def kv_axis(
    argnames: str = "",
    values: Sequence = (),
    ids: Sequence[str] = (),
    *,
    fp8: Optional[Callable[[object], bool]] = None,
):
    """``(argnames, params)`` for ``pytest.mark.parametrize``: a check's own parameters
    (``argnames``, comma-separated; ``values``, a tuple each when several names; ``ids``) with
    ``KV_PARAM`` added. First every value with ``kv_cache_dtype=None``, its id unchanged; then,
    per FP8 dtype of ``SUITE_FP8_KV_DTYPES``, every value ``fp8`` accepts (default: all) with that
    dtype, its id followed by ``-kv_fp8_e4m3`` / ``-kv_fp8_e5m2``. A check without parameters of
    its own (``kv_axis()``) gets the ids ``kv_auto``, ``kv_fp8_e4m3``, ``kv_fp8_e5m2``."""
    names = [n.strip() for n in argnames.split(",") if n.strip()]
    if names:
        rows = [tuple(v) if len(names) > 1 else (v,) for v in values]
        ids = list(ids)
        if len(ids) != len(rows):
            raise ValueError(f"kv_axis: {len(rows)} values and {len(ids)} ids")
        base = list(zip(values, rows, ids))
    else:
        base = [(None, (), kv_id(None))]
    params = [pytest.param(*row, None, id=ident) for _, row, ident in base]
    for kv in SUITE_FP8_KV_DTYPES:
        for value, row, ident in base:
            if names and fp8 is not None and not fp8(value):
                continue
            params.append(pytest.param(*row, kv, id=f"{ident}-{kv_id(kv)}" if names else kv_id(kv)))
    return ",".join([*names, KV_PARAM]), params


def fp8_model_dtype(declared: Sequence[torch.dtype]) -> torch.dtype:
    """The model dtype (q, k, v, the output) of an FP8 case: the most precise declared
    half-precision dtype of ``SUITE_DTYPES`` (float16, then bfloat16: FP8 caches serve
    half-precision models), else the most precise declared one. Skips when none is declared."""
    halves = [d for d in SUITE_DTYPES if d.itemsize == 2]
    return _first_declared(halves + [d for d in SUITE_DTYPES if d not in halves], declared, "dtypes", dtype_name)


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

    dtype: torch.dtype  # the model's: q, k, v and the output
    head_dim: int
    page_size: int
    sliding_window: bool  # the backend supports SWA layers
    graphs: GraphSupport
    #: what the KV cache stores: None (``dtype``) or a declared FP8 dtype (the FP8 axis)
    kv_cache_dtype: Optional[torch.dtype] = None

    def spec(self, **overrides) -> WorldSpec:
        """A small ``WorldSpec`` in this config (4 layers: 3 SWA + 1 full when SWA is
        supported; the config's cache dtype), updated with ``overrides``. The SWA pool is half
        the full pool and its free list is scrambled (``WorldSpec.scramble_swa``), so
        translation is never the identity."""
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
            kv_cache_dtype=self.kv_cache_dtype,
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


def base_config(caps: Capabilities, *, dtype=None, head_dim=None, page_size=None, kv_cache_dtype=None) -> TestConfig:
    """The config most checks use: the most precise declared dtype, the smallest declared
    head dim of {64, 128, 256} and the smallest declared page size of {1, 4} (the smallest
    declared page size when neither is declared). An explicit
    value must be declared (else the check is skipped, naming the capability).
    ``kv_cache_dtype`` (the FP8 axis) must be in ``capabilities().fp8_kv_dtypes``; the model
    dtype is then ``fp8_model_dtype`` unless ``dtype`` is given."""
    if kv_cache_dtype is not None:
        declared = tuple(caps.fp8_kv_dtypes)
        require(
            kv_cache_dtype in declared,
            f"capabilities().fp8_kv_dtypes does not declare {dtype_name(kv_cache_dtype)} "
            f"(declared: {', '.join(dtype_name(d) for d in declared) or 'nothing'})",
        )
    if dtype is not None:
        require(dtype in caps.dtypes, f"capabilities().dtypes does not declare {dtype_name(dtype)}")
    elif kv_cache_dtype is not None:
        dtype = fp8_model_dtype(caps.dtypes)
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
    return TestConfig(dtype, head_dim, page_size, bool(caps.sliding_window), caps.graphs, kv_cache_dtype)


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
