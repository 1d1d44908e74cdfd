"""A small engine for driving any backend the way an engine does (docs/contract.md).

``World`` owns one KV pool, allocator and request table and one backend instance; it plans
steps for a set of live requests in any ``ForwardMode`` (allocating slots, writing
``req_to_token``, building the ``ForwardBatch`` with device-side constructors), runs them
eagerly or through a ``GraphRunner``, evicts out-of-window SWA slots between steps and frees
requests when they finish. Each request keeps its token history (k, v per layer, on the host)
so that any result can be recomputed densely.

The conformance suite adds a few instruments on top: a reference backend over the SAME pool
(``World.reference_backend``, to set up a prefix identically in twin worlds), KV snapshots
(``snapshot_kv`` / ``restore_kv``), the host view of which slots are live
(``live_full_slots`` / ``live_swa_slots`` / ``free_swa_slots``), a store that writes a step's
KV without any backend (``store_kv``: long prompts set up cheaply, ``save_kv_cache=False``
steps) and ``WorldSpec.scramble_swa``: the SWA free list is shuffled at construction, so the
full -> SWA translation of every later step is a real permutation, never the identity.

An FP8 world (``WorldSpec.kv_cache_dtype``: ``float8_e4m3fn`` or ``float8_e5m2``) stores its
k / v quantised (``attnplug.memory.fp8``) with per-layer, per-KV-head scales set at
construction (``fp8_scales``: seeded, part of the heads saturating on the suite's N(0, 1)
inputs, none 1.0), and each request's history holds what the cache holds:
``dequantize_kv(quantize_kv(x))`` in float64 (``World.cached_values``). Cache comparisons read
bits (``kv_bits``): float8 values are compared, indexed and written as bytes, which every
device supports (``torch.equal`` has no float8 kernel on the host).

Device-neutral: the device is a ``torch.device`` given by the caller.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple, Type

import torch

from attnplug import (
    AttentionBackend,
    ForwardBatch,
    ForwardMode,
    GraphRunner,
    ReqToTokenPool,
    SWAKVPool,
    SWATokenAllocator,
    decide_needs_cpu_seq_lens,
)
from attnplug.memory.fp8 import dequantize_kv, fp8_max, is_fp8, quantize_kv, resolve_kv_cache_dtype

from .rules import ATTENTION

__all__ = [
    "WorldSpec",
    "World",
    "Request",
    "Step",
    "layer_step",
    "KVSnapshot",
    "ContractViolation",
    "kv_bits",
    "fp8_scales",
    "FP8_SATURATING",
    "FP8_WIDE",
]

#: per layer ``(k, v)`` clones of the KV buffers
KVSnapshot = List[Tuple[torch.Tensor, torch.Tensor]]

#: an integer dtype of each element size: a tensor's bits, as ``kv_bits`` views them
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def kv_bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as the integers of its element size (uint8 for FP8, int16 for float16 /
    bfloat16, ...): a view, no copy. What cache comparisons read (bit for bit: NaN equals its own
    bits, and float8 values are compared, indexed and written as bytes on any device)."""
    return t.view(_BITS[t.element_size()])


#: FP8 worlds: the magnitude ``m`` past which a head's k or v saturate (its scale is
#: ``m / fp8_max(dtype)``). Saturating heads draw ``m`` from ``FP8_SATURATING`` (1 % to 21 % of
#: N(0, 1) values lie past it), the others from ``FP8_WIDE`` (6e-7 or fewer); log-uniform.
FP8_SATURATING: Tuple[float, float] = (1.25, 2.5)
FP8_WIDE: Tuple[float, float] = (5.0, 20.0)


def fp8_scales(
    dtype: torch.dtype, num_kv_heads: int, layer: int, generator: torch.Generator
) -> Tuple[torch.Tensor, torch.Tensor]:
    """One layer's ``(k_scale, v_scale)`` of an FP8 world: float64 host ``[num_kv_heads]``.

    Head ``h``'s K saturates when ``layer + h`` is even, its V when it is odd (``FP8_SATURATING``;
    the others ``FP8_WIDE``), so every layer has saturating and non-saturating heads, and a
    world of one KV head saturates K on even layers and V on odd ones. Every scale is
    ``m / fp8_max(dtype)`` (at most 20 / 448 for e4m3fn): none is 1.0, so a backend that ignores
    a scale, or does not saturate, gives other numbers. Drawn from ``generator``."""
    limit = fp8_max(dtype)
    scales = []
    for part in (0, 1):  # k, v
        u = torch.rand(num_kv_heads, generator=generator, dtype=torch.float64)
        ranges = [FP8_SATURATING if (layer + h + part) % 2 == 0 else FP8_WIDE for h in range(num_kv_heads)]
        lo, hi = torch.tensor(ranges, dtype=torch.float64).unbind(1)
        scales.append(lo * (hi / lo) ** u / limit)
    return scales[0], scales[1]


