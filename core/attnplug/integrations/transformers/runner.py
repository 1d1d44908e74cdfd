"""``ModelRunner``: a transformers causal LM over attnplug's pools and one backend.

The runner owns the KV memory of one model (``SWAKVPool``, ``ReqToTokenPool``,
``SWATokenAllocator``, on the model's device; the KV pool in the model's dtype, or an FP8 dtype
with ``kv_cache_dtype``) and the backend built for the model's ``ModelSpec``. ``forward`` runs
ONE step of any ``ForwardMode``: the new tokens of every request of the step flattened into one
sequence (batch dim 1), the backend's metadata prepared once, then the model with the step
bound to its attention layers. The caller (an engine, ``Engine``, or a test) allocates slots,
writes ``req_to_token`` and builds the ``ForwardBatch``, as for any attnplug backend.

Uniform steps (DECODE; TARGET_VERIFY / DRAFT_EXTEND with ``num_draft_tokens``) can run
through a ``GraphRunner`` whose captured step is the whole model forward
(``enable_graphs`` / ``forward_graph``): device graphs where the backend has them, its eager
stand-in otherwise. So can EXTEND steps (prefill chunks) on a backend at
``GraphSupport.ALWAYS``, one graph per token-count bucket (``extend_tokens``): the captured
forward returns the logits of each request's last token (``[bs, vocab]``), picked on the device
from ``extend_seq_lens``.

With ``compile``, every step runs a ``torch.compile``-d model around the opaque attention op
``attnplug::attention``: the captured steps a model compiled for their static shapes, the
eager steps (EXTEND chunks, whose token counts vary) a model compiled once with a symbolic
token count (``dynamic=True``). A new prompt length then reuses the compiled code: the
compilations are bounded (a step of one token and a step that keeps one logit row are
specialised, as ``torch.compile`` specialises sizes of 0 and 1), never one per length.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple, Union

import torch

from ...batch import ForwardBatch, ForwardMode
from ...graphs import GraphRunner
from ...memory import ReqToTokenPool, SWAKVPool, SWATokenAllocator
from ...memory.fp8 import host_scales, is_fp8, resolve_kv_cache_dtype
from ..choice import BackendArg, backend_class
from .attention import IMPLEMENTATION, BoundStep, bind_step, register
from .errors import UnsupportedModelError
from .modules import attention_modules
from .spec import ModelSpec, model_spec
from .support import unsupported_reasons

__all__ = ["ModelRunner", "default_pool_sizes", "live_window_slots", "check_sizes", "kv_cache_dtype_of", "KVScales"]

#: per-layer FP8 KV scales: ``{layer_id: (k_scale, v_scale)}``, each a float (every KV head), a
#: sequence of ``num_kv_heads`` floats or a tensor of 1 or ``num_kv_heads`` elements
KVScales = Mapping[int, Tuple[Any, Any]]


def _round_up(n: int, page: int) -> int:
    return -(-n // page) * page


def live_window_slots(spec: ModelSpec, page_size: int) -> int:
    """SWA slots one request of a sliding model holds at most after eviction: its live window
    (at most ``W + page_size - 2`` positions, in whole pages) plus the page its next tokens
    start."""
    return _round_up(spec.sliding_window + page_size - 2, page_size) + page_size


def default_pool_sizes(
    spec: ModelSpec, *, max_batch_size: int, max_context_len: int, page_size: int, max_step_tokens: int
) -> tuple:
    """``(full_pool_tokens, swa_pool_tokens)`` that never run out for ``max_batch_size``
    requests of up to ``max_context_len`` positions whose steps add at most
    ``max_step_tokens`` tokens in all, with out-of-window SWA slots evicted between steps.

    Full pool: every request's whole context. SWA pool: without sliding layers, the same (it
    holds no KV then, only bookkeeping); with them, each request's live window (at most
    ``W + page_size - 2`` positions after eviction, in whole pages) plus one step's new tokens
    (and one page per request for where they start)."""
    full = max_batch_size * _round_up(max_context_len, page_size)
    if not spec.swa_layer_ids:
        return full, full
    step = _round_up(max_step_tokens, page_size) + max_batch_size * page_size
    return full, min(full, max_batch_size * live_window_slots(spec, page_size) + step)


def check_sizes(**sizes) -> None:
    """Raise ``ValueError`` naming the first argument that is not an int >= 1."""
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def kv_cache_dtype_of(kv_cache_dtype, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype a model's KV pool stores for ``kv_cache_dtype`` (None or ``"auto"``: the model's;
    ``"fp8"`` / ``"fp8_e4m3"``, ``"fp8_e5m2"`` or an FP8 ``torch.dtype``: that FP8 dtype;
    ``attnplug.memory.fp8.resolve_kv_cache_dtype``). Any other value, or a dtype that is
    neither the model's nor an FP8 one, raises ``ValueError`` naming the choices."""
    dtype = resolve_kv_cache_dtype(kv_cache_dtype, model_dtype)
    if dtype != model_dtype and not is_fp8(dtype):
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r}: the KV cache stores the model's dtype ({_dtype_name(model_dtype)}) "
            "or an FP8 dtype (float8_e4m3fn, float8_e5m2: 'fp8', 'fp8_e4m3', 'fp8_e5m2')"
        )
    return dtype


