"""What a backend claims, as pure data: the ``GraphSupport`` levels and the modes each lets a
backend run inside a captured graph (``GRAPH_MODES``), and the ``Capabilities`` of a backend
class or instance. The conformance suite skips a check only when these say the backend does not
claim it, and checks that every claim holds.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from .batch import ForwardMode

__all__ = ["Capabilities", "GraphSupport", "GRAPH_MODES"]


class GraphSupport(enum.IntEnum):
    """Which steps a backend can run inside a captured device graph (ordered); ``modes``
    lists them (the one table, ``GRAPH_MODES``):

    * ``NEVER``: none;
    * ``DECODE_ONLY``: DECODE;
    * ``UNIFORM``: the modes with the same number of new tokens for every request (DECODE,
      TARGET_VERIFY, DRAFT_EXTEND);
    * ``ALWAYS``: every mode with new tokens, EXTEND included (the backend's metadata and
      kernels take variable per-request lengths from device tensors inside a graph).

    ``GraphRunner`` captures the uniform modes per batch-size bucket (which fixes the tokens per
    request) and, at ``ALWAYS`` and when built with ``extend_tokens``, EXTEND steps per
    token-count bucket (padded requests without new tokens, padded tokens of no request).
    """

    NEVER = 0
    DECODE_ONLY = 1
    UNIFORM = 2
    ALWAYS = 3

    @property
    def modes(self) -> Tuple[ForwardMode, ...]:
        """The forward modes this level lets a backend run inside a captured graph."""
        return GRAPH_MODES[self]


#: GraphSupport level -> the forward modes a backend at that level runs inside a captured graph
GRAPH_MODES: Dict[GraphSupport, Tuple[ForwardMode, ...]] = {
    GraphSupport.NEVER: (),
    GraphSupport.DECODE_ONLY: (ForwardMode.DECODE,),
    GraphSupport.UNIFORM: ForwardMode.uniform(),
    GraphSupport.ALWAYS: (*ForwardMode.uniform(), ForwardMode.EXTEND),
}


@dataclass(frozen=True)
class Capabilities:
    """What a backend instance can do, as pure data. The conformance suite skips a check
    only when these say the backend does not claim it, and it checks that every claim holds.

    * ``device_type``: ``torch.device(...).type`` of the pool the backend runs on.
    * ``needs_cpu_seq_lens``: False promises sync-free metadata from device tensors.
    * ``pdl``: kernels use Programmatic Dependent Launch in this process (decided at run time).
    * ``graphs``: the ``GraphSupport`` level.
    * ``dtypes`` / ``head_dims`` / ``page_sizes``: the model dtypes (q, k, v, the output, and
      an unquantised cache), head dims and pool page sizes that are supported.
    * ``fp8_kv_dtypes``: the FP8 KV cache dtypes served (``attnplug.memory.fp8``: k / v of any
      of ``dtypes`` quantised at store with the pool's per-head scales, attention over the
      dequantised cache). Default ``()``: the constructor refuses an FP8 pool.
    * ``sliding_window``: SWA layers (``sliding_window=W``) are supported.
    * ``logit_softcap``: the constructor accepts ``logit_softcap=c`` (logits capped to
      ``c * tanh(s / c)`` before masking and softmax). Default False.
    * ``attention_sinks``: ``forward`` accepts ``sinks=`` (one learned logit per q head that
      joins the softmax denominator). Default False.
    * ``large_kv_buffers``: layer KV buffers of more than ``2**31 - 1`` elements (slots x KV
      heads x head_dim) are addressed correctly, i.e. with 64-bit offsets. Default False: the
      constructor refuses a pool whose largest layer buffer is past that limit
      (``BackendConfigError``; ``attnplug.input_checks.check_kv_buffer_size``).
    """

    device_type: str
    needs_cpu_seq_lens: bool
    pdl: bool
    graphs: GraphSupport
    dtypes: Tuple[torch.dtype, ...]
    head_dims: Tuple[int, ...]
    page_sizes: Tuple[int, ...]
    sliding_window: bool
    logit_softcap: bool = False
    attention_sinks: bool = False
    large_kv_buffers: bool = False
    fp8_kv_dtypes: Tuple[torch.dtype, ...] = ()

    @property
    def kv_dtypes(self) -> Tuple[torch.dtype, ...]:
        """Every dtype a KV cache of this backend may store: ``dtypes`` then ``fp8_kv_dtypes``."""
        return tuple(self.dtypes) + tuple(self.fp8_kv_dtypes)

    def to_json(self) -> dict:
        return {
            "device_type": self.device_type,
            "needs_cpu_seq_lens": self.needs_cpu_seq_lens,
            "pdl": self.pdl,
            "graphs": self.graphs.name,
            "dtypes": [str(d).replace("torch.", "") for d in self.dtypes],
            "head_dims": list(self.head_dims),
            "page_sizes": list(self.page_sizes),
            "sliding_window": self.sliding_window,
            "logit_softcap": self.logit_softcap,
            "attention_sinks": self.attention_sinks,
            "large_kv_buffers": self.large_kv_buffers,
            "fp8_kv_dtypes": [str(d).replace("torch.", "") for d in self.fp8_kv_dtypes],
        }

    def for_instance(
        self, *, device_type: str, pdl: bool = False, graphs: Optional[GraphSupport] = None
    ) -> "Capabilities":
        """These declared (class-level) capabilities narrowed to one instance: the pool's
        ``device_type``, whether this instance's kernels really use PDL, and optionally a lower
        graph level. Raises ``ValueError`` when the instance would claim more than the
        declaration (PDL not declared, a higher graph level), so an instance can never
        disagree with what ``describe()`` shows."""
        if pdl and not self.pdl:
            raise ValueError("pdl=True but the declared capabilities say pdl=False")
        graphs = self.graphs if graphs is None else GraphSupport(graphs)
        if graphs > self.graphs:
            raise ValueError(f"graphs={graphs.name} is above the declared {self.graphs.name}")
        return dataclasses.replace(self, device_type=device_type, pdl=bool(pdl), graphs=graphs)
