"""check_attention_matches_reference — attention output and KV cache equal the reference.

Guards the contract of ``forward``: the backend's output matches the ``ReferenceBackend`` in
a twin world (same spec, same seed: the same inputs at the same slots) within the dtype's
tolerance, its output has q's shape, dtype and device, and its KV cache is bit-identical
(free rows and the sink are filled with random values first, so a store anywhere else shows).
Every step runs twice on the backend: as its declaration asks (``seq_lens_cpu`` only when
needed) and with the ``seq_lens_cpu`` mirror supplied. The worlds' SWA free lists are
scrambled, so the full -> SWA translation is never the identity.

* mode cases: EXTEND without and with a cached prefix, DECODE, TARGET_VERIFY, DRAFT_EXTEND,
  IDLE; GQA ratios 1/4/8; windows smaller than, equal to and larger than the sequence;
  batch sizes 1, 2, 3 and 10; an explicit ``scaling``; DECODE in each half-precision dtype. The
  prefix of a mode case is written by the reference backend in both worlds, so only the step
  under test runs on the backend.
* tile cases: sequences of 31/32/33, 63/64/65 and 127/128/129 tokens (several windows long)
  prefilled, decoded, verified and extended on the backend.
* scenarios: a multi-step sequence (every mode, eviction, rollback of rejected drafts, a
  request joining and one leaving) in every declared dtype; a shorter one in every declared
  head dim and every declared page size.
* long context: one request of 4,100 keys and one short one, DECODE and TARGET_VERIFY, in
  each declared half-precision dtype, compared with attention computed in float64 as a
  relative error per (token, layer, head): low-precision accumulation grows with the number
  of keys and fails here.

The FP8 axis: every case whose model dtype is half precision (the cases that name none take
``config.fp8_model_dtype``) also runs over each declared FP8 cache (``...-kv_fp8_e4m3``): the
backend and the reference quantise by the one exact rule, so the caches must stay bit-identical,
and the outputs within the model dtype's tolerance; the long context is judged against float64
attention over the dequantised cache. ``every_combination`` (thorough) also crosses every
declared FP8 dtype with the half dtypes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import pytest
import torch

from attnplug import ForwardMode
from attnplug_conformance.long_context import run_long_context
from attnplug_conformance.support import (
    DRAFT_TOKENS,
    EXTEND_CHUNK,
    PREFIX,
    SUITE_DTYPES,
    Twins,
    base_config,
    conformance_check,
    dtype_name,
    kv_axis,
    new_tokens_of,
    require,
)

__all__ = ["check_attention_matches_reference"]

_N = 3  # requests per mode case
_MODES = ("EXTEND_no_prefix", "EXTEND_prefix", "DECODE", "TARGET_VERIFY", "DRAFT_EXTEND", "IDLE")


@dataclass(frozen=True)
class Case:
    id: str
    mode: Optional[str] = None  # one of _MODES, or None for a scenario
    gqa: int = 4
    window: str = "smaller"  # smaller / equal / larger than the sequences
    dtype: Optional[torch.dtype] = None
    head_dim: Optional[int] = None
    page_size: Optional[int] = None
    kind: str = "mode"  # mode / scenario / every_head_dim / every_page_size / tiles / long_context
    bs: int = 3
    scaling: Optional[float] = None
    lengths: tuple = ()


_LARGE_BS = 10
_TILES = ((31, 32, 33), (63, 64, 65), (127, 128, 129))


def _cases():
    cases = []
    for mode in _MODES:
        for gqa in (1, 4, 8):
            cases.append(Case(f"{mode}-gqa{gqa}-window_smaller", mode, gqa, "smaller"))
        for window in ("equal", "larger"):
            cases.append(Case(f"{mode}-gqa4-window_{window}", mode, 4, window))
        if mode != "IDLE":
            for bs in (1, 2, _LARGE_BS):
                cases.append(Case(f"{mode}-bs{bs}", mode, bs=bs))
    for mode in ("EXTEND_prefix", "DECODE", "TARGET_VERIFY"):
        cases.append(Case(f"{mode}-scaling0.3", mode, scaling=0.3))
    for dtype in (torch.float16, torch.bfloat16):
        cases.append(Case(f"DECODE-{dtype_name(dtype)}", "DECODE", dtype=dtype))
    for lengths in _TILES:
        cases.append(Case(f"tiles-{'_'.join(map(str, lengths))}", kind="tiles", lengths=lengths))
    for dtype in SUITE_DTYPES:
        cases.append(Case(f"scenario-{dtype_name(dtype)}", dtype=dtype, kind="scenario"))
    cases.append(Case("every_head_dim", kind="every_head_dim"))
    cases.append(Case("every_page_size", kind="every_page_size"))
    cases.append(Case("every_combination", kind="every_combination"))
    for dtype in (torch.float16, torch.bfloat16):
        cases.append(Case(f"long_context-{dtype_name(dtype)}", dtype=dtype, kind="long_context"))
    return cases


CASES = _cases()


def _fp8_applies(case: Case) -> bool:
    """The FP8 axis: cases in a half-precision model dtype (or none named); ``every_combination``
    crosses the FP8 dtypes itself."""
    return case.kind != "every_combination" and (case.dtype is None or case.dtype.itemsize == 2)


def _prefix(n: int):
    """Prompt lengths of ``n`` requests (``PREFIX``, continued with other lengths)."""
    return [PREFIX[i % len(PREFIX)] + 2 * (i // len(PREFIX)) for i in range(n)]


def _chunk(n: int):
    return [EXTEND_CHUNK[i % len(EXTEND_CHUNK)] for i in range(n)]


def _final_lengths(mode: str, n: int = _N):
    if mode == "EXTEND_no_prefix":
        return _prefix(n)
    if mode == "EXTEND_prefix":
        return [p + e for p, e in zip(_prefix(n), _chunk(n))]
    if mode == "IDLE":
        return _prefix(n)
    q = 1 if mode == "DECODE" else DRAFT_TOKENS[ForwardMode[mode]]
    return [p + q for p in _prefix(n)]


def _window(kind: str, finals) -> int:
    if kind == "smaller":
        return 3
    if kind == "equal":
        return max(finals)  # the longest request attends to exactly its whole sequence
    return max(finals) + 7


def _mode_case(case: Case, cfg, make_world, make_ref) -> None:
    n = case.bs
    finals = _final_lengths(case.mode, n)
    spec = cfg.spec(num_heads=2 * case.gqa, sliding_window=_window(case.window, finals), scaling=case.scaling)
    if not cfg.sliding_window:
        require(
            case.window == "larger",
            "capabilities().sliding_window is False: window cases other than 'larger' (no SWA layer) do not apply",
        )
    twins = Twins(make_world(spec, 11), make_ref(spec, 11))
    idx = list(range(n))
    if case.mode == "EXTEND_no_prefix":
        twins.add(n)
        twins.step(ForwardMode.EXTEND, idx, _prefix(n))
        return
    twins.setup(_prefix(n))
    if case.mode == "IDLE":
        twins.step(ForwardMode.IDLE)
        twins.step(ForwardMode.DECODE, idx, what="DECODE step after an IDLE step")
        return
    mode = ForwardMode.EXTEND if case.mode == "EXTEND_prefix" else ForwardMode[case.mode]
    _, ndt = new_tokens_of(mode, n)
    twins.step(mode, idx, _chunk(n) if mode is ForwardMode.EXTEND else None, num_draft_tokens=ndt)


def _tiles(case: Case, cfg, make_world, make_ref) -> None:
    """Sequences around attention tile sizes, several windows long, every mode on the backend."""
    longest = max(case.lengths) + 16
    spec = cfg.spec(sliding_window=8, max_context_len=-(-longest // 16) * 16)
    twins = Twins(make_world(spec, 13), make_ref(spec, 13))
    a = twins.add(len(case.lengths))
    twins.step(ForwardMode.EXTEND, a, list(case.lengths))
    twins.step(ForwardMode.DECODE, a)
    twins.step(ForwardMode.TARGET_VERIFY, a, num_draft_tokens=3)
    twins.step(ForwardMode.EXTEND, a, [2, 1, 3])
    twins.step(ForwardMode.DRAFT_EXTEND, a, num_draft_tokens=2)


def _two_layers(cfg):
    """A 2-layer spec (one SWA layer when supported, one full): the every_* cases run many shapes."""
    return cfg.spec(num_layers=2, swa_layer_ids=(0,) if cfg.sliding_window else None)


def _short_scenario(spec, make_world, make_ref, what: str) -> None:
    """Every mode once on the backend (one shape of the every_* cases)."""
    twins = Twins(make_world(spec, 7), make_ref(spec, 7))
    a = twins.add(3)
    twins.step(ForwardMode.EXTEND, a, [5, 12, 9], what=f"EXTEND step ({what})")
    twins.step(ForwardMode.DECODE, a, what=f"DECODE step ({what})")
    twins.step(ForwardMode.TARGET_VERIFY, a, num_draft_tokens=3, what=f"TARGET_VERIFY step ({what})")
    twins.step(ForwardMode.EXTEND, a, [3, 1, 6], what=f"EXTEND step on a prefix ({what})")
    twins.step(ForwardMode.DRAFT_EXTEND, a, num_draft_tokens=2, what=f"DRAFT_EXTEND step ({what})")


def _scenario(cfg, make_world, make_ref) -> None:
    spec = cfg.spec(num_heads=8)
    twins = Twins(make_world(spec, 5), make_ref(spec, 5))
    a = twins.add(3)
    twins.step(ForwardMode.EXTEND, a, [5, 12, 9])
    twins.step(ForwardMode.DECODE, a)
    twins.step(ForwardMode.EXTEND, a, [3, 1, 6])
    keep = None
    if spec.page_size == 1:  # accept one draft of three; rollback is planned for page size 1
        keep = [r.seq_len + 1 for r in twins.requests(a)[0]]
    twins.step(ForwardMode.TARGET_VERIFY, a, num_draft_tokens=3, keep=keep)
    twins.step(ForwardMode.DRAFT_EXTEND, a, num_draft_tokens=2)
    twins.step(ForwardMode.IDLE)
    b = twins.add(1)
    twins.step(ForwardMode.EXTEND, [a[0]] + b, [2, 7], what="EXTEND step mixing a cached request and a new one")
    for _ in range(2):
        twins.step(ForwardMode.DECODE, a + b)
    twins.finish(a[1])
    twins.step(ForwardMode.DECODE, [a[0], a[2]] + b, what="DECODE step after a request finished")


def _combinations(caps):
    """``(dtype, kv_cache_dtype)`` of ``every_combination``: every declared suite dtype with its
    own cache, and every half one over every declared FP8 cache."""
    dtypes = [d for d in SUITE_DTYPES if d in caps.dtypes]
    fp8 = list(caps.fp8_kv_dtypes)
    return [(d, None) for d in dtypes] + [(d, kv) for d in dtypes if d.itemsize == 2 for kv in fp8]


@conformance_check
@pytest.mark.parametrize(*kv_axis("case", CASES, [c.id for c in CASES], fp8=_fp8_applies))
def check_attention_matches_reference(
    case, kv_cache_dtype, attnplug_capabilities, attnplug_world, attnplug_reference_world, attnplug_thorough
):
    """Outputs within the dtype's tolerance of the reference and bit-identical KV caches."""
    caps = attnplug_capabilities
    kv = kv_cache_dtype
    cfg = base_config(caps, dtype=case.dtype, head_dim=case.head_dim, page_size=case.page_size, kv_cache_dtype=kv)
    make, make_ref = attnplug_world, attnplug_reference_world
    if case.kind == "mode":
        _mode_case(case, cfg, make, make_ref)
    elif case.kind == "tiles":
        _tiles(case, cfg, make, make_ref)
    elif case.kind == "scenario":
        _scenario(cfg, make, make_ref)
    elif case.kind == "every_head_dim":
        for hd in caps.head_dims:
            cfg = base_config(caps, head_dim=hd, kv_cache_dtype=kv)
            _short_scenario(_two_layers(cfg), make, make_ref, f"head_dim {hd}")
    elif case.kind == "every_page_size":
        for ps in caps.page_sizes:
            cfg = base_config(caps, page_size=ps, kv_cache_dtype=kv)
            _short_scenario(_two_layers(cfg), make, make_ref, f"page_size {ps}")
    elif case.kind == "every_combination":
        require(attnplug_thorough, "runs with --attnplug-thorough (attnplug conformance --thorough)")
        for dtype, kv in _combinations(caps):
            cache = f" over a {dtype_name(kv)} cache" if kv is not None else ""
            for hd in caps.head_dims:
                for ps in caps.page_sizes:
                    cfg = base_config(caps, dtype=dtype, head_dim=hd, page_size=ps, kv_cache_dtype=kv)
                    _short_scenario(
                        _two_layers(cfg), make, make_ref, f"{dtype_name(dtype)}{cache}, head_dim {hd}, page_size {ps}"
                    )
    else:
        run_long_context(cfg, make)
