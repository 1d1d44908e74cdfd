"""Triton kernels of the CUDA plugin, one kernel family per module.

==================  ==========================================================================
module              what it does (the Triton kernel's name, as profiler traces show it)
==================  ==========================================================================
``pdl``             ``pdl_supported(device)``: may kernels use Programmatic Dependent Launch
``kv_store``        ``kv_store`` (``_kv_store_kernel``): write one step's k/v rows into a
                    layer's cache
``step_metadata``   ``step_metadata`` (``_step_metadata_kernel``): ONE launch per step: SWA
                    slot translation (tail zeroed), ``cu_q_lens``, ``window_start``,
                    ``token_pos``, the SWA window table
``paged_attention`` ``paged_attention`` (``_paged_attention_kernel``, and
                    ``_split_combine_kernel`` when decode splits the KV range): attention over
                    the paged cache for every mode (grouped-query tiles, flash-decoding)
``store_attend``    ``store_attend`` (``_store_attend_kernel``): small steps (decode, verify,
                    draft extend): a layer's KV store, attention and split merge in ONE launch
``interpret``       ``use_interpreter()``: run the kernels on the CPU through the Triton
                    interpreter (plus two fixes for Triton 3.6's interpreter)
==================  ==========================================================================

This package imports on any machine: Triton is imported only when a kernel module is
loaded, through ``load_kernels()`` (or by importing the module directly, e.g.
``from attnplug_cuda.kernels.kv_store import kv_store``). To run the kernels on the CPU
through the Triton interpreter, set ``TRITON_INTERPRET=1`` before the kernel modules are
first imported. Their timings: ``attnplug bench --backend cuda --only kernels``.
"""

from __future__ import annotations

import functools
import types

from .pdl import pdl_supported

__all__ = ["pdl_supported", "load_kernels"]


@functools.lru_cache(maxsize=None)
def load_kernels() -> types.SimpleNamespace:
    """Import the kernel modules (and Triton) and return their entry points. Raises ImportError when
    Triton is missing."""
    from . import kv_store as _kv
    from . import paged_attention as _pa
    from . import step_metadata as _sm
    from . import store_attend as _sa

    return types.SimpleNamespace(
        kv_store=_kv.kv_store,
        step_metadata=_sm.step_metadata,
        step_metadata_per_step_args=_sm.per_step_args,
        step_metadata_padded_copy=_sm.PaddedCopy,
        paged_attention=_pa.paged_attention,
        workspace_numel=_pa.workspace_numel,
        paged_attention_store_rows=_pa.STORE_ROWS,
        store_attend=_sa.store_attend,
        store_attend_eligible=_sa.eligible,
        store_attend_workspace_numel=_sa.store_attend_workspace_numel,
        num_sms=_sa.num_sms,
    )
