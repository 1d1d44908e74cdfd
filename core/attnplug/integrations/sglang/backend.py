"""``AttnplugSGLangBackend``: SGLang's ``AttentionBackend`` on attnplug's op layer.

Per step (SGLang's metadata hooks; no host read, ``needs_cpu_seq_lens = False``):

* the full->SWA translation of ``out_cache_loc``, ONCE (``swa_out_cache_loc``: the stores of
  every SWA layer read it), and of the requests' ``req_to_token`` rows, ONCE (the SWA layers'
  key table);
* ``PagedOps.plan`` of the full layers and of the SWA layers (block size 1: ``req_to_token``
  is a slot per position), with ``query_start_loc`` from the step's new tokens.

Per layer: ``PagedOps.store_kv`` into the layer's K/V buffers (the SWA sub-pool's at
``swa_out_cache_loc``), then ``PagedOps.attend`` (window ``sliding_window_size + 1``: SGLang's
window counts the keys before the query; ``logit_cap`` as the soft-cap; ``sinks``).

FP8 KV cache (``--kv-cache-dtype fp8_e4m3`` / ``fp8_e5m2``: SGLang's pools store bytes and hand
out ``float8_e4m3fn`` / ``float8_e5m2`` views): the store quantises the model-dtype k / v with
the layer's ``k_scale`` / ``v_scale`` (``RadixAttention``'s: a float32 tensor loaded from the
checkpoint, a float, or None for 1.0, SGLang's own default) by ``attnplug.memory.fp8``'s rule,
and attention reads the dequantised cache. A pool dtype the op layer serves neither as a model
dtype nor in ``fp8_kv_dtypes`` (e.g. ROCm's ``float8_e4m3fnuz``) is refused at construction.

Graphs, both generations of SGLang's hooks: ``init_forward_metadata_out_graph`` (host bounds) and
``init_forward_metadata_in_graph`` (the device work above: recorded into a captured graph and
replayed by it); the legacy capture / replay hooks run the same two, and a legacy replay copies
the new metadata into the tensors the capture recorded. Forward modes: DECODE, EXTEND and
TARGET_VERIFY (drafts as a chain); anything else is refused naming the mode.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Dict, Optional, Set, Tuple

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

from ...memory.fp8 import host_scales, is_fp8
from ...ops import PagedStep
from ..choice import backend_class

__all__ = ["AttnplugSGLangBackend", "create_backend"]

logger = logging.getLogger(__name__)


def create_backend(runner) -> "AttnplugSGLangBackend":
    """SGLang's backend factory (``register_attention_backend``)."""
    return AttnplugSGLangBackend(runner)


@dataclass
class _Metadata:
    """One step: the full layers' and the SWA layers' plans, the hoisted SWA store slots."""

    full: PagedStep
    swa: Optional[PagedStep]
    swa_out_cache_loc: Optional[torch.Tensor]


def _copy_step(dst: PagedStep, src: PagedStep) -> None:
    for name in ("query_start_loc", "seq_lens", "slot_table", "token_req", "token_idx", "q_start"):
        a, b = getattr(dst, name), getattr(src, name)
        if a is not None and b is not None:
            a.copy_(b)


