"""``AscendOps``: the ascend backend's op layer over caches an engine owns (``attnplug.ops``).

It calls the same torch_npu operators as ``AscendBackend``, the same way (``fused``), wherever
they can serve the call. Where they cannot, it runs the portable PyTorch path
(``PortableOps``, which it extends). Shapes and semantics are ``PagedOps``': q / k / v float16
or bfloat16, caches ``[N, P, Hkv, D]`` or ``[S, Hkv, D]``, block tables ``[B, M]``.

* ``plan`` (once per step and cache group) builds the portable step: checks, slot table and
  token map, all on the device. When the block size is one of ``native_block_sizes`` and no
  graph capture is running, it also gets the fused attention's host lengths ONCE:
  ``actual_seq_qlen`` (cumulative new tokens) and ``actual_seq_kvlen`` (``seq_lens``). They
  come from ``query_start_loc_cpu`` / ``seq_lens_cpu`` when the engine passes them. Otherwise
  they are one device-to-host read of ``query_start_loc`` and ``seq_lens`` (``host_reads``
  counts these). The plan checks them and keeps the block table as int32, with negative
  padding read as block 0, which masks or table lengths keep out of every request. Every layer
  of the group reuses all of this.
* ``store_kv`` calls ``npu_scatter_pa_kv_cache`` on contiguous ``[N, P, Hkv, D]`` caches whose
  ``P`` is a native block size. A token whose slot is outside ``[1, S)`` writes slot 0's own
  value back, so nothing changes.
* ``attend`` calls ``npu_fused_infer_attention_score_v2`` (v1 where there is no ``_v2``) in
  TND, over the caches viewed ``[N, P, Hkv * D]``. A full layer uses ``sparse_mode=3`` over
  the request's table. A window of ``W`` keys uses ``sparse_mode=4`` with
  ``pre_tokens = W - 1``, over the table clipped to start at the block of the first new
  token's window. That table is built on the device once per step, window and cache size.
  Sinks go in as ``learnable_sink``.

The portable path serves (``fallbacks`` counts each reason; each is logged once):

* a block size outside ``native_block_sizes`` (every call of that step, with no host read);
* a step planned, or attention run, during a graph capture (the operator's host lengths would
  stay those of the capture);
* caches that are not contiguous, such as the K and V halves of an interleaved cache, or a
  flat ``[S, Hkv, D]`` cache at store. The operators take contiguous tensors only;
* a head dim the backend does not declare (``head_dims``); more than 256 query heads or more
  than 64 per KV head; a logit soft-cap (the operator has none); sinks without ``_v2``; a
  cache of more than ``2**31 - 1`` elements, or ``Hkv * D > 65535``; a batch needing more
  blocks than the cache holds (the operator's rule; shared prefixes can do that).

It refuses with ``OpsInputError``, before writing anything:

* whatever ``PagedOps`` refuses;
* an FP8 cache (``fp8_kv_dtypes`` is the backend's, which declares none);
* on the fused path, host lengths that break the contract: ``query_start_loc`` not starting
  at 0, decreasing, or ending anywhere but ``num_tokens``; more new tokens than
  ``seq_lens``; lengths past ``max_query_len`` / ``max_seq_len`` or past the block table.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from attnplug.ops.base import OpsInputError, PagedStep
from attnplug.ops.portable import PortableOps

from .fused import (
    FIA_DTYPES,
    MAX_KV_HIDDEN,
    compressed_mask,
    is_capturing,
    layer_kwargs,
    operator_problems,
    store_skipping,
)
from .ops import INT32_MAX, NpuOps

__all__ = ["AscendOps", "AscendStep"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AscendStep(PagedStep):
    """``PagedStep``, whose portable fields are always filled, plus what the fused attention
    reads.

    ``block_table`` is ``[B, M]`` int32 with negative entries set to 0. ``block_size`` is the
    plan's. ``q_cum`` ``[B]`` is the host cumulative new tokens (``actual_seq_qlen``) and
    ``kv_lens`` ``[B]`` the host ``seq_lens``. When ``block_table`` is None the step runs on
    the portable path, and ``portable_reason`` says why (it is None for an empty step).
    ``derived`` maps ``(window, cache blocks)`` to the table, KV lengths and blocks needed that
    a layer passes; the first layer that needs them builds them.
    """

    block_table: Optional[torch.Tensor] = None
    block_size: int = 0
    q_cum: Optional[List[int]] = None
    kv_lens: Optional[List[int]] = None
    portable_reason: Optional[str] = None
    derived: Dict[tuple, tuple] = field(default_factory=dict, compare=False, repr=False)

    @property
    def fused(self) -> bool:
        """Whether the fused attention can read this step."""
        return self.block_table is not None


def _fail(message: str) -> None:
    raise OpsInputError(message)


def _host_ints(values, name: str, count: int) -> List[int]:
    """``values`` (a CPU integer tensor or a sequence of ints) as ``count`` host ints."""
    if isinstance(values, torch.Tensor):
        if values.device.type != "cpu" or values.dtype not in (torch.int32, torch.int64) or values.dim() != 1:
            got = f"{values.dtype} {tuple(values.shape)} on {values.device}"
            _fail(f"{name} must be a 1-D int32/int64 CPU tensor, got {got}")
        values = values.tolist()
    try:
        out = [operator.index(v) for v in values]
    except TypeError:
        _fail(f"{name} must hold integers, got {values!r}")
    if len(out) != count:
        _fail(f"{name} has {len(out)} entries, the step needs {count}")
    return out


class AscendOps(PortableOps):
    """Store and attend over caller-owned paged caches with torch_npu's fused operators, and
    the portable path where they cannot serve (module docstring)."""

    name = "ascend"
    fp8_kv_dtypes: tuple = ()

    def __init__(
        self,
        device,
        npu: NpuOps,
        *,
        name: Optional[str] = None,
        dtypes: Sequence[torch.dtype] = FIA_DTYPES,
        head_dims: Sequence[int] = (64, 128, 256),
        native_block_sizes: Sequence[int] = (128, 256, 512),
        fp8_kv_dtypes: Sequence[torch.dtype] = (),
        device_type: str = "npu",
    ) -> None:
        """``npu``: the resolved operators (``ops.load_ops``). ``dtypes``, ``head_dims``,
        ``native_block_sizes`` and ``fp8_kv_dtypes`` are what the backend declares (its
        ``dtypes``, ``head_dims``, ``page_sizes`` and FP8 dtypes, of which it has none).
        ``device_type`` is the backend's device type; ``device`` must be of it."""
        dev = torch.device(device)
        label = name or self.name
        if dev.type != device_type:
            raise ValueError(f"the {label} ops run on {device_type} devices (the fused operators'), got {dev}")
        unserved = [d for d in dtypes if d not in FIA_DTYPES]
        if unserved:
            raise ValueError(f"the {label} ops' dtypes {unserved} are not the fused operators' {FIA_DTYPES}")
        super().__init__(dev, name=name, dtypes=dtypes, fp8_kv_dtypes=fp8_kv_dtypes)
        #: the resolved operators
        self.npu = npu
        #: the head dims the fused attention serves here (the backend's declared ones)
        self.head_dims = tuple(int(d) for d in head_dims)
        #: the block sizes whose caches the fused operators serve; any other block size runs the
        #: portable path (the conformance suite's ``check_paged_ops`` runs its cases at these)
        self.native_block_sizes = tuple(sorted({int(p) for p in native_block_sizes}))
        #: ``"<op>: <reason>"`` -> how many calls the portable path served for it
        self.fallbacks: Counter = Counter()
        #: plans that read their host lengths from the device (one read each)
        self.host_reads = 0
        self._mask: Optional[torch.Tensor] = None

    # ------------------------------------------------------------------ per step
    def plan(
        self,
        query_start_loc,
        seq_lens,
        block_table,
        block_size,
        *,
        num_tokens,
        max_query_len,
        max_seq_len,
        query_start_loc_cpu=None,
        seq_lens_cpu=None,
    ) -> AscendStep:
        """``PagedOps.plan``, and the fused attention's host lengths (module docstring).
        ``query_start_loc_cpu`` / ``seq_lens_cpu``: the same lengths on the host (CPU integer
        tensors or int sequences, equal to the device tensors), if the engine has them; given
        both, the plan reads nothing from the device."""
        step = super().plan(
            query_start_loc,
            seq_lens,
            block_table,
            block_size,
            num_tokens=num_tokens,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
        )
        portable = {f.name: getattr(step, f.name) for f in dataclasses.fields(PagedStep)}
        P = operator.index(block_size)  # an integer >= 1: super().plan checked it
        if P not in self.native_block_sizes:
            why = f"block size {P} (the fused attention serves {list(self.native_block_sizes)})"
            return AscendStep(**portable, portable_reason=why)
        if is_capturing(self.npu):
            why = "planned during a graph capture (the fused attention's host lengths would stay the capture's)"
            return AscendStep(**portable, portable_reason=why)
        if step.num_tokens == 0 or step.num_reqs == 0:
            return AscendStep(**portable)
        qsl, seq = self._host_lengths(step.num_reqs, query_start_loc, seq_lens, query_start_loc_cpu, seq_lens_cpu)
        self._check_lengths(step, qsl, seq, int(block_table.shape[1]), P)
        table = block_table[: step.num_reqs].to(torch.int32)
        table = torch.where(table >= 0, table, 0)  # -1 padding: block 0, past the request's keys
        return AscendStep(**portable, block_table=table, block_size=P, q_cum=qsl[1:], kv_lens=seq)

    def _host_lengths(self, B, query_start_loc, seq_lens, qsl_cpu, seq_cpu) -> Tuple[List[int], List[int]]:
        """``(query_start_loc, seq_lens)`` as host ints: the engine's host copies, or one read."""
        if qsl_cpu is not None and seq_cpu is not None:
            return _host_ints(qsl_cpu, "query_start_loc_cpu", B + 1), _host_ints(seq_cpu, "seq_lens_cpu", B)
        self.host_reads += 1
        both = torch.cat([query_start_loc.long(), seq_lens.long()]).tolist()  # the step's one device read
        return both[: B + 1], both[B + 1 :]

    @staticmethod
    def _check_lengths(step: PagedStep, qsl: List[int], seq: List[int], M: int, P: int) -> None:
        if qsl[0] != 0:
            _fail(f"query_start_loc must start at 0, got {qsl[0]}")
        q = [b - a for a, b in zip(qsl, qsl[1:])]
        bad = next((i for i, n in enumerate(q) if n < 0), None)
        if bad is not None:
            _fail(f"query_start_loc decreases at request {bad} ({qsl[bad]} then {qsl[bad + 1]})")
        if qsl[-1] != step.num_tokens:
            _fail(f"query_start_loc ends at {qsl[-1]}, but num_tokens is {step.num_tokens}")
        bad = next((i for i, (n, s) in enumerate(zip(q, seq)) if n > s), None)
        if bad is not None:
            _fail(
                f"request {bad} has {q[bad]} new tokens but seq_lens[{bad}] = {seq[bad]} "
                "(seq_lens counts the new tokens too)"
            )
        if max(q) > step.max_query_len:
            _fail(f"a request has {max(q)} new tokens, more than max_query_len={step.max_query_len}")
        if max(seq) > step.max_seq_len:
            _fail(f"seq_lens holds {max(seq)}, more than max_seq_len={step.max_seq_len}")
        if max(seq) > M * P:
            _fail(f"block_table has {M} blocks of {P} slots a request; seq_lens holds {max(seq)} keys")

    # ------------------------------------------------------------------ per layer
    def store_kv(self, key, value, key_cache, value_cache, slot_mapping, *, k_scale=None, v_scale=None) -> None:
        kc, vc, n = self.check_store(key, value, key_cache, value_cache, slot_mapping)
        ks, vs = self.check_scales(k_scale, v_scale, kc)
        if n == 0:
            return
        why = self._store_problem(key_cache, value_cache)
        if why is not None:
            self._fall_back("store_kv", why)
            self._store(key[:n], value[:n], kc, vc, slot_mapping[:n], ks, vs)
            return
        slots = slot_mapping[:n]
        keep = (slots >= 1) & (slots < kc.shape[0])
        store_skipping(self.npu, key[:n], value[:n], key_cache, value_cache, torch.where(keep, slots, 0), keep)

    def _store_problem(self, key_cache: torch.Tensor, value_cache: torch.Tensor) -> Optional[str]:
        if key_cache.dim() != 4 or value_cache.shape != key_cache.shape:
            return "caches that are not both [blocks, block_size, Hkv, D] (the KV store's layout)"
        if key_cache.shape[1] not in self.native_block_sizes:
            return f"block size {key_cache.shape[1]} (the fused operators serve {list(self.native_block_sizes)})"
        if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
            return _NOT_CONTIGUOUS
        return None

    def attend(
        self,
        query,
        key_cache,
        value_cache,
        step,
        *,
        scale,
        window=None,
        softcap=None,
        sinks=None,
        out=None,
        k_scale=None,
        v_scale=None,
    ):
        kc, vc, result = self.check_attend(query, key_cache, value_cache, step, scale, window, softcap, sinks, out)
        ks, vs = self.check_scales(k_scale, v_scale, kc)
        if step.num_tokens == 0 or step.num_reqs == 0:
            return result
        why = self._attend_problem(step, query, kc, vc, softcap, sinks)
        derived = None
        if why is None:
            derived = self._derived(step, window, kc.shape[0] // step.block_size)
            if derived[2] > kc.shape[0] // step.block_size:
                why = f"a batch needing {derived[2]} blocks, more than the cache's {kc.shape[0] // step.block_size}"
        if why is not None:
            self._fall_back("attend", why)
            return self._attend(
                query, kc, vc, step, result, ks, vs, scale=scale, window=window, softcap=softcap, sinks=sinks
            )
        table, kv_lens, _ = derived
        H, D, hkv, P = query.shape[1], query.shape[2], kc.shape[1], step.block_size
        kwargs = layer_kwargs(
            self.npu,
            window=window,
            q_cum=step.q_cum,
            kv_lens=kv_lens,
            block_table=table,
            block_size=P,
            num_heads=H,
            num_kv_heads=hkv,
            scale=float(scale),
            mask=self._compressed_mask(),
        )
        if sinks is not None:
            kwargs = self.npu.with_sinks(kwargs, sinks)
        paged = (kc.shape[0] // P, P, hkv * D)  # (blocknum, blocksize, H)
        attn = self.npu.attention(query.contiguous(), kc.view(paged), vc.view(paged), kwargs)
        if out is None:
            return attn
        result.copy_(attn)
        return result

    def _attend_problem(self, step, query, kc, vc, softcap, sinks) -> Optional[str]:
        """Why the fused attention cannot serve this call (None: it can)."""
        if not isinstance(step, AscendStep) or not step.fused:
            return getattr(step, "portable_reason", None) or "a step these ops did not plan for the fused attention"
        if is_capturing(self.npu):
            return "attention during a graph capture (the fused attention's host lengths would stay the capture's)"
        if softcap is not None:
            return "a logit soft-cap (the fused attention has none)"
        if sinks is not None and not self.npu.has_sinks:
            return f"sinks ({self.npu.source} has no npu_fused_infer_attention_score_v2: no learnable_sink)"
        H, D, hkv = query.shape[1], query.shape[2], kc.shape[1]
        if D not in self.head_dims:
            return f"head_dim={D} (the fused path serves the declared {list(self.head_dims)})"
        problems = operator_problems(kc.dtype, D, H, hkv)
        if problems:
            return "; ".join(problems)
        if not (kc.is_contiguous() and vc.is_contiguous()):
            return _NOT_CONTIGUOUS
        if kc.shape[0] % step.block_size:
            return f"caches of {kc.shape[0]} slots, not whole blocks of {step.block_size}"
        if kc.numel() > INT32_MAX:
            return f"a cache of {kc.numel()} elements (the paged attention takes at most 2**31 - 1)"
        if hkv * D > MAX_KV_HIDDEN:
            return f"Hkv * D = {hkv * D} (the paged attention's (blocknum, blocksize, H) takes at most {MAX_KV_HIDDEN})"
        return None

    def _derived(self, step: AscendStep, window: Optional[int], num_blocks: int) -> tuple:
        """``(block_table, kv_lens, blocks needed)`` a layer of ``window`` over a cache of
        ``num_blocks`` passes; built once per step (``step.derived``). A window's table starts at
        the block of its first new token's window start (``kv_lens`` counted from there), as the
        backend's SWA tables do. A block past the cache becomes block 0."""
        key = (window, num_blocks)
        got = step.derived.get(key)
        if got is not None:
            return got
        P, table, kv = step.block_size, step.block_table, step.kv_lens
        if window is not None:
            q = [b - a for a, b in zip([0] + step.q_cum, step.q_cum)]
            starts = [max(s - n - window + 1, 0) // P for s, n in zip(kv, q)]
            kv = [s - b * P for s, b in zip(kv, starts)]
            M = table.shape[1]
            width = min(M, -(-(window + max(q) - 1) // P) + 1)
            qsl = step.query_start_loc.long()
            new = qsl[1:] - qsl[:-1]
            first = (step.seq_lens.long() - new - window + 1).clamp_min(0) // P  # on the device, like `starts`
            cols = first[:, None] + torch.arange(width, device=table.device)
            table = torch.where(cols < M, torch.gather(table, 1, cols.clamp_max(M - 1)), 0)
        table = torch.where(table < num_blocks, table, 0).to(torch.int32)
        got = (table, kv, sum(-(-s // P) for s in kv))
        step.derived[key] = got
        return got

    # ------------------------------------------------------------------ helpers
    def _compressed_mask(self) -> torch.Tensor:
        if self._mask is None:
            self._mask = compressed_mask(self.device)
        return self._mask

    def _fall_back(self, op: str, why: str) -> None:
        reason = f"{op}: {why}"
        if reason not in self.fallbacks:
            logger.info("attnplug: the %s op layer runs %s on the portable PyTorch path for %s", self.name, op, why)
        self.fallbacks[reason] += 1


_NOT_CONTIGUOUS = (
    "caches that are not contiguous (the K and V halves of an interleaved cache, say): "
    "the fused operators take contiguous tensors only"
)
