"""How a check passes or fails: a step's outputs and KV caches compared with the reference's,
and ``conformance_check``, which makes every failure message start with the rule that broke.
"""

from __future__ import annotations

import functools
import os
from typing import Optional, Sequence, Tuple

import pytest
import torch

from .config import ATTENTION_TOL, dtype_name
from .harness import World, kv_bits
from .rules import ALL_RULES, ATTENTION

__all__ = [
    "conformance_check",
    "layer_kind",
    "cache_note",
    "assert_attention_close",
    "assert_caches_equal",
    "changed_rows",
    "kv_bits",
    "same_bits",
    "show_rows",
]


def conformance_check(fn=None, *, rule: str = ATTENTION):
    """Mark a suite function as a test whatever its name (pytest's ``__test__``), and make
    every failure name a rule: an exception raised by the backend (or by the harness on its
    behalf) whose message names no rule is reported as ``"<rule>: <check> raised <type>:
    <message>"``. Use bare (``@conformance_check``) or with the check's ``rule``."""
    if fn is None:
        return functools.partial(conformance_check, rule=rule)

    @functools.wraps(fn)
    def check(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            text = str(exc)
            if text.startswith(ALL_RULES):
                pytest.fail(text, pytrace=False)
            pytest.fail(
                f"{rule}: {fn.__name__}: the backend raised {type(exc).__name__}: {text}{_where(exc)}", pytrace=True
            )

    check.__test__ = True
    return check


def _where(exc: BaseException) -> str:
    """`` (at file:line in function)`` of the innermost frame outside this suite and torch."""
    import traceback

    here = os.path.dirname(os.path.abspath(__file__))
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        path = os.path.abspath(frame.filename)
        if not path.startswith(here) and not path.startswith(torch_dir):
            return f" (at {os.path.basename(frame.filename)}:{frame.lineno} in {frame.name})"
    return ""


# ---------------------------------------------------------------------------- comparisons
def layer_kind(world: World, layer: int) -> str:
    if world.pool.is_swa_layer(layer):
        return f"SWA, window {world.spec.sliding_window}"
    return "full"


def cache_note(world: World) -> str:
    """`` over a float8_e4m3fn KV cache (dequantised)`` for an FP8 world's failure messages, else ``""``."""
    return f" over a {dtype_name(world.pool.dtype)} KV cache (dequantised)" if world.pool.is_fp8 else ""


def assert_attention_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    world: World,
    *,
    what: str,
    rule: str = ATTENTION,
    tol: Optional[Tuple[float, float]] = None,
) -> None:
    """``[T, L, H, D]`` step outputs: elementwise ``|a - e| <= atol + rtol * |e|`` with the
    dtype's tolerance (``ATTENTION_TOL`` unless ``tol``); the message names the rule, the
    step, the worst layer (and its kind), token and head."""
    dtype = world.spec.dtype
    atol, rtol = tol if tol is not None else ATTENTION_TOL[dtype]
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    if a.shape != e.shape:
        pytest.fail(f"{rule}: {what}: output shape {tuple(a.shape)}, expected {tuple(e.shape)}")
    if e.numel() == 0:
        return
    if not torch.isfinite(a).all():
        bad = torch.nonzero(~torch.isfinite(a))[0].tolist()
        pytest.fail(
            f"{rule}: {what}: non-finite output at token {bad[0]}, layer {bad[1]} "
            f"({layer_kind(world, bad[1])}), head {bad[2]}"
        )
    excess = (a - e).abs() - (atol + rtol * e.abs())
    if (excess > 0).any():
        flat = int(torch.argmax(excess))
        t, l, h, d = [int(i) for i in torch.unravel_index(torch.tensor(flat), a.shape)]
        n_bad = int((excess > 0).sum())
        pytest.fail(
            f"{rule}: {what}: layer {l} ({layer_kind(world, l)}) token {t} head {h}: "
            f"got {a[t, l, h, d]:.6g}, expected {e[t, l, h, d]:.6g} (|diff| {abs(a[t, l, h, d] - e[t, l, h, d]):.3g}; "
            f"{n_bad} of {a.numel()} values outside atol {atol:g} + rtol {rtol:g} for {dtype_name(dtype)}"
            f"{cache_note(world)})"
        )


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of one dtype have the same shape and the same bits (``kv_bits``:
    FP8 caches included; a NaN equals its own bits)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(torch.equal(kv_bits(a), kv_bits(b)))


def changed_rows(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """Host int64: rows (slots) of a ``[slots, Hkv, D]`` buffer whose bits differ (any dtype, FP8
    included)."""
    if same_bits(before, after):
        return torch.zeros(0, dtype=torch.int64)
    diff = (kv_bits(before) != kv_bits(after)).flatten(1).any(1)
    return torch.nonzero(diff.cpu()).flatten()


def show_rows(rows: torch.Tensor, n: int = 8) -> str:
    """The first ``n`` of ``rows`` (slots, tokens) for a failure message, and how many more."""
    rows = rows.tolist()
    return f"{rows[:n]}" + (f" (+{len(rows) - n} more)" if len(rows) > n else "")


def assert_caches_equal(
    world: World, other: World, *, what: str, rule: str = ATTENTION, ignore_rows: Sequence[int] = ()
) -> None:
    """Every layer's KV buffers bit-identical in two worlds (except ``ignore_rows``): an FP8
    cache's bytes too, since both quantise by the one exact rule."""
    for layer in range(world.spec.num_layers):
        for name, a, b in zip("kv", world.pool.get_kv_buffer(layer), other.pool.get_kv_buffer(layer)):
            rows = changed_rows(a, b)
            if len(ignore_rows):
                rows = rows[~torch.isin(rows, torch.tensor(list(ignore_rows), dtype=torch.int64))]
            if rows.numel():
                pytest.fail(
                    f"{rule}: {what}: layer {layer} ({layer_kind(world, layer)}) {name} cache differs "
                    f"from the reference at slots {show_rows(rows)}"
                )
