"""What attnplug needs to know about a transformers model's attention: ``ModelSpec``.

``model_spec(config)`` reads a ``transformers`` config and says, per architecture, which
layers use the sliding window, the window, the logit scaling, the logit soft-cap and whether
the layers have attention sinks. Anything attnplug cannot express exactly is refused with
``UnsupportedModelError`` and the reason (never approximated): encoder-decoder models and
cross-attention, ALiBi, bidirectional attention, per-layer different windows, layer types
other than full and sliding attention, and architectures whose attention is not described
here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, FrozenSet, Optional

from .errors import UnsupportedModelError

__all__ = ["ModelSpec", "model_spec", "ARCHITECTURES"]

FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass(frozen=True)
class _Arch:
    """How one architecture lays out its attention.

    * ``layers``: ``"layer_types"`` (``config.layer_types`` names each layer's kind),
      ``"all_sliding"`` (every layer slides when ``config.sliding_window`` is set, else every
      layer is full) or ``"all_full"``.
    * ``scaling``: ``"head_dim"`` (``head_dim ** -0.5``) or ``"query_pre_attn_scalar"``
      (``config.query_pre_attn_scalar ** -0.5``).
    * ``softcap``: the config attribute holding the attention logit soft-cap the layers apply,
      or None when the architecture applies none.
    * ``sinks``: the attention modules have a ``sinks`` parameter (one logit per q head).
    """

    layers: str
    scaling: str = "head_dim"
    softcap: Optional[str] = None
    sinks: bool = False


_ARCHS: Dict[str, _Arch] = {
    "llama": _Arch("all_full"),
    "mistral": _Arch("all_sliding"),
    "qwen2": _Arch("layer_types"),
    "qwen3": _Arch("layer_types"),
    "gemma2": _Arch("layer_types", scaling="query_pre_attn_scalar", softcap="attn_logit_softcapping"),
    "gemma3_text": _Arch("layer_types", scaling="query_pre_attn_scalar"),
    "cohere2": _Arch("layer_types"),
    "gpt_oss": _Arch("layer_types", sinks=True),
}

#: the ``config.model_type`` values ``model_spec`` accepts
ARCHITECTURES = tuple(_ARCHS)


@dataclass(frozen=True)
class ModelSpec:
    """The attention of one model, as attnplug runs it.

    * ``num_layers``, ``num_heads`` (query heads), ``num_kv_heads``, ``head_dim``;
    * ``sliding_window``: ``W`` of the sliding layers (a query at ``p`` sees ``p - W < j <= p``),
      None when no layer slides; ``swa_layer_ids``: the sliding layers;
    * ``scaling``: the factor of ``q . k`` (e.g. Gemma's ``query_pre_attn_scalar ** -0.5``);
    * ``logit_softcap``: ``c`` of ``c * tanh(s / c)`` applied to the scaled logits, or None;
    * ``has_sinks``: each attention module has a learned ``sinks`` logit per q head;
    * ``model_type``: the config's ``model_type``.
    """

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    sliding_window: Optional[int]
    swa_layer_ids: FrozenSet[int]
    scaling: float
    logit_softcap: Optional[float]
    has_sinks: bool
    model_type: str = ""


def _refuse(model_type: str, reason: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"{model_type or 'this model'}: {reason}")


def _positive_int(model_type: str, config, name: str) -> int:
    value = getattr(config, name, None)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _refuse(model_type, f"config.{name} must be a positive int, got {value!r}")
    return value


def _check_structure(model_type: str, config) -> None:
    """Refuse what no architecture here can be: encoder-decoder, cross-attention, ALiBi,
    bidirectional attention."""
    if getattr(config, "is_encoder_decoder", False):
        raise _refuse(model_type, "encoder-decoder models are not supported (attnplug runs causal decoders)")
    if getattr(config, "add_cross_attention", False):
        raise _refuse(model_type, "cross-attention is not supported (add_cross_attention=True)")
    if getattr(config, "alibi", False) or getattr(config, "position_embedding_type", None) == "alibi":
        raise _refuse(model_type, "ALiBi position biases are not supported (attnplug adds no bias to the logits)")
    if getattr(config, "use_bidirectional_attention", False):
        raise _refuse(model_type, "bidirectional attention is not supported (use_bidirectional_attention=True)")


def _window(model_type: str, config) -> Optional[int]:
    window = getattr(config, "sliding_window", None)
    if window is None:
        return None
    if isinstance(window, (list, tuple)):
        raise _refuse(
            model_type,
            f"per-layer sliding windows {list(window)} are not supported (attnplug has one window per model)",
        )
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise _refuse(model_type, f"config.sliding_window must be None or an int >= 1, got {window!r}")
    return window


def _swa_layers(model_type: str, arch: _Arch, config, num_layers: int, window: Optional[int]) -> FrozenSet[int]:
    if arch.layers == "all_full":
        if window is not None:
            raise _refuse(model_type, f"config.sliding_window={window} but this architecture's layers never slide")
        return frozenset()
    if arch.layers == "all_sliding":
        return frozenset(range(num_layers)) if window is not None else frozenset()
    types = getattr(config, "layer_types", None)
    if types is None:
        if window is not None:
            raise _refuse(model_type, "config.sliding_window is set but config.layer_types is missing")
        return frozenset()
    types = list(types)
    if len(types) != num_layers:
        raise _refuse(model_type, f"config.layer_types has {len(types)} entries, num_hidden_layers is {num_layers}")
    unknown = sorted({t for t in types if t not in (FULL, SLIDING)})
    if unknown:
        raise _refuse(
            model_type,
            f"layer types {unknown} are not supported (attnplug runs {FULL!r} and {SLIDING!r} layers)",
        )
    swa = frozenset(i for i, t in enumerate(types) if t == SLIDING)
    if swa and window is None:
        raise _refuse(model_type, f"layers {sorted(swa)} are {SLIDING!r} but config.sliding_window is None")
    return swa


def _positive_float(model_type: str, config, name: str) -> float:
    value = getattr(config, name, None)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise _refuse(model_type, f"config.{name} must be a finite number > 0, got {value!r}")
    return float(value)


def model_spec(config) -> ModelSpec:
    """The ``ModelSpec`` of a transformers config (``PretrainedConfig``); raises
    ``UnsupportedModelError`` with the reason when attnplug cannot run it exactly."""
    model_type = str(getattr(config, "model_type", "") or "")
    _check_structure(model_type, config)
    arch = _ARCHS.get(model_type)
    if arch is None:
        raise _refuse(
            model_type,
            f"architecture {model_type!r} is not supported: its attention is not described to attnplug "
            f"(supported: {', '.join(ARCHITECTURES)})",
        )
    num_layers = _positive_int(model_type, config, "num_hidden_layers")
    num_heads = _positive_int(model_type, config, "num_attention_heads")
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    if isinstance(num_kv_heads, bool) or not isinstance(num_kv_heads, int) or num_heads % num_kv_heads:
        raise _refuse(
            model_type, f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads!r}"
        )
    head_dim = getattr(config, "head_dim", None) or _positive_int(model_type, config, "hidden_size") // num_heads
    window = _window(model_type, config)
    swa = _swa_layers(model_type, arch, config, num_layers, window)
    if arch.scaling == "query_pre_attn_scalar":
        scaling = _positive_float(model_type, config, "query_pre_attn_scalar") ** -0.5
    else:
        scaling = head_dim**-0.5
    softcap = None
    if arch.softcap is not None and getattr(config, arch.softcap, None) is not None:
        softcap = _positive_float(model_type, config, arch.softcap)
    return ModelSpec(
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        sliding_window=window if swa else None,
        swa_layer_ids=swa,
        scaling=scaling,
        logit_softcap=softcap,
        has_sinks=arch.sinks,
        model_type=model_type,
    )
