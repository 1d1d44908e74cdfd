"""The model-level check: tiny transformers models run step by step through a backend, every
new token's logits compared with transformers' eager attention over the full sequence.

``check_matches_transformers`` (``checks/``) runs one ``ModelCase`` per test: a tiny random
model of one architecture (``attnplug.integrations.transformers.tiny_model``) in one dtype and
page size, driven through ``ModelRunner`` on the backend under test by ``ModelDriver`` (a small
engine: slots, request rows, batches, eviction, rollback), in the scenario ``SCENARIO``:

1. chunked prefill: EXTEND steps of 3 prompts of different lengths in chunks, a request
   joining with a one-token chunk of its own next token;
2. DECODE steps;
3. TARGET_VERIFY of 3 drafts per request, the rejected ones rolled back with the allocator's
   ``rollback`` (their logits are compared too: they were computed in their own context);
4. DRAFT_EXTEND of 2 tokens per request;
5. a request finishing (slots and row freed) and a new one prefilled in a mixed EXTEND step
   with one-token chunks of the others, then DECODE steps.

Every model has windows smaller than its sequences (``sliding_window=5``), out-of-window SWA
slots are evicted between steps and the SWA pool is smaller than the tokens the run allocates,
so SWA slots are reused (the driver checks both happened).

Expected logits: the same weights with ``attn_implementation="eager"`` over each request's
whole token sequence, on the host in float32 (the positions are the token indices, which is
what the driver gives the runner). Comparison per new token (``compare``):

* float32: ``||a - e|| / ||e|| <= FP32_TOL`` (relative L2 error of the logit vector);
* float16 / bfloat16: cosine similarity ``>= HALF_MIN_COSINE``, and the relative error
  against the float32 logits at most ``HALF_REL_FACTOR`` times transformers' own error in that
  dtype (its eager attention, same weights cast, same tokens, on the backend's device; at
  that token or its median over the run, whichever is larger) plus ``HALF_REL_SLACK``: the
  backend may be about as inexact as transformers itself in half precision, not more.

FP8 KV cache cases (``ModelCase.kv_dtype``; run where the backend lists the dtype in
``capabilities().fp8_kv_dtypes``, else skipped naming it): the same scenario with the runner's
pool storing K / V as ``kv_dtype``, in the backend's default dtype (``default_dtype``), with
per-layer, per-KV-head scales from a calibration run (``calibrated_fp8_scales``: the largest ``|k|`` /
``|v|`` of a calibration prompt times ``FP8_SATURATE_AT`` maps to the format's largest value,
so the scenario's outliers saturate). Two judgements:

* **the backend's own error** (the strict one): the same scenario run by the reference backend
  over an FP8 cache of the same dtype and scales, which stores the same bytes for the same k/v
  (one quantisation rule, ``attnplug.memory.fp8``). Float32: relative L2 error of every new
  token's logits ``<= FP8_FP32_TOL`` and their median ``<= FP8_FP32_MEDIAN_TOL`` against the
  reference in float32 on the host; half precision: the half rule above with the reference over
  the FP8 cache in float32 on the host in place of transformers' float32 logits, the reference
  in the case's dtype on the backend's device in place of transformers' own half-precision run
  and the cosine floor ``FP8_HALF_MIN_COSINE``. The caches themselves, against the reference
  run in the same dtype (float32: the host's; half: the device's), slot for slot: the first
  layer's bytes (its k/v are the tokens' projections, the same in both runs, so this is the
  store's quantisation rule bit for bit) at least ``FP8_MIN_SAME_BYTES``; every layer's stored
  values, per K / V and KV head, of the reference's L2 norm within ``FP8_NORM_TOL`` (a layer
  or head quantised with another's scales moves it by their ratio; a backend whose attention
  rounds otherwise than the reference's moves later layers' k/v across FP8 rounding
  boundaries, byte by byte, not their norm);
* **the quantisation's error** (the looser one): cosine similarity of every new token's logits
  with transformers' eager float32 attention over the unquantised sequence
  ``>= FP8_MIN_COSINE[kv_dtype]``.

Device-neutral: the backend's device comes from the caller; the host computes the expected
values.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import pytest
import torch

from attnplug import ForwardBatch, ForwardMode, decide_needs_cpu_seq_lens
from attnplug.integrations import transformers_missing
from attnplug.memory.fp8 import fp8_max

from .config import kv_id
from .rules import MODEL

__all__ = [
    "MODEL_ARCHS",
    "ModelCase",
    "MODEL_CASES",
    "default_dtype",
    "FP32_TOL",
    "HALF_MIN_COSINE",
    "HALF_REL_FACTOR",
    "HALF_REL_SLACK",
    "FP8_FP32_TOL",
    "FP8_FP32_MEDIAN_TOL",
    "FP8_HALF_MIN_COSINE",
    "FP8_MIN_COSINE",
    "FP8_MIN_SAME_BYTES",
    "FP8_NORM_TOL",
    "FP8_SATURATE_AT",
    "calibrated_fp8_scales",
    "WINDOW",
    "ModelDriver",
    "run_model_case",
    "transformers_missing",
]

#: the architectures the check runs (``attnplug.integrations.transformers.ARCHITECTURES``)
MODEL_ARCHS: Tuple[str, ...] = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma2",
    "gemma3_text",
    "cohere2",
    "gpt_oss",
)

#: float32: bound on the per-token relative L2 error of the logits. Measured on these models:
#: the reference backend's logits differ from transformers eager by at most 1.1e-6 (float32
#: rounding in a different summation order; transformers' own float32 logits differ from
#: float64 by about as much), while an attention bug moves them by 6e-2 or more (a scale
#: from head_dim instead of query_pre_attn_scalar: 6.5e-2; a window one key short, a wrong
#: window table start, a wrong GQA head, a dropped soft-cap or sink: 0.4 to 1.5). 2e-5 leaves
#: 20x the measured noise and is 3,000x below the smallest bug.
FP32_TOL = 2e-5
#: half precision: minimum cosine similarity of a token's logits with the float32 logits
#: (measured: 0.9997 or more for transformers itself and for the reference backend)
HALF_MIN_COSINE = 0.999
#: half precision: relative error at most FACTOR x transformers' own (same dtype, same
#: tokens; the larger of its error at that token and its median over the run) + SLACK.
#: Measured for the reference backend: at most 1.6x; attention bugs: 10x and more.
HALF_REL_FACTOR = 3.0
HALF_REL_SLACK = 2e-3
#: FP8 KV cache, float32: bounds on the relative L2 error of the logits against the reference
#: backend over an FP8 cache of the same dtype and scales: every token's at most FP8_FP32_TOL,
#: their median over the run at most FP8_FP32_MEDIAN_TOL. Two levels, because a k/v value that
#: a backend's own float32 rounding moves across an FP8 rounding boundary stores the
#: neighbouring FP8 value (a step of 6 % in e4m3, 12 % in e5m2) and moves the later logits of
#: that request by up to 1.7e-2 (measured: one such step in the largest element of a key, on
#: these models), while the other tokens stay at float32 rounding (measured: 9e-7 for
#: attention computed in float64 instead of float32). FP8 bugs move every token: a scale
#: ignored, taken from the wrong KV head, the wrong layer or the other of K / V gave medians of
#: 2.4e-2 to 1.0 and maxima of 7e-2 to 1.4 (a store without saturation: non-finite logits).
FP8_FP32_TOL = 3e-2
FP8_FP32_MEDIAN_TOL = 1e-3
#: FP8 KV cache, half precision: minimum cosine similarity of a token's logits with the
#: reference backend's over the same FP8 cache in float32 (the half rule's floor; the relative
#: rule is HALF_REL_FACTOR / HALF_REL_SLACK as without FP8). Looser than HALF_MIN_COSINE: the
#: half-precision k/v round to other FP8 values than the float32 ones in a few percent of the
#: elements (an FP8 step is 16 to 32 bfloat16 steps). Measured for the reference backend in
#: bfloat16 itself: 0.997 or more.
FP8_HALF_MIN_COSINE = 0.99
#: FP8 KV cache: minimum fraction of the subject's first-layer KV bytes equal to the
#: reference's in the same dtype, slot for slot over the slots either wrote (the first layer's
#: k/v are the same in both runs). Measured: 1.0 for the reference backend and for the cuda
#: kernels through the Triton interpreter in bfloat16. Later layers are not held to their bytes:
#: there the cuda kernels' attention, rounding otherwise than the reference's float64, leaves
#: 0.69 to 0.90 of them equal (0.92 to 0.98 within one FP8 step), as much as a layer quantised
#: with another layer's scales (0.49 to 0.68 of the whole cache)
FP8_MIN_SAME_BYTES = 0.999
#: FP8 KV cache: largest relative difference of the L2 norm of a layer's stored K (V) values of
#: one KV head (in scale units, the codes' values) from the reference's. Measured in bfloat16:
#: within 0.001 for the cuda kernels through the Triton interpreter, 0.891 to 1.063 (ratio) for
#: every layer quantised with layer 0's scales (a bug the bfloat16 logits alone do not show)
FP8_NORM_TOL = 0.02
#: FP8 KV cache: minimum cosine similarity of a token's logits with transformers' eager float32
#: logits over the unquantised sequence (the quantisation's own error, which the backend does
#: not choose; the looser judgement). Measured for the reference backend on these models with
#: these scales (float32 and bfloat16): 0.982 or more in e4m3, 0.972 or more in e5m2.
FP8_MIN_COSINE: Dict[torch.dtype, float] = {torch.float8_e4m3fn: 0.96, torch.float8_e5m2: 0.94}
#: FP8 KV cache scales: a layer's and KV head's scale maps FP8_SATURATE_AT x the calibration
#: prompt's largest |k| (|v|) to the format's largest value, so larger values saturate (the
#: check makes sure some do)
FP8_SATURATE_AT = 0.75
#: the sliding window of every model with SWA layers (smaller than every sequence)
WINDOW = 5

_HEAD_DIM = 64  # declared by every backend of the suite's configurations
#: config overrides of every tiny model: 4 q heads over 2 KV heads (GQA group 2, so
#: ``h % Hkv`` and ``h // G`` differ), head_dim 64
_COMMON = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=_HEAD_DIM)
#: per architecture: windows smaller than the sequences where layers slide; Gemma's
#: query_pre_attn_scalar differs from head_dim (scaling 48 ** -0.5, not 64 ** -0.5)
_ARCH_OVERRIDES: Dict[str, dict] = {
    "llama": {},
    "gemma2": dict(sliding_window=WINDOW, query_pre_attn_scalar=48),
    "gemma3_text": dict(sliding_window=WINDOW, query_pre_attn_scalar=48),
    # every expert active: the router's discrete top-k choice cannot flip between two equally
    # valid half-precision runs (a flip changes a token's logits far beyond rounding)
    "gpt_oss": dict(sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=4),
}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


@dataclass(frozen=True)
class ModelCase:
    """One test: an architecture in a dtype and page size; ``kv_dtype``: an FP8 KV cache dtype
    (None: the KV cache stores the model's dtype). ``dtype`` None: the backend's default dtype
    (``default_dtype``), what the FP8 cases run in."""

    arch: str
    dtype: Optional[torch.dtype] = torch.float32
    page_size: int = 1
    kv_dtype: Optional[torch.dtype] = None

    @property
    def id(self) -> str:
        out = self.arch + (f"-{_dtype_name(self.dtype)}" if self.dtype is not None else "")
        out += f"-page{self.page_size}" if self.page_size != 1 else ""
        return out + ("-" + kv_id(self.kv_dtype) if self.kv_dtype is not None else "")


def _cases() -> List[ModelCase]:
    # Gemma3 first: the first round of the suite (and --attnplug-quick) runs the first case.
    order = ("gemma3_text",) + tuple(a for a in MODEL_ARCHS if a != "gemma3_text")
    cases = [ModelCase(a) for a in order]
    cases += [ModelCase(a, torch.bfloat16) for a in order]
    cases += [ModelCase("gemma3_text", torch.float16), ModelCase("gemma3_text", page_size=4)]
    cases += [ModelCase("gpt_oss", torch.bfloat16, page_size=4)]
    # FP8 KV caches, in the backend's default dtype: hybrid sliding + full layers in e4m3;
    # pages, sinks and e5m2 (where a store without saturation makes an infinity)
    cases += [ModelCase("gemma3_text", None, kv_dtype=torch.float8_e4m3fn)]
    cases += [ModelCase("gpt_oss", None, page_size=4, kv_dtype=torch.float8_e5m2)]
    return cases


MODEL_CASES: Tuple[ModelCase, ...] = tuple(_cases())


def default_dtype(caps) -> torch.dtype:
    """The dtype the default run checks every architecture in: float32 where the backend
    declares it (the strict bound), else bfloat16, else its first declared dtype."""
    for dtype in (torch.float32, torch.bfloat16):
        if dtype in caps.dtypes:
            return dtype
    return caps.dtypes[0]


# ---------------------------------------------------------------------------- the engine
@dataclass
class _Req:
    rid: int
    row: int
    prompt: List[int]
    tokens: List[int] = field(default_factory=list)  # every token in the cache, in position order

    @property
    def seq_len(self) -> int:
        return len(self.tokens)


@dataclass
class _Record:
    """The logits of ``n`` new tokens of request ``rid`` computed in one step, and the
    request's tokens at the end of that step (their context)."""

    rid: int
    label: str
    context: Tuple[int, ...]
    n: int
    logits: torch.Tensor  # [n, vocab] float32 on the host


class ModelDriver:
    """A small engine over a ``ModelRunner``: request rows, slots (``alloc_extend``), batches
    in every mode, eviction after each step, rollback of rejected drafts, finishing requests.
    Records every new token's logits (``records``) for ``compare``."""

    def __init__(self, runner, vocab_size: int, seed: int) -> None:
        self.runner = runner
        self.vocab = vocab_size
        self.gen = torch.Generator().manual_seed(seed)
        self.reqs: Dict[int, _Req] = {}
        self.records: List[_Record] = []
        self.finished: Dict[int, Tuple[int, ...]] = {}
        self.steps = 0
        self.allocated = 0  # tokens given slots over the run
        self.evicted = 0  # SWA slots freed by eviction over the run
        self._next_rid = 0
        self.window = runner.spec.sliding_window if runner.spec.swa_layer_ids else None
        self.device = runner.pool.device

    # -- requests
    def _tokens(self, n: int) -> List[int]:
        return torch.randint(0, self.vocab, (n,), generator=self.gen).tolist()

    def add(self, prompt_len: int) -> int:
        rid = self._next_rid
        self._next_rid += 1
        self.reqs[rid] = _Req(rid, self.runner.req_to_token_pool.alloc(), self._tokens(prompt_len))
        return rid

    def finish(self, rid: int) -> None:
        req = self.reqs.pop(rid)
        rows = self.runner.req_to_token_pool
        if req.seq_len:
            self.runner.allocator.free(rows.req_to_token[req.row, : req.seq_len].to(torch.int64))
            rows.req_to_token[req.row, : req.seq_len] = 0
        rows.free(req.row)
        self.finished[rid] = tuple(req.tokens)

    # -- steps
    def step(self, mode: ForwardMode, new: Dict[int, int], *, keep: Optional[Dict[int, int]] = None, label: str = ""):
        """One step: ``new[rid]`` tokens per request (the next prompt tokens, then random
        continuations), run through the runner; logits recorded; then rejected drafts rolled
        back (``keep[rid]``: tokens of the step that survive) and out-of-window SWA slots evicted."""
        self.steps += 1
        label = f"step {self.steps} ({mode.name}{', ' + label if label else ''})"
        rows = self.runner.req_to_token_pool
        reqs = [self.reqs[r] for r in new]
        counts = [new[r.rid] for r in reqs]
        ids, positions, last = [], [], []
        for req, n in zip(reqs, counts):
            start = req.seq_len
            pending = req.prompt[start : start + n]
            tokens = pending + self._tokens(n - len(pending))
            ids.extend(tokens)
            positions.extend(range(start, start + n))
            last.append(int(rows.req_to_token[req.row, start - 1]) if start else -1)
        prefix = [r.seq_len for r in reqs]
        seq = [p + n for p, n in zip(prefix, counts)]
        loc = self.runner.allocator.alloc_extend(prefix, seq, last)
        self.allocated += len(ids)
        offset = 0
        for req, n in zip(reqs, counts):
            rows.req_to_token[req.row, req.seq_len : req.seq_len + n] = loc[offset : offset + n].to(torch.int32)
            offset += n
        dev = self.device
        uniform = mode is not ForwardMode.EXTEND
        needs_cpu = decide_needs_cpu_seq_lens([self.runner.backend])
        batch = ForwardBatch(
            forward_mode=mode,
            batch_size=len(reqs),
            req_pool_indices=torch.tensor([r.row for r in reqs], dtype=torch.int64).to(dev),
            seq_lens=torch.tensor(seq, dtype=torch.int64).to(dev),
            out_cache_loc=loc.to(dev),
            positions=torch.tensor(positions, dtype=torch.int64).to(dev),
            seq_lens_cpu=list(seq) if needs_cpu else None,
            extend_seq_lens=None if uniform else torch.tensor(counts, dtype=torch.int64).to(dev),
            extend_seq_lens_cpu=None if uniform else list(counts),
            num_draft_tokens=counts[0] if mode.is_speculative else None,
        )
        input_ids = torch.tensor(ids, dtype=torch.int64).to(dev)
        logits = self.runner.forward(batch, input_ids, batch.positions)
        logits = logits.detach().to("cpu", torch.float32)
        offset = 0
        for req, n in zip(reqs, counts):
            req.tokens.extend(ids[offset : offset + n])
            self.records.append(_Record(req.rid, label, tuple(req.tokens), n, logits[offset : offset + n]))
            offset += n
        for req in reqs:
            if keep is not None and req.rid in keep:
                self._rollback(req, req.seq_len - new[req.rid] + keep[req.rid])
            if self.window is not None:
                self.evicted += self.runner.allocator.evict_out_of_window(rows, req.row, req.seq_len, self.window)

    def _rollback(self, req: _Req, length: int) -> None:
        """Drop the request's tokens past ``length`` (rejected drafts): the allocator's
        ``rollback`` gives back their slots, the row forgets them."""
        if length >= req.seq_len:
            return
        rows = self.runner.req_to_token_pool
        self.runner.allocator.rollback(rows.req_to_token[req.row, length : req.seq_len].to(torch.int64))
        rows.req_to_token[req.row, length : req.seq_len] = 0
        del req.tokens[length:]


#: ``(mode, {request index: new tokens}, keep, label)``; requests are numbered in the order
#: ``SCENARIO_PROMPTS`` adds them (``"add"`` entries add one with that prompt length,
#: ``"finish"`` frees one). Windows (5) are smaller than every sequence.
SCENARIO_PROMPTS = (19, 6, 13)
SCENARIO = (
    ("EXTEND", {0: 8, 1: 6, 2: 5}, None, "chunked prefill, first chunks"),
    ("EXTEND", {0: 7, 1: 1, 2: 8}, None, "second chunks and a one-token chunk"),
    ("EXTEND", {0: 4, 1: 1, 2: 1}, None, "last chunk"),
    ("DECODE", {0: 1, 1: 1, 2: 1}, None, ""),
    ("DECODE", {0: 1, 1: 1, 2: 1}, None, ""),
    ("TARGET_VERIFY", {0: 3, 1: 3, 2: 3}, {0: 1, 1: 3, 2: 2}, "rejected drafts rolled back after"),
    ("DECODE", {0: 1, 1: 1, 2: 1}, None, "after a rollback"),
    ("DRAFT_EXTEND", {0: 2, 1: 2, 2: 2}, None, ""),
    ("finish", 1, None, ""),
    ("add", 11, None, ""),
    ("EXTEND", {0: 1, 2: 1, 3: 11}, None, "a new request prefilled beside one-token chunks"),
    ("DECODE", {0: 1, 2: 1, 3: 1}, None, "after a request finished"),
    ("TARGET_VERIFY", {0: 3, 2: 3, 3: 3}, {0: 2, 2: 1, 3: 3}, "rejected drafts rolled back after"),
    ("DECODE", {0: 1, 2: 1, 3: 1}, None, ""),
)


def run_scenario(driver: ModelDriver) -> None:
    ids = [driver.add(n) for n in SCENARIO_PROMPTS]
    for mode, arg, keep, label in SCENARIO:
        if mode == "finish":
            driver.finish(ids[arg])
            continue
        if mode == "add":
            ids.append(driver.add(arg))
            continue
        new = {ids[i]: n for i, n in arg.items()}
        kept = None if keep is None else {ids[i]: k for i, k in keep.items()}
        driver.step(ForwardMode[mode], new, keep=kept, label=label)


def scenario_pool_tokens(page_size: int) -> Tuple[int, int]:
    """``(full, swa)`` pool sizes: the full pool holds every token of the run; the SWA pool
    holds the live windows and the largest step (rounded to pages) but fewer slots than the
    run allocates, so SWA slots are reused."""
    ps = page_size
    longest_step = 24  # tokens of the largest step of SCENARIO
    live = 4 * (WINDOW + 2 * ps)  # per request: the window plus two partial pages
    swa = -(-(live + longest_step + 4 * ps) // ps) * ps
    full = -(-(256 + 8 * ps) // ps) * ps
    return full, swa


# ---------------------------------------------------------------------------- the comparison
def _expected(model, records: Sequence[_Record], finals: Dict[int, Tuple[int, ...]], device) -> List[torch.Tensor]:
    """Logits of ``model`` (eager attention) for every record, over the full sequence: one
    forward per request's final sequence, plus one per context that is not a prefix of it
    (drafts later rolled back). ``[n, vocab]`` float32 on the host per record."""
    cache: Dict[Tuple[int, ...], torch.Tensor] = {}

    def logits_of(tokens: Tuple[int, ...]) -> torch.Tensor:
        if tokens not in cache:
            ids = torch.tensor([list(tokens)], dtype=torch.int64, device=device)
            with torch.no_grad():
                cache[tokens] = model(input_ids=ids, use_cache=False).logits[0].to("cpu", torch.float32)
        return cache[tokens]

    out = []
    for rec in records:
        final = finals[rec.rid]
        source = final if final[: len(rec.context)] == rec.context else rec.context
        end = len(rec.context)
        out.append(logits_of(source)[end - rec.n : end])
    return out


def _rel(a: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    a, e = a.double(), e.double()
    return (a - e).norm(dim=-1) / e.norm(dim=-1).clamp_min(1e-30)


def _fail_non_finite(what: str, rec: _Record, got: torch.Tensor) -> None:
    if not torch.isfinite(got).all():
        j = int((~torch.isfinite(got)).any(-1).to(torch.int8).argmax())
        pos0 = len(rec.context) - rec.n
        pytest.fail(f"{MODEL}: {what}: {rec.label}: request {rec.rid}, position {pos0 + j}: non-finite logits")


def compare(
    case: ModelCase,
    records,
    expected,
    own=None,
    *,
    against: str = "transformers eager",
    fp32_tol: float = FP32_TOL,
    fp32_median_tol: Optional[float] = None,
    min_cosine: float = HALF_MIN_COSINE,
) -> None:
    """Fail naming the first token out of bounds (see the module docstring). ``expected``: per
    record, the float32 logits of ``against``; ``own``: per record, ``against``'s own logits in
    the case's half dtype (None for float32); ``fp32_tol``: the float32 bound of every token,
    ``fp32_median_tol`` (None: none) of their median over the run; ``min_cosine``: the
    half-precision cosine floor."""
    what = f"{case.id}"
    typical = None
    if own is not None:  # the baseline's median error over the run: a token where it is lucky sets no bar
        typical = torch.cat([_rel(o, e) for o, e in zip(own, expected)]).median()
    half = _dtype_name(case.dtype)
    for rec, exp in zip(records, expected):
        if rec.logits.shape != exp.shape:
            pytest.fail(
                f"{MODEL}: {what}: {rec.label}: logits of shape {tuple(rec.logits.shape)}, expected {tuple(exp.shape)}"
            )
        _fail_non_finite(what, rec, rec.logits)
    if case.dtype == torch.float32 and fp32_median_tol is not None and records:
        median = float(torch.cat([_rel(r.logits, e) for r, e in zip(records, expected)]).median())
        if not median <= fp32_median_tol:
            pytest.fail(
                f"{MODEL}: {what}: the logits differ from {against} by a median relative error of {median:.3g} over "
                f"the run's {sum(r.n for r in records)} new tokens (bound {fp32_median_tol:g} for float32)"
            )
    for i, (rec, exp) in enumerate(zip(records, expected)):
        got = rec.logits
        pos0 = len(rec.context) - rec.n
        rel = _rel(got, exp)
        if case.dtype == torch.float32:
            j = int(rel.argmax())
            if float(rel[j]) > fp32_tol:
                pytest.fail(
                    f"{MODEL}: {what}: {rec.label}: request {rec.rid}, position {pos0 + j}: logits differ from "
                    f"{against} by a relative error of {float(rel[j]):.3g} (bound {fp32_tol:g} for float32; "
                    f"{int((rel > fp32_tol).sum())} of {rec.n} new tokens of this request out of bounds)"
                )
            continue
        cos = torch.nn.functional.cosine_similarity(got.double(), exp.double(), dim=-1)
        j = int(cos.argmin())
        if float(cos[j]) < min_cosine:
            pytest.fail(
                f"{MODEL}: {what}: {rec.label}: request {rec.rid}, position {pos0 + j}: cosine similarity "
                f"{float(cos[j]):.5f} with {against} float32 logits (minimum {min_cosine})"
            )
        theirs = _rel(own[i], exp)
        bound = HALF_REL_FACTOR * torch.maximum(theirs, typical) + HALF_REL_SLACK
        j = int((rel - bound).argmax())
        if float(rel[j]) > float(bound[j]):
            pytest.fail(
                f"{MODEL}: {what}: {rec.label}: request {rec.rid}, position {pos0 + j}: relative error "
                f"{float(rel[j]):.3g} against {against} float32 logits; {against}'s own {half} error there is "
                f"{float(theirs[j]):.3g}, its median {float(typical):.3g} (bound {HALF_REL_FACTOR:g} x the larger + "
                f"{HALF_REL_SLACK:g})"
            )


def compare_cosine(case: ModelCase, records, expected, min_cosine: float, against: str) -> None:
    """Fail naming the first token whose logits have a cosine similarity below ``min_cosine``
    with ``expected`` (per record, float32 logits of ``against``)."""
    for rec, exp in zip(records, expected):
        _fail_non_finite(case.id, rec, rec.logits)
        cos = torch.nn.functional.cosine_similarity(rec.logits.double(), exp.double(), dim=-1)
        j = int(cos.argmin())
        if float(cos[j]) < min_cosine:
            pytest.fail(
                f"{MODEL}: {case.id}: {rec.label}: request {rec.rid}, position {len(rec.context) - rec.n + j}: "
                f"cosine similarity {float(cos[j]):.5f} with {against} (minimum {min_cosine} over an FP8 KV cache "
                f"of {_dtype_name(case.kv_dtype)})"
            )


def _written(a, b, layer: int):
    """``(which, x, y)`` for K and V of ``layer`` in pools ``a`` and ``b``, on the host, the
    rows of the slots either pool wrote (a slot whose bytes are all zero in both was never
    written: a stored k/v row is never exactly zero)."""
    for which, x, y in zip("KV", a.get_kv_buffer(layer), b.get_kv_buffer(layer)):
        x, y = x.to("cpu"), y.to("cpu")
        written = (x.view(torch.uint8) != 0).flatten(1).any(1) | (y.view(torch.uint8) != 0).flatten(1).any(1)
        yield which, x[written], y[written]


def same_bytes(a, b, layer: int) -> float:
    """The fraction of ``layer``'s KV cache bytes of pool ``a`` equal to pool ``b``'s, slot for
    slot, over its K and V buffers and the slots either pool wrote; read on the host."""
    equal = total = 0
    for _, x, y in _written(a, b, layer):
        equal += int((x.view(torch.uint8) == y.view(torch.uint8)).sum())
        total += x.numel()
    return equal / max(total, 1)


def norm_departures(a, b, tol: float) -> List[str]:
    """Where the L2 norm of the values an FP8 pool ``a`` stores (in scale units: the codes'
    values), per layer, K / V and KV head over the slots either pool wrote, is further than
    ``tol`` (relative) from pool ``b``'s: ``"layer L K head h: ratio r"`` each; read on the host."""
    out = []
    for layer in range(a.num_layers):
        for which, x, y in _written(a, b, layer):
            nx, ny = x.float().norm(dim=(0, 2)), y.float().norm(dim=(0, 2))
            ratio = nx / ny.clamp_min(1e-30)
            for h in torch.nonzero((ratio - 1).abs() > tol).flatten().tolist():
                out.append(f"layer {layer} {which} head {h}: ratio {ratio[h].item():.3f}")
    return out


def saturated(pool) -> int:
    """How many of the values an FP8 pool holds are its format's largest magnitude (what a
    value past the scale's range saturates to); read on the host."""
    top = fp8_max(pool.dtype)
    count = 0
    for layer in range(pool.num_layers):
        for buf in pool.get_kv_buffer(layer):
            count += int((buf.to("cpu", torch.float32).abs() == top).sum())
    return count


# ---------------------------------------------------------------------------- one case
def missing_capability(caps, spec, case: ModelCase) -> Optional[str]:
    """Why the backend's declared capabilities cannot run ``case`` (one line), or None."""
    from attnplug.integrations.transformers.support import unsupported_reasons

    reasons = unsupported_reasons(caps, spec, dtype=case.dtype, page_size=case.page_size, kv_cache_dtype=case.kv_dtype)
    return f"{case.arch} needs " + "; ".join(reasons) if reasons else None


def build_models(case: ModelCase, seed: int = 0):
    """``(config, fp32 weights model)``: the tiny model of ``case.arch`` with the check's
    overrides, float32 on the host."""
    from attnplug.integrations.transformers import tiny_model

    overrides = {**_COMMON, **_ARCH_OVERRIDES.get(case.arch, dict(sliding_window=WINDOW))}
    model = tiny_model(case.arch, seed=seed, dtype=torch.float32, **overrides)
    return model.config, model


def _clone(model, dtype: torch.dtype, device, attn_implementation: str):
    """A copy of ``model``'s weights in ``dtype`` on ``device``, attention implemented by
    ``attn_implementation``."""
    twin = copy.deepcopy(model).to(device=device, dtype=dtype).eval()
    twin.set_attn_implementation(attn_implementation)
    return twin


#: prompt tokens of the FP8 scales' calibration run
CALIBRATION_TOKENS = 24


def calibrated_fp8_scales(model, kv_dtype: torch.dtype, seed: int = 0) -> Dict[int, Tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer, per-KV-head FP8 scales for ``model`` (float32 weights on the host):
    ``{layer: (k_scale [Hkv], v_scale [Hkv])}``, float32 host tensors. A calibration prompt of
    ``CALIBRATION_TOKENS`` seeded tokens runs through the reference backend over an
    unquantised pool; a head's scale is ``FP8_SATURATE_AT * max|k| / fp8_max(kv_dtype)`` over
    what the layer stored (the same for v), so values beyond ``FP8_SATURATE_AT`` x the
    calibration's largest saturate."""
    from attnplug.backends.reference import ReferenceBackend
    from attnplug.integrations.transformers import ModelRunner

    runner = ModelRunner(
        _clone(model, torch.float32, "cpu", "eager"),
        ReferenceBackend,
        max_batch_size=1,
        max_context_len=CALIBRATION_TOKENS,
    )
    driver = ModelDriver(runner, model.config.vocab_size, seed=seed + 7)
    rid = driver.add(CALIBRATION_TOKENS)
    driver.step(ForwardMode.EXTEND, {rid: CALIBRATION_TOKENS})
    top = FP8_SATURATE_AT / fp8_max(kv_dtype)
    scales = {}
    for layer in range(runner.spec.num_layers):
        k, v = (buf.abs().amax(dim=(0, 2)).to(torch.float32) for buf in runner.pool.get_kv_buffer(layer))
        scales[layer] = tuple(torch.where(m > 0, m * top, 1.0) for m in (k, v))  # a head never stored: 1.0
    return scales


def run_model_case(case: ModelCase, backend_cls, device, caps, *, seed: int = 0) -> ModelDriver:
    """Run ``case`` on ``backend_cls`` (see the module docstring); fails through pytest with a
    message naming the rule, the step, the request and the position. Returns the driver."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: a thread pool only adds overhead on the host
    try:
        return _run_model_case(case, backend_cls, device, caps, seed)
    finally:
        torch.set_num_threads(threads)


def _scenario_run(model, backend_cls, case: ModelCase, spec, vocab: int, seed: int, scales) -> ModelDriver:
    """``model`` (on its device, in its dtype) through ``backend_cls`` in the scenario: the
    driver after the run, its runner synchronised."""
    from attnplug.integrations.transformers import ModelRunner

    full, swa = scenario_pool_tokens(case.page_size)
    runner = ModelRunner(
        model,
        backend_cls,
        max_batch_size=4,
        max_context_len=64,
        page_size=case.page_size,
        swa_pool_tokens=swa if spec.swa_layer_ids else None,
        full_pool_tokens=full,
        kv_cache_dtype=case.kv_dtype,
        kv_scales=scales,
    )
    driver = ModelDriver(runner, vocab, seed=seed + 1)
    run_scenario(driver)
    runner.backend.synchronize(runner.pool.device)
    return driver


def _finals(driver: ModelDriver) -> Dict[int, Tuple[int, ...]]:
    return {**driver.finished, **{rid: tuple(r.tokens) for rid, r in driver.reqs.items()}}


def _run_model_case(case: ModelCase, backend_cls, device, caps, seed: int) -> ModelDriver:
    from attnplug.integrations.transformers import model_spec

    if case.dtype is None:
        case = dataclasses.replace(case, dtype=default_dtype(caps))
    config, model = build_models(case, seed)
    spec = model_spec(config)
    why = missing_capability(caps, spec, case)
    if why is not None:
        pytest.skip(why)
    if case.arch != "llama" and not spec.swa_layer_ids:
        raise RuntimeError(f"the check's tiny {case.arch} model has no sliding-window layer: {spec}")
    device = torch.device(device)
    scales = calibrated_fp8_scales(model, case.kv_dtype, seed) if case.kv_dtype is not None else None
    subject = _clone(model, case.dtype, device, "eager")
    driver = _scenario_run(subject, backend_cls, case, spec, config.vocab_size, seed, scales)
    finals = _finals(driver)
    _, swa = scenario_pool_tokens(case.page_size)
    if driver.window is not None and (driver.evicted == 0 or driver.allocated <= swa):
        raise RuntimeError(
            f"the scenario evicted {driver.evicted} SWA slots and allocated {driver.allocated} tokens over an SWA "
            f"pool of {swa}: it must evict and reuse SWA slots"
        )
    reference = _clone(model, torch.float32, "cpu", "eager")
    expected = _expected(reference, driver.records, finals, "cpu")
    if case.kv_dtype is not None:
        _compare_fp8(case, driver, model, spec, config.vocab_size, seed, scales, expected)
        return driver
    own = None
    if case.dtype != torch.float32:
        half = _clone(model, case.dtype, device, "eager")
        own = _expected(half, driver.records, finals, device)
    compare(case, driver.records, expected, own)
    return driver


def _compare_fp8(case: ModelCase, driver: ModelDriver, model, spec, vocab: int, seed: int, scales, expected) -> None:
    """The FP8 judgements of the module docstring: against the reference backend over an FP8
    cache of the same dtype and scales (the backend's own error, and the cache's bytes), then
    against transformers' float32 logits (the quantisation's error)."""
    from attnplug.backends.reference import ReferenceBackend

    device = driver.runner.pool.device
    fp8 = "the reference backend over the same FP8 KV cache"
    ref = _scenario_run(_clone(model, torch.float32, "cpu", "eager"), ReferenceBackend, case, spec, vocab, seed, scales)
    twins = [ref]
    own = None
    if case.dtype != torch.float32:  # the reference in the case's dtype on the device: its own half error
        twin = _scenario_run(
            _clone(model, case.dtype, device, "eager"), ReferenceBackend, case, spec, vocab, seed, scales
        )
        twins.append(twin)
        own = [r.logits for r in twin.records]
    for twin in twins:
        if [r.context for r in twin.records] != [r.context for r in driver.records]:
            raise RuntimeError(f"{case.id}: the reference run of the scenario saw other tokens than the backend's")
    if saturated(ref.runner.pool) == 0:
        raise RuntimeError(f"{case.id}: no K/V value of the scenario saturated: the scales must make some saturate")
    compare(
        case,
        driver.records,
        [r.logits for r in ref.records],
        own,
        against=fp8,
        fp32_tol=FP8_FP32_TOL,
        fp32_median_tol=FP8_FP32_MEDIAN_TOL,
        min_cosine=FP8_HALF_MIN_COSINE,
    )
    pool, twin_pool = driver.runner.pool, twins[-1].runner.pool
    same = same_bytes(pool, twin_pool, 0)
    if same < FP8_MIN_SAME_BYTES:
        pytest.fail(
            f"{MODEL}: {case.id}: the backend's FP8 KV cache holds other bytes than the reference backend's for the "
            f"same k/v (the first layer's): {same:.2%} of the bytes equal, slot for slot (minimum "
            f"{FP8_MIN_SAME_BYTES:.1%}): its stores do not quantise k/v with their scales by attnplug.memory.fp8's rule"
        )
    moved = norm_departures(pool, twin_pool, FP8_NORM_TOL)
    if moved:
        pytest.fail(
            f"{MODEL}: {case.id}: the values the backend's FP8 KV cache stores are not on the reference's scale "
            f"(L2 norm per layer, K / V and KV head further than {FP8_NORM_TOL:.0%} from the reference's): "
            f"{'; '.join(moved[:6])}: its stores do not quantise each layer's and head's k/v with their own scales"
        )
    compare_cosine(
        case, driver.records, expected, FP8_MIN_COSINE[case.kv_dtype], "transformers eager float32 (unquantised)"
    )
