"""What a ``GraphRunner`` is built from, checked before anything is allocated, and who owns a
backend's graph state.

``check_runner_args`` refuses, naming the argument and the value, what the runner cannot
capture as given (nothing is coerced, sorted, deduplicated or dropped silently): ``backend``
not an ``AttentionBackend``, ``step`` not callable, ``max_bs`` / ``num_draft_tokens`` not
positive ints, ``bucket_sizes`` empty, not strictly increasing or outside ``1..max_bs``,
``modes`` empty, repeated, not ``ForwardMode`` values, or modes the backend cannot capture (or
speculative ones without ``num_draft_tokens``, EXTEND without ``extend_tokens``),
``extend_tokens`` empty, not strictly increasing or given for a backend below
``GraphSupport.ALWAYS``, ``extend_rows`` neither ``"tokens"`` nor ``"requests"``, and ``inputs``
that are not ``name -> (per-token shape, dtype)``. It runs before the backend's ``init_cuda_graph_state``, so
a refused runner leaves the backend as it was.

Graph state ownership (``claim_graph_state``): a captured graph reads its buffers at fixed
addresses for as long as it lives. A backend that implements ``set_cuda_graph_state`` makes a
new state per ``init_cuda_graph_state`` and each runner switches it back to its own before its
captures and replays: any number of runners share the backend. A backend that keeps one state
(``get_cuda_graph_state()`` is None, the contract's default) serves one live runner: a second
one is refused while the first lives, since its ``init_cuda_graph_state`` would replace the
buffers under the first one's graphs.
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from ..backend import AttentionBackend
from ..batch import ForwardMode
from ..memory.args import host_int
from .buckets import captured_modes, captures_extend

__all__ = ["check_graph_state_free", "check_runner_args", "claim_graph_state", "owns_graph_states"]

#: backend -> its one live runner (weakly), for backends that keep one graph state
_sole_runner: "weakref.WeakKeyDictionary[AttentionBackend, weakref.ref]" = weakref.WeakKeyDictionary()


def _ints(value: Any, name: str, lo: int) -> int:
    return host_int(value, name, lo=lo, error=ValueError)


def _increasing(value: Any, name: str, what: str, default: str) -> Tuple[int, ...]:
    """``value`` (not None) as a strictly increasing tuple of ints >= 1; ``ValueError`` naming
    ``name`` otherwise (``what``: one entry's meaning, ``default``: what None would do)."""
    if isinstance(value, (str, bytes, Mapping, set, frozenset)):
        raise ValueError(f"{name} must be a sequence of ints, got {value!r}")
    try:
        given = list(value)
    except TypeError:
        raise ValueError(f"{name} must be a sequence of ints, got {value!r}") from None
    sizes = [_ints(b, f"{name} entry", 1) for b in given]
    if not sizes:
        raise ValueError(f"{name} must list at least one {what}, got [] (None: {default})")
    if any(a >= b for a, b in zip(sizes, sizes[1:])):
        raise ValueError(f"{name} must be strictly increasing (no repeats), got {sizes}")
    return tuple(sizes)


def _bucket_sizes(bucket_sizes: Any, max_bs: int) -> Optional[Tuple[int, ...]]:
    if bucket_sizes is None:
        return None
    sizes = _increasing(bucket_sizes, "bucket_sizes", "batch size", "the default sizes up to max_bs")
    if sizes[-1] > max_bs:
        raise ValueError(f"bucket_sizes must lie in 1..max_bs={max_bs}, got {list(sizes)}")
    return sizes


def _extend_tokens(extend_tokens: Any, backend: AttentionBackend) -> Optional[Tuple[int, ...]]:
    if extend_tokens is None:
        return None
    sizes = _increasing(extend_tokens, "extend_tokens", "token count", "EXTEND steps run eagerly")
    graphs = backend.capabilities().graphs
    if not captures_extend(graphs):
        raise ValueError(
            f"extend_tokens given, but backend {backend.name!r} cannot capture EXTEND steps (graphs={graphs.name}; "
            "ALWAYS is needed: lengths read from device tensors inside a graph)"
        )
    return sizes


def _modes(
    modes: Any, backend: AttentionBackend, num_draft_tokens: Optional[int], extend_tokens: Optional[Tuple[int, ...]]
) -> Optional[Tuple[ForwardMode, ...]]:
    if modes is None:
        return None
    if isinstance(modes, (str, bytes, Mapping, ForwardMode)):
        raise ValueError(f"modes must be a sequence of ForwardMode, got {modes!r}")
    try:
        wanted = tuple(modes)
    except TypeError:
        raise ValueError(f"modes must be a sequence of ForwardMode, got {modes!r}") from None
    bad = [m for m in wanted if not isinstance(m, ForwardMode)]
    if bad:
        raise ValueError(f"modes entries must be ForwardMode values, got {bad[0]!r} in {list(wanted)!r}")
    if not wanted:
        raise ValueError("modes must name at least one mode to capture, got [] (None: every mode the backend allows)")
    if len(set(wanted)) != len(wanted):
        raise ValueError(f"modes must not repeat a mode, got {[m.name for m in wanted]}")
    graphs = backend.capabilities().graphs
    supported = captured_modes(graphs) + ((ForwardMode.EXTEND,) if captures_extend(graphs) else ())
    unsupported = [m.name for m in wanted if m not in supported]
    if unsupported:
        raise ValueError(f"backend {backend.name!r} cannot capture {unsupported} (graphs={graphs.name})")
    if num_draft_tokens is None and any(m.is_speculative for m in wanted):
        raise ValueError(
            f"modes {[m.name for m in wanted if m.is_speculative]} need num_draft_tokens (the q_len of every request)"
        )
    if extend_tokens is None and ForwardMode.EXTEND in wanted:
        raise ValueError("mode EXTEND needs extend_tokens (the token counts of its graphs)")
    return wanted


def _inputs(inputs: Any) -> Dict[str, Tuple[Tuple[int, ...], torch.dtype]]:
    if not isinstance(inputs, Mapping):
        raise ValueError(f"inputs must map each input's name to (per-token shape, dtype), got {inputs!r}")
    checked: Dict[str, Tuple[Tuple[int, ...], torch.dtype]] = {}
    for name, spec in inputs.items():
        if not isinstance(name, str):
            raise ValueError(f"inputs keys must be names (str), got {name!r}")
        if not isinstance(spec, (tuple, list)) or len(spec) != 2:
            raise ValueError(f"inputs[{name!r}] must be (per-token shape, dtype), got {spec!r}")
        shape, dtype = spec
        if isinstance(shape, (str, bytes, torch.Tensor)) or not isinstance(shape, Sequence):
            raise ValueError(f"inputs[{name!r}] shape must be a sequence of ints, got {shape!r}")
        dims: List[int] = [_ints(d, f"inputs[{name!r}] shape entry", 1) for d in shape]
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"inputs[{name!r}] dtype must be a torch.dtype, got {dtype!r}")
        checked[name] = (tuple(dims), dtype)
    return checked


