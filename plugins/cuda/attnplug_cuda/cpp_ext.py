"""Build and load the CUDA C++ kernel of the plugin (``csrc/``) as a torch extension.

The kernel (``.cu`` files compile alone, free of torch headers; each ``*_binding.cpp``
registers its functions into the one module that ``module.cpp`` defines) is the KV store
(``csrc/kv_store.cu``): for each new token ``t``, ``k_cache[loc[t]] = k[t]`` and
``v_cache[loc[t]] = v[t]``, all heads of a token per thread group, 16-byte loads/stores when
the rows allow it, and Programmatic Dependent Launch (PDL) on sm_90+: it waits
(``cudaGridDependencySynchronize``) before reading k, v or loc and lets its dependents start
(``cudaTriggerProgrammaticLaunchCompletion``) after its last store. It copies rows, it does
not quantise: it refuses FP8 caches (the binding's dtype check), and ``TritonBackend`` stores
an FP8 pool with the Triton kernels whatever ``ATTNPLUG_KV_STORE`` says (``kv_store_reason``
says so), so an FP8 pool is never written unquantised.

API:

* :func:`cpp_ext_status` -> ``(available, reason)``; never raises. The reason names the
  cause when the extension cannot be used: ``ATTNPLUG_DISABLE_CPP=1``, torch without CUDA, no
  ``nvcc``, no ``ninja``, no CUDA device, or a build failure (with the compiler's last lines).
* :func:`load_ext` -> the extension module (built once per process, reused across processes
  through the build directory); raises :class:`CppExtensionUnavailable` with the same reason.
  :func:`try_load_ext` returns ``None`` instead of raising.
* :func:`kv_store` -> ``ext.kv_store(k, v, k_cache, v_cache, loc, pdl)``; returns whether the
  launch used PDL.
* :func:`nvcc_compile_command` -> the bare ``nvcc -arch=sm_90 -c csrc/<kernel>.cu`` command
  CI uses to prove a kernel compiles without a GPU or torch's CUDA headers.

Build cache: ``$ATTNPLUG_CACHE_DIR/cpp_ext/kernels-<key>`` (default
``$XDG_CACHE_HOME/attnplug`` or ``~/.cache/attnplug``), where ``<key>`` hashes the sources,
the flags, the Python, torch and CUDA versions. Set ``ATTNPLUG_CPP_VERBOSE=1`` to see the
build.

Importing this module imports neither torch nor ``torch.utils.cpp_extension``: both are
imported when a function needs them, so the plugin package imports on any machine.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import List, Optional, Sequence, Tuple, Union

from . import env

__all__ = [
    "CSRC_DIR",
    "KV_STORE_CU",
    "KERNEL_SOURCES",
    "EXT_SOURCES",
    "SM90_GENCODE",
    "CppExtensionUnavailable",
    "cpp_ext_status",
    "ext_build_dir",
    "find_nvcc",
    "kv_store",
    "load_ext",
    "nvcc_compile_command",
    "try_load_ext",
]

CSRC_DIR = Path(__file__).resolve().parent / "csrc"
KV_STORE_CU = CSRC_DIR / "kv_store.cu"
#: the kernels, each compiling alone with ``nvcc_compile_command``
KERNEL_SOURCES: Tuple[Path, ...] = (KV_STORE_CU,)
#: compiled into the extension: the kernels, their bindings and the module
EXT_SOURCES: Tuple[Path, ...] = (*KERNEL_SOURCES, CSRC_DIR / "kv_store_binding.cpp", CSRC_DIR / "module.cpp")
#: hashed into the build key with the sources
_HEADERS: Tuple[Path, ...] = (CSRC_DIR / "kv_store.h", CSRC_DIR / "bindings.h")

#: Hopper machine code; always built, whatever GPU is present
SM90_GENCODE = "-gencode=arch=compute_90,code=sm_90"
# No -std here: torch.utils.cpp_extension picks the standard its headers need (C++20 in
# recent torch) and a later -std flag would override it.
_CUDA_CFLAGS: Tuple[str, ...] = (SM90_GENCODE, "-O3", "-lineinfo")
_CXX_CFLAGS: Tuple[str, ...] = ("-O3",)

_BUILD_LOG_LINES = 20

_lock = threading.Lock()
_ext: Optional[ModuleType] = None
_ext_dir: Optional[Path] = None
_ext_error: Optional[str] = None


class CppExtensionUnavailable(RuntimeError):
    """The C++ extension cannot be used here; the message says why."""


# --------------------------------------------------------------------------- toolchain


def find_nvcc() -> Optional[str]:
    """Path of ``nvcc`` as ``torch.utils.cpp_extension`` would find it (``CUDA_HOME``,
    ``CUDA_PATH``, ``PATH``, ``/usr/local/cuda``), or ``None``."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home:
            candidate = Path(home) / "bin" / "nvcc"
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return str(candidate)
    found = shutil.which("nvcc")
    if found:
        return found
    candidate = Path("/usr/local/cuda/bin/nvcc")
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    return None


