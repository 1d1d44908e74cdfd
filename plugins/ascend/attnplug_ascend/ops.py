"""The one place the ascend backend resolves the torch_npu operators it calls.

``load_ops(module=None)`` returns an ``NpuOps``: the KV store, the fused attention (with its
graph-mode ``.out`` variant and workspace query) and the NPU runtime calls that re-issue a
captured attention task at replay. With ``module=None`` it imports ``torch_npu`` (through
``device.npu_module``, which names torch_npu in its ``RuntimeError`` when the import fails);
``torch_npu`` is never imported when this package is imported. A test passes its stand-in
module instead (the injection point: ``AscendBackend.ops_module``), which must offer the same
names with the same documented semantics.

Operators (Ascend/op-plugin ``docs/context``):

* ``npu_scatter_pa_kv_cache(key, value, key_cache, value_cache, slot_mapping, cache_mode="Norm")``:
  key/value ``[T, Hkv, D]``, caches ``[num_blocks, block_size, Hkv, D]``;
* ``npu_fused_infer_attention_score_v2`` (preferred: it takes ``learnable_sink``) or
  ``npu_fused_infer_attention_score`` (v1; no sinks), both called in layout ``TND`` with
  paged KV (``block_table``, ``block_size``); the two differ in argument names only, which
  ``NpuOps.attention`` maps;
* for graphs: ``<op>.out(..., workspace=, out=[attention_out, softmax_lse])``,
  ``_<op>_get_max_workspace(...)`` and ``torch.npu``'s ``ExternalEvent``,
  ``graph_task_group_begin/end``, ``graph_task_update_begin/end``,
  ``is_current_stream_capturing``, ``Stream``, ``stream``, ``current_stream``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

__all__ = ["NpuOps", "load_ops", "INT32_MAX", "GRAPH_RUNTIME_NAMES"]

#: the operators' default ``pre_tokens`` / ``next_tokens`` ("no limit")
INT32_MAX = 2**31 - 1

_FIA_V1 = "npu_fused_infer_attention_score"
_FIA_V2 = "npu_fused_infer_attention_score_v2"
_STORE = "npu_scatter_pa_kv_cache"
#: what graph capture and replay need of the runtime (``torch.npu`` once torch_npu is imported)
GRAPH_RUNTIME_NAMES = (
    "ExternalEvent",
    "graph_task_group_begin",
    "graph_task_group_end",
    "graph_task_update_begin",
    "graph_task_update_end",
    "is_current_stream_capturing",
    "Stream",
    "stream",
    "current_stream",
)


@dataclass(frozen=True)
class NpuOps:
    """The resolved operators (see module docstring). ``source`` says where they come from
    (``torch_npu <version>``, or what a stand-in calls itself); ``runtime`` is the module with
    the stream and graph-task calls (``torch.npu``)."""

    source: str
    store: Callable
    fia_v1: Callable
    fia_v2: Optional[Callable]
    runtime: Any
    workspace_v1: Optional[Callable] = None
    workspace_v2: Optional[Callable] = None

    # ------------------------------------------------------------------ what this install has
    @property
    def has_sinks(self) -> bool:
        """Learned sinks need ``_v2`` (its ``learnable_sink``)."""
        return self.fia_v2 is not None

    @property
    def graph_ready(self) -> bool:
        """Whether captured attention can be re-issued at replay: the operator's ``.out``
        variant, its workspace query and the runtime's task-update calls."""
        op, ws = (self.fia_v2, self.workspace_v2) if self.fia_v2 is not None else (self.fia_v1, self.workspace_v1)
        return (
            ws is not None
            and getattr(op, "out", None) is not None
            and all(hasattr(self.runtime, n) for n in GRAPH_RUNTIME_NAMES)
        )

    # ------------------------------------------------------------------ the KV store
    def store_kv(self, key, value, key_cache, value_cache, slot_mapping) -> None:
        """``key``/``value`` ``[T, Hkv, D]`` into ``[blocks, block_size, Hkv, D]`` caches at
        ``slot_mapping`` (``block * block_size + offset``), in place (ND layout: "Norm")."""
        self.store(key, value, key_cache, value_cache, slot_mapping, cache_mode="Norm")

    # ------------------------------------------------------------------ attention
    def attention_kwargs(
        self,
        *,
        q_cum: Sequence[int],
        kv_lens: Sequence[int],
        block_table: torch.Tensor,
        block_size: int,
        num_heads: int,
        num_kv_heads: int,
        scale: float,
        sparse_mode: int,
        pre_tokens: int,
        next_tokens: int,
        atten_mask: Optional[torch.Tensor],
        sinks: Optional[torch.Tensor],
    ) -> Dict[str, Any]:
        """The keyword arguments of one TND paged call, under the names of the operator this
        install uses (``_v2`` where present, else v1; sinks only through ``_v2``)."""
        common = dict(
            atten_mask=atten_mask,
            block_table=block_table,
            block_size=block_size,
            num_key_value_heads=num_kv_heads,
            pre_tokens=pre_tokens,
            next_tokens=next_tokens,
            input_layout="TND",
            sparse_mode=sparse_mode,
        )
        if self.fia_v2 is not None:
            kw = dict(
                common,
                actual_seq_qlen=q_cum,
                actual_seq_kvlen=kv_lens,
                num_query_heads=num_heads,
                softmax_scale=scale,
            )
            if sinks is not None:
                kw["learnable_sink"] = sinks
            return kw
        if sinks is not None:
            raise ValueError(f"sinks: {self.source} has no {_FIA_V2} (learnable_sink); attention sinks need it")
        return dict(common, actual_seq_lengths=q_cum, actual_seq_lengths_kv=kv_lens, num_heads=num_heads, scale=scale)

    def with_sinks(self, kwargs: Dict[str, Any], sinks: torch.Tensor) -> Dict[str, Any]:
        """``kwargs`` (of ``attention_kwargs``) with one layer's learned sinks (``_v2`` only)."""
        if self.fia_v2 is None:
            raise ValueError(f"sinks: {self.source} has no {_FIA_V2} (learnable_sink); attention sinks need it")
        return dict(kwargs, learnable_sink=sinks)

    def _op(self) -> Callable:
        return self.fia_v2 if self.fia_v2 is not None else self.fia_v1

    def attention(self, query, key, value, kwargs: Dict[str, Any]) -> torch.Tensor:
        """One eager call: ``attention_out`` (``[T, N, D]``, query's dtype)."""
        out, _lse = self._op()(query, key, value, **kwargs)
        return out

    def workspace(self, query, key, value, kwargs: Dict[str, Any]) -> torch.Tensor:
        """The largest workspace the call needs (graph capture allocates it once, so that the
        replay's re-issued task keeps its addresses)."""
        ws = self.workspace_v2 if self.fia_v2 is not None else self.workspace_v1
        return ws(query, key, value, **kwargs)

    def attention_out(self, query, key, value, kwargs: Dict[str, Any], *, workspace, out: Tuple[torch.Tensor, ...]):
        """The ``.out`` call (graph capture, and the replay's task update): writes ``out``."""
        self._op().out(query, key, value, workspace=workspace, out=list(out), **kwargs)


