"""``Engine``: greedy generation with continuous batching over a ``ModelRunner``.

The scheduler, between steps, on the host:

* **Admission.** Requests wait in arrival order and join as soon as a request row is free
  and the pools can hold them: each running request reserves its whole context in the full
  pool and, with sliding layers, its live window in the SWA pool; room for one step's new
  tokens beyond the windows is kept free on top (never more than the requests' contexts can
  use). A request that fits no pool even alone is refused before anything runs. So a run
  never runs out of slots halfway, and a small SWA pool is reused as windows slide.
* **Steps.** While some admitted request has prompt tokens left, the step is an EXTEND of up
  to ``max_prefill_tokens`` prompt tokens in all (long prompts are prefilled in chunks over
  several steps), replayed through a captured graph of the next token-count bucket when the
  backend captures EXTEND steps (``GraphSupport.ALWAYS``) and graphs are on; otherwise it is
  one batched DECODE step of every running request, replayed through a ``GraphRunner`` when
  graphs are on.
* **After each step.** Each request takes the argmax of its last token's logits when its
  prompt is done (an EXTEND step reads the device only then: one read for the tokens of the
  prompts it completes, none for a chunk that completes no prompt; its slots, table writes and
  metadata come from the host's own state, uploaded in one asynchronous copy), out-of-window
  SWA slots are evicted, and finished requests (``max_new_tokens`` tokens, or an EOS token,
  which is kept) free their slots and row, so others can join.
* **Overlap.** Consecutive DECODE steps overlap the host with the device: step ``N + 1`` is
  prepared and enqueued (its input tokens are step ``N``'s argmax, still on the device) before
  the host reads step ``N``'s tokens, so the host work of a step (slot allocation, eviction,
  the batch upload, graph preparation) runs while the device computes the previous one. A
  request's slots, lengths and table rows are known on the host without reading the device;
  the only read of a DECODE step is its sampled tokens, one step late. A request that ends
  with an EOS token has run one step past it by then: that step's token is dropped (and its
  slot freed with the others), so the result is exactly that of stepping one at a time.

``generate`` returns the new tokens of each prompt; afterwards every slot and row is back in
the pools (also when a step raises).
"""

from __future__ import annotations

import array
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Union

import torch

from ...batch import ForwardBatch, ForwardMode
from ...graphs import EagerGraph, captures_extend, default_extend_tokens
from ...memory.args import host_int
from ..choice import BackendArg
from .progress import Progress
from .runner import KVScales, ModelRunner, _round_up, check_sizes, default_pool_sizes, live_window_slots
from .spec import model_spec

__all__ = ["Engine"]


#: prompt tokens of one EXTEND step by default: vLLM's server default on 70 GB+ cards (its
#: ``max_num_batched_tokens``). An eager EXTEND step issues the same launches a layer at 512
#: tokens as at 8,192, so fewer, fuller chunks spend less of a prefill on launching; a smaller
#: budget bounds one step's activations and latency instead.
DEFAULT_MAX_PREFILL_TOKENS = 8192


def _split(values: List[int], sizes: Sequence[int]) -> List[List[int]]:
    """``values`` cut into consecutive pieces of ``sizes``."""
    out, offset = [], 0
    for n in sizes:
        out.append(values[offset : offset + n])
        offset += n
    return out


@dataclass(eq=False)  # a request is itself: compared (and removed from lists) by identity
class _Request:
    """One prompt being generated (host state)."""

    index: int
    prompt: List[int]
    max_new: int
    out: List[int] = field(default_factory=list)
    row: int = 0  # request row in req_to_token (0: none yet)
    slots: List[int] = field(default_factory=list)  # full slot of each stored position
    seq_len: int = 0  # positions stored in the KV cache
    reserve_full: int = 0
    reserve_swa: int = 0
    inflight: int = 0  # tokens sampled on the device the host has not read yet (0 or 1)
    finished: bool = False  # max_new tokens or an EOS token read: no more steps

    @property
    def prefilling(self) -> bool:
        return self.seq_len < len(self.prompt)

    @property
    def last_loc(self) -> int:
        return self.slots[-1] if self.slots else -1

    @property
    def wants_step(self) -> bool:
        """Another DECODE step would give it a token it keeps (as far as the host knows)."""
        return not self.finished and len(self.out) + self.inflight < self.max_new