def check_runner_args(
    backend: Any,
    step: Any,
    max_bs: Any,
    inputs: Any,
    num_draft_tokens: Any,
    bucket_sizes: Any,
    modes: Any,
    extend_tokens: Any = None,
    extend_rows: Any = "tokens",
) -> Tuple[int, Dict[str, Tuple[Tuple[int, ...], torch.dtype]], Optional[int], Optional[Tuple[int, ...]], Any, Any]:
    """``(max_bs, inputs, num_draft_tokens, bucket_sizes, modes, extend_tokens)`` checked and
    normalised (see the module docstring); raises ``ValueError`` naming the argument and the
    value."""
    if not isinstance(backend, AttentionBackend):
        raise ValueError(f"backend must be an AttentionBackend, got {type(backend).__name__}")
    if not callable(step):
        raise ValueError(f"step must be callable as step(batch, inputs), got {step!r}")
    max_bs = _ints(max_bs, "max_bs", 1)
    if num_draft_tokens is not None:
        num_draft_tokens = _ints(num_draft_tokens, "num_draft_tokens", 1)
    sizes = _bucket_sizes(bucket_sizes, max_bs)
    if extend_rows not in ("tokens", "requests"):
        raise ValueError(f"extend_rows must be 'tokens' or 'requests', got {extend_rows!r}")
    extend = _extend_tokens(extend_tokens, backend)
    return max_bs, _inputs(inputs), num_draft_tokens, sizes, _modes(modes, backend, num_draft_tokens, extend), extend


def owns_graph_states(backend: AttentionBackend) -> bool:
    """Whether the backend makes a graph state per runner (implements ``set_cuda_graph_state``)."""
    return type(backend).set_cuda_graph_state is not AttentionBackend.set_cuda_graph_state


def check_graph_state_free(backend: AttentionBackend) -> None:
    """Refuse a second runner on a backend that keeps one graph state while its runner lives."""
    if owns_graph_states(backend):
        return
    ref = _sole_runner.get(backend)
    if ref is not None and ref() is not None:
        raise ValueError(
            f"backend {backend.name!r} ({type(backend).__name__}) already has a live GraphRunner: the backend keeps "
            "one set of graph buffers (it does not implement set_cuda_graph_state), which this runner's "
            "init_cuda_graph_state would replace under the first runner's captured graphs. Drop the first "
            "runner before building another, or build the second one over its own backend"
        )


def claim_graph_state(backend: AttentionBackend, runner: object) -> None:
    """Record ``runner`` as the one live runner of a backend that keeps one graph state."""
    if not owns_graph_states(backend):
        _sole_runner[backend] = weakref.ref(runner)