def _version(module) -> str:
    return str(getattr(module, "__version__", "?"))


def load_ops(module=None) -> NpuOps:
    """The operators of ``module`` (default: ``torch_npu``, imported now; ``RuntimeError``
    naming torch_npu when it cannot be). Raises ``RuntimeError`` naming what ``module`` lacks
    (the KV store or the fused attention)."""
    if module is None:
        from .device import npu_module

        runtime = npu_module()  # imports torch_npu (RuntimeError naming it), returns torch.npu
        import sys

        module = sys.modules["torch_npu"]
        source = f"torch_npu {_version(module)}"
    else:
        runtime = getattr(module, "npu", None)
        source = str(getattr(module, "SOURCE", getattr(module, "__name__", type(module).__name__)))
    missing: List[str] = [name for name in (_STORE, _FIA_V1) if getattr(module, name, None) is None]
    if missing:
        raise RuntimeError(
            f"the ascend backend needs {', '.join(missing)} from {source} (torch_npu's fused operators); "
            "upgrade torch_npu"
        )
    return NpuOps(
        source=source,
        store=getattr(module, _STORE),
        fia_v1=getattr(module, _FIA_V1),
        fia_v2=getattr(module, _FIA_V2, None),
        runtime=runtime,
        workspace_v1=getattr(module, f"_{_FIA_V1}_get_max_workspace", None),
        workspace_v2=getattr(module, f"_{_FIA_V2}_get_max_workspace", None),
    )
