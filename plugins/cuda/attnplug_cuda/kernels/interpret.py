"""Run this package's kernels on the CPU through the Triton interpreter.

``use_interpreter()`` sets ``TRITON_INTERPRET=1``, which Triton reads when a ``@triton.jit``
function is defined (its own ``triton.language`` helpers included), so it must run before
Triton is first imported. It also applies two fixes to Triton 3.6's interpreter, which the
kernel modules apply themselves too (``ensure_interpreter_compat()``) when they are imported
with the interpreter on:

* a loop bound that came from a scalar load (a one-element array) is turned into a Python
  int with ``int(array)``, which NumPy >= 2.4 rejects ("only 0-dimensional arrays can be
  converted to Python scalars"); the fix converts through ``.item()``;
* ``tl.dot`` multiplies bfloat16 operands as their raw uint16 storage; the fix widens them
  to float32 first (exact).

Both touch only the interpreter, never compiled kernels. The interpreter has no
``griddepcontrol``: ``pdl_supported`` answers False under it, so the kernels run with
``PDL=False``. Tensors are plain CPU tensors.
"""

from __future__ import annotations

import os
import sys

__all__ = ["use_interpreter", "ensure_interpreter_compat", "interpreting"]

_TRUE = ("1", "true", "on", "yes")


def _index(self) -> int:
    data = self.handle.data
    return int(data.item() if getattr(data, "size", 1) == 1 else data)


def _patch_interpreter() -> None:
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is not None and not getattr(original, "_attnplug_patched", False):

        def patched(tensor, scope):
            original(tensor, scope)
            scope.set_attr(tensor, "__index__", _index)

        patched._attnplug_patched = True
        interpreter._patch_lang_tensor = patched

    builder = getattr(interpreter, "InterpreterBuilder", None)
    create_dot = getattr(builder, "create_dot", None)
    if create_dot is None or getattr(create_dot, "_attnplug_patched", False):
        return
    import numpy as np
    import triton.language as tl

    def widen(h):
        if h.dtype.scalar != tl.bfloat16:
            return h
        data = interpreter._convert_float(h.data, tl.bfloat16, tl.float32, None).view(np.float32)
        return interpreter.TensorHandle(data, tl.float32)

    def patched_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    patched_dot._attnplug_patched = True
    builder.create_dot = patched_dot


def interpreting() -> bool:
    """True when Triton runs kernels through its interpreter (``TRITON_INTERPRET``)."""
    try:
        import triton

        return bool(triton.knobs.runtime.interpret)
    except Exception:
        return os.environ.get("TRITON_INTERPRET", "0").lower() in _TRUE


def ensure_interpreter_compat() -> None:
    """Apply the interpreter fix when the Triton interpreter is on; no-op otherwise."""
    if interpreting():
        _patch_interpreter()


def use_interpreter() -> None:
    """Make the kernels interpret on the CPU (call before Triton is first imported)."""
    if os.environ.get("TRITON_INTERPRET", "0").lower() not in _TRUE and "triton.language" in sys.modules:
        # triton.language's own @jit helpers (tl.sum, tl.cdiv, ...) were already built for
        # compilation: interpreting now would fail inside the kernels.
        raise RuntimeError("use_interpreter() must run before triton is first imported")
    os.environ["TRITON_INTERPRET"] = "1"
    _patch_interpreter()