def _host_kv_scales(kv_scales, spec: ModelSpec, kv_dtype: torch.dtype) -> Dict[int, Tuple[torch.Tensor, torch.Tensor]]:
    """``kv_scales`` checked on the host before anything is allocated: ``{layer: (k [Hkv],
    v [Hkv])}`` float32 CPU tensors; ``ValueError`` naming the layer and the problem."""
    if kv_scales is None:
        return {}
    if not is_fp8(kv_dtype):
        raise ValueError(
            f"kv_scales apply to an FP8 KV cache; this one stores {_dtype_name(kv_dtype)} (pass kv_cache_dtype='fp8')"
        )
    if not isinstance(kv_scales, Mapping):
        raise ValueError(
            f"kv_scales must be a mapping {{layer_id: (k_scale, v_scale)}}, got {type(kv_scales).__name__}"
        )
    out = {}
    for layer, pair in kv_scales.items():
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < spec.num_layers:
            raise ValueError(f"kv_scales: {layer!r} is not a layer id of this model (0 .. {spec.num_layers - 1})")
        if isinstance(pair, (str, bytes, torch.Tensor)) or not hasattr(pair, "__len__") or len(pair) != 2:
            raise ValueError(f"kv_scales[{layer}] must be a pair (k_scale, v_scale), got {pair!r}")
        k, v = pair
        out[layer] = (
            host_scales(k, spec.num_kv_heads, f"kv_scales[{layer}] k_scale"),
            host_scales(v, spec.num_kv_heads, f"kv_scales[{layer}] v_scale"),
        )
    return out


def _model_device_dtype(model) -> tuple:
    param = next(iter(model.parameters()), None)
    if param is None:
        raise UnsupportedModelError("the model has no parameters (device and dtype unknown)")
    return param.device, param.dtype