def nvcc_compile_command(
    out_path: Union[str, os.PathLike],
    source: Union[str, os.PathLike, None] = None,
    *,
    nvcc: Optional[str] = None,
    arch: str = "sm_90",
    extra_flags: Sequence[str] = (),
) -> List[str]:
    """The standalone compile of one kernel (no torch, no GPU needed), as an argv list:
    ``nvcc -arch=sm_90 -O3 -std=c++17 -c csrc/kv_store.cu -o OUT`` (``source``: another of
    ``KERNEL_SOURCES``).

    ``nvcc`` defaults to :func:`find_nvcc` (or plain ``"nvcc"`` when none is found)."""
    return [
        nvcc or find_nvcc() or "nvcc",
        f"-arch={arch}",
        "-O3",
        "-std=c++17",
        *extra_flags,
        "-c",
        str(source if source is not None else KV_STORE_CU),
        "-o",
        str(out_path),
    ]


# --------------------------------------------------------------------------- availability


def _prerequisites() -> Tuple[bool, str]:
    """Cheap checks, in the order a user fixes them; no build."""
    if env.cpp_disabled():
        return False, f"disabled by {env.DISABLE_CPP.name}=1"
    try:
        import torch
    except Exception as exc:  # ImportError or a broken install
        return False, f"torch is not importable ({type(exc).__name__}: {exc})"
    if getattr(torch.version, "hip", None):
        return False, f"torch {torch.__version__} is a ROCm build; the kernel is CUDA C++"
    if not getattr(torch.version, "cuda", None):
        return False, (f"torch {torch.__version__} was built without CUDA (torch.version.cuda is None)")
    if find_nvcc() is None:
        return False, "nvcc not found (set CUDA_HOME or put the CUDA toolkit's bin on PATH)"
    if shutil.which("ninja") is None:
        return False, "ninja not found on PATH (torch.utils.cpp_extension.load needs it)"
    try:
        has_device = torch.cuda.is_available()
    except Exception as exc:
        return False, f"no CUDA device (torch.cuda.is_available() raised {exc!r})"
    if not has_device:
        return False, "no CUDA device visible (torch.cuda.is_available() is False)"
    return True, "prerequisites met"


def _arch_flags() -> List[str]:
    """sm_90 always; plus the current device's own architecture when it differs, so the
    extension also runs there (the PDL calls are compiled in only for sm_90+)."""
    import torch

    flags = [SM90_GENCODE]
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0):
        flags.append(f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}")
    return flags


