"""Twin worlds: the world under test and a reference twin driven in lockstep (``Twins``), and
the request shapes most checks set up before the step they test.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Tuple

import pytest
import torch

from attnplug import ForwardMode

from .compare import assert_attention_close, assert_caches_equal
from .harness import ContractViolation, Step, World
from .instruments import poison_free_rows
from .rules import ALL_RULES, ATTENTION, KV_SLOTS, SEQ_LENS_CPU_NONE

__all__ = [
    "PREFIX",
    "EXTEND_CHUNK",
    "DRAFT_TOKENS",
    "new_tokens_of",
    "Twins",
    "with_seq_lens_cpu",
    "assert_translation_not_identity",
]

#: prompt lengths of the requests most checks set up before the step they test
PREFIX: Tuple[int, ...] = (5, 12, 9, 3, 7, 10)
#: new tokens per request of an EXTEND step on top of a prefix (chunked prefill)
EXTEND_CHUNK: Tuple[int, ...] = (4, 1, 7, 2, 5, 3)
#: q_len of the speculative modes
DRAFT_TOKENS = {ForwardMode.TARGET_VERIFY: 3, ForwardMode.DRAFT_EXTEND: 2}


def new_tokens_of(mode: ForwardMode, n: int):
    """``(new_tokens, num_draft_tokens)`` for ``World.plan`` of ``n`` requests in ``mode``."""
    if mode is ForwardMode.EXTEND:
        return list(EXTEND_CHUNK[:n]), None
    return None, DRAFT_TOKENS.get(mode)


def with_seq_lens_cpu(batch):
    """The same step with the host mirror ``seq_lens_cpu`` supplied (an engine that mixes
    backends passes it even to a backend that does not need it)."""
    if batch.seq_lens_cpu is not None:
        return batch
    mirror = [int(x) for x in batch.seq_lens.to("cpu").tolist()]
    return dataclasses.replace(batch, seq_lens_cpu=mirror)


def assert_translation_not_identity(world: World, step: Step) -> None:
    """The suite's worlds make translation a real permutation (a backend that skips it must
    not pass by luck): raise when a step's SWA slots equal its full slots."""
    if world.spec.scramble_swa and world.translation_is_identity(step.batch.out_cache_loc):
        raise RuntimeError(
            "conformance harness: translate(out_cache_loc) equals out_cache_loc in a scrambled "
            "world; the suite would not see a backend that skips the translation"
        )


