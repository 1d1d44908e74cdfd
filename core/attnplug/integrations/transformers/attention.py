"""The ``"attnplug"`` attention implementation of ``transformers``.

Importing ``attnplug.integrations.transformers`` adds it to ``transformers.AttentionInterface``
(``register_on_import``: at once when transformers' modeling module is loaded, else the moment
it is, so the import itself stays cheap), and so does ``register()`` (idempotent); then
``from_pretrained(..., attn_implementation="attnplug")`` (or ``from_config``, or
``model.set_attn_implementation("attnplug")``) routes every attention layer here. The layers
do not own a KV cache any more: each call hands the layer's new q/k/v to the attnplug backend
of the step in progress, which stores k/v in the paged pool and attends over it. A step is in
progress only inside ``ModelRunner.forward`` (or a graph step of its ``GraphRunner``), which
binds the step (``bind_step``); calling the model outside one raises ``NoStepError``.

No attention mask is built (``transformers`` builds none for an implementation without a mask
function): which keys each token sees follows from the step's ``ForwardBatch`` and the
backend's sliding window.

Under ``torch.compile`` the layer's attention is the custom op ``attnplug::attention`` (an
opaque call for the compiler: it runs the bound step's backend, which stores k/v in the pools
it owns and attends), so the rest of the model compiles around it. The per-call checks of the
eager path (module, scaling, window, soft-cap, sinks against the spec) are then not traced:
``ModelRunner`` checked every module at load, and the op checks the bound step and layer.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch

from ...backend import AttentionBackend
from ...batch import ForwardBatch
from .errors import MissingDependencyError, require_transformers
from .spec import ModelSpec

__all__ = [
    "IMPLEMENTATION",
    "NoStepError",
    "BoundStep",
    "register",
    "register_on_import",
    "bind_step",
    "attnplug_attention_forward",
    "attention_op",
]

#: the name ``attn_implementation`` takes
IMPLEMENTATION = "attnplug"


class NoStepError(RuntimeError):
    """The model's attention was called outside an attnplug step."""


@dataclass
class BoundStep:
    """What the attention layers of one model need during a step: the backend, the step's
    ``ForwardBatch``, the model's ``ModelSpec`` and its attention modules by layer id (each
    call checks it comes from one of them)."""

    backend: AttentionBackend
    batch: ForwardBatch
    spec: ModelSpec
    modules: Sequence[torch.nn.Module]


_local = threading.local()


@contextlib.contextmanager
def bind_step(step: BoundStep) -> Iterator[BoundStep]:
    """Make ``step`` the one the attention layers use until the block ends (per thread;
    an enclosing binding comes back afterwards)."""
    previous = getattr(_local, "step", None)
    _local.step = step
    try:
        yield step
    finally:
        _local.step = previous


def _current_step() -> BoundStep:
    step = getattr(_local, "step", None)
    if step is None:
        raise NoStepError(
            "this model's attention runs through attnplug (attn_implementation='attnplug') and was called "
            "outside an attnplug step: run it through attnplug.integrations.transformers.ModelRunner.forward "
            "or Engine.generate (its KV cache lives in attnplug's pools), or switch back with "
            "model.set_attn_implementation('eager')"
        )
    return step


def _mismatch(layer: int, what: str, got, expected) -> ValueError:
    return ValueError(
        f"layer {layer}: the model passed {what}={got!r} but its attnplug spec says {expected!r}; "
        "the backend was built for the spec and would compute something else"
    )


def attnplug_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    scaling: Optional[float] = None,
    dropout: float = 0.0,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    s_aux: Optional[torch.Tensor] = None,
    **kwargs,
):
    """One attention layer through the bound step's backend.

    ``query``: ``[1, num_heads, T, head_dim]``; ``key`` / ``value``: ``[1, num_kv_heads, T,
    head_dim]`` (this step's new tokens only, RoPE applied). Returns ``([1, T, num_heads,
    head_dim], None)``. The keyword arguments the layer passes (``scaling``,
    ``sliding_window``, ``softcap``, ``s_aux`` = the sinks) must agree with the model's spec
    (``ValueError`` otherwise); ``attention_mask`` must be None and ``dropout`` 0.
    """
    if torch.compiler.is_compiling():
        if attention_mask is not None or dropout:
            raise ValueError("attnplug takes no attention_mask and no dropout")
        sinks = None if s_aux is None else s_aux.detach().float()
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
        return attention_op(q, k, v, module.layer_idx, sinks).unsqueeze(0), None
    step = _current_step()
    spec = step.spec
    layer = getattr(module, "layer_idx", None)
    if not isinstance(layer, int) or not 0 <= layer < len(step.modules) or step.modules[layer] is not module:
        raise NoStepError(
            f"an attention module (layer_idx={layer!r}) of another model was called during an attnplug step "
            "of this one; each model runs through its own ModelRunner"
        )
    if attention_mask is not None:
        raise ValueError(
            f"layer {layer}: attnplug takes no attention_mask (the step's ForwardBatch says which keys each "
            "token sees); call the model without one"
        )
    if dropout:
        raise ValueError(f"layer {layer}: attention dropout {dropout} is not supported (put the model in eval mode)")
    if scaling != spec.scaling:
        raise _mismatch(layer, "scaling", scaling, spec.scaling)
    expected_window = spec.sliding_window if layer in spec.swa_layer_ids else None
    if sliding_window != expected_window:
        raise _mismatch(layer, "sliding_window", sliding_window, expected_window)
    if softcap != spec.logit_softcap:
        raise _mismatch(layer, "softcap", softcap, spec.logit_softcap)
    if (s_aux is not None) != spec.has_sinks:
        raise _mismatch(layer, "sinks", "a tensor" if s_aux is not None else None, spec.has_sinks)
    if query.dim() != 4 or query.shape[0] != 1:
        raise ValueError(
            f"layer {layer}: attnplug runs one flattened sequence per step (batch dim 1), got query "
            f"{tuple(query.shape)}; pass input_ids as [1, T]"
        )
    q = query[0].transpose(0, 1).contiguous()  # [T, H, D]
    k = key[0].transpose(0, 1).contiguous()  # [T, Hkv, D]
    v = value[0].transpose(0, 1).contiguous()
    extra = {}
    if s_aux is not None:
        extra["sinks"] = s_aux.detach().float()
    out = step.backend.forward(q, k, v, layer, step.batch, **extra)  # [T, H, D]
    return out.unsqueeze(0), None


