"""What one forward step is: its mode and the device tensors that describe it.

A ``ForwardBatch`` is built once per step by the engine (or by the graph runner over its
static buffers) and handed unchanged to ``init_forward_metadata`` and to every layer's
``forward``. It is validated at construction with host-side checks only (shapes, dtypes,
devices, lengths and any value already on the host: the ``*_cpu`` mirrors and CPU tensors):
building one never reads a device tensor, so it is safe in sync-free replay preparation.
Validation raises ``BatchError`` naming the field and the value, and changes no field; the
only field construction fills in is ``extend_seq_lens`` of a speculative mode (``torch.full``)
when it is not given. Checks against the pools (slot ranges, live rows) are the backend's
(``AttentionBackend.check_batch``).

Slot values: ``out_cache_loc`` holds full-pool slots ``>= 1``, ``0`` for a padded token (the
padding sink) or ``-1`` for "no slot" (the token's KV is stored nowhere).

Fields (``bs`` = ``batch_size``, ``T`` = number of new tokens this step):

====================  =========================  ==========================================
field                 shape / dtype / where      meaning
====================  =========================  ==========================================
forward_mode          ForwardMode                what kind of step this is
batch_size            int (host)                 number of requests ``bs``
req_pool_indices      [bs] int32|int64, device   row of each request in ``req_to_token``
seq_lens              [bs] int32|int64, device   KV length INCLUDING this step's new tokens
out_cache_loc         [T] int64, device          full-pool slot of each new token (0 = pad,
                                                 -1 = no slot)
positions             [T] int64, device | None   position of each new token (for RoPE)
seq_lens_cpu          [bs] int, host | None      host mirror of ``seq_lens``; None when no
                                                 backend of the engine needs it
extend_seq_lens       [bs] int32|int64, device   new tokens per request (decode: 1;
                      | None                     TARGET_VERIFY/DRAFT_EXTEND: num_draft_tokens,
                                                 built with ``torch.full`` when not given)
extend_seq_lens_cpu   [bs] int, host | None      host mirror, required for EXTEND on an
                                                 accelerator (``T`` must be known on host)
num_draft_tokens      int | None                 q_len of TARGET_VERIFY / DRAFT_EXTEND
====================  =========================  ==========================================
"""

from __future__ import annotations

import enum
import operator
from dataclasses import dataclass, field
from typing import Optional, Sequence, Tuple, Union

import torch

__all__ = ["ForwardMode", "ForwardBatch", "BatchError"]

_INDEX_DTYPES = (torch.int32, torch.int64)
HostInts = Union[torch.Tensor, Sequence[int]]


class BatchError(ValueError):
    """A ``ForwardBatch`` field is malformed; the message names the field."""


class ForwardMode(enum.Enum):
    """Kind of forward step.

    * ``DECODE``: one new token per request.
    * ``EXTEND``: prefill or chunked prefill; any number (>= 1) of new tokens per request,
      attending to the request's cached prefix and causally to each other.
    * ``TARGET_VERIFY``: speculative decoding, the target model scores ``num_draft_tokens``
      draft tokens per request (causal among them).
    * ``DRAFT_EXTEND``: the draft model extends by ``num_draft_tokens`` accepted tokens per
      request (uniform q_len, like TARGET_VERIFY).
    * ``IDLE``: no tokens (a data-parallel rank with nothing to do).
    """

    DECODE = "decode"
    EXTEND = "extend"
    TARGET_VERIFY = "target_verify"
    DRAFT_EXTEND = "draft_extend"
    IDLE = "idle"

    @property
    def is_uniform(self) -> bool:
        """Every request has the same number of new tokens, known on the host."""
        return self in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND)

    @property
    def is_speculative(self) -> bool:
        """The step scores or extends draft tokens (``num_draft_tokens`` a request)."""
        return self in (ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND)

    @classmethod
    def uniform(cls) -> Tuple["ForwardMode", ...]:
        """The uniform modes, in declaration order (what a graph captures per bucket)."""
        return tuple(m for m in cls if m.is_uniform)

    @classmethod
    def speculative(cls) -> Tuple["ForwardMode", ...]:
        """The speculative modes, in declaration order."""
        return tuple(m for m in cls if m.is_speculative)