class Twins:
    """The world under test and a reference twin (same spec, same seed: same inputs, same
    slots), driven in lockstep. ``step`` runs one step in both and compares; then commits
    (optionally rolls back rejected drafts) and evicts out-of-window SWA slots in both.

    Before the first step every KV row holding no live token (the sink included) is filled
    with the same random values in both worlds (``poison_free_rows``); before each step its
    translation is checked not to be the identity. Then the world under test runs the step
    as an engine of its declaration would (``seq_lens_cpu`` only when the backend needs it)
    and, eager steps, once more with the ``seq_lens_cpu`` mirror supplied (``mirror=True``):
    both outputs must match the reference within the dtype's tolerance,
    and after each run every layer's KV cache must equal the reference's bit for bit (slot 0
    excepted in a padded replay)."""

    def __init__(self, world: World, ref: World, *, rule: str = ATTENTION, mirror: bool = True):
        self.world, self.ref, self.rule, self.mirror = world, ref, rule, mirror
        self.reqs: Tuple[list, list] = ([], [])
        self.steps = 0
        self._poisoned = False

    def requests(self, idx: Sequence[int]):
        return [self.reqs[0][i] for i in idx], [self.reqs[1][i] for i in idx]

    def setup(self, lengths: Sequence[int], *, direct: bool = False) -> None:
        """New requests prefilled by the REFERENCE backend in both worlds (identical KV),
        so that the step under test is the only one the backend runs. ``direct``: the
        prompts' KV is stored without attention (``World.store_kv``; long prompts)."""
        for w, reqs in zip((self.world, self.ref), self.reqs):
            if direct:
                new = [w.new_request() for _ in lengths]
                step = w.plan(ForwardMode.EXTEND, new, list(lengths))
                w.store_kv(step)
                w.advance(step)
                reqs.extend(new)
            else:
                reqs.extend(w.prefill(lengths, backend=w.reference_backend))

    def add(self, n: int) -> List[int]:
        """``n`` new (empty) requests in both worlds; returns their indices."""
        start = len(self.reqs[0])
        for w, reqs in zip((self.world, self.ref), self.reqs):
            reqs.extend(w.new_request() for _ in range(n))
        return list(range(start, start + n))

    def finish(self, i: int) -> None:
        for w, reqs in zip((self.world, self.ref), self.reqs):
            w.finish(reqs[i])
        self.reqs[0][i] = self.reqs[1][i] = None

    def _run(self, batch, inputs, runner, label: str, check_none: bool) -> torch.Tensor:
        try:
            if runner is not None:
                out = runner.run(batch, inputs).clone()
            else:
                self.world.backend.init_forward_metadata(batch)
                out = self.world.step_fn(batch, inputs)
            self.world.backend.synchronize(self.world.device)
            return out
        except ContractViolation as exc:
            pytest.fail(f"{exc} ({label})", pytrace=False)
        except Exception as exc:
            if str(exc).startswith(ALL_RULES):
                raise
            if check_none:
                pytest.fail(
                    f"{SEQ_LENS_CPU_NONE}: {label} raised {type(exc).__name__}: {exc} with "
                    "seq_lens_cpu=None (the backend declares needs_cpu_seq_lens=False)"
                )
            pytest.fail(f"{self.rule}: {label}: the backend raised {type(exc).__name__}: {exc}")

    def step(
        self,
        mode: ForwardMode,
        idx: Sequence[int] = (),
        new_tokens=None,
        *,
        num_draft_tokens=None,
        keep: Optional[Sequence[int]] = None,
        runner=None,
        what: str = "",
        check_seq_lens_cpu_none=False,
    ):
        """Run one step in both worlds and compare (see the class docstring). ``keep``: per
        request, how many of its tokens survive (rejected drafts are rolled back before
        eviction). ``runner``: run the world under test through this ``GraphRunner``
        instead of eagerly."""
        self.steps += 1
        wreqs, rreqs = self.requests(idx)
        sw = self.world.plan(mode, wreqs, new_tokens, num_draft_tokens=num_draft_tokens)
        sr = self.ref.plan(mode, rreqs, new_tokens, num_draft_tokens=num_draft_tokens)
        label = what or f"{mode.name} step {self.steps} (requests {list(idx)}" + (
            f", new tokens {list(new_tokens)})" if isinstance(new_tokens, (list, tuple)) else ")"
        )
        if check_seq_lens_cpu_none and sw.batch.seq_lens_cpu is not None:
            raise AssertionError("the harness built seq_lens_cpu although no backend needs it")
        assert_translation_not_identity(self.world, sw)
        if not self._poisoned:  # once: rows freed later keep old, distinct values
            for w in (self.world, self.ref):
                poison_free_rows(w, seed=1000)
            self._poisoned = True
        expected = self.ref.run_eager(sr)
        ignore = (0,) if runner is not None else ()
        runs = [(sw.batch, "")]
        if self.mirror and runner is None and sw.batch.seq_lens_cpu is None:  # a runner drops the mirror
            runs.append((with_seq_lens_cpu(sw.batch), " with the seq_lens_cpu mirror supplied"))
        out = None
        for i, (batch, how) in enumerate(runs):
            # The second run starts from the cache the first left: after the comparison
            # below, that differs from the start only at the step's own slots, which it
            # rewrites with the same values.
            out_i = self._run(batch, sw.inputs, runner, label + how, check_seq_lens_cpu_none and not i)
            assert_attention_close(out_i, expected, self.world, what=label + how, rule=self.rule)
            assert_caches_equal(
                self.world,
                self.ref,
                what=label + how,
                ignore_rows=ignore,
                rule=KV_SLOTS if self.rule == ATTENTION else self.rule,
            )
            out = out_i if out is None else out
        for w, s in ((self.world, sw), (self.ref, sr)):
            w.commit(s)
            if keep is not None:
                for r, k in zip(s.requests, keep):
                    w.rollback(r, k)
            for r in s.requests:
                w.evict(r)
        return sw, out
