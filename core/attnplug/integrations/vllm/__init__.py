"""attnplug inside vLLM (>= 0.32, the v1 engine): an attention backend over vLLM's own KV cache.

``pip install 'attnplug[vllm]'`` installs the ``vllm.general_plugins`` entry point ``attnplug``
(``register``), which vLLM runs in every process it starts. It registers attnplug under vLLM's
``CUSTOM`` backend, so ``--attention-backend CUSTOM`` (``LLM(..., attention_backend="CUSTOM")``)
selects it; ``ATTNPLUG_VLLM_SLOTS`` names further vLLM backends attnplug takes over (a
platform that ignores ``CUSTOM``: ``CPU_ATTN`` on the CPU, ``TRITON_ATTN`` on ROCm and XPU).
Installing attnplug changes nothing until the user asks for it.

Which attnplug backend runs (``cuda``, ``reference``, ...) follows attnplug's own rules
(``ATTNPLUG_BACKEND``, else the highest-priority available backend that serves vLLM's device:
``attnplug.integrations.choice``). The pieces, as vLLM's v1 interface names them:

* ``backend.AttnplugBackend``: what vLLM validates (dtypes, head sizes, window, sinks, the KV
  cache layout ``LBNHC``: ``[num_blocks, block_size, Hkv, 2 * D]`` per layer, K then V);
* ``metadata.AttnplugMetadataBuilder``: per step and KV cache group, ``PagedOps.plan`` over
  the group's block table (device ops only; no ``seq_lens_cpu``);
* ``impl.AttnplugImpl``: per layer, ``PagedOps.store_kv`` (``do_kv_cache_update``) and
  ``PagedOps.attend`` into vLLM's output.

docs/engines.md has the commands, the versions tested and what this path supports.
"""

from __future__ import annotations

__all__ = ["register", "BACKEND_PATH"]

#: the class vLLM imports for the CUSTOM slot
BACKEND_PATH = "attnplug.integrations.vllm.backend.AttnplugBackend"


def register() -> None:
    """The ``vllm.general_plugins`` entry point: register attnplug under ``CUSTOM`` and under
    every name in ``ATTNPLUG_VLLM_SLOTS``. Idempotent (vLLM may call it more than once in a
    process); raises ``ValueError`` naming an unknown slot."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from ...env import vllm_slots
    from .backend import slot_class_path

    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)
    known = {m.name for m in AttentionBackendEnum}
    for slot in vllm_slots():
        if slot not in known or slot == "CUSTOM":
            if slot == "CUSTOM":
                continue
            raise ValueError(
                f"ATTNPLUG_VLLM_SLOTS names {slot!r}, which is not a vLLM attention backend (known: "
                f"{', '.join(sorted(known))})"
            )
        register_backend(AttentionBackendEnum[slot], slot_class_path(slot))
