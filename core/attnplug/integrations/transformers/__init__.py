"""Hugging Face ``transformers`` causal LMs through attnplug (``pip install attnplug[hf]``).

* the ``"attnplug"`` attention implementation, registered by importing this package (or by
  ``register()``), so ``AutoModelForCausalLM.from_pretrained(path, attn_implementation="attnplug")``
  routes every attention layer through an attnplug backend;
* ``model_spec(config)`` -> ``ModelSpec``: what the backend must do for the model (sliding
  layers and window, scaling, soft-cap, sinks), or ``UnsupportedModelError`` with the reason;
* ``ModelRunner``: the model over attnplug's pools and a backend, one step per ``forward``;
* ``Engine``: greedy generation with continuous batching, chunked prefill, batched decode,
  sliding-window eviction and graphs;
* ``tiny_config`` / ``tiny_model``: small random models of every supported architecture
  (``ARCHITECTURES``), built offline;
* ``unsupported_reasons`` / ``support_table_markdown``: which backends can run which models.

Importing this package needs ``transformers`` only when a function that uses it is called; the
registration waits for transformers' modeling module to be imported (``register_on_import``),
so importing attnplug's command or this package imports no transformers.
"""

from .attention import IMPLEMENTATION, NoStepError, attnplug_attention_forward, register, register_on_import
from .engine import Engine
from .errors import MissingDependencyError, UnsupportedModelError
from .runner import ModelRunner, default_pool_sizes
from .spec import ARCHITECTURES, ModelSpec, model_spec
from .support import support_table_markdown, unsupported_reasons
from .tiny import tiny_config, tiny_model

register_on_import()  # from_pretrained(..., attn_implementation="attnplug") works after this import

__all__ = [
    "ARCHITECTURES",
    "Engine",
    "IMPLEMENTATION",
    "MissingDependencyError",
    "ModelRunner",
    "ModelSpec",
    "NoStepError",
    "UnsupportedModelError",
    "attnplug_attention_forward",
    "default_pool_sizes",
    "model_spec",
    "register",
    "register_on_import",
    "support_table_markdown",
    "tiny_config",
    "tiny_model",
    "unsupported_reasons",
]
