"""The static buffers a ``GraphRunner``'s graphs read, and the replay preparation's copies into
them (``StaticBuffers``, a part of ``GraphRunner``).

Every operation here is a device copy/fill: nothing reads device values. The preparation does
as few device operations as it can: one grouped copy of the step into the static buffers
(``torch._foreach_copy_``), a padding fill only when rows the graph reads may still hold an
earlier, larger step's values (the buffers track how far each one holds real rather than
padding values; ``_reset_padding`` resets them all to padding), and views cached per size.
Padding: ``req_pool_indices`` 0, ``seq_lens`` the backend's fill value, ``out_cache_loc`` 0
(slot 0, the sink), position 0 and zero inputs.
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Sequence, Tuple

import torch

from ..batch import ForwardBatch

__all__ = ["StaticBuffers", "with_seq_lens_cpu"]


class StaticBuffers:
    """The runner's static buffers (``req_pool_indices``, ``seq_lens``, ``out_cache_loc``,
    ``positions``, ``inputs``) and the copies of a step into them; ``GraphRunner`` builds them
    with ``_init_static_buffers``."""

    def _init_static_buffers(
        self,
        device: torch.device,
        max_bs: int,
        max_num_tokens: int,
        inputs: Mapping[str, Tuple[Sequence[int], torch.dtype]],
        fill_value: int,
    ) -> None:
        dev, n = device, max_num_tokens
        self.fill_value = fill_value
        self.req_pool_indices = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.seq_lens = torch.full((max_bs,), self.fill_value, dtype=torch.int64, device=dev)
        self.out_cache_loc = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.inputs = {
            name: torch.zeros((n, *shape), dtype=dtype, device=dev) for name, (shape, dtype) in inputs.items()
        }
        self._input_names = tuple(self.inputs)
        # Replay-path caches: views per size, and how far each static buffer may hold values
        # other than padding (rows past it hold padding: no fill needed there).
        self._request_views: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}
        self._token_views: Dict[int, Tuple[torch.Tensor, ...]] = {}  # (out_cache_loc, positions, *inputs)
        self._dirty_requests = 0  # req_pool_indices, seq_lens
        self._dirty_tokens = 0  # out_cache_loc and the inputs
        self._dirty_positions = 0
        self._grouped_copy = True  # torch._foreach_copy_ works here (cleared on first failure)

    def _views_for_requests(self, bs: int) -> Tuple[torch.Tensor, torch.Tensor]:
        views = self._request_views.get(bs)
        if views is None:
            views = self._request_views[bs] = (self.req_pool_indices[:bs], self.seq_lens[:bs])
        return views

    def _views_for_tokens(self, n: int) -> Tuple[torch.Tensor, ...]:
        views = self._token_views.get(n)
        if views is None:
            views = (self.out_cache_loc[:n], self.positions[:n], *(self.inputs[k][:n] for k in self._input_names))
            self._token_views[n] = views
        return views

    def _copy_batch(self, batch: ForwardBatch, inputs: Mapping[str, torch.Tensor], n: int) -> None:
        """Copy the step and its inputs into the static buffers in one grouped copy, then pad
        the rows that may still hold an earlier step's values."""
        bs = batch.batch_size
        req, seq = self._views_for_requests(bs)
        tok = self._views_for_tokens(n)
        dst = [req, seq, tok[0]]
        src = [batch.req_pool_indices, batch.seq_lens, batch.out_cache_loc]
        if batch.positions is not None:
            dst.append(tok[1])
            src.append(batch.positions)
        self._add_inputs(dst, src, inputs, tok, n)
        self._copy_all(dst, src)
        if self._dirty_requests > bs:
            self.req_pool_indices[bs : self._dirty_requests].zero_()
            self.seq_lens[bs : self._dirty_requests].fill_(self.fill_value)
        self._dirty_requests = bs
        if batch.positions is not None:
            if self._dirty_positions > n:
                self.positions[n : self._dirty_positions].zero_()
            self._dirty_positions = n
        self._pad_tokens(n, with_out_cache_loc=True)

    def _check_inputs(self, inputs: Mapping[str, torch.Tensor], n: int) -> None:
        """Refuse, naming the input, what the captured buffers cannot take as it is: a missing
        input, another dtype or device, other per-token dims, fewer than ``n`` rows (a copy
        would broadcast, cast or read past them). Host metadata only (no device read)."""
        for name in self._input_names:
            static = self.inputs[name]
            x = inputs.get(name) if isinstance(inputs, Mapping) else None
            if not isinstance(x, torch.Tensor):
                raise ValueError(f"inputs[{name!r}] must be a tensor [>= {n}, *{tuple(static.shape[1:])}], got {x!r}")
            if x.dim() != static.dim() or x.shape[1:] != static.shape[1:] or x.shape[0] < n:
                raise ValueError(
                    f"inputs[{name!r}] is {tuple(x.shape)}; the captured buffer takes "
                    f"[>= {n}, {', '.join(map(str, static.shape[1:]))}] (the step's {n} tokens)"
                )
            if x.dtype != static.dtype or x.device != static.device:
                raise ValueError(
                    f"inputs[{name!r}] is {x.dtype} on {x.device}; the captured buffer is {static.dtype} on "
                    f"{static.device} (never cast or moved silently)"
                )

    def _copy_inputs(self, inputs: Mapping[str, torch.Tensor], n: int) -> None:
        """The model inputs only (the backend copies the batch itself)."""
        if not self._input_names:
            return
        dst: List[torch.Tensor] = []
        src: List[torch.Tensor] = []
        self._add_inputs(dst, src, inputs, self._views_for_tokens(n), n)
        if dst:
            self._copy_all(dst, src)
        self._pad_tokens(n, with_out_cache_loc=False)

    def _add_inputs(self, dst: list, src: list, inputs: Mapping[str, torch.Tensor], tok: tuple, n: int) -> None:
        """Queue each input's copy, except an input the engine wrote in place: the view
        ``runner.inputs[name][:T]`` itself (same memory, same layout: nothing to copy)."""
        for name, view in zip(self._input_names, tok[2:]):
            x = inputs[name]
            if x.data_ptr() == view.data_ptr() and x.shape == view.shape and x.stride() == view.stride():
                continue
            dst.append(view)
            src.append(x if x.shape[0] == n else x[:n])

    def _copy_all(self, dst: List[torch.Tensor], src: List[torch.Tensor]) -> None:
        """``dst[i].copy_(src[i])`` for every i (none: nothing): one grouped call (``torch._foreach_copy_``)
        where this torch has it for the device, else one copy each (decided on first use)."""
        if not dst:
            return
        if len(dst) > 1 and self._grouped_copy:
            try:
                torch._foreach_copy_(dst, src)
                return
            except (AttributeError, NotImplementedError):
                self._grouped_copy = False  # no grouped copy on this device: one copy each
            except RuntimeError:
                pass  # e.g. mismatched shapes: the single copies below raise the clear error
        for d, x in zip(dst, src):
            d.copy_(x)

    def _pad_tokens(self, n: int, *, with_out_cache_loc: bool) -> None:
        end = self._dirty_tokens
        if end > n:
            if with_out_cache_loc:
                self.out_cache_loc[n:end].zero_()
            for buf in self.inputs.values():
                buf[n:end].zero_()
        self._dirty_tokens = n

    def _reset_padding(self) -> None:
        """Every static buffer back to padding values (capture runs on padding only)."""
        self.req_pool_indices.zero_()
        self.seq_lens.fill_(self.fill_value)
        self.out_cache_loc.zero_()
        self.positions.zero_()
        for buf in self.inputs.values():
            buf.zero_()
        self._dirty_requests = self._dirty_tokens = self._dirty_positions = 0


def with_seq_lens_cpu(static: ForwardBatch, batch: ForwardBatch, bucket: int, fill: int) -> ForwardBatch:
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