@dataclass(frozen=True)
class WorldSpec:
    """Shapes of one test world. ``swa_layer_ids`` default: 3 of every 4 layers are SWA."""

    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 32
    dtype: torch.dtype = torch.float32
    sliding_window: Optional[int] = 8
    page_size: int = 1
    size: int = 1024
    size_swa: int = 512
    max_reqs: int = 16
    max_context_len: int = 256
    swa_layer_ids: Optional[Tuple[int, ...]] = None
    #: ``scaling`` given to the backend (None: the contract's default ``1/sqrt(head_dim)``)
    scaling: Optional[float] = None
    #: shuffle the SWA free list at construction (``World.scramble_swa_free_list``)
    scramble_swa: bool = False
    #: ``logit_softcap`` given to the backend (None: logits are not capped)
    logit_softcap: Optional[float] = None
    #: give every layer learned sink logits (``World.sinks``: seeded, float32 ``[num_heads]``)
    sinks: bool = False
    #: what the KV pool stores: None (``dtype``, the model's) or an FP8 dtype
    #: (``attnplug.memory.fp8.FP8_KV_DTYPES``: q / k / v stay ``dtype``, k / v are quantised at
    #: store with the world's scales, ``fp8_scales``)
    kv_cache_dtype: Optional[torch.dtype] = None

    def __post_init__(self) -> None:
        kv = self.kv_cache_dtype
        if kv is not None and kv != self.dtype and not is_fp8(kv):
            raise ValueError(
                f"WorldSpec: kv_cache_dtype must be None, the model dtype ({self.dtype}) or an FP8 dtype "
                f"(torch.float8_e4m3fn, torch.float8_e5m2), got {kv!r}"
            )

    def swa_layers(self) -> Tuple[int, ...]:
        if self.sliding_window is None:
            return ()
        if self.swa_layer_ids is not None:
            return tuple(self.swa_layer_ids)
        return tuple(i for i in range(self.num_layers) if i % 4 != 3)


