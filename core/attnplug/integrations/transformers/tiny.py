"""Small random models of every supported architecture, built offline (no download).

``tiny_config(arch, **overrides)`` is a ``transformers`` config with a few layers, a hidden
size of 64, a vocabulary of 256 and a sliding window of 8 (so short prompts already exceed
it), with at least one full and one sliding layer where the architecture has both;
``tiny_model(arch, ...)`` builds the causal LM from it with ``from_config`` and seeded random
weights. Weights are drawn with a larger spread than the library's default (``initializer_range
= 0.1``) so attention is far from uniform and a wrong mask or scale changes the tokens.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from .errors import require_transformers
from .spec import ARCHITECTURES

__all__ = ["ARCHITECTURES", "tiny_config", "tiny_model"]

#: shared by every architecture
_BASE: Dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    initializer_range=0.1,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

_WINDOW = 8

#: per architecture: what makes it itself (layer layout, scaling, soft-cap, sinks)
_ARCH: Dict[str, Dict[str, Any]] = {
    "llama": dict(num_hidden_layers=2),
    "mistral": dict(num_hidden_layers=2, sliding_window=_WINDOW),
    # layer 0 full, layers >= max_window_layers sliding
    "qwen2": dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=_WINDOW, max_window_layers=1),
    "qwen3": dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=_WINDOW, max_window_layers=1),
    # alternating sliding / full; scaling from query_pre_attn_scalar (not head_dim); a soft-cap
    # small enough to change the logits of these weights
    "gemma2": dict(
        num_hidden_layers=2,
        sliding_window=_WINDOW,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=1.0,
        final_logit_softcapping=30.0,
        tie_word_embeddings=False,
    ),
    # sliding, sliding, full (the real models: 5 sliding, 1 full)
    "gemma3_text": dict(
        num_hidden_layers=3,
        sliding_window=_WINDOW,
        sliding_window_pattern=3,
        query_pre_attn_scalar=24,
        tie_word_embeddings=False,
    ),
    # sliding (RoPE), full (no positional encoding)
    "cohere2": dict(num_hidden_layers=2, sliding_window=_WINDOW, sliding_window_pattern=2),
    # alternating sliding / full, sinks, a small mixture of experts
    "gpt_oss": dict(
        num_hidden_layers=2,
        sliding_window=_WINDOW,
        num_local_experts=4,
        num_experts_per_tok=2,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
        },
    ),
}


def _check_arch(arch: str) -> None:
    if arch not in _ARCH:
        raise ValueError(f"arch must be one of {', '.join(ARCHITECTURES)}, got {arch!r}")


def tiny_config(arch: str, **overrides):
    """A small ``transformers`` config of ``arch`` (one of ``ARCHITECTURES``); ``overrides``
    replace any field (e.g. ``sliding_window=4``, ``head_dim=64``, ``num_hidden_layers=4``)."""
    _check_arch(arch)
    transformers = require_transformers()
    fields = {**_BASE, **_ARCH[arch], **overrides}
    return transformers.AutoConfig.for_model(arch, **fields)


def tiny_model(
    arch: str,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: Optional[torch.device] = None,
    attn_implementation: str = "eager",
    **overrides,
):
    """A random ``AutoModelForCausalLM`` of ``tiny_config(arch, **overrides)`` in eval mode.

    Weights are drawn from ``torch.manual_seed(seed)`` inside a forked RNG (the caller's random
    state is left as it was): the same ``seed`` gives the same weights. ``attn_implementation``
    as in ``from_config`` (``"eager"``, ``"sdpa"``, or ``"attnplug"`` after ``register()``).
    """
    transformers = require_transformers()
    config = tiny_config(arch, **overrides)
    if attn_implementation == "attnplug":
        from .attention import register

        register()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(
            config, attn_implementation=attn_implementation, dtype=dtype
        )
    if device is not None:
        model = model.to(device)
    return model.eval()