@dataclass
class _Pending:
    """A DECODE step enqueued on the device whose sampled tokens the host has not read."""

    reqs: List[_Request]
    tokens: torch.Tensor  # [n] int64 on the device: the argmax of each request's logits
    host: torch.Tensor  # [n] int64 host copy (pinned off the host), valid once `ready` completed
    ready: Optional[object]  # the device event after the copy (None on the host)


def _is_array(value) -> bool:
    """A torch tensor or a numpy array (numpy is not imported for this)."""
    return isinstance(value, torch.Tensor) or type(value).__module__ == "numpy" and hasattr(value, "ndim")


def _eos_set(eos_token_id) -> frozenset:
    """The EOS token ids of ``eos_token_id``: None, an int or integer scalar (0-d tensor or
    array included), or a list, tuple, set, range or 1-D integer tensor / array of them."""
    if eos_token_id is None:
        return frozenset()
    if _is_array(eos_token_id):
        single = eos_token_id.ndim == 0
    else:
        single = not isinstance(eos_token_id, (list, tuple, set, frozenset, range))
    values = [eos_token_id] if single else list(eos_token_id)
    try:
        if _is_array(eos_token_id) and eos_token_id.ndim > 1:
            raise ValueError("not flat")
        tokens = frozenset(_token(v, "eos_token_id") for v in values)
    except ValueError:
        raise ValueError(f"eos_token_id must be None, an int or a list of ints, got {eos_token_id!r}") from None
    return tokens


def _prompt_list(prompts) -> list:
    """``prompts`` as a list: an ordered sequence (list, tuple, 2-D tensor or array, any other
    iterable that is not a str, bytes, set or mapping), else ``ValueError``."""
    if _is_array(prompts):
        if prompts.ndim != 2:
            raise ValueError(
                f"prompts must be a list of prompts (lists of token ids) or a 2-D tensor, got a "
                f"{prompts.ndim}-D {type(prompts).__name__}"
            )
        return list(prompts)
    unordered = isinstance(prompts, (set, frozenset, dict))
    if unordered or isinstance(prompts, (str, bytes, bytearray)) or not hasattr(prompts, "__iter__"):
        why = " (unordered: the outputs could not be matched to them)" if unordered else ""
        raise ValueError(f"prompts must be a list of prompts (lists of token ids), got {type(prompts).__name__}{why}")
    return list(prompts)