@dataclass
class Request:
    row: int
    seq_len: int = 0
    # history[layer] = (k [seq_len, Hkv, D], v [seq_len, Hkv, D]) on the host, float64: what the
    # cache holds (World.cached_values)
    history: List[Tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


@dataclass
class Step:
    """One planned step: the batch, the model inputs, and the requests it extends."""

    batch: ForwardBatch
    inputs: Dict[str, torch.Tensor]  # "q" [T, L, H, D], "k"/"v" [T, L, Hkv, D] on the device
    requests: List[Request]
    new_tokens: List[int]


class ContractViolation(AssertionError):
    """``forward`` returned something the contract rules out (type, shape, dtype, device)."""


def check_output(out, q: torch.Tensor, layer: int) -> None:
    """Raise ``ContractViolation`` unless ``out`` is a tensor of q's shape ``[T, H, D]``,
    dtype and device (host metadata only: nothing is read from the device)."""
    if not isinstance(out, torch.Tensor):
        raise ContractViolation(f"{ATTENTION}: forward() of layer {layer} returned {type(out).__name__}, not a tensor")
    problems = []
    if tuple(out.shape) != tuple(q.shape):
        problems.append(f"shape {list(out.shape)} (expected {list(q.shape)}: [T, num_heads, head_dim])")
    if out.dtype != q.dtype:
        problems.append(
            f"dtype {str(out.dtype).replace('torch.', '')} (expected q's dtype, {str(q.dtype).replace('torch.', '')})"
        )
    if out.device != q.device:
        problems.append(f"device {out.device} (expected q's device, {q.device})")
    if problems:
        raise ContractViolation(f"{ATTENTION}: forward() of layer {layer} returned an output of " + ", ".join(problems))


def layer_step(
    backend: AttentionBackend,
    num_layers: int,
    *,
    save_kv_cache: bool = True,
    sinks: Optional[Sequence[torch.Tensor]] = None,
):
    """The model of a step: every layer's attention, stacked to ``[T, L, H, D]``. Each
    layer's output is checked against the contract (``check_output``) before stacking (a
    stack would silently promote a wrong dtype). ``sinks``: per layer, the ``sinks=`` tensor
    given to ``forward`` (None: the keyword is not passed)."""

    def step(batch: ForwardBatch, inputs: Dict[str, torch.Tensor]) -> torch.Tensor:
        outs = []
        for l in range(num_layers):
            q = inputs["q"][:, l]
            kw = {} if sinks is None else {"sinks": sinks[l]}
            out = backend.forward(q, inputs["k"][:, l], inputs["v"][:, l], l, batch, save_kv_cache=save_kv_cache, **kw)
            check_output(out, q, l)
            outs.append(out)
        if not outs:
            return inputs["q"].new_empty(inputs["q"].shape)
        return torch.stack(outs, dim=1)

    return step


class World:
    """One pool + allocator + request table + backend (see module docstring)."""

    def __init__(
        self, spec: WorldSpec, backend_cls: Type[AttentionBackend], device, *, seed: int = 0, keep_history: bool = True
    ):
        self.spec = spec
        self.keep_history = keep_history  # False: lengths only (long runs that never recompute densely)
        self.pool = SWAKVPool(
            spec.size,
            spec.size_swa,
            spec.num_layers,
            spec.swa_layers(),
            spec.num_kv_heads,
            spec.head_dim,
            resolve_kv_cache_dtype(spec.kv_cache_dtype, spec.dtype),
            device,
            page_size=spec.page_size,
        )
        self.device = self.pool.device  # concrete ("cuda" -> "cuda:0"), as the pool reports it
        if self.pool.is_fp8:  # before the backend and any store; its own stream: inputs unchanged
            gen = torch.Generator().manual_seed(seed * 7919 + 211)
            for layer in range(spec.num_layers):
                self.pool.set_kv_scales(layer, *fp8_scales(self.pool.dtype, spec.num_kv_heads, layer, gen))
        self.alloc = SWATokenAllocator(self.pool)
        self.rows = ReqToTokenPool(spec.max_reqs, spec.max_context_len, self.device)
        kwargs = {} if spec.scaling is None else {"scaling": spec.scaling}
        if spec.logit_softcap is not None:
            kwargs["logit_softcap"] = spec.logit_softcap
        #: per layer, float32 ``[num_heads]`` sink logits on the device (``spec.sinks``), else None
        self.sinks: Optional[List[torch.Tensor]] = None
        if spec.sinks:
            gen = torch.Generator().manual_seed(seed * 7919 + 101)  # its own stream: inputs unchanged
            self.sinks = [
                (torch.randn(spec.num_heads, generator=gen) * 2 + 0.5).to(self.device) for _ in range(spec.num_layers)
            ]
        self.backend = backend_cls(
            self.pool, self.rows, num_heads=spec.num_heads, sliding_window=spec.sliding_window, **kwargs
        )
        self.seed = seed
        self.generator = torch.Generator().manual_seed(seed)
        self.requests: List[Request] = []
        self.step_fn = layer_step(self.backend, spec.num_layers, sinks=self.sinks)
        self._reference: Optional[AttentionBackend] = None
        if spec.scramble_swa:
            self.scramble_swa_free_list()

    @property
    def reference_backend(self) -> AttentionBackend:
        """A ``ReferenceBackend`` over this world's pool and request table (built once).
        Steps run with it write the same KV as in a reference-only twin world, so a prefix
        can be set up identically whatever backend is under test."""
        if self._reference is None:
            from attnplug.backends.reference import ReferenceBackend

            self._reference = ReferenceBackend(
                self.pool,
                self.rows,
                num_heads=self.spec.num_heads,
                sliding_window=self.spec.sliding_window,
                scaling=self.spec.scaling,
                logit_softcap=self.spec.logit_softcap,
            )
        return self._reference

    def scramble_swa_free_list(self, chunks: int = 16) -> None:
        """Shuffle the SWA free list with the allocator's public API, so that full slots and
        their SWA slots stop coinciding: take every SWA page (with as many full pages), free
        their SWA pages in ``chunks`` groups in a seeded random order, then free the full
        pages. Afterwards the full pool hands out its pages in order while the SWA pool hands
        out a permutation. Deterministic in the world's seed (twin worlds scramble alike).
        Only at construction, before any request exists."""
        if self.requests:
            raise RuntimeError("scramble_swa_free_list() must run before any request is allocated")
        ps = self.spec.page_size
        pages = min(self.alloc.swa_available_size(), self.alloc.full_available_size()) // ps
        if pages < 2:
            return
        loc = self.alloc.alloc(pages * ps).cpu()
        first = loc.view(pages, ps)[:, 0]  # one slot per page
        gen = torch.Generator().manual_seed(self.seed * 7919 + 17)
        order = first[torch.randperm(pages, generator=gen)]
        for part in torch.tensor_split(order, min(chunks, pages)):
            self.alloc.free_swa(part)
        self.alloc.free(loc)

    def translation_is_identity(self, loc: torch.Tensor) -> bool:
        """Whether ``translate(loc)`` equals ``loc`` (host bool; reads the device: a test
        instrument, never called inside a step)."""
        if not self.pool.swa_layer_ids or loc.numel() == 0:
            return False
        swa = self.pool.translate_loc_from_full_to_swa(loc).to("cpu", torch.int64)
        return bool(torch.equal(swa, loc.to("cpu", torch.int64)))

    # ------------------------------------------------------------------ requests
    def new_request(self) -> Request:
        req = Request(row=self.rows.alloc())
        req.history = [
            (torch.zeros(0, self.spec.num_kv_heads, self.spec.head_dim, dtype=torch.float64),) * 2
            for _ in range(self.spec.num_layers)
        ]
        self.requests.append(req)
        return req

    def finish(self, req: Request) -> None:
        """Free every slot of the request and its row."""
        if req.seq_len:
            locs = self.rows.req_to_token[req.row, : req.seq_len].to(torch.int64)
            self.alloc.free(locs)
        self.rows.free(req.row)
        self.requests.remove(req)

    def evict(self, req: Request) -> int:
        if self.spec.sliding_window is None:
            return 0
        return self.alloc.evict_out_of_window(self.rows, req.row, req.seq_len, self.spec.sliding_window)

    def rollback(self, req: Request, keep: int) -> None:
        """Drop the last ``req.seq_len - keep`` tokens (rejected drafts): the allocator's
        ``rollback`` gives their slots back (a page keeps its first ``keep`` slots), the
        request's row and history forget them."""
        if keep >= req.seq_len:
            return
        locs = self.rows.req_to_token[req.row, keep : req.seq_len].to(torch.int64)
        self.alloc.rollback(locs)
        self.rows.req_to_token[req.row, keep : req.seq_len] = 0
        req.history = [(k[:keep], v[:keep]) for k, v in req.history]
        req.seq_len = keep

    # ------------------------------------------------------------------ steps
    def _randn(self, *shape) -> torch.Tensor:
        return torch.randn(*shape, generator=self.generator, dtype=torch.float32)

    def _allocate(self, reqs: Sequence[Request], new: Sequence[int]) -> torch.Tensor:
        if self.spec.page_size == 1:
            return self.alloc.alloc(sum(new))
        prefix = [r.seq_len for r in reqs]
        seq = [p + n for p, n in zip(prefix, new)]
        last = [int(self.rows.req_to_token[r.row, r.seq_len - 1]) if r.seq_len else -1 for r in reqs]
        return self.alloc.alloc_extend(prefix, seq, last)

    def plan(
        self,
        mode: ForwardMode,
        reqs: Sequence[Request],
        new_tokens=None,
        *,
        num_draft_tokens=None,
        seq_lens_cpu: Optional[bool] = None,
    ) -> Step:
        """Allocate slots for the next tokens of ``reqs`` and describe the step.

        ``new_tokens``: per-request counts for EXTEND (an int applies to all); DECODE uses 1,
        TARGET_VERIFY / DRAFT_EXTEND use ``num_draft_tokens``. ``seq_lens_cpu``: whether the
        batch carries the host mirror of ``seq_lens``; default: only when the backend declares
        ``needs_cpu_seq_lens`` (what an engine does through ``decide_needs_cpu_seq_lens``).
        """
        if seq_lens_cpu is None:
            seq_lens_cpu = decide_needs_cpu_seq_lens([self.backend])
        dev = self.device
        reqs = list(reqs)
        if mode is ForwardMode.IDLE:
            empty = torch.zeros(0, dtype=torch.int64, device=dev)
            batch = ForwardBatch(
                mode, 0, empty, empty, empty, positions=empty, seq_lens_cpu=[] if seq_lens_cpu else None
            )
            return Step(batch, self._inputs(0), [], [])
        if mode is ForwardMode.DECODE:
            new = [1] * len(reqs)
        elif mode.is_speculative:
            new = [int(num_draft_tokens)] * len(reqs)
        else:
            new = [new_tokens] * len(reqs) if isinstance(new_tokens, int) else list(new_tokens)
        locs = self._allocate(reqs, new)
        positions = []
        offset = 0
        for r, n in zip(reqs, new):
            self.rows.req_to_token[r.row, r.seq_len : r.seq_len + n] = locs[offset : offset + n].to(torch.int32)
            positions.extend(range(r.seq_len, r.seq_len + n))
            offset += n
        seq_after = [r.seq_len + n for r, n in zip(reqs, new)]
        batch = ForwardBatch(
            forward_mode=mode,
            batch_size=len(reqs),
            req_pool_indices=torch.tensor([r.row for r in reqs], dtype=torch.int64).to(dev),
            seq_lens=torch.tensor(seq_after, dtype=torch.int64).to(dev),
            out_cache_loc=locs.to(dev),
            positions=torch.tensor(positions, dtype=torch.int64).to(dev),
            seq_lens_cpu=list(seq_after) if seq_lens_cpu else None,
            extend_seq_lens=torch.tensor(new, dtype=torch.int64).to(dev) if mode is ForwardMode.EXTEND else None,
            extend_seq_lens_cpu=new if mode is ForwardMode.EXTEND else None,
            num_draft_tokens=num_draft_tokens if mode.is_speculative else None,
        )
        return Step(batch, self._inputs(sum(new)), reqs, new)

    def _inputs(self, T: int) -> Dict[str, torch.Tensor]:
        s = self.spec
        L, H, Hkv, D = s.num_layers, s.num_heads, s.num_kv_heads, s.head_dim
        return {
            "q": self._randn(T, L, H, D).to(self.device, s.dtype),
            "k": self._randn(T, L, Hkv, D).to(self.device, s.dtype),
            "v": self._randn(T, L, Hkv, D).to(self.device, s.dtype),
        }

    def input_shapes(self) -> Dict[str, Tuple[Tuple[int, ...], torch.dtype]]:
        s = self.spec
        return {
            "q": ((s.num_layers, s.num_heads, s.head_dim), s.dtype),
            "k": ((s.num_layers, s.num_kv_heads, s.head_dim), s.dtype),
            "v": ((s.num_layers, s.num_kv_heads, s.head_dim), s.dtype),
        }

    def cached_values(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """What ``layer``'s cache holds for ``k`` / ``v`` (``[n, num_kv_heads, head_dim]``, the
        model dtype, any device), as float64 host tensors of the same shape: the values as given
        on an unquantised pool; on an FP8 pool ``dequantize_kv(quantize_kv(x))`` with the layer's
        scales (``attnplug.memory.fp8``: the one rule, exact in float64). The oracle attends over
        these, so a backend's own error is judged, never the quantisation's."""
        if not self.pool.is_fp8:
            return k.detach().to("cpu", torch.float64), v.detach().to("cpu", torch.float64)
        k_scale, v_scale = self.pool.kv_scales(layer)
        return tuple(  # type: ignore[return-value]
            dequantize_kv(quantize_kv(x.detach(), s, self.pool.dtype), s, torch.float64).cpu()
            for x, s in ((k, k_scale), (v, v_scale))
        )

    def commit(self, step: Step) -> None:
        """Record the step's tokens in each request's history (what the cache holds:
        ``cached_values``) and length."""
        if not self.keep_history:
            for r, n in zip(step.requests, step.new_tokens):
                r.seq_len += n
            return
        offset = 0
        k_all, v_all = step.inputs["k"], step.inputs["v"]
        held = [self.cached_values(l, k_all[:, l], v_all[:, l]) for l in range(self.spec.num_layers)]
        for r, n in zip(step.requests, step.new_tokens):
            r.history = [
                (torch.cat([k, held[l][0][offset : offset + n]]), torch.cat([v, held[l][1][offset : offset + n]]))
                for l, (k, v) in enumerate(r.history)
            ]
            r.seq_len += n
            offset += n

    def run_eager(
        self, step: Step, backend: Optional[AttentionBackend] = None, *, save_kv_cache: bool = True
    ) -> torch.Tensor:
        """Run ``step`` eagerly: one metadata call, then every layer. ``backend`` defaults to
        the world's backend (``self.reference_backend`` sets up a prefix identically).
        ``save_kv_cache=False`` is passed to every layer (the caller stored the KV itself,
        e.g. with ``store_kv``)."""
        backend = backend if backend is not None else self.backend
        backend.init_forward_metadata(step.batch)
        if backend is self.backend and save_kv_cache:
            return self.step_fn(step.batch, step.inputs)
        return layer_step(backend, self.spec.num_layers, save_kv_cache=save_kv_cache, sinks=self.sinks)(
            step.batch, step.inputs
        )

    def store_kv(self, step: Step) -> None:
        """Write the step's k/v into the pool without any backend: full layers at
        ``out_cache_loc``, SWA layers at its translation (what an engine does before calling
        ``forward(..., save_kv_cache=False)``; also sets up long prompts cheaply). An FP8 pool
        quantises them by the rule (``SWAKVPool.set_kv_buffer``)."""
        loc = step.batch.out_cache_loc
        swa_loc = self.pool.translate_loc_from_full_to_swa(loc) if self.pool.swa_layer_ids else None
        for layer in range(self.spec.num_layers):
            k, v = step.inputs["k"][:, layer], step.inputs["v"][:, layer]
            if self.pool.is_swa_layer(layer):
                self.pool.set_kv_buffer(layer, loc, k, v, swa_loc=swa_loc)
            else:
                self.pool.set_kv_buffer(layer, loc, k, v)

    def advance(self, step: Step) -> None:
        """After a step ran: record its tokens (``commit``) and evict what left the window."""
        self.commit(step)
        for req in step.requests:
            self.evict(req)

    def prefill(self, lengths: Sequence[int], *, backend: Optional[AttentionBackend] = None) -> List[Request]:
        """New requests with prompts of ``lengths`` tokens, run as one EXTEND step (by
        ``backend``, default the world's), committed and evicted."""
        reqs = [self.new_request() for _ in lengths]
        step = self.plan(ForwardMode.EXTEND, reqs, list(lengths))
        self.run_eager(step, backend)
        self.advance(step)
        return reqs

    # ------------------------------------------------------------------ KV instruments
    def snapshot_kv(self) -> KVSnapshot:
        """Clones of every layer's ``(k, v)`` buffers (in the pool's dtype, FP8 included)."""
        return [(k.clone(), v.clone()) for k, v in (self.pool.get_kv_buffer(l) for l in range(self.spec.num_layers))]

    def restore_kv(self, snapshot: KVSnapshot) -> None:
        """Write a ``snapshot_kv()`` back into the KV buffers (in place, bit for bit)."""
        for layer, (k, v) in enumerate(snapshot):
            kb, vb = self.pool.get_kv_buffer(layer)
            kv_bits(kb).copy_(kv_bits(k))
            kv_bits(vb).copy_(kv_bits(v))

    def live_full_slots(self) -> torch.Tensor:
        """Host int64: full slots holding a committed token of a live request."""
        parts = [self.rows.req_to_token[r.row, : r.seq_len].to("cpu", torch.int64) for r in self.requests]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)

    def live_swa_slots(self) -> torch.Tensor:
        """Host int64: SWA slots currently mapped from some full slot (allocated, not evicted)."""
        mapping = self.pool.full_to_swa_index_mapping[:-1].to("cpu", torch.int64)
        return torch.unique(mapping[mapping > 0])

    def free_swa_slots(self) -> torch.Tensor:
        """Host int64: SWA slots no full slot maps to (never page 0, the padding sink)."""
        ps = self.spec.page_size
        used = torch.zeros(self.spec.size_swa + ps, dtype=torch.bool)
        used[:ps] = True
        used[self.live_swa_slots()] = True
        return torch.nonzero(~used).flatten()

    def graph_runner(
        self,
        *,
        max_bs: int,
        num_draft_tokens: Optional[int] = None,
        bucket_sizes=None,
        modes=None,
        capture: bool = True,
        extend_tokens=None,
    ) -> GraphRunner:
        """A ``GraphRunner`` over this world's backend (its constructor calls
        ``init_cuda_graph_state``), captured unless ``capture=False``; ``extend_tokens``: its
        EXTEND token-count buckets (None: EXTEND steps run eagerly)."""
        runner = GraphRunner(
            self.backend,
            self.step_fn,
            max_bs=max_bs,
            inputs=self.input_shapes(),
            num_draft_tokens=num_draft_tokens,
            bucket_sizes=bucket_sizes,
            modes=modes,
            extend_tokens=extend_tokens,
        )
        if capture:
            runner.capture()
        return runner
