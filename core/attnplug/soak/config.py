"""What one soak run simulates: sizes, rates and tolerances (host data only).

The defaults are small on purpose: a few heads, short contexts and small pools, so that the
float64 oracle stays cheap, pool pressure (``OutOfKVSlots``) happens often and slots are
reused many times. Every field has a command-line option (``attnplug soak --help``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Dict, Optional, Tuple

import torch

__all__ = ["SoakConfig", "DEFAULT_TOLERANCE", "DTYPES", "dtype_name"]

#: ``--dtype`` names
DTYPES: Dict[str, torch.dtype] = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}

#: largest allowed relative error of one token's output, ``||out - exact|| / ||exact||``, per KV dtype.
#: The oracle sees the same dtype-rounded q/k/v as the backend, so this only bounds the error
#: of the backend's arithmetic (softmax and the two products in reduced precision).
DEFAULT_TOLERANCE: Dict[torch.dtype, float] = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass
class SoakConfig:
    """One soak run. ``None`` fields are decided from the backend (see ``resolve``).

    Model shape: ``num_layers`` layers, of which every third (and the last) is a full layer and
    the others SWA layers with ``sliding_window``; ``num_heads`` query heads over
    ``num_kv_heads`` KV heads (GQA), ``head_dim`` (default: the smallest the backend supports).
    Requests: prompts of 1..``max_prompt`` tokens, prefilled in chunks of 1..``max_chunk``,
    then decoded / verified / draft-extended until ``max_context`` tokens at most.
    Memory: ``max_running`` request rows, pools of ``pool_size`` / ``swa_pool_size`` slots
    (default: just large enough for the largest single request, so pressure is constant).
    Graphs: ``buckets`` batch sizes captured for DECODE / TARGET_VERIFY / DRAFT_EXTEND with
    ``draft_tokens`` per request; verify steps with ``alt_draft_tokens`` and batches larger than
    the largest bucket run eagerly. ``extend_tokens``: the token-count buckets of the prefill
    chunks' (EXTEND) graphs where the backend captures them (``GraphSupport.ALWAYS``); chunks of
    more tokens run eagerly.
    """

    backend: str = "reference"
    steps: int = 1000
    seed: int = 0
    device: Optional[str] = None
    dtype: Optional[torch.dtype] = None
    page_size: int = 1
    graphs: Optional[bool] = None
    num_layers: int = 3
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: Optional[int] = None
    sliding_window: int = 8
    max_running: int = 12
    max_prompt: int = 40
    max_chunk: int = 12
    max_context: int = 64
    draft_tokens: int = 3
    alt_draft_tokens: int = 2
    buckets: Tuple[int, ...] = (1, 2, 4, 6)
    extend_tokens: Tuple[int, ...] = (8, 32)
    pool_size: Optional[int] = None
    swa_pool_size: Optional[int] = None
    poison: str = "nan"  # "nan": free slots and the sink hold NaN before every step; "none": left as they are
    tolerance: Optional[float] = None
    kv_check_every: int = 1
    stop_on_failure: bool = True
    threads: int = 1  # host threads for torch ops: the soak's tensors are tiny, more threads only synchronise
    progress_every: float = 10.0  # seconds between progress lines; 0 = none

    # ------------------------------------------------------------------ derived
    def swa_layer_ids(self) -> Tuple[int, ...]:
        """Layers using the SWA pool: all but every third layer and the last one."""
        return tuple(i for i in range(self.num_layers) if i % 3 != 2 and i != self.num_layers - 1)

    def sizes(self) -> Tuple[int, int]:
        """``(pool_size, swa_pool_size)`` in slots, multiples of ``page_size``."""
        ps = self.page_size
        size = self.pool_size or 6 * self.max_context + 4 * ps
        per_req_swa = self.sliding_window + self.max_chunk + self.draft_tokens + 3 * ps
        swa = self.swa_pool_size or 6 * per_req_swa
        return _round_up(size, ps), _round_up(swa, ps)

    def check(self) -> None:
        """Raise ``ValueError`` naming the first field that cannot run."""
        positive = (
            "steps",
            "page_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "sliding_window",
            "max_running",
            "max_prompt",
            "max_chunk",
            "max_context",
            "draft_tokens",
            "alt_draft_tokens",
            "kv_check_every",
            "threads",
        )
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        tol = self.tolerance
        if tol is not None and (
            isinstance(tol, bool) or not isinstance(tol, (int, float)) or not math.isfinite(tol) or tol <= 0
        ):
            # inf or NaN would pass every error, NaN outputs included: a soak that cannot fail
            raise ValueError(f"tolerance must be a finite number > 0 (or None: the dtype's), got {tol!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if self.max_prompt + 2 * self.draft_tokens + 2 > self.max_context:
            raise ValueError(
                f"max_context={self.max_context} must exceed max_prompt + 2 * draft_tokens + 1 = "
                f"{self.max_prompt + 2 * self.draft_tokens + 1}"
            )
        if self.alt_draft_tokens == self.draft_tokens:
            raise ValueError(
                f"alt_draft_tokens must differ from draft_tokens={self.draft_tokens} "
                "(it exercises the eager fallback of uncaptured verify shapes)"
            )
        if not self.buckets or any(b < 1 for b in self.buckets):
            raise ValueError(f"buckets must be sizes >= 1, got {self.buckets}")
        if self.poison not in ("nan", "none"):
            raise ValueError(f"poison must be 'nan' or 'none', got {self.poison!r}")
        size, swa = self.sizes()
        need_full = _round_up(self.max_context + self.page_size, self.page_size)
        need_swa = _round_up(
            self.sliding_window + self.max_chunk + self.draft_tokens + 2 * self.page_size, self.page_size
        )
        if size < need_full:
            raise ValueError(
                f"pool_size={size} cannot hold one request of max_context={self.max_context} (needs >= {need_full})"
            )
        if swa < need_swa:
            raise ValueError(f"swa_pool_size={swa} cannot hold one request's window and chunk (needs >= {need_swa})")

    def to_json(self) -> dict:
        data = asdict(self)
        data["dtype"] = dtype_name(self.dtype) if self.dtype is not None else None
        data["buckets"] = list(self.buckets)
        data["swa_layer_ids"] = list(self.swa_layer_ids())
        data["pool_slots"], data["swa_pool_slots"] = self.sizes()
        return data


#: fields never repeated on a reproducing command line (derived, or not affecting results)
_NOT_REPEATED = (
    "progress_every",
    "threads",
    "stop_on_failure",
    "swa_layer_ids",
    "pool_slots",
    "swa_pool_slots",
    "steps",
)


def command_line(config: dict, steps: int) -> str:
    """The ``attnplug soak`` command that re-runs ``config`` (a ``to_json()`` dict) for
    ``steps`` steps: every field that differs from the defaults, as its option
    (``--field-name``, ``--graphs`` / ``--no-graphs``)."""
    defaults = SoakConfig().to_json()
    parts = ["attnplug soak", f"--backend {config['backend']}", f"--steps {steps}", f"--seed {config['seed']}"]
    for name, value in config.items():
        if name in _NOT_REPEATED or name in ("backend", "seed") or value is None or value == defaults.get(name):
            continue
        if name == "graphs":
            parts.append("--graphs" if value else "--no-graphs")
        elif name == "buckets":
            parts.append("--buckets " + ",".join(str(b) for b in value))
        else:
            parts.append(f"--{name.replace('_', '-')} {value}")
    return " ".join(parts)
