"""``CudaTuning``: every choice of the cuda backend that a step's shape does not force.

One frozen object holds them: the user's switches (PDL, the KV store kernel) and the
planner's bounds (``planner.py`` reads nothing else). ``CudaTuning.from_env()`` is what a
backend gets by default; a variant is ``dataclasses.replace(tuning, ...)``, passed to
``CudaBackend(..., tuning=...)``.

The paths a decode or draft step's layers can take (``planner.plan_step``):

* ``one_launch``: steps of up to ``one_launch_rows`` (token, q head) rows a request and up to
  ``one_launch_groups_per_sm`` (request, kv head) groups an SM run ONE launch a layer,
  ``store_attend`` (store, attention and split merge);
* ``paged_store``: other steps of up to ``paged_store_rows`` rows a request store their K/V
  inside the ``paged_attention`` launch;
* otherwise, and for extends, a KV store launch, then ``paged_attention`` (and its split
  combine when decode splits the KV range).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

from . import env

__all__ = ["CudaTuning"]


@dataclass(frozen=True)
class CudaTuning:
    """The cuda backend's choices (module docstring). Bounds are ints >= 1; split counts and
    row bounds powers of two."""

    #: launch with Programmatic Dependent Launch where the device has it
    #: (``ATTNPLUG_DISABLE_PDL=1``: False)
    pdl: bool = True
    #: the KV store kernel: ``triton``, or ``cpp`` (the CUDA C++ store; ``ATTNPLUG_KV_STORE``).
    #: An FP8 pool is stored by the Triton kernels whatever this says: the C++ store does not
    #: quantise (``TritonBackend`` records why in ``kv_store_reason``)
    kv_store: str = "triton"
    #: small decode and draft steps run one ``store_attend`` launch a layer
    one_launch: bool = True
    #: other decode and draft steps store their K/V inside the ``paged_attention`` launch
    paged_store: bool = True

    # ``store_attend`` (one launch a layer)
    #: most (token, q head) rows of one request
    one_launch_rows: int = 16
    #: most (request, kv head) groups an SM
    one_launch_groups_per_sm: int = 2
    #: most KV splits of a group
    one_launch_max_splits: int = 32
    #: a split of a program alone on its SM covers at least this many keys
    one_launch_split_keys: int = 32
    #: programs an SM of a paired plan (4-warp programs sharing each SM)
    paired_programs_per_sm: int = 2
    #: a split of a paired plan covers at least this many keys
    paired_split_keys: int = 64
    #: most (split, row) pairs the merge holds at once
    merge_rows: int = 64
    #: most (split, row) pairs one merge reads: the split count stops there
    merge_reads: int = 256

    # ``paged_attention``
    #: most (token, q head) rows of one request whose K/V it stores in its launch
    paged_store_rows: int = 16
    #: most KV splits of a program group (flash-decoding)
    paged_max_splits: int = 64
    #: a split covers at least this many keys
    paged_split_keys: int = 256
    #: at most this many (token, split) pairs get a partial: bounds the workspace
    paged_split_tokens: int = 2048
    #: split a decode tile's KV range until about this many programs an SM exist (flash tiles
    #: split only while their programs do not cover the SMs once)
    paged_programs_per_sm: int = 3

    # FP8 KV caches
    #: an FP8 cache's keys count this many times in the split-key bounds above
    #: (``one_launch_split_keys``, ``paired_split_keys``, ``paged_split_keys``): each bound
    #: stands for the bytes a split streams against the fixed cost of its partials and their
    #: merge, and an FP8 key is half the bytes of a 16-bit one (the tiles and paths stay the
    #: 16-bit ones). Chosen from the code, not yet timed: 1 gives FP8 the 16-bit split counts
    #: (more, shorter splits), the alternative to measure.
    fp8_split_keys_factor: int = 2
    #: most elements (keys x head dim) of an FP8 cache's key block in a 4-warp ``store_attend``
    #: program of a draft step (twice that alone on an SM, 8 warps; decode steps keep the
    #: 16-bit blocks): its tiles are converted in registers, and compiled for sm_90 (Triton
    #: 3.9) the 16-bit plans' 128 x 128 (4 warps) and 256 x 128 (8 warps) blocks spill there,
    #: 64 x 128 and 128 x 128 do not (a power of two)
    fp8_block_elems: int = 8192
    #: registers a thread of ``paged_attention``'s FP8 decode tiles at head dim 128 may hold
    #: (Triton's ``maxnreg``), or None: the compiler's choice (and 128-key blocks). The tiles
    #: convert their K/V blocks in registers: uncapped, compiled for sm_90 they take 190-210
    #: registers (2 programs an SM); at 128 they hold 64-key blocks without spills (4
    #: programs an SM). An NVIDIA compile option: other devices' defaults have None
    fp8_decode_registers: Optional[int] = 128
    #: ``store_attend`` converts an FP8 cache's K/V tiles to float16 by inline PTX where they
    #: are loaded, for float16 products (``common.product_tile``), so they reach the products as
    #: 16-bit tiles through shared memory instead of being read a byte at a time there. An
    #: NVIDIA compile option: other devices' defaults have False (the interpreter, which runs no
    #: PTX, converts with Triton's cast: the same values). (``paged_attention``'s decode tiles
    #: measured slower that way: docs/benchmarks.md, "The FP8 decode tiles".)
    fp8_ptx_convert: bool = True
    #: ``paged_attention``'s flash tiles that read their slots ahead (``PagedPlan.SLOTS_AHEAD``)
    #: wait for each key block's products in that block's iteration (``common.settle``, an
    #: empty inline-asm use of the accumulator): with the P·V products in flight across the
    #: loop's back edge, ptxas serialises every ``wgmma`` of the kernel (its warning C7515,
    #: compiled for sm_90). An NVIDIA compile option: other devices' defaults have False.
    settle_flash_products: bool = True

    # the device's tiles (``TritonDevicePart.default_tuning``: other devices other defaults)
    #: the widest key block of any plan (a power of two >= 16)
    max_block_n: int = 256
    #: the fewest warps of a flash-attention tile (``paged_attention`` tiles of more than 16
    #: rows, ``store_attend`` blocks of 128 x 128 or more)
    min_flash_warps: int = 4

    def __post_init__(self) -> None:
        if self.kv_store not in env.KV_STORE_KERNELS:
            raise ValueError(f"kv_store must be one of {env.KV_STORE_KERNELS}, got {self.kv_store!r}")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type in ("bool", bool):
                if not isinstance(value, bool):
                    raise ValueError(f"{f.name} must be a bool, got {value!r}")
            elif f.type in ("int", int):
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise ValueError(f"{f.name} must be an int >= 1, got {value!r}")
        regs = self.fp8_decode_registers
        if regs is not None and (isinstance(regs, bool) or not isinstance(regs, int) or not 24 <= regs <= 255):
            raise ValueError(f"fp8_decode_registers must be None or an int in [24, 255], got {regs!r}")
        if self.max_block_n < 16:
            raise ValueError(f"max_block_n must be >= 16, got {self.max_block_n}")
        for name in (
            "one_launch_rows",
            "paged_store_rows",
            "one_launch_max_splits",
            "paged_max_splits",
            "max_block_n",
            "fp8_block_elems",
        ):
            value = getattr(self, name)
            if value & (value - 1):
                raise ValueError(f"{name} must be a power of two, got {value}")

    @classmethod
    def from_env(cls) -> "CudaTuning":
        """The defaults with the user's environment applied (``ATTNPLUG_DISABLE_PDL``,
        ``ATTNPLUG_KV_STORE``; a value that does not parse raises ``EnvError``)."""
        return cls(pdl=not env.pdl_disabled(), kv_store=env.kv_store_kernel())