class AttnplugSGLangBackend(AttentionBackend):
    """SGLang attention through the chosen attnplug backend's op layer (module docstring)."""

    needs_cpu_seq_lens = False

    def __init__(self, model_runner) -> None:
        super().__init__()
        self.device = torch.device(model_runner.device)
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        cls = backend_class(None, self.device)
        #: the attnplug backend whose op layer runs the layers
        self.attnplug_backend = cls
        self.ops = cls.paged_ops(self.device)
        pool = self.token_to_kv_pool
        kv_dtype = getattr(pool, "dtype", None)
        if kv_dtype is not None and kv_dtype not in tuple(self.ops.dtypes) + tuple(self.ops.fp8_kv_dtypes):
            served = ", ".join(
                str(d).replace("torch.", "") for d in tuple(self.ops.dtypes) + tuple(self.ops.fp8_kv_dtypes)
            )
            raise NotImplementedError(
                f"attnplug inside SGLang: the KV cache dtype {kv_dtype} is not served by the {cls.name} backend's op "
                f"layer (it serves {served})"
            )
        #: the per-layer FP8 scales handed to the op layer: layer id -> (k source, v source, k, v)
        self._scales: Dict[int, tuple] = {}
        #: the scale of a layer without one (SGLang's default: 1.0), made before any graph capture
        self._ones: Optional[torch.Tensor] = None
        if is_fp8(kv_dtype):
            self._ones = torch.ones(1, dtype=torch.float32, device=self.device)
        self.layers_mapping = getattr(pool, "layers_mapping", None)
        self.has_swa = bool(getattr(pool, "swa_layer_nums", 0)) and hasattr(pool, "translate_loc_from_full_to_swa")
        self.forward_metadata: Optional[_Metadata] = None
        self.swa_out_cache_loc: Optional[torch.Tensor] = None
        self.cuda_graph_swa_out_cache_loc: Optional[torch.Tensor] = None
        self._host: Dict[str, int] = {}
        self._captured: Dict[Tuple[int, int, str], _Metadata] = {}
        self._max_context = int(self.req_to_token_pool.req_to_token.shape[1])
        self._features_seen: Set[str] = set()
        logger.info(
            "attnplug: SGLang attention through the %s backend's op layer on %s (KV cache %s)",
            cls.name,
            self.device,
            str(kv_dtype).replace("torch.", ""),
        )

    # ------------------------------------------------------------------ per step
    @staticmethod
    def _q_len(fb) -> Optional[int]:
        """New tokens a request when the mode fixes them (None: EXTEND, per request)."""
        mode = fb.forward_mode
        if mode.is_decode():
            return 1
        if mode.is_target_verify():
            return int(fb.spec_info.draft_token_num)
        if mode.is_extend():
            return None
        raise NotImplementedError(f"attnplug inside SGLang: forward mode {mode.name} is not supported")

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False) -> None:
        """Host bounds of the step (no device read): the widest request's new tokens and the
        widest context a key table needs."""
        fb = forward_batch
        q_len = self._q_len(fb)
        if q_len is None:
            lens = fb.extend_seq_lens_cpu
            q_len = max(lens) if lens is not None and len(lens) else 1
        seq_cpu = getattr(fb, "seq_lens_cpu", None)
        bound = int(seq_cpu.max()) if seq_cpu is not None and seq_cpu.numel() else self._max_context
        self._host = dict(max_query_len=int(q_len), max_seq_len=max(int(q_len), min(bound, self._max_context)))

    def init_forward_metadata_in_graph(self, forward_batch) -> None:
        """The step's device work (graph-recordable: device ops of static shape only)."""
        fb = forward_batch
        bs = int(fb.batch_size)
        seq = fb.seq_lens[:bs]
        q_len = self._q_len(fb)
        if q_len is None:
            new = fb.extend_seq_lens[:bs].to(torch.int32)
        else:
            new = torch.full((bs,), q_len, dtype=torch.int32, device=self.device)
        qsl = torch.zeros(bs + 1, dtype=torch.int32, device=self.device)
        torch.cumsum(new, 0, out=qsl[1:])
        num_tokens = int(fb.out_cache_loc.shape[0]) if fb.out_cache_loc is not None else 0
        host = self._host or dict(max_query_len=q_len or 1, max_seq_len=self._max_context)
        width = host["max_seq_len"]
        rows = self.req_to_token_pool.req_to_token[fb.req_pool_indices[:bs].long(), :width]
        plan = dict(num_tokens=num_tokens, **host)
        full = self.ops.plan(qsl, seq, rows, 1, **plan)
        swa = swa_loc = None
        if self.has_swa:
            pool = self.token_to_kv_pool
            # the step's ONE translation: the new tokens' slots and the requests' rows together
            both = pool.translate_loc_from_full_to_swa(torch.cat([fb.out_cache_loc.long(), rows.flatten().long()]))
            swa_loc = both[:num_tokens]
            swa_rows = both[num_tokens:].view(bs, width).to(torch.int32)
            swa = self.ops.plan(qsl, seq, swa_rows, 1, **plan)
        md = _Metadata(full=full, swa=swa, swa_out_cache_loc=swa_loc)
        self.forward_metadata = md
        self.swa_out_cache_loc = swa_loc

    # ------------------------------------------------------------------ graphs
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self.cuda_graph_swa_out_cache_loc = torch.zeros(max_num_tokens, dtype=torch.int32, device=self.device)
        self._captured = {}

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    def _key(self, fb) -> Tuple[int, int, str]:
        return (int(fb.batch_size), int(fb.out_cache_loc.shape[0]), fb.forward_mode.name)

    def _keep_swa_loc(self, md: _Metadata) -> None:
        """The contract's graph buffer: ``[:n]`` the translated slots, the tail zeroed."""
        if self.cuda_graph_swa_out_cache_loc is not None and md.swa_out_cache_loc is not None:
            n = md.swa_out_cache_loc.shape[0]
            self.cuda_graph_swa_out_cache_loc[:n].copy_(md.swa_out_cache_loc)
            self.cuda_graph_swa_out_cache_loc[n:].zero_()

    def init_forward_metadata_capture_cuda_graph(self, *args, **kwargs) -> None:
        """SGLang's legacy capture hook: the new hooks, and the metadata kept for replays."""
        fb = self._legacy_batch(args, kwargs)
        self.init_forward_metadata_out_graph(fb, in_capture=True)
        self.init_forward_metadata_in_graph(fb)
        self._keep_swa_loc(self.forward_metadata)
        self._captured[self._key(fb)] = self.forward_metadata

    def init_forward_metadata_replay_cuda_graph(self, *args, **kwargs) -> None:
        """SGLang's legacy replay hook: new metadata copied into the captured tensors."""
        fb = self._legacy_batch(args, kwargs)
        self.init_forward_metadata_out_graph(fb)
        self.init_forward_metadata_in_graph(fb)
        fresh = self.forward_metadata
        kept = self._captured.get(self._key(fb))
        if kept is None:
            raise RuntimeError(f"no graph was captured for {self._key(fb)}")
        _copy_step(kept.full, fresh.full)
        if kept.swa is not None:
            _copy_step(kept.swa, fresh.swa)
            kept.swa_out_cache_loc.copy_(fresh.swa_out_cache_loc)
        self._keep_swa_loc(kept)
        self.forward_metadata = kept

    @staticmethod
    def _legacy_batch(args, kwargs):
        fb = kwargs.get("forward_batch") if "forward_batch" in kwargs else (args[0] if args else None)
        if fb is None or not hasattr(fb, "forward_mode"):
            raise NotImplementedError(
                "attnplug inside SGLang: the legacy graph hooks are served with a ForwardBatch; this SGLang passes "
                "loose tensors (use a version with init_forward_metadata_out_graph / _in_graph)"
            )
        return fb

    # ------------------------------------------------------------------ the layer
    def _is_swa(self, layer) -> bool:
        if self.layers_mapping is None:
            return False
        return bool(self.layers_mapping[layer.layer_id][1])

    def _scale(self, value, name: str, layer) -> torch.Tensor:
        """One of a layer's FP8 scales as the op layer takes it: float32 on the device, 1 or
        ``Hkv`` elements (None: 1.0, SGLang's default without checkpoint scales; a float:
        checked on the host, then filled on the device, no host-to-device copy)."""
        if value is None:
            if self._ones is None:
                self._ones = torch.ones(1, dtype=torch.float32, device=self.device)
            return self._ones
        if isinstance(value, torch.Tensor):
            return value.detach().to(device=self.device, dtype=torch.float32)
        try:
            one = host_scales(value, 1, f"layer {layer.layer_id}'s {name}")
        except ValueError as exc:
            raise ValueError(f"attnplug inside SGLang: {exc}") from None
        return torch.full((1,), float(one[0]), dtype=torch.float32, device=self.device)

    def _kv_scales(self, layer, cache: torch.Tensor) -> dict:
        """``k_scale`` / ``v_scale`` for the op layer over an FP8 ``cache`` (nothing for a cache in
        the model's dtype), converted once a layer (again if the layer's scale objects change)."""
        if not is_fp8(cache.dtype):
            return {}
        src = (getattr(layer, "k_scale", None), getattr(layer, "v_scale", None))
        kept = self._scales.get(layer.layer_id)
        if kept is None or kept[0] is not src[0] or kept[1] is not src[1]:
            kept = (*src, self._scale(src[0], "k_scale", layer), self._scale(src[1], "v_scale", layer))
            self._scales[layer.layer_id] = kept
        return {"k_scale": kept[2], "v_scale": kept[3]}

    def _attend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        md = self.forward_metadata
        if md is None:
            raise RuntimeError("attnplug inside SGLang: forward before the step's metadata")
        is_swa = self._is_swa(layer)
        pool = self.token_to_kv_pool
        k_buf, v_buf = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        hkv, d = layer.tp_k_head_num, layer.qk_head_dim
        scales = self._kv_scales(layer, k_buf)
        if save_kv_cache and k is not None and v is not None:
            loc = md.swa_out_cache_loc if is_swa else forward_batch.out_cache_loc
            self.ops.store_kv(k.view(-1, hkv, d), v.view(-1, hkv, d), k_buf, v_buf, loc, **scales)
        T, H = q.shape[0], layer.tp_q_head_num
        out = q.new_empty(T, H * layer.v_head_dim)
        window = None
        if is_swa or layer.sliding_window_size > -1:
            window = int(layer.sliding_window_size) + 1  # SGLang's window excludes the query's own key
        sinks = kwargs.get("sinks")
        if sinks is not None:
            sinks = sinks.to(torch.float32).contiguous()
        cap = layer.logit_cap if layer.logit_cap and layer.logit_cap > 0 else None
        self._note_features(window, cap, sinks)
        self.ops.attend(
            q.view(T, H, d),
            k_buf,
            v_buf,
            md.swa if is_swa else md.full,
            scale=float(layer.scaling),
            window=window,
            softcap=cap,
            sinks=sinks,
            out=out.view(T, H, layer.v_head_dim),
            **scales,
        )
        return out

    def _note_features(self, window, cap, sinks) -> None:
        """Log, once a process, the first layer that uses each feature (what a check reads to
        know the model's window, soft-cap and sinks reached attnplug)."""
        for feature, used in (("window", window), ("softcap", cap), ("sinks", sinks)):
            if used is not None and feature not in self._features_seen:
                self._features_seen.add(feature)
                logger.info("attnplug: first layer with %s", feature)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._attend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._attend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def support_triton(self) -> bool:
        return False
