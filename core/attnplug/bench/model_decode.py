"""``model_decode``: decode tokens/s of a 1B-class Gemma3 text model through ``Engine`` against
transformers' own fastest ``generate`` on the same model, in the same run.

The model (``GEMMA3_1B``, random weights, seed 0, bfloat16; the shape of gemma-3-1b):
vocab 262,144, hidden 1,152, MLP 6,912, 26 layers, 4 query heads over 1 KV head of
head_dim 256, ``query_pre_attn_scalar`` 256, sliding window 512 on 5 of every 6 layers
(``layer_types``: 5 sliding, 1 full), RoPE theta 10,000 (sliding) / 1,000,000 (full), tied
embeddings, no soft-capping. ``--quick`` uses a tiny config of the same layout
(``QUICK_CONFIG``), so the benchmark runs on the host in seconds.

Method, per batch size (1 and 32; ``--quick``: 1 and 4):

* the same prompts for both paths: ``bs`` prompts of ``PROMPT_LEN`` random token ids (seed 0);
  both generate greedily exactly ``n`` new tokens (no end-of-sequence token);
* attnplug: ``attnplug.integrations.transformers.Engine(model, backend_cls, max_batch_size=bs,
  max_context_len=..., compile=True)`` with its default graph use (graphs where the backend
  has them, replaying the model compiled around the ``attnplug::attention`` op; when compiling
  fails, the same run uncompiled, the row's ``notes`` saying why), ``Engine.generate(prompts, n)``;
* transformers: the same weights with ``attn_implementation="sdpa"``,
  ``model.generate(input_ids, max_new_tokens=n, do_sample=False, cache_implementation="static")``:
  a static KV cache, whose decode step transformers compiles with ``torch.compile`` on an
  accelerator. When compiling fails, the run falls back to the same call with
  ``disable_compile=True``; the row's ``path`` records which one ran (and why);
* each path is warmed up (a full ``generate`` of ``NEW_TOKENS`` tokens: graph capture,
  compilation, the static cache allocated), then ``t(n)`` is the median of ``REPEATS``
  wall-clock times of ``generate`` with ``n`` new tokens, the device synchronised through the
  backend class around each call. Decode tokens/s = ``bs * (N - 1) / (t(N) - t(1))`` with
  ``N = NEW_TOKENS``: the difference removes prefill and fixed per-call costs, leaving
  ``N - 1`` decode steps of each request;
* rows: tokens/s of each path (``variant`` attnplug / transformers), the ratio attnplug /
  transformers (target: > 1, faster than transformers), ``t(1)`` (prefill + first token) and
  the share of generated tokens both paths agree on (greedy decoding of random weights in
  bfloat16: an information, not a check; the logits are checked by the conformance suite's
  ``check_matches_transformers``);
* FP8 KV cache, where the backend declares ``float8_e4m3fn`` in ``fp8_kv_dtypes``: the same
  Engine run with ``kv_cache_dtype="fp8"`` (every scale 1.0, what vLLM uses without calibrated
  scales; the model, prompts and method as above), its decode tokens/s (``variant``
  ``attnplug fp8 kv``) and a row of the ratio FP8 / model-dtype KV tokens/s with the share of
  token positions whose greedy token equals the model-dtype KV run's (``token_agreement_kv``:
  an information figure, never a check; FP8 moves the logits, and random weights have many
  near ties).

Prefill, before the decode rows, per shape ``bs x prompt_len`` of ``PREFILL_SHAPES`` (1 x 2,048,
8 x 1,024, 32 x 512; ``--quick``: small ones): ``bs`` prompts of random token ids (seed 0), and

* attnplug: ``Engine(model, backend_cls, max_batch_size=bs, compile=PREFILL_COMPILE, ...)``
  (default ``max_prefill_tokens``: the prompts run as EXTEND steps of up to 8,192 tokens, of
  the model compiled once for every chunk length, as the decode rows' Engine compiles; when
  compiling fails, the eager Engine's time, the row's ``notes`` saying why), timed
  ``Engine.generate(prompts, 1)``: the whole prefill and the first token, nothing else; beside
  it the same Engine uncompiled (variant ``attnplug eager``, information), and uncompiled with
  its EXTEND steps run eagerly instead of replayed in token-count graphs (``extend_graphs=False``,
  variant ``attnplug eager, EXTEND uncaptured``: where the backend captures EXTEND steps, what
  the captures save an eager model; information);
* transformers: one forward of the same weights with ``attn_implementation="sdpa"`` over the
  same ``[bs, prompt_len]`` ids, ``use_cache=False`` and ``logits_to_keep=1`` (the LM head on
  the last token only, as the Engine), then the argmax;
* each warmed up once, then the median of ``REPEATS`` synchronised wall-clock times; rows
  ``prefill BSxLEN``: the time of each path (``variant``) and the ratio transformers /
  attnplug time for each Engine (target >= 1 for the compiled one: attnplug at least as fast;
  held only on an accelerator, an information figure on the host), with the share of prompts
  whose first token both agree on. Any compilation happens in the compiled Engine's warm-up
  (untimed).

The suite option ``model_decode_series`` (``--set model_decode_series=prefill``) names the
series run: ``prefill``, ``decode`` or both (the default).

Skipped (a row with the reason, no error) when transformers or the integration cannot be
imported, and for the 1B config on the host (``--quick`` runs the tiny one there).
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import Callable, List, Sequence

import torch

from ..batch import ForwardMode
from ..integrations import transformers_missing
from .context import Ctx
from .rows import row
from .suite import Benchmark

__all__ = [
    "BENCHMARK",
    "build_model",
    "GEMMA3_1B",
    "QUICK_CONFIG",
    "PROMPT_LEN",
    "NEW_TOKENS",
    "BATCH_SIZES",
    "PREFILL_SHAPES",
    "run",
    "series",
    "OPTIONS",
]

NAME = "model_decode"
#: the entry a suite lists (only run when named: ``attnplug bench --only model_decode``)
BENCHMARK = Benchmark(
    NAME,
    f"{__name__}:run",
    "prefill time and decode tokens/s of a 1B-class Gemma3 text model: Engine vs transformers (sdpa)",
    reserve_s=600.0,
    default=False,
)

#: the 1B-class Gemma3 text config (transformers ``Gemma3TextConfig`` keyword arguments; the
#: rest are its defaults: RoPE theta 1e4 sliding / 1e6 full, 5 sliding : 1 full layers)
GEMMA3_1B = dict(
    vocab_size=262144,
    hidden_size=1152,
    intermediate_size=6912,
    num_hidden_layers=26,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=256,
    sliding_window=512,
    query_pre_attn_scalar=256,
    max_position_embeddings=32768,
)
#: ``--quick``: the same layout, tiny
QUICK_CONFIG = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=64,
    sliding_window=16,
    query_pre_attn_scalar=64,
    max_position_embeddings=512,
)
PROMPT_LEN = 128
NEW_TOKENS = 128
BATCH_SIZES = (1, 32)
#: the prefill rows' ``(bs, prompt_len)`` shapes (issue 38)
PREFILL_SHAPES = ((1, 2048), (8, 1024), (32, 512))
#: the prefill rows' Engine ``compile`` (as the decode rows' Engine: its EXTEND steps run the model
#: compiled once for every chunk length); the eager Engine is timed beside it
PREFILL_COMPILE = True
REPEATS = 3
_QUICK = dict(prompt_len=24, new_tokens=8, batch_sizes=(1, 4), repeats=1, prefill_shapes=((1, 40), (2, 24)))


#: the suite options this benchmark reads, with their defaults (every suite listing it takes them)
OPTIONS = {"model_decode_series": "prefill,decode"}


def series(option: str) -> tuple:
    """The row series of the suite option ``model_decode_series`` (``"prefill,decode"``): a
    non-empty subset of ``prefill`` and ``decode``, in that order; ``ValueError`` naming the
    choices for anything else."""
    choices = ("prefill", "decode")
    names = [n.strip().lower() for n in str(option).split(",") if n.strip()]
    if not names or any(n not in choices for n in names):
        raise ValueError(f"model_decode_series={option!r}: name one or both of {list(choices)}, comma-separated")
    return tuple(c for c in choices if c in names)


def _skip(ctx: Ctx, why: str) -> List[dict]:
    ctx.rows.append(row(NAME, "(all)", "decode tokens/s", None, "tok/s", notes=f"skipped: {why}", key=True))
    ctx.log(f"{NAME}: skipped: {why}")
    return ctx.rows


def build_model(device: torch.device, config_kwargs: dict):
    """``(model, dtype)``: the random-weight Gemma3 text model of ``config_kwargs``
    (``GEMMA3_1B`` or ``QUICK_CONFIG``; seed 0) in bfloat16 (float32 on the host) on
    ``device``, sdpa attention, generating exactly the tokens asked (no EOS)."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    config = Gemma3TextConfig(**config_kwargs)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.eval()
    model.generation_config.eos_token_id = None  # exactly n new tokens, as the engine
    model.generation_config.pad_token_id = 0
    return model, dtype


