"""What one forward step is: its mode and the device tensors that describe it.

A ``ForwardBatch`` is built once per step by the engine (or by the graph runner over its
static buffers) and handed unchanged to ``init_forward_metadata`` and to every layer's
``forward``. It is validated at construction with host-side checks only (shapes, dtypes,
devices, lengths known on the host): building one never reads a device tensor, so it is
safe in sync-free replay preparation.

Fields (``bs`` = ``batch_size``, ``T`` = number of new tokens this step):

====================  =========================  ==========================================
field                 shape / dtype / where      meaning
====================  =========================  ==========================================
forward_mode          ForwardMode                what kind of step this is
batch_size            int (host)                 number of requests ``bs``
req_pool_indices      [bs] int32|int64, device   row of each request in ``req_to_token``
seq_lens              [bs] int32|int64, device   KV length INCLUDING this step's new tokens
out_cache_loc         [T] int64, device          full-pool slot of each new token (0 = pad)
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
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

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
        return self in (ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND)


def _host_list(name: str, value: Optional[HostInts], bs: int) -> Optional[list]:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            raise BatchError(f"{name} must be a host (cpu) tensor or a list, got device {value.device}")
        if value.dim() != 1:
            raise BatchError(f"{name} must be 1-D, got shape {tuple(value.shape)}")
        value = value.tolist()
    else:
        value = [int(x) for x in value]
    if len(value) != bs:
        raise BatchError(f"{name} has {len(value)} entries, batch_size is {bs}")
    return value


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
            self._validate()
        elif self.forward_mode.is_speculative and self.extend_seq_lens is None:
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

        self.seq_lens_cpu = _host_list("seq_lens_cpu", self.seq_lens_cpu, bs)
        self.extend_seq_lens_cpu = _host_list("extend_seq_lens_cpu", self.extend_seq_lens_cpu, bs)

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
            if self.extend_seq_lens is None:
                self.extend_seq_lens = self._full_extend_lens()
            expected = [n] * bs
        elif mode is ForwardMode.DECODE:
            expected = [1] * bs
        else:
            expected = None

        if self.extend_seq_lens is not None:
            self._check_index_tensor("extend_seq_lens", self.extend_seq_lens, bs, _INDEX_DTYPES)
        elif mode is ForwardMode.EXTEND:
            raise BatchError("extend_seq_lens is required in EXTEND mode")

        host_ext = self.extend_seq_lens_cpu
        if host_ext is None and mode is ForwardMode.EXTEND and self.extend_seq_lens.device.type == "cpu":
            host_ext = self.extend_seq_lens.tolist()  # already on the host: no device read
        if expected is not None and host_ext is not None and host_ext != expected:
            raise BatchError(f"extend_seq_lens_cpu must be {expected[0]} for every request in {mode.name} mode")
        if expected is not None:
            host_ext = expected
        if host_ext is None:
            raise BatchError(
                "extend_seq_lens_cpu is required in EXTEND mode on an accelerator: the number of new tokens "
                "must be known on the host without reading the device"
            )
        if any(e < 1 for e in host_ext):
            raise BatchError(f"extend_seq_lens must be >= 1 for every request, got {host_ext}")
        if sum(host_ext) != T:
            raise BatchError(
                f"len(out_cache_loc) == {T} but sum(extend_seq_lens) == {sum(host_ext)}; they must be equal"
            )
        if self.seq_lens_cpu is not None:
            bad = [i for i, (s, e) in enumerate(zip(self.seq_lens_cpu, host_ext)) if s < e]
            if bad:
                raise BatchError(f"seq_lens_cpu[{bad[0]}] = {self.seq_lens_cpu[bad[0]]} is smaller than its "
                                 f"{host_ext[bad[0]]} new tokens (seq_lens include this step's tokens)")
