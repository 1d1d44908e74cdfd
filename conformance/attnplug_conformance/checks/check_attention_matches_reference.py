"""check_attention_matches_reference — attention output and KV cache equal the reference.

Guards the contract of ``forward``: for every mode (EXTEND without and with a cached prefix,
DECODE, TARGET_VERIFY, DRAFT_EXTEND, IDLE), GQA ratios 1/4/8 and sliding windows smaller
than, equal to and larger than the sequence, the backend's output matches the
``ReferenceBackend`` in a twin world (same spec, same seed: the same inputs at the same
slots) within the dtype's tolerance, and its KV cache is bit-identical. The prefix of a
mode case is written by the reference backend in both worlds, so only the step under test
runs on the backend. Scenario cases run a whole multi-step sequence (every mode, eviction,
rollback of rejected drafts, a request joining and one leaving) on the backend, once per
declared dtype, head dim of {64, 128, 256} and page size of {1, 4}.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import pytest
import torch

from attnplug import ForwardMode

from attnplug_conformance.support import (
    DRAFT_TOKENS,
    EXTEND_CHUNK,
    PREFIX,
    Twins,
    base_config,
    conformance_check,
    dtype_name,
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


def _cases():
    cases = []
    for mode in _MODES:
        for gqa in (1, 4, 8):
            cases.append(Case(f"{mode}-gqa{gqa}-window_smaller", mode, gqa, "smaller"))
        for window in ("equal", "larger"):
            cases.append(Case(f"{mode}-gqa4-window_{window}", mode, 4, window))
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        cases.append(Case(f"scenario-{dtype_name(dtype)}", dtype=dtype))
    for hd in (64, 128, 256):
        cases.append(Case(f"scenario-head_dim{hd}", head_dim=hd))
    for ps in (1, 4):
        cases.append(Case(f"scenario-page_size{ps}", page_size=ps))
    return cases


CASES = _cases()


def _final_lengths(mode: str):
    if mode == "EXTEND_no_prefix":
        return list(PREFIX[:_N])
    if mode == "EXTEND_prefix":
        return [p + e for p, e in zip(PREFIX[:_N], EXTEND_CHUNK)]
    if mode == "IDLE":
        return list(PREFIX[:_N])
    q = 1 if mode == "DECODE" else DRAFT_TOKENS[ForwardMode[mode]]
    return [p + q for p in PREFIX[:_N]]


def _window(kind: str, finals) -> int:
    if kind == "smaller":
        return 3
    if kind == "equal":
        return finals[1]  # the longest request attends to exactly its whole sequence
    return max(finals) + 7


def _mode_case(case: Case, cfg, make_world, make_ref) -> None:
    finals = _final_lengths(case.mode)
    spec = cfg.spec(num_heads=2 * case.gqa, sliding_window=_window(case.window, finals))
    if not cfg.sliding_window:
        require(case.window == "larger", "capabilities().sliding_window is False: window cases other than "
                                         "'larger' (no SWA layer) do not apply")
    twins = Twins(make_world(spec, 11), make_ref(spec, 11))
    idx = list(range(_N))
    if case.mode == "EXTEND_no_prefix":
        twins.add(_N)
        twins.step(ForwardMode.EXTEND, idx, list(PREFIX[:_N]))
        return
    twins.setup(PREFIX[:_N])
    if case.mode == "IDLE":
        twins.step(ForwardMode.IDLE)
        twins.step(ForwardMode.DECODE, idx, what="DECODE step after an IDLE step")
        return
    mode = ForwardMode.EXTEND if case.mode == "EXTEND_prefix" else ForwardMode[case.mode]
    new, ndt = new_tokens_of(mode, _N)
    twins.step(mode, idx, new, num_draft_tokens=ndt)


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


@conformance_check
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def check_attention_matches_reference(case, attnplug_capabilities, attnplug_world, attnplug_reference_world):
    """Outputs within the dtype's tolerance of the reference and bit-identical KV caches."""
    cfg = base_config(attnplug_capabilities, dtype=case.dtype, head_dim=case.head_dim, page_size=case.page_size)
    if case.mode is None:
        _scenario(cfg, attnplug_world, attnplug_reference_world)
    else:
        _mode_case(case, cfg, attnplug_world, attnplug_reference_world)
