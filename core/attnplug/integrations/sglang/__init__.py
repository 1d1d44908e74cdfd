"""attnplug inside SGLang (>= 0.5.23, whose plugin loader runs before argument parsing): the
``attnplug`` attention backend over SGLang's own KV pools.

``pip install 'attnplug[sglang]'`` installs the ``sglang.srt.plugins`` entry point ``attnplug``
(``register``), which SGLang runs in every process before it parses arguments; it registers
the backend factory and adds ``attnplug`` to the ``--attention-backend`` choices, so
``--attention-backend attnplug`` (``Engine(..., attention_backend="attnplug")``) selects it.
Nothing else changes when attnplug is installed.

Which attnplug backend runs follows attnplug's rules (``ATTNPLUG_BACKEND``, else the default for
SGLang's device: ``attnplug.integrations.choice``); ``backend.AttnplugSGLangBackend`` calls its
op layer (``AttentionBackend.paged_ops``) over SGLang's ``req_to_token`` and KV buffers.
docs/engines.md says what this path supports and what was run.
"""

from __future__ import annotations

__all__ = ["register", "NAME"]

#: the ``--attention-backend`` value
NAME = "attnplug"


def register() -> None:
    """The ``sglang.srt.plugins`` entry point: register the ``attnplug`` backend factory and
    the ``--attention-backend attnplug`` choice. Idempotent."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices

    from .backend import create_backend

    if ATTENTION_BACKENDS.get(NAME) is not create_backend:
        register_attention_backend(NAME)(create_backend)
    if NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([NAME])
