"""``attnplug sglang-check``: tiny models through ``sglang.Engine`` with
``attention_backend="attnplug"``, against transformers and SGLang's own backend.

For each model of ``engine_check.ENGINE_MODELS`` and each mode (``eager``: whole prompts;
``chunked``: ``chunked_prefill_size=16``), the greedy tokens of the engine with attnplug must
equal transformers' (float32 on the host; ``--min-agreement`` in half precision), and
attnplug's backend must have run in SGLang's scheduler process with every feature of the model
(its log lines, at INFO). SGLang's own backend (``--compare``, default ``torch_native``) runs the
same prompts and is shown beside them; it does not decide the result (on a hybrid SWA pool
``torch_native`` reads the window at full-pool slots).

On a host without SGLang's GPU packages this is a smoke run of SGLang's engine, not a run on
hardware (docs/engines.md says what .ci/run installs for it). Exit codes: 0 all agree, 1 a
disagreement or a missing log line, 2 the run cannot start.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, List

from ...cli_errors import fail
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
    model_names,
    module_main,
    prepare_models,
    run_as_child,
    side_by_side_env,
    spawn_child,
    table,
)

__all__ = ["add_arguments", "run_command"]

#: the tiny models SGLang 0.5.23's engine runs with another backend than its own list (docs/engines.md:
#: its Gemma2 reads a config field transformers 5 dropped, its gpt-oss hook accepts only its listed
#: backends, its Mistral runs without the sliding window)
DEFAULT_MODELS = ("llama-gqa", "gemma3-hybrid")
_MODULE = "attnplug.integrations.sglang.check"  # the children run it with --child
#: the log lines of attnplug's SGLang backend a run must show
_BUILT = "attnplug: SGLang attention through the "
_FEATURE = "attnplug: first layer with "


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser, DEFAULT_MODELS)
    parser.add_argument("--device", default="cpu", metavar="DEVICE", help="SGLang's device (default: cpu)")
    parser.add_argument("--compare", default="torch_native", metavar="NAME", help="SGLang's own backend to show")


def _run_child(spec: Dict[str, Any]) -> Dict[str, Any]:
    import sglang

    results: Dict[str, Any] = {}
    greedy = {"temperature": 0, "max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True}
    host = spec["device"] == "cpu"
    for run in spec["runs"]:
        chunked = run["mode"] == "chunked"
        engine = sglang.Engine(
            model_path=run["path"],
            device=spec["device"],
            attention_backend=spec["attention_backend"],
            skip_tokenizer_init=True,
            dtype=spec["dtype"],
            disable_cuda_graph=host,
            # SGLang checks the fraction against the memory free after loading (which the other
            # engine, side by side on the host, also uses); the pool itself is capped below
            mem_fraction_static=0.5 if host else 0.3,
            max_total_tokens=4096,
            context_length=MAX_MODEL_LEN,
            chunked_prefill_size=CHUNK_BUDGET if chunked else MAX_MODEL_LEN,
            random_seed=0,
            log_level="info",
        )
        try:
            out = engine.generate(input_ids=spec["prompts"], sampling_params=greedy)
        finally:
            engine.shutdown()
        results[f"{run['model']}/{run['mode']}"] = {"tokens": [list(o["output_ids"]) for o in out]}
    return results


def _log_counts(work: str, name: str) -> Dict[str, int]:
    """What attnplug's backend logged in a child's processes: backends built, features used."""
    counts: Dict[str, int] = {}
    with open(os.path.join(work, f"{name}.log")) as f:
        for line in f:
            if _BUILT in line:
                backend = line.split(_BUILT, 1)[1].split()[0]
                counts[f"backend:{backend}"] = counts.get(f"backend:{backend}", 0) + 1
            elif _FEATURE in line:
                feature = line.split(_FEATURE, 1)[1].strip()
                counts[feature] = counts.get(feature, 0) + 1
    return counts


def run_command(args: argparse.Namespace) -> int:
    if run_as_child(args, _run_child):
        return 0
    try:
        import sglang
    except ImportError:
        return fail("sglang-check needs SGLang: pip install 'attnplug[sglang]'")
    try:
        names = model_names(args.models)
    except ValueError as exc:
        return fail(str(exc))
    host = args.device == "cpu"
    dtype = "float32" if host else "bfloat16"
    print(f"sglang-check: SGLang {sglang.__version__} on {args.device}: attnplug vs transformers", file=sys.stderr)
    work, token_prompts, paths, reference = prepare_models(names, args.work, "sglang")
    rows: List[Row] = []
    base = dict(prompts=token_prompts, device=args.device, dtype=dtype)
    try:
        results: Dict[str, Dict[str, Any]] = {"attnplug": {}, args.compare: {}}
        for n in names:  # a child a model and backend: its log tells what attnplug ran for that model
            runs = [{"model": n, "path": paths[n], "mode": m} for m in MODES]
            specs = [(b, {**base, "runs": runs, "attention_backend": b}) for b in results]
            if host:  # side by side on the host's cores
                started = [(b, spawn_child(_MODULE, spec, side_by_side_env(), work, f"{b}-{n}")) for b, spec in specs]
                for b, child in started:
                    results[b].update(collect_child(child))
            else:  # one engine at a time on an accelerator
                for b, spec in specs:
                    results[b].update(collect_child(spawn_child(_MODULE, spec, dict(os.environ), work, f"{b}-{n}")))
    except RuntimeError as exc:
        return fail(str(exc), code=1)
    for n in names:
        counts = _log_counts(work, f"attnplug-{n}")
        for mode in MODES:
            key = f"{n}/{mode}"
            tokens = {source: results[source][key]["tokens"] for source in ("attnplug", args.compare)}
            row = Row(n, mode, {**tokens, "transformers": reference[n]}, calls=counts)
            check_row(
                row,
                ENGINE_MODELS[n],
                ("transformers",),
                exact=dtype == "float32",
                min_agreement=args.min_agreement,
                ran=any(k.startswith("backend:") for k in counts),
                features=list(counts),
                where="SGLang's scheduler (no log line of attnplug's backend)",
            )
            rows.append(row)
    print(table(rows, ["attnplug", args.compare, "transformers"], "attnplug"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"sglang": sglang.__version__, "results": results}, f, indent=1)
    failed = [r for r in rows if r.problems]
    print(
        f"sglang-check (a smoke run on {args.device}): {len(rows) - len(failed)}/{len(rows)} runs agree",
        file=sys.stderr,
    )
    return 1 if failed else 0


if __name__ == "__main__":  # python -m attnplug.integrations.sglang.check (the children)
    sys.exit(module_main("attnplug sglang-check", add_arguments, run_command))
