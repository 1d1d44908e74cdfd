"""What the engine checks (``attnplug vllm-check``, ``attnplug sglang-check``) share: the tiny
models, the prompts, transformers' greedy tokens as the independent reference, and the table.

Each model exercises one attention feature an engine hands a backend (``FEATURES``): grouped
query heads, a sliding window, a logit soft-cap, attention sinks. The models are small random
``transformers`` models built offline (``attnplug.integrations.transformers.tiny``), with head
dim 64 (a size every engine backend serves) and saved with ``save_pretrained``; the prompts are
seeded token ids of lengths that straddle a window of 8 and a chunk budget of 16.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

__all__ = [
    "EngineModel",
    "ENGINE_MODELS",
    "MAX_NEW_TOKENS",
    "MAX_MODEL_LEN",
    "CHUNK_BUDGET",
    "MODES",
    "prompts",
    "save_model",
    "transformers_tokens",
    "engine_tokens",
    "Row",
    "check_row",
    "side_by_side_env",
    "table",
    "spawn_child",
    "collect_child",
    "add_common_arguments",
    "run_as_child",
    "model_names",
    "prepare_models",
    "module_main",
]


@dataclass(frozen=True)
class EngineModel:
    """One tiny model: its name, ``tiny_config`` architecture and overrides, and the impl
    features an engine must hand attnplug for it (counted in the worker: ``window``,
    ``softcap``, ``sinks``)."""

    name: str
    arch: str
    overrides: Dict[str, object] = field(default_factory=dict)
    features: Sequence[str] = ()


_COMMON = dict(head_dim=64)

ENGINE_MODELS: Dict[str, EngineModel] = {
    m.name: m
    for m in (
        EngineModel("llama-gqa", "llama", dict(_COMMON)),
        EngineModel("mistral-swa", "mistral", dict(_COMMON), ("window",)),
        # vLLM's Gemma2 ties the output projection to the embeddings (it loads no lm_head)
        EngineModel("gemma2-softcap", "gemma2", dict(_COMMON, tie_word_embeddings=True), ("window", "softcap")),
        EngineModel("gpt_oss-sinks", "gpt_oss", dict(_COMMON), ("window", "sinks")),
        # sliding, sliding, full: SGLang keeps the sliding layers in its hybrid SWA pool
        EngineModel("gemma3-hybrid", "gemma3_text", dict(_COMMON, tie_word_embeddings=True), ("window",)),
    )
}

#: prompt lengths: shorter and longer than the window (8) and the chunk budget (16)
PROMPT_LENGTHS = (5, 17, 40, 70)
#: what every engine run of a check uses: greedy tokens a prompt, the context, the chunk budget
#: of the chunked mode, and the modes (whole prompts in one step; chunked prefill)
MAX_NEW_TOKENS = 12
MAX_MODEL_LEN = 256
CHUNK_BUDGET = 16
MODES = ("eager", "chunked")


def prompts(seed: int = 1, lengths: Sequence[int] = PROMPT_LENGTHS, vocab: int = 256) -> List[List[int]]:
    """Seeded token-id prompts (ids 3.. avoid pad, bos and eos)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def save_model(model: EngineModel, root: str, dtype: torch.dtype = torch.float32) -> str:
    """Build ``model`` (seed 0) and save it under ``root/<name>``; returns the folder. A folder
    already there is reused (the same seed gives the same weights)."""
    from .transformers.tiny import tiny_model

    path = os.path.join(root, model.name)
    if not os.path.exists(os.path.join(path, "config.json")):
        tiny_model(model.arch, seed=0, dtype=dtype, **model.overrides).save_pretrained(path)
    return path


