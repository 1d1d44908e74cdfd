"""Subtle mutants of the reference backend: each one a small, plausible kernel bug of the kind
a vendor's backend could ship (the catalogue; one submodule a topic, listed below).
``tests/conformance/test_conformance_mutants.py`` shows that each one is really wrong (a
direct comparison or a direct observation of the broken rule, its ``WITNESS``) and that the
conformance suite fails it with a message naming the rule.

Every mutant subclasses ``ReferenceBackend`` and overrides one method (or wraps one helper),
so it keeps working when the reference gets small edits. ``NoOpMutant`` is the control: it
overrides a method without changing anything and must pass the suite.

A mutant's ``WITNESS`` says how it is shown to be wrong:

* ``("output", spec overrides, plan)``: twin worlds (the mutant and the reference, same
  inputs and slots) run ``plan``; the outputs differ beyond the dtype's tolerance, the KV
  caches differ, or the mutant raises;
* ``("sync",)``: its graph-replay metadata makes a host read or a data-dependent-size op
  (seen by a minimal dispatcher-level counter in the test, independent of the suite);
* ``("mapping",)``: rewriting the full->SWA mapping after the metadata call changes its
  output (the layers read the mapping);
* ``("dtype",)``: a half-precision step returns another dtype;
* ``("no_save",)``: ``forward(save_kv_cache=False)`` changes the KV cache;
* ``("ops",)``: the op layer (``paged_ops``) over an interleaved, paged cache an engine owns
  stores or attends wrongly (float64 attention, the untouched slots).

The submodules: ``kv_slots`` (rule 1, the KV slots and paging), ``precision`` (tiling,
accumulation, head dims, split-KV, scaling, output dtype), ``masking`` (window, causal mask,
GQA, batch rows, prefixes, the host mirror), ``softcap_sinks``, ``sync`` (rule 2) and ``ops``
(the op layer engines call). A
mutant is named ``mutants:ClassName`` wherever a backend target is given.
"""

from __future__ import annotations

from attnplug.backends.reference import ReferenceBackend

from .kv_slots import (
    IdentityTranslation,
    IgnoresSaveKvCacheFalse,
    NeighbourWriteInPage,
    PageOffset3Bit,
    RegatherWindowPerLayer,
    WritesOtherLayer,
    WritesSink,
)
from .masking import (
    ExtendIgnoresPrefix,
    GqaHeadMapping,
    LargeBatchScratch,
    MisreadsSeqLensCpu,
    NoCausalInVerify,
    WindowPlusOne,
    WindowStartOffByOne,
)
from .ops import OpsBlockOffsetDropped, OpsDenseHeadStride, OpsStoreWrapsPadding, OpsWindowIgnored
from .precision import (
    HalfPrecisionAccumulation,
    HeadDimTailUnmasked,
    IgnoresScaling,
    LastPartialTileDropped,
    ReturnsFp32,
    SplitKVSmallBatch,
    TileSkipsFirstKey,
)
from .softcap_sinks import (
    SinkInEverySplit,
    SinksDroppedOnSwaLayers,
    SinkTimesScaling,
    SoftcapAfterLog2eFold,
    SoftcapSkippedOnEdgeBlocks,
)
from .sync import (
    ArangeOfMaxInReplay,
    BincountInReplay,
    FullOfMaxInReplay,
    NarrowWithTensorInReplay,
    RepeatInterleaveInReplay,
    SliceWithTensorBoundInReplay,
    ZerosOfMaxInReplay,
)


class NoOpMutant(ReferenceBackend):
    """Control: overrides ``forward`` and changes nothing."""

    WITNESS = None

    def forward(self, q, k, v, layer_id, batch, save_kv_cache=True, *, sinks=None):
        return super().forward(q, k, v, layer_id, batch, save_kv_cache, sinks=sinks)


SUBTLE = [
    IdentityTranslation,
    RegatherWindowPerLayer,
    NeighbourWriteInPage,
    WritesOtherLayer,
    WritesSink,
    IgnoresSaveKvCacheFalse,
    PageOffset3Bit,
    TileSkipsFirstKey,
    LastPartialTileDropped,
    HalfPrecisionAccumulation,
    HeadDimTailUnmasked,
    SplitKVSmallBatch,
    IgnoresScaling,
    ReturnsFp32,
    WindowPlusOne,
    WindowStartOffByOne,
    NoCausalInVerify,
    GqaHeadMapping,
    LargeBatchScratch,
    ExtendIgnoresPrefix,
    MisreadsSeqLensCpu,
    SoftcapAfterLog2eFold,
    SoftcapSkippedOnEdgeBlocks,
    SinkInEverySplit,
    SinkTimesScaling,
    SinksDroppedOnSwaLayers,
    ArangeOfMaxInReplay,
    ZerosOfMaxInReplay,
    FullOfMaxInReplay,
    SliceWithTensorBoundInReplay,
    NarrowWithTensorInReplay,
    BincountInReplay,
    RepeatInterleaveInReplay,
    OpsStoreWrapsPadding,
    OpsBlockOffsetDropped,
    OpsDenseHeadStride,
    OpsWindowIgnored,
]
