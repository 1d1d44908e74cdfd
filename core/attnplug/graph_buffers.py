"""The static buffers a backend's captured steps read: allocated once, filled in place.

A captured graph replays kernels over fixed addresses, so every tensor it reads must exist
before capture, at its largest size, and never be reallocated. ``GraphBuffers`` owns those
tensors for one backend (``init_cuda_graph_state`` creates it) and is where rule 1 of the
contract (docs/contract.md, "Hoisted SWA writes") is kept for graph mode:

* ``swa_out_cache_loc`` — the contract's ``cuda_graph_swa_out_cache_loc``: int32,
  ``[max_num_tokens]``, zero-filled at allocation. A step of ``n`` tokens holds the
  translation of its ``out_cache_loc`` in ``[:n]`` and zeros in ``[n:]``, so the padded
  tokens of a captured bucket write to the sink (slot 0). ``fill_swa_out_cache_loc`` is that
  rule; a backend whose fused kernel writes the buffer itself must produce exactly what
  ``expected_swa_out_cache_loc`` defines (tested against it).
* further buffers a backend registers with ``add(name, rows, *tail, dtype)``: ``rows`` is
  ``"requests"`` (``max_bs`` rows), ``"tokens"`` (``max_num_tokens`` rows) or an int. Views of
  one captured shape come from ``view(name, bs, q_len)``: the leading ``bs`` rows of a request
  buffer, the leading ``bs * q_len`` rows of a token buffer.

The translation itself has one definition: the pool's ``translate_loc_from_full_to_swa``.

One ``GraphBuffers`` is one graph state. A captured graph reads the buffers it was captured
with, at their addresses, for as long as it lives, so a second ``GraphRunner`` on the same
backend must never replace them: every ``init_cuda_graph_state`` makes a new state, the runner
that called it keeps it (``AttentionBackend.get_cuda_graph_state``) and hands it back before
each of its captures and replays (``set_cuda_graph_state``). Whatever else a backend derives
from the buffers and its graphs read belongs to the state too: ``views`` (the backend's
per-shape views, built once per captured shape) and ``shared`` (tensors the backend also uses
outside graphs, e.g. eager workspaces it grew for this state's sizes: the state keeps the ones
its graphs were captured with alive and current).
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple, Union

import torch

__all__ = ["GraphBuffers"]

_ROWS = ("requests", "tokens")


class GraphBuffers:
    """Static graph buffers of one backend (see module docstring). Every method but the
    constructor and ``add`` is sync-free and allocates nothing on the device."""

    def __init__(self, device: torch.device, max_bs: int, max_num_tokens: int) -> None:
        for arg, value in (("max_bs", max_bs), ("max_num_tokens", max_num_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{arg} must be an int >= 1, got {value!r}")
        self.device = torch.device(device)
        self.max_bs = max_bs
        self.max_num_tokens = max_num_tokens
        #: [max_num_tokens] int32: the step's hoisted SWA slots, zero past the step's tokens
        self.swa_out_cache_loc: torch.Tensor = torch.zeros(max_num_tokens, dtype=torch.int32, device=self.device)
        self._buffers: Dict[str, Tuple[str, torch.Tensor]] = {}
        #: the backend's views of these buffers per captured shape (built once, kept with them)
        self.views: Dict[Any, Any] = {}
        #: tensors outside these buffers that this state's graphs read (see module docstring)
        self.shared: Dict[str, torch.Tensor] = {}

    # ------------------------------------------------------------------ allocation (once)
    def add(self, name: str, rows: Union[str, int], *tail: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """Allocate the zero-filled buffer ``name`` of ``[rows, *tail]`` (``rows``: "requests"
        = ``max_bs``, "tokens" = ``max_num_tokens``, or an int) and return it."""
        if name in self._buffers or name == "swa_out_cache_loc":
            raise ValueError(f"graph buffer {name!r} already exists")
        if isinstance(rows, str):
            if rows not in _ROWS:
                raise ValueError(f"rows must be one of {_ROWS} or an int, got {rows!r}")
            n = self.max_bs if rows == "requests" else self.max_num_tokens
        else:
            n = rows
        tensor = torch.zeros(n, *tail, dtype=dtype, device=self.device)
        self._buffers[name] = (rows if isinstance(rows, str) else "fixed", tensor)
        return tensor

    def __getitem__(self, name: str) -> torch.Tensor:
        """The whole buffer ``name`` (``swa_out_cache_loc`` included)."""
        if name == "swa_out_cache_loc":
            return self.swa_out_cache_loc
        try:
            return self._buffers[name][1]
        except KeyError:
            raise KeyError(f"no graph buffer {name!r}; have {['swa_out_cache_loc', *self._buffers]}") from None

    def __contains__(self, name: str) -> bool:
        return name == "swa_out_cache_loc" or name in self._buffers

    # ------------------------------------------------------------------ views of one shape
    def check_fits(self, bs: int, num_tokens: int) -> None:
        """Raise ``ValueError`` naming both sizes when a batch does not fit the buffers."""
        if bs > self.max_bs or num_tokens > self.max_num_tokens:
            raise ValueError(
                f"batch of {bs} requests / {num_tokens} tokens exceeds the graph state "
                f"(max_bs={self.max_bs}, max_num_tokens={self.max_num_tokens})"
            )

    def view(self, name: str, bs: int, q_len: int, num_tokens: Optional[int] = None) -> torch.Tensor:
        """The part of buffer ``name`` a captured ``(bs, q_len)`` step uses: ``[:bs]`` of a
        request buffer, ``[:bs * q_len]`` of a token buffer (``swa_out_cache_loc`` included;
        ``[:num_tokens]`` when given: an EXTEND step's tokens), the whole of a fixed-size one.
        Always a view: same storage, never a copy."""
        n = bs * q_len if num_tokens is None else num_tokens
        self.check_fits(bs, n)
        if name == "swa_out_cache_loc":
            return self.swa_out_cache_loc[:n]
        rows, tensor = self._buffers[name] if name in self._buffers else (None, self[name])
        if rows == "requests":
            return tensor[:bs]
        if rows == "tokens":
            return tensor[:n]
        return tensor

    # ------------------------------------------------------------------ rule 1
    def fill_swa_out_cache_loc(self, translated: torch.Tensor) -> torch.Tensor:
        """Rule 1 in graph mode: ``[:n]`` = ``translated`` (the step's ``n`` translated slots,
        any integer dtype, on the buffers' device) and ``[n:]`` = 0, in place. Returns the
        ``[:n]`` view. Sync-free: device copies only."""
        n = translated.shape[0]
        if translated.dim() != 1 or n > self.max_num_tokens:
            raise ValueError(
                f"translated must be [n] with n <= max_num_tokens={self.max_num_tokens}, "
                f"got shape {tuple(translated.shape)}"
            )
        head = self.swa_out_cache_loc[:n]
        head.copy_(translated)
        self.swa_out_cache_loc[n:].zero_()
        return head

    @staticmethod
    def expected_swa_out_cache_loc(pool, out_cache_loc: torch.Tensor, max_num_tokens: int) -> torch.Tensor:
        """What ``swa_out_cache_loc`` must hold after a step with ``out_cache_loc`` (the
        definition a fused kernel is tested against): the pool's translation of the step's
        slots (``translate_loc_from_full_to_swa``: 0 where no SWA slot is live, -1 for -1 and
        for a slot outside the mapping), then zeros up to ``max_num_tokens``. int32, on
        ``out_cache_loc``'s device."""
        out = torch.zeros(max_num_tokens, dtype=torch.int32, device=out_cache_loc.device)
        out[: out_cache_loc.shape[0]] = pool.translate_loc_from_full_to_swa(out_cache_loc).to(torch.int32)
        return out
