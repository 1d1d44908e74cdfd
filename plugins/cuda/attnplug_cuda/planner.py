"""The one planner of the cuda backend: a step's shape, the device and the tuning -> how each
kind of layer runs.

``plan_step`` decides once per step (from host ints only: the grid never depends on device
values) which path the step's layers take and, for the full and the SWA layers, the kernel
plan and the PDL schedules of their launches:

* ``ONE_LAUNCH``: ``store_attend`` alone (the step's K/V stored, attention, KV splits merged
  by the last program of each (request, kv head) group), for decode and draft steps of up to
  ``one_launch_rows`` (token, q head) rows a request and ``one_launch_groups_per_sm`` groups an
  SM; with the C++ KV store, a store launch first and ``store_attend`` storing nothing;
* ``PAGED_STORE``: ``paged_attention`` alone, storing the step's K/V in its launch (other
  decode and draft steps of up to ``paged_store_rows`` rows a request, the Triton store);
* ``TWO_LAUNCH``: a KV store launch, then ``paged_attention`` (and its split combine).

The kernel plans (``OneLaunchPlan``, ``PagedPlan``) are the kernels' compile-time choices,
passed to them whole (``PLAN: tl.constexpr``); ``plan_one_launch`` and ``plan_paged`` are the
heuristics, each rule with the reason it holds (the measurements behind them are in
``docs/benchmarks.md`` and the history of this file). No autotuning: a launch must be
capturable in a CUDA graph, and the same shape must always get the same kernel.

An FP8 KV cache (``kv_fp8``) takes the same paths, PDL schedules and graphs (its store is the
Triton one: the C++ store does not quantise, ``TritonBackend`` picks the Triton store for an
FP8 pool) and the same tiles, but for three rules: where a split's key count stands for the
bytes it streams (``*_split_keys``) its keys count ``CudaTuning.fp8_split_keys_factor`` times
as many (a key of an FP8 cache is half the bytes of a 16-bit one); ``paged_attention``'s decode
tiles compile with a register cap at head dim 128 (``CudaTuning.fp8_decode_registers``) and take
twice the keys a block below it or uncapped (the 16-bit tiles' bytes); and ``store_attend``'s key
blocks of steps of several tokens hold at most ``CudaTuning.fp8_block_elems`` elements a 4-warp
program (an FP8 tile is converted in registers; decode tiles keep the 16-bit blocks:
``plan_one_launch``).
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass
from typing import NamedTuple, Optional

from .kernels.pdl import EARLY, PLAIN, PROLOGUE, PROLOGUE_ENTRY, Schedule
from .tuning import CudaTuning

__all__ = [
    "Path",
    "OneLaunchPlan",
    "PagedPlan",
    "LayerPlan",
    "StepPlan",
    "AttentionShape",
    "LaunchShape",
    "plan_step",
    "plan_one_launch",
    "plan_paged",
    "one_launch_serves",
    "one_launch_workspace_numel",
    "paged_workspace_numel",
    "store_tokens",
]


class Path(enum.Enum):
    """How one layer of a step runs (module docstring)."""

    ONE_LAUNCH = "one launch: store_attend"
    PAGED_STORE = "paged_attention storing the step"
    TWO_LAUNCH = "KV store, then paged_attention"


class OneLaunchPlan(NamedTuple):
    """``store_attend``'s plan for one launch shape.

    ``ROWS``: the (token, q head) rows of a request, a power of two (the partials' rows);
    ``TOKENS``: its new tokens, a power of two (the store's tile); ``BLOCK_N``: keys a block;
    ``NUM_SPLITS``: KV splits of a group (a power of two); ``MERGE_CHUNK``: splits merged a
    trip (divides ``NUM_SPLITS``); ``OWN_BLOCK``: the first key block laid out for the
    products before the PDL wait, the step's own keys folded in after the cached ones;
    ``num_warps`` / ``num_stages``: the launch's; ``FP8_PTX``: a half q and an FP8 cache's K/V
    tiles meet in float16 products, the tiles converted by PTX where they are loaded
    (``common.product_tile``)."""

    ROWS: int
    TOKENS: int
    BLOCK_N: int
    NUM_SPLITS: int
    MERGE_CHUNK: int
    OWN_BLOCK: bool
    num_warps: int
    num_stages: int
    FP8_PTX: bool = False


class PagedPlan(NamedTuple):
    """``paged_attention``'s plan for one launch shape: ``BLOCK_M`` rows and ``BLOCK_N`` keys a
    tile, ``NUM_SPLITS`` KV splits (flash-decoding, merged by the combine kernel), ``PHASES``
    (the blocks every row sees whole in an unmasked loop of their own), ``PREFETCH`` (key
    blocks whose cached K/V lines go to L2 before a PDL prologue's wait), the launch's
    ``num_warps`` / ``num_stages``, ``max_registers`` (a thread's register cap, Triton's
    ``maxnreg``; None: the compiler's choice), ``SLOTS_AHEAD`` (with ``PHASES``: each key
    block's slots read from the key table one block ahead, so the K/V tiles pipeline to
    ``num_stages``), ``SETTLE`` (with ``SLOTS_AHEAD``: each key block's products waited for in
    its iteration, ``CudaTuning.settle_flash_products``) and ``ONE_TOKEN`` (decode tiles whose
    requests have one new token each: no key of their range is masked by position)."""

    BLOCK_M: int
    BLOCK_N: int
    NUM_SPLITS: int
    PHASES: bool
    PREFETCH: int
    num_warps: int
    num_stages: int
    max_registers: Optional[int] = None
    SLOTS_AHEAD: bool = False
    ONE_TOKEN: bool = False
    SETTLE: bool = False


@dataclass(frozen=True)
class AttentionShape:
    """What a backend instance fixes: heads, head dim, the widest context
    (``req_to_token``'s columns), the window (None without SWA layers), the device's SMs,
    whether the cache stores FP8 (``kv_fp8``)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_context_len: int
    window: Optional[int]
    num_sms: int
    kv_fp8: bool = False

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads

    def table_width(self, max_q_len: int) -> int:
        """Columns of the SWA window table of a step of up to ``max_q_len`` tokens a request."""
        return min(self.max_context_len, self.window + max_q_len - 1)


class LaunchShape(NamedTuple):
    """One attention launch's shape, from host ints only: ``num_reqs`` requests, ``num_tokens``
    new tokens, up to ``max_q_len`` of them a request, ``num_kv_heads`` kv heads of ``group``
    q heads each, ``head_dim``, ``max_kv_len`` (a host bound of the keys a request reads: the
    key table's width), the ``window`` (None: a full layer), the device's ``num_sms``, whether
    the cache stores FP8 (``kv_fp8``: its keys are half the bytes), whether the grid is a tile
    map written on the device (``tile_map``: a captured EXTEND step, ``plan_step``)."""

    num_reqs: int
    num_tokens: int
    num_kv_heads: int
    group: int
    head_dim: int
    max_q_len: int
    max_kv_len: int
    window: Optional[int]
    num_sms: int
    kv_fp8: bool = False
    tile_map: bool = False


@dataclass(frozen=True)
class LayerPlan:
    """How one kind of layer (full or SWA) of a step runs: its kernel plan, and the PDL
    schedules of its attention launch as the step's first launch after the metadata launch
    (``first``) and later (``later``); both None without PDL."""

    kernel: object  # OneLaunchPlan or PagedPlan
    first: Optional[Schedule]
    later: Optional[Schedule]

    def schedule(self, after_metadata: bool) -> Optional[Schedule]:
        return self.first if after_metadata else self.later


@dataclass(frozen=True)
class StepPlan:
    """A step's path and its full and SWA layers' plans (``swa`` None without SWA layers)."""

    path: Path
    full: LayerPlan
    swa: Optional[LayerPlan]

    def layer(self, is_swa: bool) -> LayerPlan:
        return self.swa if is_swa else self.full


def _pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``)."""
    return 1 << max(0, int(n) - 1).bit_length()


def store_tokens(max_q_len: int) -> int:
    """Tokens of the tile a launch storing the step quantises and stores (``store_attend``'s
    ``TOKENS``, ``paged_attention``'s ``NEW_TOKENS``): the step's host bound ``max_q_len`` as a
    power of two, so each new value is stored once and a decode step stores one token."""
    return _pow2(max(1, max_q_len))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _split_keys(keys: int, shape: LaunchShape, t: CudaTuning) -> int:
    """A split-key bound (``CudaTuning.*_split_keys``) for ``shape``'s cache: the bounds stand
    for the bytes a split streams against what its partials and their merge cost, so an FP8
    cache's keys (half the bytes) count ``fp8_split_keys_factor`` times as many."""
    return keys * t.fp8_split_keys_factor if shape.kv_fp8 else keys


# ----------------------------------------------------------------------------- the step
def one_launch_serves(num_reqs: int, num_kv_heads: int, max_q_len: int, group: int, num_sms: int, t: CudaTuning):
    """Whether ``store_attend`` serves a step: its rows of a request fit one tile and there are
    at most ``one_launch_groups_per_sm`` (request, kv head) groups an SM (larger batches run
    faster through ``paged_attention``, whose programs stream the cache)."""
    return (
        1 <= max_q_len * group <= t.one_launch_rows and num_reqs * num_kv_heads <= t.one_launch_groups_per_sm * num_sms
    )


@functools.lru_cache(maxsize=4096)
def plan_step(
    shape: AttentionShape,
    num_reqs: int,
    num_tokens: int,
    max_q_len: int,
    tuning: CudaTuning,
    pdl: bool,
    tile_map: bool = False,
) -> StepPlan:
    """The plan of a step of ``num_reqs`` requests, ``num_tokens`` new tokens, up to
    ``max_q_len`` of them a request (module docstring); ``pdl``: the backend launches with PDL.

    ``tile_map``: an EXTEND step captured in a graph, whose lengths vary from replay to replay
    within ``num_tokens`` (and ``max_q_len = num_tokens``): a KV store launch, then
    ``paged_attention`` over the tile map the metadata launch writes (one program a request's
    row block and kv head, never a program for rows no request has), unsplit."""
    s, t = shape, tuning
    kinds = [(None, s.max_context_len)]
    if s.window is not None:
        kinds.append((s.window, s.table_width(max_q_len)))
    one = t.one_launch and one_launch_serves(num_reqs, s.num_kv_heads, max_q_len, s.group, s.num_sms, t)
    rows = max(1, max_q_len) * s.group
    if tile_map:
        path = Path.TWO_LAUNCH
    elif one:
        path = Path.ONE_LAUNCH
    elif t.paged_store and t.kv_store == "triton" and rows <= t.paged_store_rows:
        path = Path.PAGED_STORE
    else:
        path = Path.TWO_LAUNCH
    plans = []
    for window, max_kv_len in kinds:
        group, heads = s.group, s.num_kv_heads
        launch = LaunchShape(
            num_reqs, num_tokens, heads, group, s.head_dim, max_q_len, max_kv_len, window, s.num_sms, s.kv_fp8, tile_map
        )
        if path is Path.ONE_LAUNCH:
            kernel = plan_one_launch(launch, t)
            # decode steps whose groups fill a sixteenth of the SMs release at entry, so their
            # layout before the wait overlaps the layers before them
            entry = kernel.OWN_BLOCK and 16 * num_reqs * s.num_kv_heads >= s.num_sms
            first, later = EARLY, PROLOGUE_ENTRY if entry else PROLOGUE
        else:
            kernel = plan_paged(launch, t)
            first, later = (EARLY, PROLOGUE) if path is Path.PAGED_STORE else (PLAIN, PLAIN)
        plans.append(LayerPlan(kernel, first if pdl else None, later if pdl else None))
    return StepPlan(path, plans[0], plans[1] if len(plans) > 1 else None)


# ----------------------------------------------------------------------------- store_attend
@functools.lru_cache(maxsize=4096)
def plan_one_launch(shape: LaunchShape, tuning: CudaTuning) -> OneLaunchPlan:
    """``store_attend``'s plan: key blocks, warps, stages and KV splits for one launch shape."""
    t = tuning
    num_reqs, _, num_kv_heads, group, head_dim, max_q_len, max_kv_len, window, num_sms, _, _ = shape
    rows = _pow2(max(1, max_q_len) * group)
    block_d = _pow2(head_dim)
    span = max(1, max_kv_len)
    if window is not None:
        span = min(span, max(1, max_q_len) + window - 1)
    groups = max(1, num_reqs * num_kv_heads)

    def can_split(splits: int, programs: int, split_keys: int) -> bool:
        return (
            splits * 2 <= t.one_launch_max_splits
            and groups * splits * 2 <= programs * num_sms
            and span >= splits * 2 * split_keys
            and splits * 2 * rows <= t.merge_reads
        )

    # Split until the grid holds one program an SM, each split keeping enough keys that the
    # merge costs less than it saves. A window of at most one 256-key block runs unsplit once
    # the groups alone cover a quarter of the SMs: its grid leaves room for the next layer's
    # programs, whose prologue then overlaps this layer.
    windowed = window is not None and span == max(1, max_q_len) + window - 1
    unsplit = windowed and span <= 256 and 4 * groups >= num_sms
    splits = 1
    while not unsplit and can_split(splits, 1, _split_keys(t.one_launch_split_keys, shape, t)):
        splits *= 2
    alone = splits
    # Decode steps split on into 4-warp programs of at most 128-key blocks, two an SM
    # ("paired"): while one waits on its table and K/V round trips, the other's loads are in
    # flight. A window of at most 256 keys takes two splits once its groups cover a third of
    # the SMs (and no more than all of them).
    decode = max_q_len <= 1
    if decode and unsplit and num_sms <= 3 * groups and groups <= num_sms:
        splits = 2
    # Steps of several tokens a request pair their programs the same way, windowed layers
    # too, once their groups cover a quarter of the SMs.
    several = not decode and num_sms <= 4 * groups
    paired_keys = _split_keys(t.paired_split_keys, shape, t)
    while ((decode and not windowed) or several) and can_split(splits, t.paired_programs_per_sm, paired_keys):
        splits *= 2
    paired = splits > alone
    # One key block covers a split's keys where it can (each trip of the loop is a dependent
    # chain). A span set by the window is the real range: the block covers a split's share as
    # the kernel cuts it (whole 16-key steps). A span from ``max_kv_len`` is a host bound,
    # often loose: the largest power of two within the share. Blocks reach 256 keys (8 warps)
    # for an unsplit window and for shares of 512 to 1,024 keys; wider shares keep 128-key
    # blocks, pipelined.
    share = _cdiv(span, splits)
    if windowed:
        block_n = _pow2(_cdiv(share, 16) * 16)
    else:
        block_n = _pow2(share + 1) // 2
    # More groups than SMs (never split): several programs share an SM, so 4-warp programs of
    # at most 128 keys a block, pipelined.
    crowded = groups > num_sms
    wide = 256 if not (crowded or paired) and (unsplit or 512 <= share <= 1024) else 128
    block_n = max(16, min(block_n, wide if block_d <= 128 else 64, t.max_block_n))
    if shape.kv_fp8 and not decode:
        # An FP8 block is converted to q's dtype in registers, beside its bytes, where a 16-bit
        # block reaches the products through shared memory: compiled for sm_90, the 16-bit
        # limits (128 x 128 elements a 4-warp program, 256 x 128 an 8-warp one) spill the FP8
        # blocks of draft steps. Half of them: fp8_block_elems a 4-warp program, twice that for
        # a program alone on its SM (8 warps once the block is 128 x 128). Decode tiles (a
        # group's few rows) keep the 16-bit blocks: a step is a chain of dependent key blocks,
        # and halving the blocks doubled its trips (docs/benchmarks.md, "The FP8 decode tiles").
        alone = not (crowded or paired)
        block_n = max(16, min(block_n, t.fp8_block_elems * (2 if alone else 1) // block_d))
    # Software pipelining only where a split's share holds more than eight key blocks (four
    # for paired programs), or the programs are crowded: one or a few blocks run faster in one
    # stage.
    stages = 2 if crowded or share > (4 if paired else 8) * block_n else 1
    # 8 warps for a block of 128 x 128 or more alone on its SM; 4 otherwise (programs sharing
    # an SM); a device may ask more of every large block (``min_flash_warps``).
    big = block_n * block_d >= 128 * 128
    warps = 8 if big and not (crowded or paired) else 4
    if big:
        warps = max(warps, t.min_flash_warps)
    own_block = decode and groups <= num_sms
    return OneLaunchPlan(
        ROWS=rows,
        TOKENS=store_tokens(max_q_len),
        BLOCK_N=block_n,
        NUM_SPLITS=splits,
        MERGE_CHUNK=max(1, min(splits, t.merge_rows // rows)),
        # Decode steps of up to one group an SM lay their first key block out for the
        # products before the wait and fold the step's own key in as a vector afterwards.
        OWN_BLOCK=own_block,
        num_warps=warps,
        num_stages=stages,
        # FP8 tiles by PTX (``fp8_ptx_convert``; docs/benchmarks.md, "The FP8 decode tiles")
        # where a tile holds at least four elements a thread (the conversion's unit), but for a
        # first block of 128 x 128 laid out before the wait: compiled for sm_90 by Triton 3.9 it
        # spills 232-240 bytes that way (none under 3.6, 80 with Triton's cast)
        FP8_PTX=shape.kv_fp8
        and t.fp8_ptx_convert
        and block_n * block_d >= 4 * 32 * warps
        and not (own_block and block_n * block_d >= 128 * 128),
    )


def one_launch_workspace_numel(head_dim: int, num_sms: int, tuning: CudaTuning) -> int:
    """fp32 elements of a ``store_attend`` workspace serving every plan on a GPU of ``num_sms``
    SMs: twice the most programs of a planned split grid (room for plans a test or a
    benchmark sets by hand), at least ``4 * one_launch_max_splits``, each with
    ``one_launch_rows`` rows of partials."""
    t = tuning
    programs = 2 * max(t.paired_programs_per_sm * num_sms, 2 * t.one_launch_max_splits)
    return programs * t.one_launch_rows * (head_dim + 2)


# ----------------------------------------------------------------------------- paged_attention
@functools.lru_cache(maxsize=4096)
def plan_paged(shape: LaunchShape, tuning: CudaTuning) -> PagedPlan:
    """``paged_attention``'s plan: tiles, warps, stages, KV splits, loop shape and prefetch
    depth for one launch shape."""
    t = tuning
    num_reqs, num_tokens, num_kv_heads, group, head_dim, max_q_len, max_kv_len, window, num_sms, _, tile_map = shape
    block_d = _pow2(head_dim)
    rows = max(1, max_q_len) * group
    block_m = min(max(16, _pow2(rows)), 128)
    max_registers = None
    if block_m <= 16:  # decode / short verify: streaming K and V is the whole cost
        block_n = 64 if block_d <= 128 else 32
        num_warps, num_stages = 4, 2
        if shape.kv_fp8 and block_d <= 128:
            # FP8 blocks are converted in registers. At head dim 128 under the register cap
            # (``fp8_decode_registers``) four programs of 64-key tiles share an SM without
            # spills, where uncapped tiles of 128 keys (the 16-bit tiles' bytes) fit two;
            # three stages there put the key table's read two blocks ahead of its products
            # (Triton's pipeliner copies it asynchronously, at no more shared memory): faster
            # over FP8, slower over 16-bit tiles. Otherwise (uncapped, or narrower heads, whose
            # 128-key tiles fit three) 128 keys a block, the faster uncapped.
            if block_d == 128 and t.fp8_decode_registers is not None:
                max_registers = t.fp8_decode_registers
                num_stages = 3
            else:
                block_n *= 2
    else:  # flash-attention tiles: 128 rows of 128 keys (64 at head dim 256), half the keys below 128 rows
        block_n = (128 if block_d <= 128 else 64) // (1 if block_m == 128 else 2)
        num_warps, num_stages = max(8 if block_m * block_d >= 128 * 128 else 4, t.min_flash_warps), 2
    block_n = min(block_n, t.max_block_n)
    span = max(1, max_kv_len)
    if window is not None:
        span = min(span, max(1, max_q_len) + window - 1)
    base = max(1, num_reqs * num_kv_heads * _cdiv(rows, block_m))
    splits = 1
    # Decode tiles split until about ``paged_programs_per_sm`` programs an SM exist. Flash
    # tiles split only while their programs do not cover the SMs once: a prefill's programs
    # already hold most of the work, and a split adds float32 partials and a combine launch
    # (docs/benchmarks.md, "Open": the 1,024-token prompt).
    target = (t.paged_programs_per_sm if block_m <= 16 else 1) * num_sms
    if base < target and not tile_map:  # a tile map runs one split (its grid is the row blocks)
        splits = min(_cdiv(target, base), _cdiv(span, _split_keys(t.paged_split_keys, shape, t)), t.paged_max_splits)
        splits = max(1, min(splits, t.paged_split_tokens // max(1, num_tokens)))
    # Flash tiles of head dims up to 128 read their slots ahead (faster at 128,
    # docs/benchmarks.md "Prefill"); at 256, measured slower that way, in the block's iteration.
    ahead = block_m > 16 and block_d <= 128
    # The decode tiles send their first key block's cached K/V lines to L2 before a PDL
    # prologue's wait; more blocks (a whole window) cost more than they save.
    return PagedPlan(
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        NUM_SPLITS=splits,
        PHASES=block_m > 16,
        PREFETCH=1 if block_m <= 16 else 0,
        num_warps=num_warps,
        num_stages=num_stages,
        max_registers=max_registers,
        SLOTS_AHEAD=ahead,
        ONE_TOKEN=block_m <= 16 and max_q_len <= 1,
        # the read-ahead tiles' P·V products in flight across the loop's back edge make ptxas
        # serialise every wgmma of the kernel (sm_90): waited in their block's iteration instead
        SETTLE=ahead and t.settle_flash_products,
    )


def paged_workspace_numel(max_num_tokens: int, num_heads: int, head_dim: int, tuning: CudaTuning) -> int:
    """fp32 elements of a ``paged_attention`` workspace serving every plan of up to
    ``max_num_tokens`` tokens (allocate it once, e.g. with the graph buffers)."""
    pairs = min(tuning.paged_split_tokens, max(1, max_num_tokens) * tuning.paged_max_splits)
    return pairs * num_heads * (head_dim + 2)
