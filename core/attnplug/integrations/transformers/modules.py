"""The attention modules of a transformers model, checked against its ``ModelSpec``."""

from __future__ import annotations

from typing import List

import torch

from .errors import UnsupportedModelError
from .spec import ModelSpec

__all__ = ["attention_modules"]


def attention_modules(model: torch.nn.Module, spec: ModelSpec) -> List[torch.nn.Module]:
    """The model's attention modules, indexed by ``layer_idx`` (``[num_layers]``).

    An attention module is one with an int ``layer_idx`` and a ``scaling`` attribute (what
    ``transformers`` passes to the attention implementation). Raises ``UnsupportedModelError``
    when a layer has none or two, when a module's ``scaling`` differs from the spec's (attnplug
    has one scaling per model), when a module's ``sliding_window`` disagrees with the spec, or
    when the spec's sinks are missing from a module."""
    found: List[List[torch.nn.Module]] = [[] for _ in range(spec.num_layers)]
    for module in model.modules():
        layer = getattr(module, "layer_idx", None)
        if isinstance(layer, bool) or not isinstance(layer, int) or not hasattr(module, "scaling"):
            continue
        if not 0 <= layer < spec.num_layers:
            raise UnsupportedModelError(
                f"{spec.model_type}: attention module {type(module).__name__} has layer_idx={layer}, "
                f"the model has {spec.num_layers} layers"
            )
        found[layer].append(module)
    modules = []
    for layer, mods in enumerate(found):
        if len(mods) != 1:
            what = "no attention module" if not mods else f"{len(mods)} attention modules (cross-attention?)"
            raise UnsupportedModelError(f"{spec.model_type}: layer {layer} has {what}; attnplug runs one per layer")
        module = mods[0]
        if float(module.scaling) != spec.scaling:
            raise UnsupportedModelError(
                f"{spec.model_type}: layer {layer} scales logits by {module.scaling!r}, the model spec by "
                f"{spec.scaling!r} (attnplug has one scaling per model)"
            )
        window = getattr(module, "sliding_window", "absent")
        expected = spec.sliding_window if layer in spec.swa_layer_ids else None
        if window != "absent" and window != expected:
            raise UnsupportedModelError(
                f"{spec.model_type}: layer {layer} has sliding_window={window!r}, the model spec says {expected!r}"
            )
        if spec.has_sinks and not isinstance(getattr(module, "sinks", None), torch.Tensor):
            raise UnsupportedModelError(f"{spec.model_type}: layer {layer} has no sinks parameter")
        modules.append(module)
    return modules
