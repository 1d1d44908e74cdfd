"""Compile the plugin's Triton launches for sm_90 on a machine without a GPU, as a GPU would
(the tests' compile checks: ``sm90_compile.py``, the probes of ``test_offline_compile.py``).

A Triton kernel compiled by hand (``triton.compile`` of an ``ASTSource``) is only the kernel
a GPU runs when it carries the same specialisation as a real launch: which pointers are
16-byte aligned and which integers divide by 16 (``tt.divisibility``). Without it loads and
stores are compiled element by element (seen with Triton 3.9 on an earlier ``store_attend``:
a bs 1 SWA layer's plan took 255 registers and a spill stack without it, 126 with it). This
module records the launches a piece of code makes instead of running them, specialises each
one with Triton's own launch binder on the recorded arguments (CPU tensors stand in for the
GPU's: their alignment is what the binder reads), and compiles it for
``GPUTarget("cuda", 90, 32)``.

* :func:`record_launches`: a context manager; every ``kernel[grid](...)`` inside it is
  recorded (:class:`Launch`), nothing runs. Needs ``TRITON_INTERPRET`` unset before Triton
  is imported (the kernels must be real ``JITFunction``\\ s).
* :func:`compile_launch`: a recorded launch as a compiled kernel for the target.
* :func:`resources`: registers, spill stack bytes and shared memory of a compiled kernel
  (``cuobjdump --dump-resource-usage`` from Triton's NVIDIA backend), and the programs that
  fit one H100 / H200 SM by each.
* :func:`signature_key`: what makes two recorded launches one compiled kernel.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from typing import Dict, Iterator, List, Tuple

__all__ = ["Launch", "record_launches", "compile_launch", "resources", "signature_key", "SM90", "SM90_SM_LIMITS"]

#: a Hopper GPU (H100, H200) as Triton names it
SM90 = ("cuda", 90, 32)
#: what one SM of an H100 / H200 holds: 32-bit registers, shared memory for resident
#: programs, threads
SM90_SM_LIMITS = {"registers": 65536, "shared_bytes": 228 * 1024, "threads": 2048}
_OPTIONS = ("num_warps", "num_stages", "launch_pdl", "maxnreg")


@dataclass
class Launch:
    """One recorded ``kernel[grid](*args, **kwargs)``."""

    fn: object  # the JITFunction
    args: tuple
    kwargs: dict
    grid: object = None

    @property
    def name(self) -> str:
        return self.fn.fn.__name__


@contextlib.contextmanager
def record_launches() -> Iterator[List[Launch]]:
    """Record every Triton launch made inside the block (in order); nothing runs."""
    from triton.runtime.jit import JITFunction

    launches: List[Launch] = []
    original = JITFunction.run

    def _record(self, *args, grid, warmup=False, **kwargs):
        launches.append(Launch(self, args, dict(kwargs), grid))
        return None

    JITFunction.run = _record
    try:
        yield launches
    finally:
        JITFunction.run = original


def _target():
    from triton.backends.compiler import GPUTarget

    return GPUTarget(*SM90)


def compile_launch(launch: Launch):
    """The kernel a sm_90 GPU would compile for ``launch`` (Triton's binder specialises the
    recorded arguments exactly as a launch does; only the launch options named in
    ``_OPTIONS`` are passed on)."""
    import triton
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = launch.fn
    target = _target()
    backend = make_backend(target)
    kwargs = {k: v for k, v in launch.kwargs.items() if k in fn.arg_names or k in _OPTIONS}
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=target, options=options.__dict__)


def _cuobjdump() -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def resources(compiled) -> Dict[str, int]:
    """``registers`` (per thread), ``spill_bytes`` (stack frame per thread), ``shared_bytes``
    (per program), ``threads`` and ``programs_per_sm`` (what the registers, the shared memory
    and the threads of one sm_90 SM allow together) of a compiled kernel."""
    fd, path = tempfile.mkstemp(suffix=".cubin")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(compiled.asm["cubin"])
        report = subprocess.run(
            [_cuobjdump(), "--dump-resource-usage", path], capture_output=True, text=True, check=True
        ).stdout
    finally:
        os.unlink(path)
    fields = dict(re.findall(r"\b(REG|STACK|SHARED):(\d+)", report))
    if "REG" not in fields:
        raise RuntimeError(f"cuobjdump printed no register count:\n{report}")
    threads = 32 * int(compiled.metadata.num_warps)
    registers = int(fields["REG"])
    shared = int(compiled.metadata.shared)
    limits = SM90_SM_LIMITS
    by_regs = limits["registers"] // (threads * max(registers, 1))
    by_shared = limits["shared_bytes"] // shared if shared else by_regs
    return dict(
        registers=registers,
        spill_bytes=int(fields.get("STACK", 0)),
        shared_bytes=shared,
        threads=threads,
        programs_per_sm=min(by_regs, by_shared, limits["threads"] // threads),
    )


def signature_key(launch: Launch) -> Tuple:
    """What makes two launches one compiled kernel, as ``(kernel name, constexprs, argument
    types, options)`` (tuples of pairs): for de-duplicating recorded launches. Alignment is
    not in the key: the launches of one code path share it."""
    import torch

    fn = launch.fn
    bound = dict(zip(fn.arg_names, launch.args))
    bound.update((k, v) for k, v in launch.kwargs.items() if k in fn.arg_names)
    constexprs, types = [], []
    for name, p in zip(fn.arg_names, fn.params):
        v = bound.get(name)
        if p.is_constexpr:
            constexprs.append((name, v))
        else:
            types.append((name, str(v.dtype) if isinstance(v, torch.Tensor) else type(v).__name__))
    opts = tuple(sorted((k, launch.kwargs[k]) for k in _OPTIONS if k in launch.kwargs))
    return (launch.name, tuple(constexprs), tuple(types), opts)
