"""The CUDA plugin's benchmark suite: the new hot path against the "before" path of each step.

``SUITE`` is what ``attnplug bench --backend cuda`` runs (the harness: ``attnplug.bench``).

====================  =========================================================================
benchmark             what it measures (each module's docstring has the details and targets)
====================  =========================================================================
``kv_store``          61 per-layer KV stores in one CUDA graph: Triton / C++ store, PDL on / off,
                      against translate + index_put
``step_metadata``     one graph replay's preparation: device launches, host time, no sync,
                      enqueue-ahead behind a busy GPU
``decode_attention``  SWA decode at 32k context (window 4096): achieved TB/s against the copy
                      bandwidth, SDPA, gather + SDPA and flex_attention peers
``hybrid_step``       whole 48-layer hybrid steps (decode, draft-extend) through the graph
                      runner: cuda backend vs ``BeforeBackend``, each step against its launch
                      and bandwidth floors, PDL on vs off, a bf16 against an FP8 KV cache,
                      FlashInfer's attention (bf16 and FP8, its best configuration) where
                      ``import flashinfer`` works, the replay preparation at bs 128
``kernels``           (only with ``--only kernels``) each kernel alone on its own tensors:
                      attention cases checked against float32 torch, a 32-layer step with PDL
                      on / off, the store and the metadata kernel
``prefill``           (only with ``--only prefill``) paged causal prefill, D 128 / 256, 1k-16k
                      tokens and 8 x 1k, page sizes 1 / 16: the cuda backend's EXTEND path vs
                      FlashInfer's batch prefill on the same cache, TFLOP/s
``model_decode``      (only with ``--only model_decode``) decode tokens/s of a 1B-class Gemma3 text
                      model through ``Engine`` vs transformers' static-cache generate
                      (``attnplug.bench.model_decode``; needs transformers)
``batch_validation``  (only with ``--only batch_validation``) what ``ATTNPLUG_VALIDATE=1`` costs a
                      DECODE step (``attnplug.bench.validation``)
====================  =========================================================================

Options (``--set NAME=VALUE``): ``skip_cpp`` (do not build the CUDA C++ KV store),
``flex_budget_s`` (seconds for compiling + timing flex_attention; 0 skips it),
``hybrid_modes`` (the step modes ``hybrid_step`` runs, comma-separated: ``decode``,
``draft_extend``; default both), ``hybrid_sizes`` (its batch sizes, comma-separated; default
``1,8,32,64,128``), ``model_decode_series`` (the row series ``model_decode`` runs: ``prefill``,
``decode``; default both).
Each benchmark runs in its own child process by default; the run's default budget is 560 s.
It needs a CUDA device (``NeedsCudaDevice`` otherwise). Nothing here imports Triton, the
kernels or CUDA at import time.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, Optional

from attnplug.bench import Benchmark, Suite, SuiteUnavailable
from attnplug.bench.model_decode import BENCHMARK as MODEL_DECODE
from attnplug.bench.model_decode import OPTIONS as MODEL_DECODE_OPTIONS
from attnplug.bench.validation import BENCHMARK as BATCH_VALIDATION

__all__ = ["SUITE", "NeedsCudaDevice", "run_benchmarks", "DEFAULT_BUDGET_S"]

#: wall-clock budget of a whole run, in seconds: the full suite finishes in under 10 minutes
DEFAULT_BUDGET_S = 560.0


class NeedsCudaDevice(SuiteUnavailable):
    """The benchmarks were asked for on a machine without a usable CUDA device."""


def _require_cuda() -> None:
    import torch

    if not torch.cuda.is_available():
        raise NeedsCudaDevice(
            "the cuda benchmarks need a CUDA device: torch.cuda.is_available() is False "
            f"(torch {torch.__version__}, built with CUDA {torch.version.cuda}). Run them on an NVIDIA GPU "
            "(the targets are for an sm_90 GPU of 132 SMs), or run `attnplug bench --backend reference` here."
        )


def _driver_version() -> Optional[str]:
    import subprocess

    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except Exception:
        return None


def _environment() -> Dict[str, Any]:
    """GPU, compute capability, driver, CUDA version, the PDL decision, CUDA_VISIBLE_DEVICES
    (the harness records the ``ATTNPLUG_*`` variables)."""
    import os

    import torch

    env: Dict[str, Any] = {"torch_cuda": getattr(torch.version, "cuda", None)}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        env.update(
            gpu=props.name,
            compute_capability=f"{props.major}.{props.minor}",
            sm_count=props.multi_processor_count,
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            driver=_driver_version(),
        )
        try:
            from ..kernels.pdl import pdl_supported

            env["pdl"], env["pdl_reason"] = pdl_supported(torch.device("cuda", torch.cuda.current_device()))
        except Exception as exc:
            env["pdl"], env["pdl_reason"] = None, f"{type(exc).__name__}: {exc}"
    if os.environ.get("CUDA_VISIBLE_DEVICES") is not None:
        env["CUDA_VISIBLE_DEVICES"] = os.environ["CUDA_VISIBLE_DEVICES"]
    return env


def _b(name: str, description: str, reserve_s: float, default: bool = True) -> Benchmark:
    return Benchmark(name, f"{__name__}.{name}:run", description, reserve_s=reserve_s, default=default)


SUITE = Suite(
    name="cuda",
    module=__name__,
    baseline="before",
    benchmarks=[
        _b("kv_store", "61 per-layer KV stores in one CUDA graph vs translate + index_put", 60.0),
        _b("step_metadata", "host cost of one graph replay's preparation, syncs, enqueue-ahead", 60.0),
        _b("decode_attention", "SWA decode at 32k context: TB/s vs copy bandwidth and peers", 45.0),
        _b(
            "hybrid_step",
            "whole 48-layer hybrid steps through GraphRunner: new vs before, floors, PDL on/off, bf16 vs FP8 KV, "
            "FlashInfer",
            240.0,
        ),
        _b(
            "kernels",
            "each kernel alone: attention cases, 32-layer step PDL on/off, store, metadata",
            120.0,
            default=False,
        ),
        _b(
            "prefill",
            "paged causal prefill, D 128/256, 1k-16k tokens, page 1/16: EXTEND path vs FlashInfer, TFLOP/s",
            300.0,
            default=False,
        ),
        MODEL_DECODE,
        BATCH_VALIDATION,
    ],
    requires=_require_cuda,
    environment=_environment,
    options={
        "skip_cpp": False,
        "flex_budget_s": 150.0,
        "hybrid_modes": "decode,draft_extend",
        "hybrid_sizes": "1,8,32,64,128",
        **MODEL_DECODE_OPTIONS,
    },
    isolate=True,
    budget_s=DEFAULT_BUDGET_S,
)


def run_benchmarks(
    only: Optional[Iterable[str]] = None,
    quick: bool = False,
    json_path: Optional[str] = None,
    *,
    out_dir: Optional[str] = None,
    **options: Any,
) -> dict:
    """Run ``SUITE`` on the current CUDA device through the harness (``attnplug.bench.run_suite``):
    the same run as ``attnplug bench --backend cuda``. ``options``: the suite's options."""
    import torch

    from attnplug.bench import run_suite

    from ..backend import CudaBackend

    unknown = sorted(set(options) - set(SUITE.options))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown}; the cuda suite has {sorted(SUITE.options)}")
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return run_suite(
        SUITE,
        CudaBackend,
        device,
        only=list(only) if only else None,
        quick=quick,
        out_dir=out_dir,
        json_path=json_path,
        options={**SUITE.options, **options},
    )