def _token(value, where: str) -> int:
    """A token id: an int or an integer scalar (numpy, torch); a bool, float or string is
    refused naming ``where`` (never truncated: 5.7 is not token 5)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.dtype.is_floating_point:
        value = value.item() if value.dtype != torch.bool else value
    return host_int(value, where, error=ValueError)


class Engine:
    """Greedy generation for a transformers causal LM through attnplug.

    ``backend`` as in ``ModelRunner`` (None: the registry's default for the model's device).
    ``max_batch_size``: requests running at once (request rows, and the largest captured
    graph); ``max_context_len``: the most positions one request may hold (prompt + new
    tokens); ``page_size``: KV pool page size; ``max_prefill_tokens``: prompt tokens per EXTEND
    step (chunked prefill); ``full_pool_tokens`` / ``swa_pool_tokens``: pool sizes (defaults:
    enough for ``max_batch_size`` requests of ``max_context_len``, ``default_pool_sizes``).
    ``cuda_graphs``: None uses a ``GraphRunner`` for DECODE steps when the backend can capture
    them into real device graphs, True always (the eager stand-in where the device has no
    graphs), False never. ``extend_graphs``: None captures EXTEND steps too (one graph per
    token-count bucket: ``attnplug.graphs.default_extend_tokens`` up to the most tokens a step
    holds: ``max_prefill_tokens``, at most ``max_batch_size * max_context_len``) when
    graphs are on and the backend can (``GraphSupport.ALWAYS``), True requires it, False runs
    them eagerly. ``progress``: None shows a progress line on stderr only on a
    terminal and for runs longer than a second, True always, False never. ``compile``: as in
    ``ModelRunner`` (the DECODE graphs replay a ``torch.compile``-d model, and the EXTEND steps
    run the model compiled once for every chunk length).
    ``kv_cache_dtype`` / ``kv_scales``: as in ``ModelRunner`` (None / ``"auto"``: the model's
    dtype; ``"fp8"``, ``"fp8_e4m3"``, ``"fp8_e5m2"`` or an FP8 dtype: an FP8 KV cache with the
    per-layer scales of ``kv_scales``, 1.0 for the layers it does not name).

    Attributes: ``runner`` (the ``ModelRunner``), ``graphs`` (its ``GraphRunner`` or None),
    ``last_run`` (figures of the last ``generate``: steps per mode, graph steps, tokens,
    seconds, peak running requests and SWA slots in use).
    """

    def __init__(
        self,
        model,
        backend: BackendArg = None,
        *,
        max_batch_size: int = 8,
        max_context_len: int = 2048,
        page_size: int = 1,
        cuda_graphs: Optional[bool] = None,
        max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS,
        full_pool_tokens: Optional[int] = None,
        swa_pool_tokens: Optional[int] = None,
        progress: Optional[bool] = None,
        compile: Union[bool, str] = False,
        kv_cache_dtype: Union[None, str, torch.dtype] = None,
        kv_scales: Optional[KVScales] = None,
        extend_graphs: Optional[bool] = None,
    ) -> None:
        if extend_graphs not in (None, True, False):
            raise ValueError(f"extend_graphs must be None, True or False, got {extend_graphs!r}")
        check_sizes(
            max_batch_size=max_batch_size,
            max_context_len=max_context_len,
            page_size=page_size,
            max_prefill_tokens=max_prefill_tokens,
        )
        spec = model_spec(model.config)
        self.step_tokens = max(max_prefill_tokens, max_batch_size)  # the most new tokens of one step
        full, swa = default_pool_sizes(
            spec,
            max_batch_size=max_batch_size,
            max_context_len=max_context_len,
            page_size=page_size,
            max_step_tokens=self.step_tokens,
        )
        self.runner = ModelRunner(
            model,
            backend,
            max_batch_size=max_batch_size,
            max_context_len=max_context_len,
            page_size=page_size,
            full_pool_tokens=full if full_pool_tokens is None else full_pool_tokens,
            swa_pool_tokens=swa if swa_pool_tokens is None else swa_pool_tokens,
            compile=compile,
            kv_cache_dtype=kv_cache_dtype,
            kv_scales=kv_scales,
        )
        self.max_prefill_tokens = max_prefill_tokens
        self.progress = progress
        self._busy = threading.Lock()  # held by the one generate call running
        self.graphs = None
        extend = self._use_extend_graphs(extend_graphs, cuda_graphs)
        if self._use_graphs(cuda_graphs):
            modes = (ForwardMode.DECODE, ForwardMode.EXTEND) if extend else (ForwardMode.DECODE,)
            # a step holds at most max_prefill_tokens, and no more than the requests' contexts
            tokens = default_extend_tokens(min(self.step_tokens, max_batch_size * max_context_len)) if extend else None
            self.graphs = self.runner.enable_graphs(modes=modes, extend_tokens=tokens)
        self.last_run: Dict[str, object] = {}

    def _use_extend_graphs(self, extend_graphs: Optional[bool], cuda_graphs: Optional[bool]) -> bool:
        backend = self.runner.backend
        graphs = backend.capabilities().graphs
        can = captures_extend(graphs)
        if extend_graphs is True:
            if not can:
                raise ValueError(
                    f"extend_graphs=True but backend {backend.name!r} cannot capture EXTEND steps "
                    f"(graphs={graphs.name}; ALWAYS is needed)"
                )
            if cuda_graphs is False:
                raise ValueError("extend_graphs=True but cuda_graphs=False (EXTEND graphs need graphs on)")
            return True
        return extend_graphs is None and can

    def _use_graphs(self, cuda_graphs: Optional[bool]) -> bool:
        backend = self.runner.backend
        if cuda_graphs is False:
            return False
        can = ForwardMode.DECODE in backend.capabilities().graphs.modes
        if cuda_graphs is True:
            if not can:
                raise ValueError(
                    f"cuda_graphs=True but backend {backend.name!r} cannot capture DECODE steps "
                    f"(graphs={backend.capabilities().graphs.name})"
                )
            return True
        return can and not isinstance(backend.new_graph(), EagerGraph)

    # ------------------------------------------------------------------ the run
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        eos_token_id: Union[None, int, Sequence[int]] = None,
    ) -> List[List[int]]:
        """Greedy generation: the new tokens of each prompt (in order), at most
        ``max_new_tokens`` each, ending at the first EOS token (kept) when ``eos_token_id``
        (an int or a list) is given. Raises ``ValueError`` when ``prompts`` is no ordered
        sequence of prompts or ``eos_token_id`` holds no int, and naming the prompt for
        an empty prompt, a prompt that is no sequence of ints (a str, bytes, a set, a float), a
        token outside the vocabulary, or a request longer than ``max_context_len`` or than the
        pools can ever hold (all before anything runs); ``RuntimeError`` when another thread's ``generate`` is
        running on this engine (one call at a time: they share the pools and the graphs)."""
        if not self._busy.acquire(blocking=False):
            raise RuntimeError(
                "Engine.generate is already running on this engine (another thread): one engine serves one "
                "generate call at a time; use one engine a thread or wait for the call"
            )
        try:
            return self._generate(prompts, max_new_tokens, eos_token_id)
        finally:
            self._busy.release()

    def _generate(self, prompts, max_new_tokens, eos_token_id) -> List[List[int]]:
        max_new_tokens = host_int(max_new_tokens, "max_new_tokens", lo=0, error=ValueError)
        self._eos = _eos_set(eos_token_id)
        reqs = [self._request(i, p, max_new_tokens) for i, p in enumerate(_prompt_list(prompts))]
        waiting = deque(r for r in reqs if r.max_new > 0)
        running: List[_Request] = []
        counts = {"steps": {"EXTEND": 0, "DECODE": 0}, "graph_steps": 0, "peak_running": 0, "peak_swa_slots": 0}
        progress = Progress(len(reqs), enabled=self.progress)
        start = time.perf_counter()
        pending: Optional[_Pending] = None  # the DECODE step in flight (module docstring: Overlap)
        try:
            while waiting or running:
                self._admit(waiting, running)
                prefill = [r for r in running if r.prefilling]
                if prefill and pending is not None:  # EXTEND steps read their tokens at once
                    self._collect(pending)
                    pending = None
                elif prefill:
                    counts["graph_steps"] += self._extend_step(prefill)
                    counts["steps"]["EXTEND"] += 1
                else:
                    step_reqs = [r for r in running if r.wants_step]
                    if pending is not None and not all(r.inflight for r in step_reqs):
                        self._collect(pending)
                        pending = None
                    step = None
                    if step_reqs:
                        step, replayed = self._decode_step(step_reqs, pending)
                        counts["graph_steps"] += replayed
                        counts["steps"]["DECODE"] += 1
                    if pending is not None:
                        self._collect(pending)  # the device works on `step` meanwhile
                    pending = step
                alloc = self.runner.allocator
                counts["peak_running"] = max(counts["peak_running"], len(running))
                counts["peak_swa_slots"] = max(
                    counts["peak_swa_slots"], self.runner.pool.size_swa - alloc.swa_available_size()
                )
                for r in [r for r in running if r.finished and not r.inflight]:
                    running.remove(r)
                    self._release(r)
                progress.update(**self._figures(reqs, running, waiting, counts))
        finally:
            for r in running:  # a step raised: give everything back, the pools stay consistent
                self._release(r)
            progress.close(**self._figures(reqs, running, waiting, counts))
        counts["tokens"] = sum(len(r.out) for r in reqs)
        counts["seconds"] = time.perf_counter() - start
        self.last_run = counts
        return [r.out for r in reqs]

    @staticmethod
    def _figures(reqs, running, waiting, counts) -> dict:
        return dict(
            done=len(reqs) - len(running) - len(waiting),
            tokens=sum(len(r.out) for r in reqs),
            running=len(running),
            waiting=len(waiting),
            steps=sum(counts["steps"].values()),
        )

    # ------------------------------------------------------------------ admission
    def _request(self, index: int, prompt: Sequence[int], max_new: int) -> _Request:
        runner = self.runner
        if (
            isinstance(prompt, (str, bytes, bytearray, memoryview, set, frozenset, dict))
            or not hasattr(prompt, "__len__")
            or (_is_array(prompt) and prompt.ndim != 1)
        ):
            shape = f" of shape {tuple(prompt.shape)}" if _is_array(prompt) else ""
            raise ValueError(f"prompts[{index}] must be a sequence of token ids, got {type(prompt).__name__}{shape}")
        if isinstance(prompt, torch.Tensor) and (prompt.dtype.is_floating_point or prompt.dtype == torch.bool):
            raise ValueError(f"prompts[{index}] must hold integer token ids, got a {prompt.dtype} tensor")
        items = prompt.tolist() if isinstance(prompt, torch.Tensor) else list(prompt)
        if set(map(type, items)) == {int}:  # plain ints (never bools): nothing to convert, per token
            tokens = items
        else:
            tokens = [_token(t, f"prompts[{index}][{i}]") for i, t in enumerate(items)]
        if not tokens:
            raise ValueError(f"prompts[{index}] is empty (a prompt needs at least one token)")
        if min(tokens) < 0 or max(tokens) >= runner.vocab_size:
            bad = next(t for t in tokens if not 0 <= t < runner.vocab_size)
            raise ValueError(f"prompts[{index}] holds token {bad}, outside the vocabulary [0, {runner.vocab_size})")
        context = len(tokens) + max_new
        if context > runner.max_context_len:
            raise ValueError(
                f"prompts[{index}]: {len(tokens)} prompt tokens + max_new_tokens={max_new} = {context} exceed "
                f"max_context_len={runner.max_context_len}"
            )
        req = _Request(index, tokens, max_new)
        req.reserve_full, req.reserve_swa = self._reservation(context)
        pool = runner.pool
        swa_need = self._swa_need([req])
        if req.reserve_full > pool.size or swa_need > pool.size_swa:
            raise ValueError(
                f"prompts[{index}] needs {req.reserve_full} full and {swa_need} SWA slots, the pools have "
                f"{pool.size} and {pool.size_swa}: raise full_pool_tokens / swa_pool_tokens or lower "
                "max_prefill_tokens"
            )
        return req

    def _reservation(self, context: int) -> tuple:
        """``(full, swa)`` slots a request may hold at once (see the module docstring)."""
        spec, ps = self.runner.spec, self.runner.pool.page_size
        full = _round_up(context, ps)
        if not spec.swa_layer_ids:
            return full, full
        return full, min(full, live_window_slots(spec, ps))

    def _swa_need(self, reqs: Sequence[_Request]) -> int:
        """SWA slots ``reqs`` may hold at once: their windows, plus one step's new tokens beyond
        them (at most ``step_tokens`` and a page per request, and never more than the rest of
        their contexts)."""
        ps = self.runner.pool.page_size
        step = _round_up(self.step_tokens, ps) + len(reqs) * ps
        windows = sum(r.reserve_swa for r in reqs)
        return windows + min(step, sum(r.reserve_full - r.reserve_swa for r in reqs))

    def _admit(self, waiting: deque, running: List[_Request]) -> None:
        pool, rows = self.runner.pool, self.runner.req_to_token_pool
        used_full = sum(r.reserve_full for r in running)
        while waiting and rows.available_size() > 0:
            r = waiting[0]
            if used_full + r.reserve_full > pool.size or self._swa_need(running + [r]) > pool.size_swa:
                break
            waiting.popleft()
            r.row = rows.alloc()
            running.append(r)
            used_full += r.reserve_full

    def _take(self, r: _Request, token: int) -> None:
        """A token read for ``r``: kept unless ``r`` already finished (a step past its EOS)."""
        if r.finished:
            return
        r.out.append(token)
        if len(r.out) >= r.max_new or token in self._eos:
            r.finished = True

    def _collect(self, pending: _Pending) -> None:
        """Read a DECODE step's tokens (waits for that step only, not for later ones)."""
        if pending.ready is not None:
            pending.ready.synchronize()
        for r, token in zip(pending.reqs, pending.host.tolist()):
            r.inflight -= 1
            self._take(r, token)

    def _release(self, r: _Request) -> None:
        if r.slots:
            self.runner.allocator.free(torch.tensor(r.slots, dtype=torch.int64))
            r.slots = []
        if r.row:
            self.runner.req_to_token_pool.free(r.row)
            r.row = 0

    # ------------------------------------------------------------------ steps
    def _upload(self, *columns: Sequence[int]) -> List[torch.Tensor]:
        """Host int lists as int64 device tensors through ONE host-to-device copy (from pinned
        memory off the host: asynchronous, never waiting for the device queue); returns one
        view per list."""
        values = array.array("q")  # C int64s, extended a list at a time (no per-value Python work)
        for col in columns:
            values.extend(col)
        host = torch.frombuffer(values, dtype=torch.int64) if values else torch.empty(0, dtype=torch.int64)
        dev = self.runner.pool.device
        if dev.type != "cpu":
            host = host.pin_memory()
        flat = host.to(dev, non_blocking=True)
        return list(flat.split([len(col) for col in columns]))

    def _advance(self, reqs: Sequence[_Request], new: Sequence[int]) -> None:
        """The step's tokens are stored: move each request on and free the SWA slots of the
        positions that left every future query's window (``SWATokenAllocator.window_limit``),
        from the slots the engine keeps on the host: one ``free_swa`` call for the
        batch, no device read."""
        spec, alloc, rows = self.runner.spec, self.runner.allocator, self.runner.req_to_token_pool
        for r, n in zip(reqs, new):
            r.seq_len += n
        if not spec.swa_layer_ids:
            return
        ps = self.runner.pool.page_size
        gone, moved = [], []
        for r in reqs:
            frontier = rows.swa_evicted_len(r.row)
            limit = alloc.window_limit(r.seq_len, spec.sliding_window)
            if limit > frontier:
                gone += r.slots[frontier:limit:ps]  # one slot per page: positions are page-aligned
                moved.append((r.row, limit))
        if gone:
            alloc.free_swa(torch.tensor(gone, dtype=torch.int64))
            for row, limit in moved:
                rows.set_swa_evicted_len(row, limit)

    def _extend_step(self, prefill: Sequence[_Request]) -> int:
        """Run one EXTEND step of up to ``max_prefill_tokens`` prompt tokens; returns 1 when a
        captured graph ran it, else 0."""
        budget, reqs, new = self.max_prefill_tokens, [], []
        for r in prefill:
            n = min(len(r.prompt) - r.seq_len, budget)
            if n <= 0:
                break
            reqs.append(r)
            new.append(n)
            budget -= n
        runner = self.runner
        seq = [r.seq_len + n for r, n in zip(reqs, new)]
        ids = [t for r, n in zip(reqs, new) for t in r.prompt[r.seq_len : r.seq_len + n]]
        pos = [p for r, n in zip(reqs, new) for p in range(r.seq_len, r.seq_len + n)]
        rows = [r.row for r, n in zip(reqs, new) for _ in range(n)]
        ends, done, offset = [], [], 0
        for r, n in zip(reqs, new):
            offset += n
            if r.seq_len + n == len(r.prompt):  # the prompt is complete: its last token's logits
                ends.append(offset - 1)
                done.append(r)
        slots = runner.allocator.alloc_extend([r.seq_len for r in reqs], seq, [r.last_loc for r in reqs], host=True)
        slots = slots.tolist()
        ids_t, positions, token_rows, rows_t, seq_t, new_t, ends_t, loc = self._upload(
            ids, pos, rows, [r.row for r in reqs], seq, new, ends, slots
        )
        runner.req_to_token_pool.req_to_token[token_rows, positions] = loc.to(torch.int32)
        for r, taken in zip(reqs, _split(slots, new)):
            r.slots += taken
        batch = ForwardBatch(
            forward_mode=ForwardMode.EXTEND,
            batch_size=len(reqs),
            req_pool_indices=rows_t,
            seq_lens=seq_t,
            out_cache_loc=loc,
            positions=positions,
            seq_lens_cpu=seq if runner.backend.needs_cpu_seq_lens else None,
            extend_seq_lens=new_t,
            extend_seq_lens_cpu=list(new),
        )
        replayed = 0
        if self.graphs is not None and ForwardMode.EXTEND in self.graphs.modes:
            logits = runner.forward_graph(batch, ids_t, positions)  # [bs, vocab]: each request's last token
            replayed = int(self.graphs.bucket_for(batch) is not None)
            if done:
                logits = logits[[i for i, r in enumerate(reqs) if r in done]]
        else:
            logits = runner.forward(batch, ids_t, positions, logits_indices=ends_t)
        if done:  # the step's one device read; a chunk that completes no prompt reads nothing
            for r, token in zip(done, logits.argmax(dim=-1).tolist()):
                self._take(r, token)
        self._advance(reqs, new)
        return replayed

    def _decode_step(self, reqs: Sequence[_Request], pending: Optional[_Pending]) -> tuple:
        """Enqueue one DECODE step of ``reqs``; returns ``(the step as _Pending, 1 when a
        captured graph ran it else 0)``. Nothing here reads the device.

        Input tokens: the host's last token of each request, or, when ``pending`` is in flight
        (then every request of ``reqs`` is one of its requests), the tokens it sampled on the
        device. Host work is batched: one slot allocation (on the host), ONE host-to-device
        copy for the step's request rows, lengths, positions, slots and tokens (or their index
        into ``pending``'s), one indexed write of the new slots into the request table, one
        eviction call."""
        runner = self.runner
        n = len(reqs)
        seq = [r.seq_len + 1 for r in reqs]
        slots = runner.allocator.alloc_decode(seq, [r.last_loc for r in reqs], host=True).tolist()
        # some requests of the step in flight finished: gather the others' tokens by index
        gather = pending is not None and (
            len(pending.reqs) != len(reqs) or any(a is not b for a, b in zip(pending.reqs, reqs))
        )
        if pending is None:
            last = [r.out[-1] for r in reqs]
        elif gather:
            where = {id(r): i for i, r in enumerate(pending.reqs)}
            last = [where[id(r)] for r in reqs]
        else:
            last = []
        rows_t, seq_t, positions, loc, last_t = self._upload(
            [r.row for r in reqs], seq, [r.seq_len for r in reqs], slots, last
        )
        if pending is None:
            ids = last_t
        elif gather:
            ids = pending.tokens.index_select(0, last_t)
        else:
            ids = pending.tokens
        runner.req_to_token_pool.req_to_token[rows_t, positions] = loc.to(torch.int32)
        for r, slot in zip(reqs, slots):
            r.slots.append(slot)
        batch = ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=n,
            req_pool_indices=rows_t,
            seq_lens=seq_t,
            out_cache_loc=loc,
            positions=positions,
            seq_lens_cpu=seq if runner.backend.needs_cpu_seq_lens else None,
        )
        replayed = 0
        if self.graphs is not None:
            logits = runner.forward_graph(batch, ids, positions)
            replayed = int(self.graphs.bucket_for(batch) is not None)
        else:
            logits = runner.forward(batch, ids, positions)
        tokens = logits.argmax(dim=-1)  # read before the next step overwrites a graph's output
        for r in reqs:
            r.inflight += 1
        self._advance(reqs, [1] * n)
        return self._in_flight(list(reqs), tokens), replayed

    @staticmethod
    def _in_flight(reqs: List[_Request], tokens: torch.Tensor) -> _Pending:
        """The step's tokens copied to the host behind the step (pinned memory, asynchronous),
        with an event the host waits on when it reads them."""
        if tokens.device.type == "cpu":
            return _Pending(reqs, tokens, tokens, None)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        ready = torch.Event(device=tokens.device)
        ready.record()
        return _Pending(reqs, tokens, host, ready)