def _timed(ctx: Ctx, fn: Callable[[], object], repeats: int) -> float:
    """Median wall-clock seconds of ``fn()``, the device synchronised around each call."""
    sync = ctx.backend_cls.synchronize if ctx.backend_cls is not None else (lambda device: None)
    times = []
    for _ in range(repeats):
        sync(ctx.device)
        start = time.perf_counter()
        fn()
        sync(ctx.device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class _Transformers:
    """transformers' own generate with a static cache (compiled where transformers compiles)."""

    def __init__(self, model, prompts: torch.Tensor) -> None:
        self.model = model
        self.prompts = prompts
        self.disable_compile = False
        self.path = "static cache + sdpa"
        self.note = ""

    def generate(self, n: int) -> List[List[int]]:
        with torch.no_grad():
            out = self.model.generate(
                input_ids=self.prompts,
                attention_mask=torch.ones_like(self.prompts),
                max_new_tokens=n,
                do_sample=False,
                cache_implementation="static",
                disable_compile=self.disable_compile,
            )
        new = out[:, self.prompts.shape[1] :]
        if new.shape[1] != n:
            raise RuntimeError(f"transformers generated {new.shape[1]} tokens, {n} asked")
        return new.tolist()

    def warm_up(self, n: int) -> List[List[int]]:
        try:
            tokens = self.generate(n)
        except Exception as exc:  # compilation failed: the same call uncompiled
            self.disable_compile = True
            self.note = f"torch.compile failed ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})"
            tokens = self.generate(n)
        compiled = getattr(self.model, "_compiled_call", None) is not None and not self.disable_compile
        self.path = "static cache + sdpa + torch.compile" if compiled else "static cache + sdpa (not compiled)"
        if not compiled and not self.note:
            self.note = "transformers did not compile the decode step on this device"
        return tokens


def _steps(n: int) -> str:
    """``1 EXTEND step``, ``2 EXTEND steps``."""
    return f"{n} EXTEND step" + ("" if n == 1 else "s")


def _agreement(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> float:
    same = total = 0
    for x, y in zip(a, b):
        total += len(x)
        same += sum(int(p == q) for p, q in zip(x, y))
    return same / max(total, 1)


def _ours(ctx: Ctx, model, prompts: List[List[int]], prompt_len: int, n_new: int, kv_cache_dtype=None):
    """The attnplug Engine on ``prompts`` over a KV cache of ``kv_cache_dtype`` (None: the
    model's dtype): ``(warm-up tokens, t(1), t(n), last run figures, path, note)``. Where its
    DECODE steps replay graphs, the model is compiled around the attention op
    (``Engine(compile=True)``); when compiling fails, the same run uncompiled, the note saying
    why."""

    def engine_for(compile_model: bool):
        return _engine(ctx, model, len(prompts), prompt_len + n_new + 16, compile_model, kv_cache_dtype)

    note = ""
    try:
        engine = engine_for(True)
        tokens = engine.generate(prompts, n_new)
    except Exception as exc:
        note = f"torch.compile failed ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})"
        engine = engine_for(False)
        tokens = engine.generate(prompts, n_new)
    if engine.graphs is None:
        path = "eager steps (no device graphs)"
    else:
        path = "graphs of the compiled model" if engine.runner.compile else "graphs of the eager model"
    repeats = _QUICK["repeats"] if ctx.quick else REPEATS
    t1 = _timed(ctx, lambda: engine.generate(prompts, 1), repeats)
    tn = _timed(ctx, lambda: engine.generate(prompts, n_new), repeats)
    return tokens, t1, tn, dict(engine.last_run), path, note


def _theirs(ctx: Ctx, model, prompts: torch.Tensor, n_new: int):
    """transformers' generate on ``prompts``: ``(warm-up tokens, t(1), t(n), _Transformers)``."""
    hf = _Transformers(model, prompts.to(ctx.device))
    tokens = hf.warm_up(n_new)
    repeats = _QUICK["repeats"] if ctx.quick else REPEATS
    t1 = _timed(ctx, lambda: hf.generate(1), repeats)
    tn = _timed(ctx, lambda: hf.generate(n_new), repeats)
    return tokens, t1, tn, hf


def _serves_fp8(backend_cls) -> bool:
    """Whether the backend class declares an FP8 KV cache of float8_e4m3fn (``"fp8"``)."""
    caps = backend_cls.installed_capabilities() if backend_cls is not None else None
    return caps is not None and torch.float8_e4m3fn in tuple(caps.fp8_kv_dtypes)


def run(ctx: Ctx) -> List[dict]:
    """The benchmark of the module docstring for ``ctx.backend_cls`` on ``ctx.device``."""
    why = transformers_missing()
    if why is not None:
        return _skip(ctx, why)
    if ctx.device.type == "cpu" and not ctx.quick:
        return _skip(ctx, "the 1B-class config needs an accelerator; --quick runs a tiny config on the host")
    prompt_len = _QUICK["prompt_len"] if ctx.quick else PROMPT_LEN
    n_new = _QUICK["new_tokens"] if ctx.quick else NEW_TOKENS
    sizes = _QUICK["batch_sizes"] if ctx.quick else BATCH_SIZES
    config_kwargs = QUICK_CONFIG if ctx.quick else GEMMA3_1B
    ctx.log(f"{NAME}: building the {'tiny' if ctx.quick else '1B-class'} Gemma3 text model on {ctx.device}")
    hf_model, dtype = build_model(ctx.device, config_kwargs)
    ours_model = copy.deepcopy(hf_model)
    gen = torch.Generator().manual_seed(0)
    config_name = "tiny Gemma3 text" if ctx.quick else "Gemma3 text 1B-class"
    backend_name = getattr(ctx.backend_cls, "name", "?")
    parts = series(ctx.options.get("model_decode_series", OPTIONS["model_decode_series"]))
    if "prefill" in parts:
        _prefill_rows(ctx, hf_model, ours_model, config_kwargs, dtype, gen)
    if "decode" not in parts:
        return ctx.rows
    fp8 = _serves_fp8(ctx.backend_cls)
    if not fp8:
        ctx.log(f"{NAME}: backend {backend_name} declares no FP8 KV cache (float8_e4m3fn): no FP8 rows")
    for bs in sizes:
        case = f"{config_name}, bs={bs}, prompt {prompt_len}, {n_new} new tokens"
        if ctx.time_low(need_s=30.0):
            ctx.rows.append(row(NAME, case, "decode tokens/s", None, "tok/s", notes="skipped: time budget", key=True))
            continue
        prompts = torch.randint(0, config_kwargs["vocab_size"], (bs, prompt_len), generator=gen)
        ctx.log(f"{NAME}: bs={bs}: transformers (warm-up compiles where transformers compiles)")
        hf_tokens, hf_t1, hf_tn, hf = _theirs(ctx, hf_model, prompts, n_new)
        ctx.log(f"{NAME}: bs={bs}: attnplug Engine on {backend_name}")
        our_tokens, our_t1, our_tn, last, our_path, our_note = _ours(
            ctx, ours_model, prompts.tolist(), prompt_len, n_new
        )
        graph_steps, decode_steps = last.get("graph_steps", 0), last.get("steps", {}).get("DECODE", 0)
        steps = n_new - 1
        hf_tps = bs * steps / max(hf_tn - hf_t1, 1e-9)
        our_tps = bs * steps / max(our_tn - our_t1, 1e-9)
        ratio = our_tps / hf_tps
        agree = _agreement(our_tokens, hf_tokens)
        common = dict(bs=bs, series="decode", dtype=str(dtype).replace("torch.", ""), prompt_len=prompt_len)
        ctx.rows.append(
            row(
                NAME,
                case,
                "decode tokens/s",
                our_tps,
                "tok/s",
                detail=f"Engine on {backend_name}, {our_path}, {graph_steps}/{decode_steps} decode steps replayed",
                notes=our_note,
                key=True,
                variant="attnplug",
                path=our_path,
                graph_steps=graph_steps,
                decode_steps=decode_steps,
                t1_s=our_t1,
                tn_s=our_tn,
                **common,
            )
        )
        ctx.rows.append(
            row(
                NAME,
                case,
                "decode tokens/s",
                hf_tps,
                "tok/s",
                detail=hf.path,
                notes=hf.note,
                key=True,
                variant="transformers",
                path=hf.path,
                t1_s=hf_t1,
                tn_s=hf_tn,
                **common,
            )
        )
        ctx.rows.append(
            row(
                NAME,
                case,
                "attnplug / transformers",
                ratio,
                "x",
                target="> 1 (faster than transformers)",
                met=ratio > 1.0,
                detail=f"tokens agreeing {agree:.0%}",
                token_agreement=agree,
                **common,
            )
        )
        ctx.log(
            f"{NAME}: bs={bs}: attnplug {our_tps:,.0f} tok/s, transformers {hf_tps:,.0f} tok/s ({hf.path}): "
            f"{ratio:.2f}x; tokens agreeing {agree:.0%}"
        )
        if fp8:
            _fp8_rows(ctx, case, common, ours_model, prompts.tolist(), prompt_len, n_new, our_tokens, our_tps)
    return ctx.rows


def _fp8_rows(ctx: Ctx, case: str, common: dict, model, prompts, prompt_len: int, n_new: int, base_tokens, base_tps):
    """The Engine run over an FP8 KV cache (``kv_cache_dtype="fp8"``, scales 1.0) beside the
    model-dtype one: its decode tokens/s and the ratio row with the greedy tokens' agreement."""
    backend_name = getattr(ctx.backend_cls, "name", "?")
    kv_name = f"{common['dtype']} KV"
    ctx.log(f"{NAME}: bs={common['bs']}: attnplug Engine on {backend_name}, FP8 KV cache (float8_e4m3fn)")
    tokens, t1, tn, last, path, note = _ours(ctx, model, prompts, prompt_len, n_new, kv_cache_dtype="fp8")
    graph_steps, decode_steps = last.get("graph_steps", 0), last.get("steps", {}).get("DECODE", 0)
    tps = common["bs"] * (n_new - 1) / max(tn - t1, 1e-9)
    agree = _agreement(tokens, base_tokens)
    fp8 = dict(common, kv_cache_dtype="float8_e4m3fn")
    ctx.rows.append(
        row(
            NAME,
            case,
            "decode tokens/s",
            tps,
            "tok/s",
            detail=f"Engine on {backend_name}, FP8 KV cache, {path}, {graph_steps}/{decode_steps} decode steps "
            "replayed",
            notes=note,
            key=True,
            variant="attnplug fp8 kv",
            path=path,
            graph_steps=graph_steps,
            decode_steps=decode_steps,
            t1_s=t1,
            tn_s=tn,
            **fp8,
        )
    )
    ctx.rows.append(
        row(
            NAME,
            case,
            f"fp8 KV / {kv_name}",
            tps / base_tps,
            "x",
            detail=f"greedy tokens equal to the {kv_name} run's at {agree:.1%} of positions (information)",
            key=True,
            token_agreement_kv=agree,
            **fp8,
        )
    )
    ctx.log(
        f"{NAME}: bs={common['bs']}: attnplug FP8 KV {tps:,.0f} tok/s vs {kv_name} {base_tps:,.0f} tok/s "
        f"({tps / base_tps:.2f}x); greedy tokens equal to the {kv_name} run's at {agree:.1%} of positions"
    )


def _engine(ctx: Ctx, model, bs: int, context: int, compile_model, kv_cache_dtype=None, extend_graphs=None):
    """An Engine of the benchmark's backend for ``bs`` requests of up to ``context`` positions
    (rounded up to 64), with ``compile_model`` as its ``compile`` and ``extend_graphs``, no
    progress line."""
    from attnplug.integrations.transformers import Engine

    return Engine(
        model,
        ctx.backend_cls,
        max_batch_size=bs,
        max_context_len=-(-context // 64) * 64,
        progress=False,
        compile=compile_model,
        kv_cache_dtype=kv_cache_dtype,
        extend_graphs=extend_graphs,
    )


def _prefill_rows(ctx: Ctx, hf_model, ours_model, config_kwargs: dict, dtype, gen: torch.Generator) -> None:
    """The prefill rows of the module docstring: ``Engine.generate(prompts, 1)``, compiled
    (``PREFILL_COMPILE``) and eager, against one sdpa forward of transformers over the same
    prompts, per shape of ``PREFILL_SHAPES``."""
    backend_name = getattr(ctx.backend_cls, "name", "?")
    repeats = _QUICK["repeats"] if ctx.quick else REPEATS
    config_name = "tiny Gemma3 text" if ctx.quick else "Gemma3 text 1B-class"
    on_accelerator = ctx.device.type != "cpu"
    for bs, prompt_len in _QUICK["prefill_shapes"] if ctx.quick else PREFILL_SHAPES:
        case = f"prefill {bs}x{prompt_len}"
        if ctx.time_low(need_s=20.0):
            ctx.rows.append(row(NAME, case, "prefill s", None, "s", notes="skipped: time budget", key=True))
            continue
        prompts = torch.randint(0, config_kwargs["vocab_size"], (bs, prompt_len), generator=gen)
        ids = prompts.to(ctx.device)
        host_prompts = prompts.tolist()

        def theirs(ids=ids):
            with torch.no_grad():
                logits = hf_model(input_ids=ids, use_cache=False, logits_to_keep=1).logits
            return logits[:, -1].argmax(dim=-1)

        ctx.log(f"{NAME}: {case}: attnplug Engine on {backend_name} (compiled, eager), transformers sdpa forward")
        hf_tokens = theirs().tolist()  # the warm-up
        # the compiled Engine's warm-up compiles its EXTEND steps (once for every length)
        note, engine = "", _engine(ctx, ours_model, bs, prompt_len + 1, PREFILL_COMPILE)
        try:
            compiled_tokens = engine.generate(host_prompts, 1)
        except Exception as exc:  # compiling failed: the row times the eager Engine, saying why
            note = f"torch.compile failed ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})"
            engine = None
        eager = _engine(ctx, ours_model, bs, prompt_len + 1, False)
        eager_tokens = eager.generate(host_prompts, 1)
        if engine is None:
            engine, compiled_tokens = eager, eager_tokens
        variants = [("attnplug", engine, compiled_tokens), ("attnplug eager", eager, eager_tokens)]
        if eager.graphs is not None and ForwardMode.EXTEND in eager.graphs.modes:
            uncaptured = _engine(ctx, ours_model, bs, prompt_len + 1, False, extend_graphs=False)
            variants.append(("attnplug eager, EXTEND uncaptured", uncaptured, uncaptured.generate(host_prompts, 1)))
        hf_t = _timed(ctx, theirs, repeats)
        common = dict(
            bs=bs, series="prefill", dtype=str(dtype).replace("torch.", ""), prompt_len=prompt_len, config=config_name
        )
        ctx.rows.append(
            row(
                NAME,
                case,
                "prefill s",
                hf_t,
                "s",
                detail="transformers sdpa forward, logits_to_keep=1",
                key=True,
                variant="transformers",
                **common,
            )
        )
        times = {}
        for variant, eng, tokens in variants:
            times[variant] = t = _timed(ctx, lambda eng=eng, p=host_prompts: eng.generate(p, 1), repeats)
            steps = eng.last_run["steps"]["EXTEND"]
            path = "compiled model" if eng.runner.compile else "eager model"
            if eng.last_run["graph_steps"]:
                path += ", replayed in token-count graphs"
            ctx.rows.append(
                row(
                    NAME,
                    case,
                    "prefill s",
                    t,
                    "s",
                    detail=f"Engine.generate(prompts, 1) on {backend_name}, {_steps(steps)} of the {path}",
                    notes=note if variant == "attnplug" else "",
                    key=variant == "attnplug",
                    variant=variant,
                    extend_steps=steps,
                    path=path,
                    **common,
                )
            )
            agree = sum(int(o == [h]) for o, h in zip(tokens, hf_tokens)) / bs
            ratio = hf_t / max(t, 1e-12)
            held = variant == "attnplug" and on_accelerator
            ctx.rows.append(
                row(
                    NAME,
                    case,
                    f"transformers / {variant} time",
                    ratio,
                    "x",
                    target=">= 1 (at least as fast as transformers)" if held else None,
                    met=ratio >= 1.0 if held else None,
                    detail=f"first tokens agreeing {agree:.0%}"
                    + ("" if on_accelerator else "; on the host: information, no target"),
                    key=variant == "attnplug",
                    token_agreement=agree,
                    **common,
                )
            )
        ctx.log(
            f"{NAME}: {case}: attnplug {times['attnplug'] * 1e3:.1f} ms (eager {times['attnplug eager'] * 1e3:.1f} "
            f"ms), transformers {hf_t * 1e3:.1f} ms: {hf_t / max(times['attnplug'], 1e-12):.2f}x"
        )
