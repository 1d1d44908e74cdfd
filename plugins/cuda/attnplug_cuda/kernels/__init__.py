"""Triton kernels of the CUDA plugin, one kernel family per module, and what they share.

==================  ==========================================================================
module              what it does (the Triton kernel's name, as profiler traces show it)
==================  ==========================================================================
``pdl``             ``pdl_supported(device)``: may kernels use Programmatic Dependent Launch;
                    ``Schedule``: where a launch waits and releases
``common``          what the attention kernels share: ``KeyTable``, ``NewRows``, logits and
                    online-softmax steps, the sink, the PDL points, host checks and scales;
                    an FP8 cache's ``KVScales`` and its one quantisation (``quantize_kv``)
``kv_store``        ``kv_store`` (``_kv_store_kernel``): write one step's k/v rows into a
                    layer's cache (quantised into an FP8 cache)
``step_metadata``   ``step_metadata`` (``_step_metadata_kernel``): ONE launch per step: SWA
                    slot translation (tail zeroed), ``cu_q_lens``, ``window_start``,
                    ``token_pos``, the SWA window table
``paged_attention`` ``paged_attention`` (``_paged_attention_kernel``, and
                    ``_split_combine_kernel`` when decode splits the KV range): attention over
                    the paged cache for every mode (grouped-query tiles, flash-decoding)
``store_attend``    ``store_attend`` (``_store_attend_kernel``): small steps (decode, verify,
                    draft extend): a layer's KV store, attention and split merge in ONE launch
``relaunch``        ``Relaunch``: repeat an identical launch through Triton's launcher
``interpret``       ``use_interpreter()``: run the kernels on the CPU through the Triton
                    interpreter (plus two fixes for Triton 3.6's interpreter)
==================  ==========================================================================

The attention launchers take a plan (``attnplug_cuda.planner``) and a PDL schedule; they
decide nothing. This package imports on any machine: Triton is imported only when a kernel
module is imported (``pdl`` imports no Triton). To run the kernels on the CPU through the
Triton interpreter, set ``TRITON_INTERPRET=1`` before the kernel modules are first imported.
Their timings: ``attnplug bench --backend cuda --only kernels``.
"""

from __future__ import annotations

from .pdl import pdl_supported

__all__ = ["pdl_supported"]