class ModelRunner:
    """One transformers causal LM (``PreTrainedModel``) over attnplug.

    ``backend``: None (the registry's default for the model's device), a registry name or
    ``module:Class``, or a backend class. The model's attention implementation is set to
    ``"attnplug"`` (``model.set_attn_implementation``) and the model put in eval mode; to run
    it with another implementation again, call ``model.set_attn_implementation(...)``.

    Pools: ``max_batch_size`` request rows of ``max_context_len`` positions;
    ``full_pool_tokens`` / ``swa_pool_tokens`` slots (defaults: ``default_pool_sizes`` with
    steps of up to ``max_context_len`` tokens); ``page_size`` slots per page.

    KV cache: ``kv_cache_dtype`` None or ``"auto"`` stores the model's dtype; ``"fp8"`` /
    ``"fp8_e4m3"`` (``torch.float8_e4m3fn``), ``"fp8_e5m2"`` (``torch.float8_e5m2``) or one of
    those dtypes stores K and V in FP8, quantised at store by ``attnplug.memory.fp8``'s rule
    (saturating, round to nearest even) with a float32 scale per layer and KV head.
    ``kv_scales``: ``{layer_id: (k_scale, v_scale)}`` for the layers whose scales are not 1.0
    (each a float for every KV head, ``num_kv_heads`` floats, or a tensor of 1 or
    ``num_kv_heads`` elements; validated on the host before anything is allocated); every
    other layer keeps 1.0, what vLLM uses without calibrated scales. To change a layer's scales
    later, call ``runner.pool.set_kv_scales(layer_id, k, v)`` before the first step (the bytes
    already stored keep the meaning of the scales they were stored with).

    Refused at construction with ``UnsupportedModelError`` and the reason: a model attnplug
    cannot express (``model_spec``), a backend lacking a capability the model needs (sliding
    window, logit soft-capping, sinks, the model's dtype, head dim or ``page_size``, the FP8
    KV cache dtype asked for), a backend of another device type; with ``ValueError``: a
    ``kv_cache_dtype`` that is neither ``"auto"``, an FP8 name or dtype, nor the model's
    dtype, and bad ``kv_scales``. Nothing is allocated before these checks.

    ``compile``: False runs the model eagerly everywhere; True (inductor) or a ``torch.compile``
    backend name compiles the model, with each layer's attention as the opaque op
    ``attnplug::attention``: for the steps the ``GraphRunner`` captures (the compilation
    happens in the capture's warm-up, never inside a capture; the graph then replays the
    compiled kernels) and, with a symbolic token count, for the eager steps (EXTEND chunks of
    any length: module docstring).

    Attributes: ``model``, ``spec``, ``backend`` (the instance), ``pool``,
    ``req_to_token_pool``, ``allocator``, ``device``, ``dtype`` (the model's),
    ``kv_cache_dtype`` (what the KV pool stores), ``vocab_size``, ``graphs`` (the
    ``GraphRunner`` once ``enable_graphs`` ran, else None), ``compile``.
    """

    def __init__(
        self,
        model,
        backend: BackendArg = None,
        *,
        max_batch_size: int,
        max_context_len: int,
        page_size: int = 1,
        swa_pool_tokens: Optional[int] = None,
        full_pool_tokens: Optional[int] = None,
        compile: Union[bool, str] = False,
        kv_cache_dtype: Union[None, str, torch.dtype] = None,
        kv_scales: Optional[KVScales] = None,
    ) -> None:
        check_sizes(max_batch_size=max_batch_size, max_context_len=max_context_len, page_size=page_size)
        if not isinstance(compile, (bool, str)) or compile == "":
            raise ValueError(f"compile must be a bool or a torch.compile backend name, got {compile!r}")
        register()
        self.spec = model_spec(model.config)
        self.device, self.dtype = _model_device_dtype(model)
        self.kv_cache_dtype = kv_cache_dtype_of(kv_cache_dtype, self.dtype)
        scales = _host_kv_scales(kv_scales, self.spec, self.kv_cache_dtype)
        cls = backend_class(backend, self.device, UnsupportedModelError)
        caps = cls.installed_capabilities()
        if caps is None:
            raise UnsupportedModelError(f"backend {cls.name!r} declares no capabilities; cannot check it can run")
        reasons = unsupported_reasons(
            caps, self.spec, dtype=self.dtype, page_size=page_size, kv_cache_dtype=self.kv_cache_dtype
        )
        if reasons:
            raise UnsupportedModelError(
                f"backend {cls.name!r} cannot run this {self.spec.model_type} model: it lacks " + "; ".join(reasons)
            )
        self.modules = attention_modules(model, self.spec)
        if model.config._attn_implementation != IMPLEMENTATION:
            model.set_attn_implementation(IMPLEMENTATION)
            if model.config._attn_implementation != IMPLEMENTATION:
                raise UnsupportedModelError(
                    f"{type(model).__name__} cannot switch its attention implementation to {IMPLEMENTATION!r} "
                    "(it does not use transformers' AttentionInterface)"
                )
        self.model = model.eval()
        self.vocab_size = int(model.config.vocab_size)

        full, swa = default_pool_sizes(
            self.spec,
            max_batch_size=max_batch_size,
            max_context_len=max_context_len,
            page_size=page_size,
            max_step_tokens=max_context_len,
        )
        self.pool = SWAKVPool(
            size=full if full_pool_tokens is None else full_pool_tokens,
            size_swa=swa if swa_pool_tokens is None else swa_pool_tokens,
            num_layers=self.spec.num_layers,
            swa_layer_ids=self.spec.swa_layer_ids,
            num_kv_heads=self.spec.num_kv_heads,
            head_dim=self.spec.head_dim,
            dtype=self.kv_cache_dtype,
            device=self.device,
            page_size=page_size,
        )
        for layer, (k_scale, v_scale) in scales.items():
            self.pool.set_kv_scales(layer, k_scale, v_scale)
        self.req_to_token_pool = ReqToTokenPool(max_batch_size + 1, max_context_len, self.pool.device)
        self.allocator = SWATokenAllocator(self.pool)
        kwargs = {"logit_softcap": self.spec.logit_softcap} if self.spec.logit_softcap is not None else {}
        self.backend = cls(
            self.pool,
            self.req_to_token_pool,
            num_heads=self.spec.num_heads,
            sliding_window=self.spec.sliding_window,
            scaling=self.spec.scaling,
            **kwargs,
        )
        self.max_batch_size = max_batch_size
        self.max_context_len = max_context_len
        self.graphs: Optional[GraphRunner] = None
        self.compile = compile
        self._graph_model = self._eager_model = self.model
        if compile:
            name = "inductor" if compile is True else compile
            self._graph_model = torch.compile(self.model, backend=name)
            # Eager steps (EXTEND chunks of any length): compiled once for a symbolic token
            # count, so a new prompt length reuses the compiled code (module docstring).
            self._eager_model = torch.compile(self.model, backend=name, dynamic=True)

    # ------------------------------------------------------------------ eager steps
    def forward(
        self,
        batch: ForwardBatch,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        *,
        logits_indices: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Run one step eagerly: ``backend.init_forward_metadata(batch)`` then the model.

        ``input_ids`` / ``positions``: ``[T]`` int64 on the model's device, the step's new tokens
        request by request (``T = batch.num_tokens``; positions feed RoPE). The batch's slots
        must be allocated and written into ``req_to_token`` by the caller. Returns the logits,
        float32 ``[T, vocab]``, or ``[len(logits_indices), vocab]`` for the tokens at
        ``logits_indices`` (``[n]`` int64; the LM head then runs on those tokens only)."""
        self._check_tokens(batch, input_ids, positions)
        self.backend.init_forward_metadata(batch)
        return self._run_model(batch, input_ids, positions, logits_indices)

    def _check_tokens(self, batch: ForwardBatch, input_ids: torch.Tensor, positions: torch.Tensor) -> None:
        T = batch.num_tokens
        for name, t in (("input_ids", input_ids), ("positions", positions)):
            if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.shape[0] != T:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{name} must be a [T={T}] tensor (batch.num_tokens), got {got}")
            if t.dtype != torch.int64:
                raise ValueError(f"{name} must be int64, got {str(t.dtype).replace('torch.', '')}")
            if t.device != self.pool.device:
                raise ValueError(f"{name} is on {t.device}, the model on {self.pool.device}")

    def _run_model(
        self,
        batch: ForwardBatch,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_indices: Optional[torch.Tensor] = None,
        model=None,
    ) -> torch.Tensor:
        """The model (default: the eager steps' model, ``self.model`` compiled with a symbolic
        token count under ``compile``) over the step's tokens, with the step bound (metadata
        already prepared)."""
        step = BoundStep(self.backend, batch, self.spec, self.modules)
        keep = 0 if logits_indices is None else logits_indices
        with torch.no_grad(), bind_step(step):
            out = (self._eager_model if model is None else model)(
                input_ids=input_ids[None], position_ids=positions[None], use_cache=False, logits_to_keep=keep
            )
        return out.logits[0].float()

    # ------------------------------------------------------------------ graphs
    def enable_graphs(
        self,
        *,
        max_bs: Optional[int] = None,
        modes: Sequence[ForwardMode] = (ForwardMode.DECODE,),
        num_draft_tokens: Optional[int] = None,
        bucket_sizes: Optional[Sequence[int]] = None,
        extend_tokens: Optional[Sequence[int]] = None,
    ) -> GraphRunner:
        """Build (once) the ``GraphRunner`` that captures whole-model steps of ``modes``
        (default DECODE) for up to ``max_bs`` requests (default ``max_batch_size``); it
        captures on its first step or on ``graphs.capture()``. Returns it (``self.graphs``).
        With EXTEND in ``modes``, ``extend_tokens`` are its token-count buckets (the backend
        must be at ``GraphSupport.ALWAYS``); an EXTEND step's graph returns the logits of each
        request's last token."""
        if self.graphs is None:
            self.graphs = GraphRunner(
                self.backend,
                self._graph_step,
                max_bs=max_bs or self.max_batch_size,
                inputs={"input_ids": ((), torch.int64)},
                num_draft_tokens=num_draft_tokens,
                bucket_sizes=bucket_sizes,
                modes=list(modes),
                extend_tokens=extend_tokens,
                extend_rows="requests",
            )
        return self.graphs

    def _graph_step(self, batch: ForwardBatch, inputs) -> torch.Tensor:
        if batch.forward_mode is ForwardMode.EXTEND:
            # each request's last token, from the device lengths (a padded request's index is
            # the previous request's, a row the caller never reads); the eager steps' model
            # (compiled for any token count under ``compile``)
            last = (torch.cumsum(batch.extend_seq_lens, 0) - 1).clamp_min(0)
            return self._run_model(batch, inputs["input_ids"], batch.positions, last)
        return self._run_model(batch, inputs["input_ids"], batch.positions, model=self._graph_model)

    def forward_graph(self, batch: ForwardBatch, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Run one step through the ``GraphRunner`` (``enable_graphs`` first): replayed when a
        captured bucket holds it, else eagerly (``self.graphs.why_eager(batch)`` says why).
        Arguments as in ``forward``; returns float32 ``[T, vocab]`` (an EXTEND step: ``[bs,
        vocab]``, each request's last token), a view of the graph's static output after a
        replay, valid until the next step (read or clone it first)."""
        if self.graphs is None:
            raise RuntimeError("forward_graph() before enable_graphs()")
        self._check_tokens(batch, input_ids, positions)
        if batch.positions is not positions:
            batch = dataclasses.replace(batch, positions=positions, validate=False)
        return self.graphs.run(batch, {"input_ids": input_ids})