@torch.library.custom_op("attnplug::attention", mutates_args=())
def attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, sinks: Optional[torch.Tensor]
) -> torch.Tensor:
    """One layer's attention through the bound step's backend: ``q`` ``[T, H, D]``, ``k`` /
    ``v`` ``[T, Hkv, D]`` (any strides), ``sinks`` float32 ``[H]`` or None; returns a new
    ``[T, H, D]`` tensor. The backend also stores k/v in the KV pools (state the op owns: the
    model's data flow orders the layers' calls)."""
    step = _current_step()
    if not 0 <= layer < len(step.modules):
        raise NoStepError(f"attnplug::attention: layer {layer} is not a layer of the bound model")
    extra = {} if sinks is None else {"sinks": sinks}
    return step.backend.forward(q.contiguous(), k.contiguous(), v.contiguous(), layer, step.batch, **extra)


@attention_op.register_fake
def _attention_op_fake(q, k, v, layer, sinks):
    return q.new_empty(q.shape)


def _register_into(modeling_utils) -> None:
    interface = getattr(modeling_utils, "AttentionInterface", None)
    if interface is None or not callable(getattr(interface, "register", None)):
        import transformers

        raise MissingDependencyError(
            f"transformers {getattr(transformers, '__version__', '?')} has no AttentionInterface to register "
            "attn_implementation='attnplug' with: pip install 'attnplug[hf]' (transformers >= 4.56)"
        )
    interface.register(IMPLEMENTATION, attnplug_attention_forward)


def register() -> None:
    """Register ``"attnplug"`` with ``transformers.AttentionInterface`` (idempotent; raises
    ``MissingDependencyError`` naming the ``hf`` extra when transformers is missing or too old).

    Importing this package already does it (``register_on_import``): call it only to register
    at once, e.g. to see its error."""
    require_transformers()
    import transformers.modeling_utils

    _register_into(transformers.modeling_utils)


#: the transformers module that defines ``AttentionInterface`` (and every ``from_pretrained``)
_MODELING = "transformers.modeling_utils"


_FILE_LOADERS = (importlib.machinery.SourceFileLoader, importlib.machinery.SourcelessFileLoader)


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """A one-shot import hook: once ``transformers.modeling_utils`` has been executed (before
    any model can be loaded from it), ``"attnplug"`` is registered in it. Nothing is imported
    before that, so importing attnplug costs no transformers import."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _MODELING:
            return None
        _remove_hook()  # one shot; and the real finders below find the module
        try:
            spec = importlib.util.find_spec(fullname)
        except Exception:  # let the import machinery report it as it would without this hook
            return None
        loader = getattr(spec, "loader", None)
        if not isinstance(loader, _FILE_LOADERS):  # one loader object a file: safe to wrap
            return spec  # an unusual install: register() (ModelRunner calls it) still works
        exec_module = loader.exec_module

        def exec_then_register(module) -> None:
            exec_module(module)
            _register_quietly(module)

        loader.exec_module = exec_then_register
        return spec


_hook = _RegisterAfterImport()


def _remove_hook() -> None:
    try:
        sys.meta_path.remove(_hook)
    except ValueError:
        pass


def _register_quietly(modeling_utils) -> None:
    """Register, never raising into the user's ``import transformers``: a failure is left for
    ``register()`` (which ``ModelRunner`` calls) to report with its reason."""
    try:
        _register_into(modeling_utils)
    except Exception:
        pass


def register_on_import() -> None:
    """Make ``from_pretrained(..., attn_implementation="attnplug")`` work without a
    ``register()`` call: register now when transformers' modeling module is loaded already,
    else as soon as it is (an import hook; transformers is not imported here, so this costs
    nothing where transformers is not used, or not installed). Idempotent."""
    modeling = sys.modules.get(_MODELING)
    if modeling is not None:
        _register_quietly(modeling)
    elif _hook not in sys.meta_path:
        sys.meta_path.insert(0, _hook)
