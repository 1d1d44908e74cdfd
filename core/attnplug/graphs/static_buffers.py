"""The static buffers a ``GraphRunner``'s graphs read, and the replay preparation's copies into
them (``StaticBuffers``, a part of ``GraphRunner``).

Every operation here is a device copy/fill: nothing reads device values. The preparation does
as few device operations as it can: one grouped copy of the step into the static buffers
(``torch._foreach_copy_``), a padding fill only when rows the graph reads may still hold an
earlier, larger step's values (the buffers track how far each one holds real rather than
padding values; ``_reset_padding`` resets them all to padding), and views cached per size.
Padding: ``req_pool_indices`` 0, ``seq_lens`` the backend's fill value, ``extend_seq_lens`` 0
(EXTEND graphs: a padded request has no new token), ``out_cache_loc`` 0 (slot 0, the sink),
position 0 and zero inputs.
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Sequence, Tuple

import torch

from ..batch import ForwardBatch, ForwardMode

__all__ = ["StaticBuffers", "with_seq_lens_cpu"]

_INDEX = (torch.int64, torch.int32)  # request fields: int32 widens exactly into the int64 buffers
_INT64 = (torch.int64,)


def _describe(t: object) -> str:
    if isinstance(t, torch.Tensor):
        return f"{tuple(t.shape)} {t.dtype} on {t.device}"
    return repr(t)


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
        self.extend_seq_lens = torch.zeros(max_bs, dtype=torch.int64, device=dev)  # EXTEND graphs
        self.out_cache_loc = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.inputs = {
            name: torch.zeros((n, *shape), dtype=dtype, device=dev) for name, (shape, dtype) in inputs.items()
        }
        self._input_names = tuple(self.inputs)
        self._device = dev = self.req_pool_indices.device
        # What _check_step compares on the replay path: (dtype, device) of the batch fields,
        # and per input (name, buffer, per-token shape, (dtype, device)).
        self._slot_sig = (torch.int64, dev)
        self._index_sigs = frozenset((d, dev) for d in _INDEX)
        self._input_specs = tuple((k, buf, buf.shape[1:], (buf.dtype, buf.device)) for k, buf in self.inputs.items())
        #: storages of every static buffer: an input living there must be the in-place view
        self._static_storages = frozenset(
            t.untyped_storage().data_ptr()
            for t in (self.req_pool_indices, self.seq_lens, self.out_cache_loc, self.positions, *self.inputs.values())
        )
        # Replay-path caches: views per size, and how far each static buffer may hold values
        # other than padding (rows past it hold padding: no fill needed there).
        self._request_views: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}
        self._token_views: Dict[int, Tuple[torch.Tensor, ...]] = {}  # (out_cache_loc, positions, *inputs)
        self._dirty_requests = 0  # req_pool_indices, seq_lens
        self._dirty_extend = 0  # extend_seq_lens
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
        extend = batch.forward_mode is ForwardMode.EXTEND
        if extend:
            dst.append(self.extend_seq_lens[:bs])
            src.append(batch.extend_seq_lens)
        self._add_inputs(dst, src, inputs, tok, n)
        self._copy_all(dst, src)
        if extend:
            if self._dirty_extend > bs:
                self.extend_seq_lens[bs : self._dirty_extend].zero_()
            self._dirty_extend = bs
        if self._dirty_requests > bs:
            self.req_pool_indices[bs : self._dirty_requests].zero_()
            self.seq_lens[bs : self._dirty_requests].fill_(self.fill_value)
        self._dirty_requests = bs
        if batch.positions is not None:
            if self._dirty_positions > n:
                self.positions[n : self._dirty_positions].zero_()
            self._dirty_positions = n
        self._pad_tokens(n, with_out_cache_loc=True)

    # ------------------------------------------------------------------ what fits
    @staticmethod
    def _check_mode(batch: ForwardBatch) -> ForwardMode:
        """The step's mode; refuses what is not a ``ForwardBatch`` with a ``ForwardMode``."""
        if not isinstance(batch, ForwardBatch):
            raise ValueError(f"batch must be a ForwardBatch, got {type(batch).__name__}")
        mode = batch.forward_mode
        if not isinstance(mode, ForwardMode):
            raise ValueError(f"batch.forward_mode must be a ForwardMode, got {mode!r}")
        return mode

    def _check_step(self, batch: ForwardBatch, inputs: Mapping[str, torch.Tensor]) -> None:
        """Refuse, naming the field and the value, a step of a captured mode that the captured
        buffers cannot take as it is (a copy would broadcast, cast, read past it or keep an
        earlier step's values): host metadata only, never a device read. Also for steps that
        will run eagerly (too large, another ``num_draft_tokens``): whether a step is accepted
        never depends on its size. A few host comparisons per field (replay preparation is hot);
        ``_explain_step`` / ``_explain_inputs`` find and name what does not fit."""
        bs, loc, pos = batch.batch_size, batch.out_cache_loc, batch.positions
        try:
            n = loc.shape[0]
            q_len = batch.q_len
            sigs = self._index_sigs
            fits = (
                type(bs) is int
                and bs >= 1
                and pos is not None
                and (q_len is None or n == bs * q_len)
                and loc.shape == (n,)
                and pos.shape == (n,)
                and batch.req_pool_indices.shape == (bs,)
                and batch.seq_lens.shape == (bs,)
                and (loc.dtype, loc.device) == self._slot_sig
                and (pos.dtype, pos.device) == self._slot_sig
                and (batch.req_pool_indices.dtype, batch.req_pool_indices.device) in sigs
                and (batch.seq_lens.dtype, batch.seq_lens.device) in sigs
            )
        except (AttributeError, IndexError, TypeError):
            fits = False
        if fits and batch.forward_mode is ForwardMode.EXTEND:
            ext = batch.extend_seq_lens
            fits = isinstance(ext, torch.Tensor) and ext.shape == (bs,) and (ext.dtype, ext.device) in self._index_sigs
        if not fits:
            self._explain_step(batch)
        if self.needs_cpu_seq_lens:
            host = batch.seq_lens_cpu
            if host is None or len(host) != bs:
                raise ValueError(
                    f"batch.seq_lens_cpu is {host!r}: the backend needs the host mirror of seq_lens "
                    f"({bs} ints; needs_cpu_seq_lens is True)"
                )
        self._check_inputs(inputs, n)

    def _explain_step(self, batch: ForwardBatch) -> None:
        """Raise ``ValueError`` naming the first batch field that does not fit (see
        ``_check_step``)."""
        mode, bs = batch.forward_mode, batch.batch_size
        if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1:
            raise ValueError(f"batch.batch_size must be an int >= 1 in {mode.name} mode, got {bs!r}")
        loc = batch.out_cache_loc
        if not isinstance(loc, torch.Tensor) or loc.dim() != 1:
            raise ValueError(f"batch.out_cache_loc must be a 1-D tensor of slots, got {_describe(loc)}")
        n = loc.shape[0]
        q_len = batch.q_len
        if q_len is not None and n != bs * q_len:
            raise ValueError(
                f"batch.out_cache_loc has {n} tokens; a {mode.name} batch of {bs} requests has {bs} x {q_len}"
            )
        if batch.positions is None:
            raise ValueError(
                f"batch.positions is None: a {mode.name} step must give the position of each of its {n} tokens "
                "(the captured graphs read the runner's static positions, which would still hold an earlier "
                "step's; a step without positions is refused whether it would replay or run eagerly)"
            )
        device = self._device
        for name, t, rows, dtypes in (
            ("req_pool_indices", batch.req_pool_indices, bs, _INDEX),
            ("seq_lens", batch.seq_lens, bs, _INDEX),
            ("out_cache_loc", loc, n, _INT64),
            ("positions", batch.positions, n, _INT64),
        ):
            if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.shape[0] != rows:
                raise ValueError(f"batch.{name} is {_describe(t)}; the captured buffer takes [{rows}] (the step's)")
            if t.dtype not in dtypes or t.device != device:
                raise ValueError(
                    f"batch.{name} is {t.dtype} on {t.device}; the captured buffer takes "
                    f"{' or '.join(map(str, dtypes))} on {device} (never cast or moved silently)"
                )
        if mode is ForwardMode.EXTEND:
            ext = batch.extend_seq_lens
            if not isinstance(ext, torch.Tensor) or ext.shape != (bs,):
                raise ValueError(
                    f"batch.extend_seq_lens is {_describe(ext)}; a captured EXTEND step takes [{bs}] "
                    "(the new tokens of each request, on the device)"
                )
            if ext.dtype not in _INDEX or ext.device != device:
                raise ValueError(
                    f"batch.extend_seq_lens is {ext.dtype} on {ext.device}; the captured buffer takes "
                    f"{' or '.join(map(str, _INDEX))} on {device} (never cast or moved silently)"
                )
        raise ValueError(f"the batch does not fit the captured buffers: {batch!r}")  # not reached

    def _check_inputs(self, inputs: Mapping[str, torch.Tensor], n: int) -> None:
        """Refuse, naming the input, what the captured buffers cannot take as it is: a missing
        input or one the graphs do not read, another dtype or device, other per-token dims,
        fewer than ``n`` rows, or another part of the runner's own static buffers (a copy
        would broadcast, cast, read past them or overwrite its own source). Host metadata only
        (no device read)."""
        if (type(inputs) is not dict and not isinstance(inputs, Mapping)) or len(inputs) != len(self._input_specs):
            self._explain_inputs(inputs, n)
        storages = self._static_storages
        for name, static, tail, sig in self._input_specs:
            x = inputs.get(name)
            try:
                fits = x.shape[1:] == tail and x.shape[0] >= n and (x.dtype, x.device) == sig
                if fits and x.untyped_storage().data_ptr() in storages:
                    fits = x.data_ptr() == static.data_ptr() and x.stride() == static.stride()
            except (AttributeError, IndexError):
                fits = False
            if not fits:
                self._explain_inputs(inputs, n)

    def _explain_inputs(self, inputs: Mapping[str, torch.Tensor], n: int) -> None:
        """Raise ``ValueError`` naming the first input that does not fit (``_check_inputs``)."""
        if not isinstance(inputs, Mapping):
            raise ValueError(f"inputs must map each input's name to a tensor, got {type(inputs).__name__}")
        for name in inputs:
            if name not in self.inputs:
                raise ValueError(
                    f"inputs[{name!r}] is not an input of this runner: its captured graphs read "
                    f"{list(self._input_names)} only"
                )
        for name in self._input_names:
            static = self.inputs[name]
            x = inputs.get(name)
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
            if x.untyped_storage().data_ptr() in self._static_storages and not (
                x.data_ptr() == static.data_ptr() and x.stride() == static.stride()
            ):
                raise ValueError(
                    f"inputs[{name!r}] is another part of the runner's static buffers (only "
                    f"runner.inputs[{name!r}][:T] itself is taken in place); clone() it first"
                )
        raise ValueError(f"inputs do not fit the captured buffers: {sorted(inputs)}")  # not reached

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
        """Queue each input's copy, except an input the engine wrote in place: a view of
        ``runner.inputs[name]`` from row 0 with its layout (``[:T]`` is the same memory:
        nothing to copy)."""
        for name, view in zip(self._input_names, tok[2:]):
            x = inputs[name]
            if x.data_ptr() == view.data_ptr() and x.stride() == view.stride():
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
        self.extend_seq_lens.zero_()
        self.out_cache_loc.zero_()
        self.positions.zero_()
        for buf in self.inputs.values():
            buf.zero_()
        self._dirty_requests = self._dirty_extend = self._dirty_tokens = self._dirty_positions = 0


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
