"""What a whole-step benchmark measures (``step_case.run_step_benchmark``): the model and
requests (``StepShape``), the implementations timed (``StepVariant``), and the optional
comparisons around them: two variants (``StepRatio``), another implementation on the same
world (``StepPeer``, ``PeerUnavailable``), the host time of the replay preparation
(``PrepCheck``). A variant or a peer may run over another KV cache dtype than the model's
(``kv_cache_dtype``: an FP8 cache); each cache dtype gets its own world, holding the same
keys (``world.py``). Plain data: nothing here runs a step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch

from ..batch import ForwardMode
from .context import Ctx
from .floors import step_bytes
from .world import HybridWorld

__all__ = ["PeerUnavailable", "PrepCheck", "StepPeer", "StepRatio", "StepShape", "StepVariant"]


@dataclass(frozen=True)
class StepShape:
    """The model and requests of a step benchmark (SWA layers: ``layer % 4 != 3``)."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    context: int
    window: int
    num_draft: int
    dtype: torch.dtype

    @property
    def swa_layers(self) -> int:
        return sum(1 for layer in range(self.num_layers) if layer % 4 != 3)

    def q_len(self, mode: ForwardMode) -> int:
        return 1 if mode is ForwardMode.DECODE else self.num_draft

    def step_bytes(self, mode: ForwardMode, bs: int, kv_cache_dtype: Optional[torch.dtype] = None) -> int:
        """``floors.step_bytes`` of one step of ``mode`` (the world's lengths, ``world.py``) over
        a cache of ``kv_cache_dtype`` (None: the model's ``dtype``)."""
        q = self.q_len(mode)
        return step_bytes(
            num_layers=self.num_layers,
            swa_layers=self.swa_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
            bs=bs,
            q_len=q,
            seq_len=self.context - self.num_draft + q,
            window=self.window,
            kv_cache_dtype=kv_cache_dtype,
        )

    def describe(self) -> str:
        swa = self.swa_layers
        return (
            f"{self.num_layers} layers ({swa} SWA), {self.num_heads} q / {self.num_kv_heads} KV heads, "
            f"D={self.head_dim}, {str(self.dtype).replace('torch.', '')}, context {self.context}, "
            f"window {self.window}"
        )


@dataclass(frozen=True)
class StepVariant:
    """One implementation measured: ``make(pool, req_to_token_pool, num_heads, sliding_window)``
    returns its backend; ``graph``: through ``GraphRunner`` (else eager steps);
    ``with_cpu``: the batch carries ``seq_lens_cpu`` (backends that declare
    ``needs_cpu_seq_lens``); ``kv_cache_dtype``: the dtype its pool stores (None: the model's;
    an FP8 dtype: the world's FP8 twin, ``world.bench_kv_scales``)."""

    make: Callable[..., object]
    graph: bool = True
    with_cpu: bool = False
    #: run only at these batch sizes (None: every size of the benchmark)
    sizes: Optional[Tuple[int, ...]] = None
    #: compared with the baseline (a speedup row); False for variants that only feed a StepRatio
    vs_baseline: bool = True
    #: its time rows carry the step's floor and % of floor (graph variants)
    floor: bool = False
    kv_cache_dtype: Optional[torch.dtype] = None
    #: at every DECODE size, one eager step's first SWA and full layer against float32
    #: attention over the (dequantised) cache: a row held to ``step_check.CHECK_TOLERANCE``
    check_attention: bool = False


@dataclass(frozen=True)
class StepRatio:
    """``slow`` against ``fast`` (two variants) at every case where both ran: a row
    ``speedup (slow / fast)`` held to ``target`` at the batch sizes ``held_at`` (None: at
    every size; elsewhere, and with no target, reported), carrying the largest difference of
    the two step outputs; with ``identical`` a row saying whether every layer's output of one
    eager step is bit-identical."""

    slow: str
    fast: str
    target: Optional[float] = None
    identical: bool = False
    held_at: Optional[Tuple[int, ...]] = None

    def target_at(self, bs: int) -> Optional[float]:
        """The speedup held at ``bs`` (None: reported only)."""
        return self.target if self.held_at is None or bs in self.held_at else None


class PeerUnavailable(RuntimeError):
    """A peer cannot run here (not installed, unsupported device): the message says why."""


@dataclass(frozen=True)
class StepPeer:
    """Another implementation timed on the same world. ``measure(ctx, world, mode, bs)``
    returns ``(microseconds per step, detail)`` or ``(us, detail, fields)`` (``fields``: more
    JSON of its time row, e.g. the configuration it ran), appends any check rows of its own to
    ``ctx.rows``, and raises ``PeerUnavailable`` when it cannot run here (asked once per run).
    ``against``: the variant it is compared with (row ``speedup (name / against)``);
    ``target(mode, bs)``: the speedup held (None: reported); ``what``: what the peer's time
    covers (e.g. ``attention only``); ``kv_cache_dtype``: the world it runs on (None: the
    model's dtype, else that cache dtype's world, as ``StepVariant``)."""

    name: str
    measure: Callable[[Ctx, HybridWorld, ForwardMode, int], tuple]
    against: str
    modes: Tuple[ForwardMode, ...] = (ForwardMode.DECODE,)
    target: Callable[[ForwardMode, int], Optional[float]] = lambda mode, bs: None
    what: str = ""
    kv_cache_dtype: Optional[torch.dtype] = None


@dataclass(frozen=True)
class PrepCheck:
    """Host time of ``variant``'s replay preparation through the graph runner at ``bs`` in
    ``mode`` (``replay_prep_us``), held to ``target_us``."""

    variant: str
    bs: int
    target_us: float
    mode: ForwardMode = ForwardMode.DECODE
    iters: int = 2000