def _host_list(name: str, value: Optional[HostInts], bs: int) -> Optional[list]:
    """``value`` as a list of Python ints (host data only: a list or a CPU tensor)."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            raise BatchError(f"{name} must be a host (cpu) tensor or a list, got device {value.device}")
        if value.dim() != 1:
            raise BatchError(f"{name} must be 1-D, got shape {tuple(value.shape)}")
        if value.dtype not in _INDEX_DTYPES:
            raise BatchError(f"{name} must hold integers, got dtype {str(value.dtype).replace('torch.', '')}")
        value = value.tolist()
    else:
        try:
            value = [_host_int(name, x) for x in value]
        except TypeError:
            raise BatchError(f"{name} must be a list of ints or a host tensor, got {type(value).__name__}") from None
    if len(value) != bs:
        raise BatchError(f"{name} has {len(value)} entries, batch_size is {bs}")
    return value


def _host_int(name: str, x) -> int:
    """An exact int: 2.7, True or "3" are refused, never truncated or coerced."""
    if isinstance(x, bool) or isinstance(x, float) or isinstance(x, str):
        raise BatchError(f"{name} must hold ints, got {x!r}")
    try:
        return operator.index(x)
    except TypeError:
        raise BatchError(f"{name} must hold ints, got {x!r}") from None


def _on_host(t: Optional[torch.Tensor]) -> bool:
    """A tensor whose values can be read without a device sync (it lives on the host)."""
    return isinstance(t, torch.Tensor) and t.device.type == "cpu"


@dataclass
class ForwardBatch:
    """One forward step. See the module docstring for every field's shape and dtype."""

    forward_mode: ForwardMode
    batch_size: int
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    positions: Optional[torch.Tensor] = None
    seq_lens_cpu: Optional[HostInts] = None
    extend_seq_lens: Optional[torch.Tensor] = None
    extend_seq_lens_cpu: Optional[HostInts] = None
    num_draft_tokens: Optional[int] = None
    validate: bool = field(default=True, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.validate:
            self._validate()  # raises BatchError; changes no field
            self.seq_lens_cpu = _host_list("seq_lens_cpu", self.seq_lens_cpu, self.batch_size)
            self.extend_seq_lens_cpu = _host_list("extend_seq_lens_cpu", self.extend_seq_lens_cpu, self.batch_size)
        if self.forward_mode.is_speculative and self.extend_seq_lens is None:
            self.extend_seq_lens = self._full_extend_lens()

    # ------------------------------------------------------------------ derived (host)
    @property
    def num_tokens(self) -> int:
        """``T``: number of new tokens in this step (host int, never a device read)."""
        return self.out_cache_loc.shape[0]

    @property
    def device(self) -> torch.device:
        return self.out_cache_loc.device

    @property
    def q_len(self) -> Optional[int]:
        """New tokens per request for uniform modes, None for EXTEND / IDLE."""
        if self.forward_mode is ForwardMode.DECODE:
            return 1
        if self.forward_mode.is_speculative:
            return self.num_draft_tokens
        return None

    # ------------------------------------------------------------------ validation
    def _full_extend_lens(self) -> torch.Tensor:
        # Built on the device with torch.full: no host->device copy of Python data.
        return torch.full(
            (self.batch_size,), int(self.num_draft_tokens), dtype=self.seq_lens.dtype, device=self.seq_lens.device
        )

    def _check_index_tensor(self, name: str, t: Optional[torch.Tensor], length: int, dtypes) -> None:
        if not isinstance(t, torch.Tensor):
            raise BatchError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 1:
            raise BatchError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
        if t.shape[0] != length:
            raise BatchError(f"{name} has length {t.shape[0]}, expected {length}")
        if t.dtype not in dtypes:
            names = " or ".join(str(d).replace("torch.", "") for d in dtypes)
            raise BatchError(f"{name} must be {names}, got {str(t.dtype).replace('torch.', '')}")
        if t.device != self.out_cache_loc.device:
            raise BatchError(f"{name} is on {t.device}, out_cache_loc on {self.out_cache_loc.device}")

    def _validate(self) -> None:
        """Every host-side check; reads only host data (Python values, CPU tensors), never a
        device tensor, and assigns no field."""
        mode = self.forward_mode
        if not isinstance(mode, ForwardMode):
            raise BatchError(f"forward_mode must be a ForwardMode, got {mode!r}")
        bs = self.batch_size
        if isinstance(bs, bool) or not isinstance(bs, int) or bs < 0:
            raise BatchError(f"batch_size must be a non-negative int, got {bs!r}")
        if not isinstance(self.out_cache_loc, torch.Tensor) or self.out_cache_loc.dim() != 1:
            raise BatchError("out_cache_loc must be a 1-D tensor of full-pool slots")
        if self.out_cache_loc.dtype != torch.int64:
            raise BatchError(f"out_cache_loc must be int64, got {str(self.out_cache_loc.dtype).replace('torch.', '')}")
        self._check_index_tensor("req_pool_indices", self.req_pool_indices, bs, _INDEX_DTYPES)
        self._check_index_tensor("seq_lens", self.seq_lens, bs, _INDEX_DTYPES)
        T = self.num_tokens
        if self.positions is not None:
            self._check_index_tensor("positions", self.positions, T, (torch.int64,))

        seq_cpu = _host_list("seq_lens_cpu", self.seq_lens_cpu, bs)
        ext_cpu = _host_list("extend_seq_lens_cpu", self.extend_seq_lens_cpu, bs)

        if mode is ForwardMode.IDLE:
            if bs != 0 or T != 0:
                raise BatchError(f"an IDLE batch has no requests and no tokens, got batch_size={bs}, tokens={T}")
            return
        if bs == 0:
            raise BatchError(f"batch_size is 0 in {mode.name} mode (use ForwardMode.IDLE)")

        if mode.is_speculative:
            n = self.num_draft_tokens
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise BatchError(f"num_draft_tokens must be an int >= 1 in {mode.name} mode, got {n!r}")
            expected = [n] * bs
        elif mode is ForwardMode.DECODE:
            expected = [1] * bs
        else:
            expected = None

        if self.extend_seq_lens is not None:
            self._check_index_tensor("extend_seq_lens", self.extend_seq_lens, bs, _INDEX_DTYPES)
        elif mode is ForwardMode.EXTEND:
            raise BatchError("extend_seq_lens is required in EXTEND mode")

        # Host-known values: the host mirrors, and any index tensor that lives on the host.
        ext_tensor = self.extend_seq_lens.tolist() if _on_host(self.extend_seq_lens) else None
        seq_tensor = self.seq_lens.tolist() if _on_host(self.seq_lens) else None
        if ext_cpu is not None and ext_tensor is not None and ext_cpu != ext_tensor:
            raise BatchError(f"extend_seq_lens_cpu = {ext_cpu} differs from extend_seq_lens = {ext_tensor}")
        if seq_cpu is not None and seq_tensor is not None and seq_cpu != seq_tensor:
            raise BatchError(f"seq_lens_cpu = {seq_cpu} differs from seq_lens = {seq_tensor}")
        if expected is not None:
            for name, got in (("extend_seq_lens_cpu", ext_cpu), ("extend_seq_lens", ext_tensor)):
                bad = [i for i, e in enumerate(got or []) if e != expected[i]]
                if bad:
                    raise BatchError(
                        f"{name}[{bad[0]}] = {got[bad[0]]}: every request has {expected[0]} new "
                        f"token(s) in {mode.name} mode"
                    )
        host_ext = expected if expected is not None else (ext_cpu if ext_cpu is not None else ext_tensor)
        if host_ext is None:
            raise BatchError(
                "extend_seq_lens_cpu is required in EXTEND mode on an accelerator: the number of new tokens "
                "must be known on the host without reading the device"
            )
        bad = [i for i, e in enumerate(host_ext) if e < 1]
        if bad:
            raise BatchError(f"extend_seq_lens[{bad[0]}] = {host_ext[bad[0]]}: every request has >= 1 new token")
        if sum(host_ext) != T:
            raise BatchError(
                f"len(out_cache_loc) == {T} but sum(extend_seq_lens) == {sum(host_ext)}; they must be equal"
            )
        for name, seq in (("seq_lens_cpu", seq_cpu), ("seq_lens", seq_tensor)):
            bad = [i for i, (s, e) in enumerate(zip(seq or [], host_ext)) if s < e]
            if bad:
                i = bad[0]
                raise BatchError(
                    f"{name}[{i}] = {seq[i]} is smaller than its {host_ext[i]} new token(s) "
                    "(seq_lens include this step's tokens)"
                )
        _check_host_min("req_pool_indices", self.req_pool_indices, 0, "rows are >= 0; 0 is the padding row")
        _check_host_min(
            "out_cache_loc", self.out_cache_loc, -1, "slots are >= 1; 0 is the padding sink, -1 means no slot"
        )


def _check_host_min(name: str, t: torch.Tensor, low: int, meaning: str) -> None:
    """Refuse an entry below ``low`` of a host tensor (tensor ops, no Python loop over T)."""
    if not _on_host(t) or t.numel() == 0:
        return
    bad = torch.nonzero(t < low)
    if bad.numel():
        i = int(bad[0, 0])
        raise BatchError(f"{name}[{i}] = {int(t[i])} is out of range ({meaning})")
