"""A complete engine loop over attnplug, eagerly and through ``GraphRunner``.

Three requests are prefilled (EXTEND; one prompt in two chunks), decoded together for many
steps (DECODE) with sliding-window eviction between steps, verified once (TARGET_VERIFY) with
some drafts rejected and rolled back, then finished and freed. At the end every slot and
request row is back in the pools and the allocator's invariants hold.

    python examples/engine_loop.py                                  # reference backend, CPU
    python examples/engine_loop.py --backend cuda --device cuda     # any backend and device
    python examples/engine_loop.py --path graphs                    # only the GraphRunner path

``--path both`` (the default) runs the loop eagerly and then through ``GraphRunner`` and checks
that both produce the same logits at every step.

The model is tiny and random (embedding, per-layer q/k/v/o projections, attention through the
backend, a residual stream) so the loop runs in seconds anywhere. It reads its input tokens from
a fixed random script instead of sampling them, and the verify step accepts a fixed number of
drafts per request, so the eager and the graph run see identical inputs and can be compared.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from attnplug import (
    ForwardBatch,
    ForwardMode,
    GraphRunner,
    ReqToTokenPool,
    SWAKVPool,
    SWATokenAllocator,
    decide_needs_cpu_seq_lens,
    get_backend,
)

# The model and the cache.
NUM_LAYERS, SWA_LAYERS = 4, (0, 1, 2)  # layers 0-2 use the sliding window, layer 3 is full
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 64
WINDOW = 8  # sliding_window W: a query at position p sees keys p-W < j <= p
VOCAB, MAX_CONTEXT = 97, 64
POOL_SIZE, SWA_POOL_SIZE, MAX_REQS = 256, 64, 8  # full slots, SWA slots, request rows (row 0 reserved)
NUM_DRAFT_TOKENS = 3

# The schedule.
PROMPTS = {"A": (11,), "B": (6,), "C": (12, 9)}  # C's 21-token prompt is prefilled in two chunks
DECODE_STEPS = (8, 6)  # decode steps before the verify step, and after it (B has finished)
ACCEPTED = {"A": 3, "B": 1, "C": 0}  # drafts the verify step accepts, per request


@dataclass
class Request:
    """What the engine tracks per request (host)."""

    name: str
    row: int  # the request's row in req_to_token
    script: List[int]  # the tokens fed at positions 0, 1, 2, ...
    seq_len: int = 0  # positions stored in the KV cache
    slots: List[int] = field(default_factory=list)  # full slot of each stored position

    @property
    def last_loc(self) -> int:
        """The full slot of the last stored position; -1 before the first token."""
        return self.slots[-1] if self.slots else -1


class TinyModel:
    """``NUM_LAYERS`` attention layers with random projections; hidden size ``H * D``.

    ``step(batch, inputs)`` is the whole forward of one step: it reads ``inputs["hidden"]``
    (``[T, H * D]``, the token embeddings) and ``batch.positions`` (``[T]``), calls
    ``backend.forward`` once per layer and returns the logits, ``[T, VOCAB]``. It only uses
    device operations on its arguments, so ``GraphRunner`` can capture it.
    """

    def __init__(self, backend, dtype: torch.dtype, device: torch.device, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        hidden, kv = NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM

        def weight(*shape: int, scale: float) -> torch.Tensor:
            return (torch.randn(*shape, generator=g) * scale).to(device, dtype)

        self.backend = backend
        self.embed = weight(VOCAB, hidden, scale=1.0)
        self.pos = weight(MAX_CONTEXT, hidden, scale=0.1)
        self.wq = [weight(hidden, hidden, scale=hidden**-0.5) for _ in range(NUM_LAYERS)]
        self.wk = [weight(hidden, kv, scale=hidden**-0.5) for _ in range(NUM_LAYERS)]
        self.wv = [weight(hidden, kv, scale=hidden**-0.5) for _ in range(NUM_LAYERS)]
        self.wo = [weight(hidden, hidden, scale=hidden**-0.5) for _ in range(NUM_LAYERS)]

    def step(self, batch: ForwardBatch, inputs: Dict[str, torch.Tensor]) -> torch.Tensor:
        h = inputs["hidden"] + self.pos[batch.positions]
        T = h.shape[0]
        for layer in range(NUM_LAYERS):
            x = _rms_norm(h)
            q = (x @ self.wq[layer]).view(T, NUM_HEADS, HEAD_DIM)
            k = (x @ self.wk[layer]).view(T, NUM_KV_HEADS, HEAD_DIM)
            v = (x @ self.wv[layer]).view(T, NUM_KV_HEADS, HEAD_DIM)
            o = self.backend.forward(q, k, v, layer, batch)  # stores k/v at the step's slots, attends
            h = h + o.reshape(T, -1) @ self.wo[layer]
        return (_rms_norm(h) @ self.embed.T) * h.shape[1] ** -0.5


def _rms_norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)


class Engine:
    """The scheduler side: pools, allocation, batches, eviction, rollback, freeing.

    ``graphs=False``: each step is ``backend.init_forward_metadata(batch)`` then
    ``model.step``. ``graphs=True``: each step is ``runner.run(batch, inputs)``.
    """

    def __init__(
        self,
        backend_name: str,
        device: str,
        *,
        graphs: bool,
        page_size: int,
        dtype: Optional[torch.dtype],
        seed: int = 0,
        log=print,
    ) -> None:
        backend_cls = get_backend(backend_name)
        self.device = torch.device(device)
        dtype = dtype or _default_dtype(backend_cls, self.device, page_size)
        self.pool = SWAKVPool(
            size=POOL_SIZE,
            size_swa=SWA_POOL_SIZE,
            num_layers=NUM_LAYERS,
            swa_layer_ids=SWA_LAYERS,
            num_kv_heads=NUM_KV_HEADS,
            head_dim=HEAD_DIM,
            dtype=dtype,
            device=self.device,
            page_size=page_size,
        )
        self.alloc = SWATokenAllocator(self.pool)
        self.rows = ReqToTokenPool(MAX_REQS, MAX_CONTEXT, self.pool.device)
        self.backend = backend_cls(self.pool, self.rows, num_heads=NUM_HEADS, sliding_window=WINDOW)
        # OR over every backend the engine runs (target, draft, ...): when False, pass seq_lens_cpu=None.
        self.needs_cpu_seq_lens = decide_needs_cpu_seq_lens([self.backend])
        self.model = TinyModel(self.backend, dtype, self.pool.device, seed)
        self.tokens = torch.Generator().manual_seed(seed + 1)
        self.log = log
        self.trace: List[Tuple[str, torch.Tensor]] = []  # (step label, logits on the host, float64)

        self.runner: Optional[GraphRunner] = None
        if graphs:
            # One static input buffer per per-token model input: name -> (per-token shape, dtype).
            # The constructor calls backend.init_cuda_graph_state(max_bs, max_num_tokens).
            # Buckets 1, 2, 4: a step of 3 requests replays the graph of 4 with one padded request.
            # A backend at GraphSupport.ALWAYS captures the prefill chunks too, one graph per
            # token-count bucket (16 and 32: the first prefill's 29 tokens pad to 32, C's second
            # chunk of 9 to 16); elsewhere they run eagerly through the same run() call.
            extend = ForwardMode.EXTEND in self.backend.capabilities().graphs.modes
            self.runner = GraphRunner(
                self.backend,
                self.model.step,
                max_bs=4,
                inputs={"hidden": ((NUM_HEADS * HEAD_DIM,), dtype)},
                num_draft_tokens=NUM_DRAFT_TOKENS,
                modes=[ForwardMode.DECODE, ForwardMode.TARGET_VERIFY] + ([ForwardMode.EXTEND] if extend else []),
                extend_tokens=[16, 32] if extend else None,
            )  # the modes run here
            # Capture every (mode, bucket) now, before serving. Without this call a mode's
            # first step would capture that mode's buckets.
            failures = self.runner.capture()
            status = self.runner.status()
            kind = "device graphs" if status["device_graphs"] else "eager stand-in"
            self.log(f"captured {', '.join(status['captured'])} ({kind}); failed: {failures or 'none'}")

    # ------------------------------------------------------------------ requests
    def add_request(self, name: str, length: int) -> Request:
        row = self.rows.alloc()
        script = torch.randint(0, VOCAB, (length,), generator=self.tokens).tolist()
        return Request(name, row, script)

    def finish(self, req: Request) -> None:
        """Free the request's full slots (their SWA slots too, where still live), then its row."""
        self.alloc.free(torch.tensor(req.slots, dtype=torch.int64))
        self.rows.free(req.row)
        self.log(f"{'finish ' + req.name:<24} freed {len(req.slots)} slots and row {req.row}")

    # ------------------------------------------------------------------ one step
    def _allocate(self, mode: ForwardMode, reqs: Sequence[Request], new: Sequence[int]) -> torch.Tensor:
        """Slots for each request's next ``new[i]`` positions, written into its row; returns
        ``out_cache_loc`` (``[sum(new)]`` int64, device). All-or-nothing: ``OutOfKVSlots``
        leaves everything unchanged (a real scheduler would then retract or wait)."""
        prefix = [r.seq_len for r in reqs]
        seq = [p + n for p, n in zip(prefix, new)]
        last = [r.last_loc for r in reqs]
        if mode is ForwardMode.DECODE:
            loc = self.alloc.alloc_decode(seq, last)
        else:  # continues each request's last partially used page, then takes new pages
            loc = self.alloc.alloc_extend(prefix, seq, last)
        host = loc.tolist()  # the scheduler's host copy (for last_loc, rollback and free)
        offset = 0
        for r, n in zip(reqs, new):
            self.rows.req_to_token[r.row, r.seq_len : r.seq_len + n] = loc[offset : offset + n].to(torch.int32)
            r.slots += host[offset : offset + n]
            offset += n
        return loc

    def _batch(self, mode: ForwardMode, reqs: Sequence[Request], new: Sequence[int], loc: torch.Tensor) -> ForwardBatch:
        dev = self.pool.device
        seq = [r.seq_len + n for r, n in zip(reqs, new)]  # INCLUDING this step's tokens
        positions = [p for r, n in zip(reqs, new) for p in range(r.seq_len, r.seq_len + n)]
        extend = mode is ForwardMode.EXTEND
        return ForwardBatch(
            forward_mode=mode,
            batch_size=len(reqs),
            req_pool_indices=torch.tensor([r.row for r in reqs], dtype=torch.int64, device=dev),
            seq_lens=torch.tensor(seq, dtype=torch.int64, device=dev),
            out_cache_loc=loc,
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            seq_lens_cpu=seq if self.needs_cpu_seq_lens else None,
            extend_seq_lens=torch.tensor(new, dtype=torch.int64, device=dev) if extend else None,
            extend_seq_lens_cpu=list(new) if extend else None,
            num_draft_tokens=NUM_DRAFT_TOKENS if mode.is_speculative else None,
        )

    def _forward(self, batch: ForwardBatch, inputs: Dict[str, torch.Tensor]) -> Tuple[torch.Tensor, str]:
        """Run the step; returns the logits ``[T, VOCAB]`` and how they were computed."""
        if self.runner is None:
            self.backend.init_forward_metadata(batch)  # the step's one translation, every table
            return self.model.step(batch, inputs), "eager"
        out = self.runner.run(batch, inputs)  # replay padded to a bucket, or eager
        bucket = self.runner.bucket_for(batch)
        unit = "tokens" if batch.forward_mode is ForwardMode.EXTEND else "bs"
        return out, f"graph {unit}={bucket}" if bucket is not None else "eager (runner)"

    def step(self, label: str, mode: ForwardMode, reqs: Sequence[Request], new: Sequence[int]) -> torch.Tensor:
        """Allocate, build the batch and inputs, run; returns the logits (host, float64).
        The requests' ``seq_len`` is NOT advanced here: the caller decides what is kept."""
        loc = self._allocate(mode, reqs, new)
        batch = self._batch(mode, reqs, new, loc)
        tokens = [r.script[p] for r, n in zip(reqs, new) for p in range(r.seq_len, r.seq_len + n)]
        inputs = {"hidden": self.model.embed[torch.tensor(tokens, device=self.pool.device)]}
        out, path = self._forward(batch, inputs)
        # After a replay `out` is a view of the graph's static output, overwritten by the next
        # run(): use it (sample, copy) before then.
        logits = out.to("cpu", torch.float64)
        self.trace.append((label, logits))
        self.log(
            f"{label:<24} {mode.name:<13} bs={batch.batch_size} T={batch.num_tokens:<3} {path:<15} "
            f"free full {self.alloc.full_available_size():>3}/{POOL_SIZE} "
            f"swa {self.alloc.swa_available_size():>2}/{SWA_POOL_SIZE}"
        )
        return logits

    def keep(self, reqs: Sequence[Request], new: Sequence[int]) -> None:
        """The step's tokens are kept: advance each request and free the SWA slots no future
        query can reach (between steps, never inside one)."""
        for r, n in zip(reqs, new):
            r.seq_len += n
            self.alloc.evict_out_of_window(self.rows, r.row, r.seq_len, WINDOW)

    def reject_drafts(self, reqs: Sequence[Request], accepted: Sequence[int]) -> None:
        """After TARGET_VERIFY: keep each request's first ``accepted[i]`` drafts, give the
        rejected drafts' slots back with ``rollback`` and clear their positions in the row."""
        rejected: List[int] = []
        for r, a in zip(reqs, accepted):
            drop = NUM_DRAFT_TOKENS - a
            if drop:
                rejected += r.slots[-drop:]
                del r.slots[-drop:]
                start = r.seq_len + a
                self.rows.req_to_token[r.row, start : start + drop] = 0  # the row no longer holds them
        if rejected:
            self.alloc.rollback(torch.tensor(rejected, dtype=torch.int64))
        self.keep(reqs, accepted)


