"""Graph runner: one captured graph per (mode, batch-size bucket), replayed with padding.

The runner owns the static input buffers of a step (``req_pool_indices``, ``seq_lens``,
``out_cache_loc``, ``positions`` and the per-token model inputs), captures ``step(batch,
inputs)`` once per bucket through the backend's device graph (``backend.new_graph()``), and
at run time:

1. copies the real step into the static buffers and pads up to the bucket: padded requests
   get ``req_pool_indices = 0`` and ``seq_lens = backend.get_cuda_graph_seq_len_fill_value()``,
   padded tokens ``out_cache_loc = 0`` (slot 0, the sink) and zero inputs;
2. calls ``backend.init_forward_metadata_replay_cuda_graph`` on the padded static batch (the
   ONE translation of the step happens there, into ``cuda_graph_swa_out_cache_loc``);
3. replays the graph and returns the first ``T`` rows of the static output.

A step that no graph covers (mode not captured, more requests than the largest bucket)
runs eagerly: ``init_forward_metadata`` (which translates once) and ``step``.

Every replay-path operation is a device copy/fill: the runner never reads device values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Mapping, Optional, Sequence, Tuple

import torch

from ..backend import AttentionBackend, GraphSupport, decide_needs_cpu_seq_lens
from ..batch import ForwardBatch, ForwardMode
from .device_graph import DeviceGraph

__all__ = ["GraphRunner", "default_bucket_sizes", "StepFn"]

#: ``step(batch, inputs) -> Tensor[T, ...]``: runs every layer of one step.
StepFn = Callable[[ForwardBatch, Dict[str, torch.Tensor]], torch.Tensor]

_MODES_BY_SUPPORT = {
    GraphSupport.NEVER: (),
    GraphSupport.DECODE_ONLY: (ForwardMode.DECODE,),
    GraphSupport.UNIFORM: (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND),
    GraphSupport.ALWAYS: (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND),
}


def default_bucket_sizes(max_bs: int) -> Tuple[int, ...]:
    """1, 2, 4, 8, then every 8 up to 64, then every 16, ending at ``max_bs``."""
    sizes = [b for b in (1, 2, 4) if b < max_bs]
    b = 8
    while b < max_bs:
        sizes.append(b)
        b += 8 if b < 64 else 16
    sizes.append(max_bs)
    return tuple(sizes)


@dataclass
class _Captured:
    graph: DeviceGraph
    batch: ForwardBatch  # padded static batch (views of the runner's buffers)
    output: torch.Tensor  # static output the graph rewrites on replay


class GraphRunner:
    """Capture and replay steps of one backend (see module docstring).

    ``inputs`` maps each per-token model input to its per-token shape and dtype, e.g.
    ``{"q": ((L, H, D), torch.bfloat16)}``; the static buffer is ``[max_num_tokens, *shape]``.
    ``num_draft_tokens`` enables TARGET_VERIFY / DRAFT_EXTEND capture (q_len per request).
    """

    def __init__(
        self,
        backend: AttentionBackend,
        step: StepFn,
        *,
        max_bs: int,
        inputs: Mapping[str, Tuple[Sequence[int], torch.dtype]],
        num_draft_tokens: Optional[int] = None,
        bucket_sizes: Optional[Sequence[int]] = None,
        modes: Optional[Sequence[ForwardMode]] = None,
    ) -> None:
        if max_bs < 1:
            raise ValueError(f"max_bs must be >= 1, got {max_bs}")
        self.backend = backend
        self.step = step
        self.num_draft_tokens = num_draft_tokens
        self.bucket_sizes = tuple(sorted(set(bucket_sizes or default_bucket_sizes(max_bs))))
        if self.bucket_sizes[0] < 1 or self.bucket_sizes[-1] > max_bs:
            raise ValueError(f"bucket sizes must lie in 1..{max_bs}, got {self.bucket_sizes}")
        supported = _MODES_BY_SUPPORT[backend.capabilities().graphs]
        wanted = tuple(modes) if modes is not None else supported
        unsupported = [m.name for m in wanted if m not in supported]
        if unsupported:
            raise ValueError(f"backend {backend.name!r} cannot capture {unsupported} (graphs={backend.capabilities().graphs.name})")
        self.modes = tuple(m for m in wanted if m is ForwardMode.DECODE or num_draft_tokens)
        self.max_bs = max_bs
        q_max = max([1] + [num_draft_tokens or 1 for m in self.modes if m.is_speculative])
        self.max_num_tokens = max_bs * q_max
        self.fill_value = int(backend.get_cuda_graph_seq_len_fill_value())
        self.needs_cpu_seq_lens = decide_needs_cpu_seq_lens([backend])

        dev, n = backend.device, self.max_num_tokens
        backend.init_cuda_graph_state(max_bs, n)
        self.req_pool_indices = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.seq_lens = torch.full((max_bs,), self.fill_value, dtype=torch.int64, device=dev)
        self.out_cache_loc = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.inputs = {name: torch.zeros((n, *shape), dtype=dtype, device=dev) for name, (shape, dtype) in inputs.items()}
        self.graphs: Dict[Tuple[ForwardMode, int], _Captured] = {}

    # ------------------------------------------------------------------ capture
    def _q_len(self, mode: ForwardMode) -> int:
        return 1 if mode is ForwardMode.DECODE else int(self.num_draft_tokens)

    def _static_batch(self, mode: ForwardMode, bs: int) -> ForwardBatch:
        n = bs * self._q_len(mode)
        return ForwardBatch(
            forward_mode=mode,
            batch_size=bs,
            req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs],
            out_cache_loc=self.out_cache_loc[:n],
            positions=self.positions[:n],
            seq_lens_cpu=[self.fill_value] * bs if self.needs_cpu_seq_lens else None,
            num_draft_tokens=self.num_draft_tokens if mode.is_speculative else None,
            validate=False,  # padding views: padded requests may be shorter than q_len
        )

    def capture(self) -> None:
        """Capture every (mode, bucket) graph, largest bucket first. Buffers hold padding
        values during capture, so capture never touches a live KV slot (slot 0 only)."""
        for mode in self.modes:
            for bs in reversed(self.bucket_sizes):
                batch = self._static_batch(mode, bs)
                views = {name: buf[: batch.num_tokens] for name, buf in self.inputs.items()}
                self.backend.init_forward_metadata_capture_cuda_graph(batch)
                graph = self.backend.new_graph()
                output = graph.capture(lambda batch=batch, views=views: self.step(batch, views))
                self.graphs[(mode, bs)] = _Captured(graph, batch, output)

    # ------------------------------------------------------------------ run
    def bucket_for(self, batch: ForwardBatch) -> Optional[int]:
        """The smallest captured bucket that holds ``batch``, or None (eager)."""
        if batch.forward_mode not in self.modes:
            return None
        if batch.forward_mode.is_speculative and batch.num_draft_tokens != self.num_draft_tokens:
            return None
        for bs in self.bucket_sizes:
            if bs >= batch.batch_size and (batch.forward_mode, bs) in self.graphs:
                return bs
        return None

    def run(self, batch: ForwardBatch, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Run one step; returns ``[T, ...]`` (a view of the static output after a replay:
        valid until the next call)."""
        bucket = self.bucket_for(batch)
        if bucket is None:
            self.backend.init_forward_metadata(batch)
            return self.step(batch, dict(inputs))
        captured = self.graphs[(batch.forward_mode, bucket)]
        bs, n = batch.batch_size, batch.num_tokens
        self._copy_padded(self.req_pool_indices, batch.req_pool_indices, bs, bucket, 0)
        self._copy_padded(self.seq_lens, batch.seq_lens, bs, bucket, self.fill_value)
        nb = captured.batch.num_tokens
        self._copy_padded(self.out_cache_loc, batch.out_cache_loc, n, nb, 0)
        if batch.positions is not None:
            self._copy_padded(self.positions, batch.positions, n, nb, 0)
        for name, buf in self.inputs.items():
            self._copy_padded(buf, inputs[name], n, nb, 0)
        static = captured.batch
        if self.needs_cpu_seq_lens:
            static = _with_seq_lens_cpu(static, batch, bucket, self.fill_value)
        self.backend.init_forward_metadata_replay_cuda_graph(static)
        captured.graph.replay()
        return captured.output[:n]

    @staticmethod
    def _copy_padded(dst: torch.Tensor, src: torch.Tensor, n: int, padded: int, fill) -> None:
        dst[:n].copy_(src[:n])
        if padded > n:
            dst[n:padded].fill_(fill)


def _with_seq_lens_cpu(static: ForwardBatch, batch: ForwardBatch, bucket: int, fill: int) -> ForwardBatch:
    """The static batch with the host mirror of the padded ``seq_lens`` (only for backends
    that declared ``needs_cpu_seq_lens``; the engine then supplies ``seq_lens_cpu``)."""
    if batch.seq_lens_cpu is None:
        raise ValueError("the backend needs seq_lens_cpu but the batch has none")
    return ForwardBatch(
        forward_mode=static.forward_mode,
        batch_size=static.batch_size,
        req_pool_indices=static.req_pool_indices,
        seq_lens=static.seq_lens,
        out_cache_loc=static.out_cache_loc,
        positions=static.positions,
        seq_lens_cpu=list(batch.seq_lens_cpu) + [fill] * (bucket - batch.batch_size),
        extend_seq_lens=static.extend_seq_lens,
        num_draft_tokens=static.num_draft_tokens,
        validate=False,
    )