def transformers_tokens(path: str, token_prompts: Sequence[Sequence[int]], max_new_tokens: int) -> List[List[int]]:
    """Greedy tokens of the saved model with transformers' eager attention, float32 on the
    host, every step a full forward (no cache): the reference no engine shares code with."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32)
    model.eval()
    out = []
    with torch.no_grad():
        for p in token_prompts:
            ids = torch.tensor([list(p)])
            new: List[int] = []
            for _ in range(max_new_tokens):
                nxt = int(model(input_ids=ids).logits[0, -1].argmax())
                new.append(nxt)
                ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
            out.append(new)
    return out


def engine_tokens(
    path: str, token_prompts: Sequence[Sequence[int]], max_new_tokens: int, kv_cache_dtype: str
) -> List[List[int]]:
    """Greedy tokens of the saved model through attnplug's own ``Engine`` on the reference
    backend, float32 on the host, over a KV cache of ``kv_cache_dtype`` (an engine's name:
    ``"fp8"``, ``"fp8_e5m2"``, ...) with every scale 1.0, what an engine uses without
    calibrated scales: the reference of an engine run over an FP8 cache (transformers' tokens
    are those of the unquantised cache)."""
    import transformers

    from .transformers import Engine

    model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32)
    longest = max(len(p) for p in token_prompts) + max_new_tokens
    engine = Engine(
        model,
        "reference",
        max_batch_size=len(token_prompts),
        max_context_len=longest,
        progress=False,
        kv_cache_dtype=kv_cache_dtype,
    )
    return engine.generate([list(p) for p in token_prompts], max_new_tokens)


@dataclass
class Row:
    """One (model, mode) of a check: tokens per source, and what the worker counted."""

    model: str
    mode: str
    tokens: Dict[str, List[List[int]]]
    calls: Optional[Dict[str, int]] = None
    problems: List[str] = field(default_factory=list)

    def agreement(self, a: str, b: str) -> float:
        """Fraction of token positions where sources ``a`` and ``b`` agree."""
        pairs = [(x, y) for pa, pb in zip(self.tokens[a], self.tokens[b]) for x, y in zip(pa, pb)]
        return sum(x == y for x, y in pairs) / max(1, len(pairs))


def table(rows: Sequence[Row], sources: Sequence[str], against: str) -> str:
    """A Markdown table: per row, the agreement of each source with ``against`` and the
    worker's counts."""
    others = [s for s in sources if s != against]
    head = ["model", "mode"] + [f"{s} = {against}" for s in others] + ["attnplug calls", "result"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        calls = r.calls or {}
        counted = ", ".join(f"{k} {v}" for k, v in sorted(calls.items())) or "-"
        cells = [r.model, r.mode] + [f"{100 * r.agreement(s, against):.0f} %" for s in others]
        cells += [counted, "ok" if not r.problems else "FAIL: " + "; ".join(r.problems)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def check_row(
    row: Row,
    model: EngineModel,
    against: Sequence[str],
    *,
    exact: bool,
    min_agreement: float,
    ran: bool,
    features: Sequence[str],
    where: str,
) -> None:
    """Record in ``row.problems`` what is wrong: attnplug's tokens against each source of
    ``against`` (equal when ``exact``, else at least ``min_agreement``), attnplug's code not run
    in the engine's ``where`` (``ran``), a feature of the model no attnplug layer used."""
    for source in against:
        agree = row.agreement("attnplug", source)
        if (exact and agree < 1.0) or agree < min_agreement:
            row.problems.append(f"attnplug tokens differ from {source}'s ({100 * agree:.1f} % agree)")
    if not ran:
        row.problems.append(f"attnplug's code did not run in {where}")
    for feature in model.features:
        if feature not in features:
            row.problems.append(f"no attnplug layer used the model's {feature}")


def side_by_side_env(children: int = 2) -> Dict[str, str]:
    """This process's environment for one of ``children`` engine runs that share the host's
    cores at once: each takes its share of them (``OMP_NUM_THREADS``, unless the caller set
    it), where every engine's torch would otherwise start a thread a core."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // children)))
    return env


def spawn_child(module: str, spec: Dict[str, Any], env: Dict[str, str], work: str, name: str):
    """Start ``python -m module --child SPEC OUT`` (an engine run in its own process, whose
    plugin loading and environment are its own); ``collect_child`` waits for it."""
    spec_path, out_path = os.path.join(work, f"{name}.spec.json"), os.path.join(work, f"{name}.out.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    if os.path.exists(out_path):
        os.remove(out_path)
    cmd = [sys.executable, "-m", module, "--child", spec_path, out_path]
    log = open(os.path.join(work, f"{name}.log"), "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    return name, out_path, log, proc, time.perf_counter()


def collect_child(started) -> Dict[str, Any]:
    """The JSON a child wrote; ``RuntimeError`` with its log's tail when it failed."""
    name, out_path, log, proc, t0 = started
    code = proc.wait()
    log.close()
    if code != 0 or not os.path.exists(out_path):
        with open(log.name) as f:
            tail = "\n".join(f.read().splitlines()[-40:])
        raise RuntimeError(f"the {name} run failed (exit code {code}; log {log.name}):\n{tail}")
    print(f"  {name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    with open(out_path) as f:
        return json.load(f)


# ---------------------------------------------------------------------------- the commands' common parts
def add_common_arguments(parser: argparse.ArgumentParser, default_models: Sequence[str]) -> None:
    """``--models``, ``--work``, ``--min-agreement``, ``--json`` and the hidden ``--child``."""
    parser.add_argument(
        "--models",
        default=",".join(default_models),
        metavar="NAMES",
        help=f"comma-separated tiny models (default: {', '.join(default_models)}; known: {', '.join(ENGINE_MODELS)})",
    )
    parser.add_argument("--work", metavar="DIR", help="where the tiny models are saved (default: a temporary folder)")
    parser.add_argument("--min-agreement", type=float, default=0.95, metavar="F", help="half precision only")
    parser.add_argument("--json", metavar="PATH", help="write the runs' tokens and counts as JSON")
    parser.add_argument("--child", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)


def run_as_child(args: argparse.Namespace, run_child: Callable[[Dict[str, Any]], Dict[str, Any]]) -> bool:
    """When the command runs as a child (``--child SPEC OUT``): run ``run_child`` on the spec,
    write its result, return True."""
    if not args.child:
        return False
    with open(args.child[0]) as f:
        spec = json.load(f)
    result = run_child(spec)
    with open(args.child[1], "w") as f:
        json.dump(result, f)
    return True


def model_names(text: str) -> List[str]:
    """The ``--models`` list; ``ValueError`` naming an unknown one."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in ENGINE_MODELS]
    if unknown or not names:
        raise ValueError(f"--models: unknown {unknown or names} (known: {', '.join(ENGINE_MODELS)})")
    return names


def prepare_models(
    names: Sequence[str], work: Optional[str], engine: str
) -> Tuple[str, List[List[int]], Dict[str, str], Dict[str, List[List[int]]]]:
    """The work folder, the prompts, each model saved (its folder) and transformers' tokens."""
    work = work or tempfile.mkdtemp(prefix=f"attnplug-{engine}-")
    os.makedirs(work, exist_ok=True)
    token_prompts = prompts()
    paths = {n: save_model(ENGINE_MODELS[n], work) for n in names}
    reference = {n: transformers_tokens(paths[n], token_prompts, MAX_NEW_TOKENS) for n in names}
    return work, token_prompts, paths, reference


def module_main(prog: str, add_arguments: Callable, run_command: Callable) -> int:
    """``python -m`` of a check module (how a check runs its children): parse, run."""
    parser = argparse.ArgumentParser(prog=prog)
    add_arguments(parser)
    return run_command(parser.parse_args())