def run_loop(
    backend: str = "reference",
    device: str = "cpu",
    *,
    graphs: bool = False,
    page_size: int = 4,
    dtype: Optional[torch.dtype] = None,
    seed: int = 0,
    log=print,
) -> List[Tuple[str, torch.Tensor]]:
    """Run the whole schedule; returns the trace: ``(label, logits [T, VOCAB] float64)`` per step."""
    eng = Engine(backend, device, graphs=graphs, page_size=page_size, dtype=dtype, seed=seed, log=log)
    reqs = [
        eng.add_request(name, sum(chunks) + sum(DECODE_STEPS) + NUM_DRAFT_TOKENS) for name, chunks in PROMPTS.items()
    ]
    a, b, c = reqs

    # Prefill: every prompt's first chunk in one EXTEND step, then C's second chunk.
    first = [PROMPTS[r.name][0] for r in reqs]
    eng.step("prefill", ForwardMode.EXTEND, reqs, first)
    eng.keep(reqs, first)
    eng.step("prefill C, chunk 2", ForwardMode.EXTEND, [c], [PROMPTS["C"][1]])
    eng.keep([c], [PROMPTS["C"][1]])

    # Decode: one token per request per step; eviction between steps keeps the SWA pool small.
    for i in range(DECODE_STEPS[0]):
        eng.step(f"decode {i + 1}", ForwardMode.DECODE, reqs, [1] * 3)
        eng.keep(reqs, [1] * 3)

    # Speculative verify: NUM_DRAFT_TOKENS drafts per request, some rejected and rolled back.
    eng.step("verify", ForwardMode.TARGET_VERIFY, reqs, [NUM_DRAFT_TOKENS] * 3)
    eng.reject_drafts(reqs, [ACCEPTED[r.name] for r in reqs])
    eng.alloc.check_invariants()  # a debugging check (copies the mapping to the host)
    eng.log(
        f"{'accept':<24} {', '.join(f'{r.name}: {ACCEPTED[r.name]}/{NUM_DRAFT_TOKENS}' for r in reqs)} "
        f"-> seq_lens {[r.seq_len for r in reqs]}"
    )

    # B finishes; A and C decode on.
    eng.finish(b)
    for i in range(DECODE_STEPS[1]):
        eng.step(f"decode {DECODE_STEPS[0] + i + 1}", ForwardMode.DECODE, [a, c], [1, 1])
        eng.keep([a, c], [1, 1])
    eng.finish(a)
    eng.finish(c)

    # Everything is back: every slot of both pools, every request row, consistent bookkeeping.
    assert eng.alloc.full_available_size() == POOL_SIZE, eng.alloc.full_available_size()
    assert eng.alloc.swa_available_size() == SWA_POOL_SIZE, eng.alloc.swa_available_size()
    assert eng.rows.available_size() == MAX_REQS - 1, eng.rows.available_size()
    eng.alloc.check_invariants()
    if eng.runner is not None:
        eng.log(f"runner: eager steps {eng.runner.status()['eager_runs']}")
    eng.log(f"done: pools full ({POOL_SIZE} full, {SWA_POOL_SIZE} SWA slots free), {MAX_REQS - 1} rows free")
    return eng.trace