def _loaded_libstdcxx() -> Optional[str]:
    """Path of the libstdc++ shared library this process (torch) runs with, on Linux."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        fields = line.split()
        if len(fields) >= 6 and os.path.basename(fields[-1]).startswith("libstdc++.so"):
            return fields[-1]
    return None


def _ldflags() -> List[str]:
    """Link the extension against the libstdc++ that torch already uses.

    A g++ that cannot find ``libstdc++.so`` (seen: a wrapper compiler named by ``CXX`` on a GPU
    machine's image) silently links ``libstdc++.a`` into the extension; the second copy of the
    C++ runtime then crashes on the first ``std::ostream << long`` (any TORCH_CHECK message
    with a number). Naming the loaded shared library first makes the linker take every C++
    runtime symbol from it, and nothing from the archive."""
    lib = _loaded_libstdcxx()
    return [lib] if lib else []


def _build_key(cuda_cflags: Sequence[str]) -> str:
    import torch

    h = hashlib.sha256()
    for path in (*_HEADERS, *EXT_SOURCES):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    for part in (
        torch.__version__,
        str(torch.version.cuda),
        "%d.%d" % sys.version_info[:2],
        platform.machine(),
        find_nvcc() or "",
        *cuda_cflags,
        "|",
        *_CXX_CFLAGS,
        "|",
        *_ldflags(),
    ):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def _build_dir(key: str) -> Path:
    return env.cache_dir() / "cpp_ext" / f"kernels-{key}"


def ext_build_dir(cuda_cflags: Optional[Sequence[str]] = None) -> Path:
    """Build directory of the extension for these flags (default: sm_90 only)."""
    flags = list(cuda_cflags) if cuda_cflags is not None else list(_CUDA_CFLAGS)
    return _build_dir(_build_key(flags))


def _build_and_load() -> Tuple[ModuleType, Path]:
    from torch.utils import cpp_extension  # lazy: heavy, and pulls in setuptools

    cuda_cflags = [*_arch_flags(), *(f for f in _CUDA_CFLAGS if f != SM90_GENCODE)]
    key = _build_key(cuda_cflags)
    build_dir = _build_dir(key)
    build_dir.mkdir(parents=True, exist_ok=True)
    module = cpp_extension.load(
        name=f"attnplug_cuda_ext_{key}",
        sources=[str(p) for p in EXT_SOURCES],
        extra_cflags=list(_CXX_CFLAGS),
        extra_cuda_cflags=cuda_cflags,
        extra_include_paths=[str(CSRC_DIR)],
        extra_ldflags=_ldflags(),
        build_directory=str(build_dir),
        with_cuda=True,
        verbose=env.cpp_verbose(),
    )
    return module, build_dir


def _failure_reason(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    tail = "\n".join(lines[-_BUILD_LOG_LINES:])
    return f"building the CUDA C++ extension failed ({type(exc).__name__}); last lines:\n{tail}"


def cpp_ext_status(build: bool = True) -> Tuple[bool, str]:
    """``(available, reason)`` for the C++ extension; never raises.

    With ``build=True`` (default) a ``True`` answer means the extension is loaded: it is
    built (or taken from the build cache) on the first call of the process, which needs the
    CUDA device. With ``build=False`` nothing is built: ``True`` then only says the
    prerequisites are met (the reason says so) unless the extension was loaded already."""
    try:
        ok, reason = _prerequisites()
        if not ok:
            return False, reason
        if _ext is not None:
            return True, f"loaded {_ext.__name__} from {_ext_dir}"
        if _ext_error is not None:
            return False, _ext_error
        if not build:
            return True, "prerequisites met; not built in this process yet"
        load_ext()
        return True, f"loaded {_ext.__name__} from {_ext_dir}"  # type: ignore[union-attr]
    except CppExtensionUnavailable as exc:
        return False, str(exc)
    except Exception as exc:  # status must never raise
        return False, f"status check failed ({type(exc).__name__}: {exc})"


def load_ext() -> ModuleType:
    """The loaded extension module (``kv_store``, ``vec_bytes``); built once per process.
    Raises :class:`CppExtensionUnavailable` with the reason otherwise; a failed build is
    remembered and not retried in this process."""
    global _ext, _ext_dir, _ext_error
    ok, reason = _prerequisites()
    if not ok:
        raise CppExtensionUnavailable(reason)
    if _ext is not None:
        return _ext
    with _lock:
        if _ext is None:
            if _ext_error is not None:
                raise CppExtensionUnavailable(_ext_error)
            try:
                _ext, _ext_dir = _build_and_load()
            except Exception as exc:  # compiler errors, missing libraries, import errors
                _ext_error = _failure_reason(exc)
                raise CppExtensionUnavailable(_ext_error) from exc
    return _ext


def try_load_ext() -> Optional[ModuleType]:
    """:func:`load_ext`, or ``None`` when unavailable (see :func:`cpp_ext_status` for why)."""
    try:
        return load_ext()
    except CppExtensionUnavailable:
        return None


def kv_store(k, v, k_cache, v_cache, loc, pdl: bool = False) -> bool:
    """``k_cache[loc[t]] = k[t]; v_cache[loc[t]] = v[t]`` for every token ``t`` on the current
    CUDA stream (in place, no sync; slots outside ``[1, num_slots)`` are skipped).

    k, v: ``[T, Hkv, D]`` fp16/bf16/fp32 with dense ``[Hkv, D]`` rows (token stride free);
    caches: ``[S, Hkv, D]``, same dtype and device (never FP8: the binding refuses it, the
    Triton ``kv_store`` quantises); loc: ``[T]`` int32 or int64, contiguous.
    ``pdl`` requests Programmatic Dependent Launch (decide it with
    ``attnplug_cuda.kernels.pdl.pdl_supported``; ``ATTNPLUG_DISABLE_PDL=1`` turns it off here
    too); returns whether it was used."""
    if pdl and env.pdl_disabled():
        pdl = False
    return bool(load_ext().kv_store(k, v, k_cache, v_cache, loc, bool(pdl)))
