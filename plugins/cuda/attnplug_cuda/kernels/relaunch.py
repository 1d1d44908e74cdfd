"""Repeat an identical Triton launch with the least host work.

Graph-replay preparation launches the same kernel with the same arguments every step: the
tensors are the graph's static buffers (their contents change on the device, never their
addresses or shapes) and the host ints are the same. ``Relaunch`` makes the first launch
through the normal ``kernel[grid](...)`` path (which compiles and specialises), keeps the
compiled kernel, and repeats the launch by calling Triton's launcher directly — skipping the
argument binding, specialisation and cache lookup that cost tens of microseconds per call.
It is exact only for identical arguments, with one exception: the first ``per_step``
positional arguments may be replaced on each call (``relaunch(*new_front)``), which is valid
only when the kernel never specialises on them (``do_not_specialize``) and the new values
have the same types (same tensor dtypes, ints of the same width). Callers build a new
``Relaunch`` when any other argument changes. Where no compiled kernel comes back (the
interpreter), it re-runs the normal path.

The direct launcher call is the CUDA and HIP drivers' launcher signature: on any other
Triton backend (Intel's XPU) every call takes the normal path.

Host work per call: one current-stream lookup and the compiled launcher (plus one tuple
concatenation when the per-step arguments are replaced). The launcher takes a tensor argument
either as a tensor (then it calls ``data_ptr()`` and asks the driver whether the address is
device memory, on every launch) or as the address itself: the captured arguments (tensors in
tuple arguments too) are passed as their addresses, resolved once here (their tensors are
held, so the memory stays theirs), while per-step tensors are passed as tensors and so still
checked by the launcher on each call. The launch-metadata call is made only when a launch
hook is set (it returns nothing otherwise).
"""

from __future__ import annotations

from typing import Any, Dict, Sequence, Tuple

__all__ = ["Relaunch"]


class Relaunch:
    """``Relaunch(jit_fn, grid, args, kwargs, per_step=0)`` launches once; ``relaunch()``
    launches again with the same arguments, ``relaunch(*front)`` with the first ``per_step``
    positional arguments replaced by ``front`` (see the module docstring)."""

    __slots__ = ("jit_fn", "grid", "args", "kwargs", "per_step", "_compiled", "_all", "_rest", "_driver", "_knobs")

    def __init__(
        self, jit_fn, grid: Tuple[int, ...], args: Sequence[Any], kwargs: Dict[str, Any], per_step: int = 0
    ) -> None:
        self.jit_fn, self.grid, self.args, self.kwargs = (
            jit_fn,
            tuple(grid) + (1,) * (3 - len(grid)),
            tuple(args),
            kwargs,
        )
        if not 0 <= per_step <= len(self.args):
            raise ValueError(f"per_step must lie in 0..{len(self.args)}, got {per_step}")
        self.per_step = per_step
        self._rest: Tuple[Any, ...] = ()
        compiled = jit_fn[grid](*self.args, **kwargs)
        self._compiled = compiled if hasattr(compiled, "packed_metadata") and _direct_launcher() else None
        self._all: Tuple[Any, ...] = ()
        if self._compiled is not None:
            values = dict(zip(jit_fn.arg_names, self.args))
            values.update((k, v) for k, v in kwargs.items() if k in jit_fn.arg_names)
            ordered = tuple(values[name] for name in jit_fn.arg_names)
            if any(a is not b for a, b in zip(ordered[:per_step], self.args[:per_step])):
                raise ValueError("the per-step arguments must be the kernel's first positional arguments")
            self._all = tuple(_address(a) for a in ordered)
            self._rest = self._all[per_step:]
            from triton import knobs
            from triton.runtime import driver

            self._driver, self._knobs = driver, knobs

    def __call__(self, *front: Any) -> None:
        ck = self._compiled
        if front and len(front) != self.per_step:
            raise ValueError(f"expected {self.per_step} per-step arguments, got {len(front)}")
        if ck is None:
            args = front + self.args[self.per_step :] if front else self.args
            self.jit_fn[self.grid](*args, **self.kwargs)
            return
        all_args = front + self._rest if front else self._all
        active = self._driver.active
        stream = active.get_current_stream(active.get_current_device())
        g0, g1, g2 = self.grid
        hooks = self._knobs.runtime
        enter = hooks.launch_enter_hook
        ck.run(
            g0,
            g1,
            g2,
            stream,
            ck.function,
            ck.packed_metadata,
            ck.launch_metadata(self.grid, stream, *all_args) if enter is not None else None,
            enter,
            hooks.launch_exit_hook,
            *all_args,
        )


def _direct_launcher() -> bool:
    """Whether ``__call__`` may call the compiled launcher directly: False only where the
    active Triton driver is known and is neither CUDA nor HIP (Intel's XPU backend)."""
    from triton.runtime import driver

    try:
        backend = driver.active.get_current_target().backend
    except Exception:  # no active driver to ask: a compiled kernel came back, keep its launcher
        return True
    return backend in ("cuda", "hip")


def _address(arg: Any) -> Any:
    """A tensor argument as its address (what the launcher reads from it), a tuple argument
    with its tensors so (a named tuple stays one); anything else as is."""
    if isinstance(arg, tuple):
        items = [_address(a) for a in arg]
        return type(arg)(*items) if hasattr(arg, "_fields") else tuple(items)
    data_ptr = getattr(arg, "data_ptr", None)
    return data_ptr() if callable(data_ptr) else arg