def compare(eager, graphs, rtol: float, atol: float) -> float:
    """Largest absolute difference between two traces; raises if they differ beyond tolerance."""
    worst = 0.0
    for (label, x), (label_g, y) in zip(eager, graphs, strict=True):
        assert label == label_g and x.shape == y.shape, (label, label_g, x.shape, y.shape)
        if not torch.allclose(y, x, rtol=rtol, atol=atol):
            raise AssertionError(f"{label}: graph path differs from the eager path by {(y - x).abs().max():.3e}")
        worst = max(worst, float((y - x).abs().max()))
    return worst


def _default_dtype(backend_cls, device: torch.device, page_size: int) -> torch.dtype:
    """float32 when the backend serves it, else its first KV dtype (asked of a tiny instance)."""
    pool = SWAKVPool(page_size, page_size, 1, [0], NUM_KV_HEADS, HEAD_DIM, torch.float16, device, page_size=page_size)
    caps = backend_cls(
        pool, ReqToTokenPool(2, 1, pool.device), num_heads=NUM_HEADS, sliding_window=WINDOW
    ).capabilities()
    return torch.float32 if torch.float32 in caps.dtypes else caps.dtypes[0]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="reference", help="registered backend name (default: reference)")
    parser.add_argument("--device", default="cpu", help="torch device of the pools (default: cpu)")
    parser.add_argument("--path", choices=("eager", "graphs", "both"), default="both")
    parser.add_argument("--page-size", type=int, default=4)
    parser.add_argument(
        "--dtype",
        choices=("float32", "float16", "bfloat16"),
        default=None,
        help="KV and model dtype (default: float32 when the backend serves it)",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    dtype = (
        getattr(torch, args.dtype)
        if args.dtype
        else _default_dtype(get_backend(args.backend), torch.device(args.device), args.page_size)
    )
    traces = {}
    for path in ("eager", "graphs") if args.path == "both" else (args.path,):
        print(f"--- {path} ---")
        traces[path] = run_loop(
            args.backend, args.device, graphs=path == "graphs", page_size=args.page_size, dtype=dtype, seed=args.seed
        )
    if len(traces) == 2:
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        worst = compare(traces["eager"], traces["graphs"], rtol=tol, atol=tol)
        print(f"graph path equals eager path: {len(traces['eager'])} steps, max |diff| {worst:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
