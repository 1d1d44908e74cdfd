"""Hardware floors of a whole step: the least time the device allows for it.

A step is held against two floors, and its floor is the larger of them:

* the **launch floor**: replay time of a graph of as many EMPTY kernels as the step
  launches, launched the same way (with Programmatic Dependent Launch where the step uses it).
  What an empty kernel is, how a step's launches are counted and how the graph is replayed
  are device matters: a plugin supplies them as a ``LaunchFloor``;
* the **bandwidth floor**: the bytes the step must move (``step_bytes``) at the device's
  copy bandwidth measured in the same run (``timing.copy_bandwidth``, bytes read + written).
  An FP8 KV cache moves one byte an element of K and V (``kv_cache_dtype``).

``StepFloor`` holds both and says which one binds. ``attention_flops`` is the arithmetic of
attention (what a TFLOP/s figure divides). Nothing here touches a device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, Sequence, Tuple

import torch

__all__ = ["LaunchFloor", "StepFloor", "step_bytes", "keys_reached", "keys_attended", "attention_flops"]


class LaunchFloor(Protocol):
    """What a device plugin supplies for the launch floor."""

    def count(self, run_step: Callable[[], Any]) -> Tuple[Optional[int], str]:
        """``(launches, how)``: the device operations (kernels, copies, fills) one ``run_step()``
        runs, and how they were counted; ``(None, why)`` when they cannot be counted."""
        ...

    def empty_graph_us(self, launches: int, pdl: bool) -> float:
        """Microseconds per replay of a graph of ``launches`` empty kernels (``pdl``: launched
        with Programmatic Dependent Launch, each waiting for its predecessor), timed as the
        step is timed (back-to-back replays, then one synchronisation)."""
        ...


def keys_reached(seq_len: int, q_len: int, window: Optional[int]) -> int:
    """Keys one request's attention reads in one layer: every key of the context for a full
    layer (``window=None``), else the window of each new token, together
    ``min(seq_len, window + q_len - 1)``."""
    if window is None:
        return seq_len
    return min(seq_len, window + q_len - 1)


def keys_attended(seq_len: int, q_len: int, window: Optional[int] = None) -> int:
    """Keys one request's queries attend together, summed over its ``q_len`` new tokens (at
    positions ``seq_len - q_len .. seq_len - 1``, causal): the token at position ``p`` attends
    ``p + 1`` keys on a full layer (``window=None``), ``min(p + 1, window)`` on an SWA layer.
    A prefill of ``T`` tokens without a prefix attends ``T * (T + 1) / 2`` keys."""
    if q_len < 0 or seq_len < q_len or (window is not None and window < 1):
        raise ValueError(
            f"keys_attended needs 0 <= q_len <= seq_len and window >= 1 (or None); got seq_len={seq_len}, "
            f"q_len={q_len}, window={window}"
        )
    lo, hi = seq_len - q_len + 1, seq_len  # keys of the first and the last new token, unwindowed
    if window is None or hi <= window:
        return (lo + hi) * q_len // 2
    top = min(hi, window)
    below = (lo + top) * (top - lo + 1) // 2 if top >= lo else 0  # tokens that see fewer than W keys
    return below + window * (hi - max(lo - 1, window))  # the rest see W keys each


def attention_flops(
    num_heads: int, head_dim: int, seq_lens: Sequence[int], q_lens: Sequence[int], window: Optional[int] = None
) -> int:
    """Floating-point operations of one layer's attention over a batch: ``2 * 2 * H * D *
    sum over requests of keys_attended(seq_len, q_len, window)`` (the products q.k and p.v, a
    multiply and an add for each of ``D`` elements, for every head and every (query, key)
    pair the causal mask keeps). A causal prefill of ``T`` tokens: ``2 * H * D * T * (T + 1)``.
    The softmax is not counted (the convention of the published TFLOP/s figures)."""
    if len(seq_lens) != len(q_lens):
        raise ValueError(f"attention_flops: {len(seq_lens)} seq_lens but {len(q_lens)} q_lens")
    keys = sum(keys_attended(int(s), int(q), window) for s, q in zip(seq_lens, q_lens))
    return 2 * 2 * num_heads * head_dim * keys


def step_bytes(
    *,
    num_layers: int,
    swa_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    bs: int,
    q_len: int,
    seq_len: int,
    window: int,
    kv_cache_dtype: Optional[torch.dtype] = None,
) -> int:
    """Bytes one step of ``bs`` requests (``q_len`` new tokens each, ``seq_len`` keys after the
    step) must read or write over all layers: the K and V of every key each layer reaches
    (``keys_reached``; the new tokens' keys included), q read and the output written, the new
    K/V read from the step's inputs and written into the cache. q, the output and the new K/V
    inputs are of the model's ``dtype``; the cache holds ``kv_cache_dtype`` (None: ``dtype``;
    an FP8 cache: one byte an element; its per-head scales, 2 * Hkv float32 a layer, are not
    counted)."""
    if bs < 0 or q_len < 1 or seq_len < q_len or not 0 <= swa_layers <= num_layers:
        raise ValueError(
            f"step_bytes needs bs >= 0, 1 <= q_len <= seq_len and 0 <= swa_layers <= num_layers; got bs={bs}, "
            f"q_len={q_len}, seq_len={seq_len}, swa_layers={swa_layers}, num_layers={num_layers}"
        )
    es = torch.empty((), dtype=dtype).element_size()
    kv_es = es if kv_cache_dtype is None else torch.empty((), dtype=kv_cache_dtype).element_size()
    kv_row = 2 * num_kv_heads * head_dim * es  # one key's K and V as the step's inputs
    cache_row = 2 * num_kv_heads * head_dim * kv_es  # one key's K and V in the cache
    q_row = num_heads * head_dim * es
    T = bs * q_len
    keys = swa_layers * keys_reached(seq_len, q_len, window) + (num_layers - swa_layers) * seq_len
    per_layer_tokens = T * (2 * q_row + kv_row + cache_row)  # q in, out, new k/v in, new k/v into the cache
    return bs * keys * cache_row + num_layers * per_layer_tokens


@dataclass(frozen=True)
class StepFloor:
    """Both floors of one step. ``launches``/``launch_us``: None when the launches could not
    be counted (``launch_note`` says why); ``nbytes`` at ``copy_tb_s`` gives the bandwidth floor."""

    nbytes: int
    copy_tb_s: float
    launches: Optional[int] = None
    launch_us: Optional[float] = None
    launch_note: str = ""

    @property
    def bandwidth_us(self) -> float:
        return self.nbytes / (self.copy_tb_s * 1e12) * 1e6

    @property
    def floor_us(self) -> float:
        return max(self.bandwidth_us, self.launch_us or 0.0)

    @property
    def bound(self) -> str:
        """``"launch"`` or ``"bandwidth"``: the floor that binds."""
        return "launch" if (self.launch_us or 0.0) > self.bandwidth_us else "bandwidth"

    def describe(self) -> str:
        launch = (
            f"{self.launches} launches {self.launch_us:.1f} us"
            if self.launch_us is not None
            else f"launches not counted ({self.launch_note})"
        )
        return (
            f"floor {self.floor_us:.1f} us ({self.bound}): {launch}; "
            f"{self.nbytes / 1e6:.1f} MB at {self.copy_tb_s:.2f} TB/s {self.bandwidth_us:.1f} us"
        )

    def fields(self) -> dict:
        """The numbers a result row carries (JSON)."""
        return {
            "launches": self.launches,
            "launch_floor_us": self.launch_us,
            "bandwidth_floor_us": self.bandwidth_us,
            "floor_bytes": self.nbytes,
            "copy_tb_s": self.copy_tb_s,
            "floor_bound": self.bound,
        }
