"""Mutants of the reference backend that the model-level check must catch
(``check_matches_transformers``; ``tests/conformance/test_model_check.py`` runs it against
each). Each is a small, plausible kernel bug that shows up when a real model's configuration
drives the backend: the model's scaling, window, GQA layout, soft-cap and sinks, and the
positions of multi-token steps.

Every mutant subclasses ``ReferenceBackend`` and overrides one method, passing on any
keyword the reference adds (``**kwargs``), so it keeps working when the reference grows.
``MODEL_CONTROL`` is the control: it overrides a method without changing anything.

``CAUGHT_IN[name]``: the model case whose failure the test expects first (the check runs
its cases in ``MODEL_CASES`` order and stops at the first failure).
"""

from __future__ import annotations

import torch

from attnplug.backends.reference import ReferenceBackend


class ModelControl(ReferenceBackend):
    """Control: overrides ``_attend`` and changes nothing."""

    def _attend(self, q, keys, values, key_pos, window, md, **kwargs):
        return super()._attend(q, keys, values, key_pos, window, md, **kwargs)


class ScaleFromHeadDim(ReferenceBackend):
    """Scaling: the kernel recomputes ``1/sqrt(head_dim)`` instead of taking the model's
    ``scaling`` (Gemma's ``query_pre_attn_scalar ** -0.5``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.scaling = self.head_dim**-0.5


class WindowOneShort(ReferenceBackend):
    """Window: SWA queries see ``W - 1`` keys (``p - W + 1 < j``: the window read as exclusive
    of the query's own key)."""

    def _attend(self, q, keys, values, key_pos, window, md, **kwargs):
        return super()._attend(q, keys, values, key_pos, None if window is None else window - 1, md, **kwargs)


class TableStartFromLastQuery(ReferenceBackend):
    """Multi-token steps: the window table starts at the LAST new token's window
    (``seq_len - W``) instead of the first's (right for DECODE), so the earlier tokens of an
    EXTEND chunk, a verify or a draft-extend step lose the oldest keys of their windows."""

    def _build_metadata(self, batch, q_len_max):
        md = super()._build_metadata(batch, q_len_max)
        if md.swa_start is None:
            return md
        ks = md.swa_slots.shape[1]
        start = torch.maximum(md.swa_start, (md.seq_lens - self.sliding_window).clamp_min(0))
        shift = start - md.swa_start  # [bs] columns dropped at the front
        cols = shift[:, None] + torch.arange(ks, device=self.device)
        table = torch.gather(md.swa_slots, 1, cols.clamp_max(ks - 1))
        md.swa_slots = torch.where(cols < ks, table, 0)
        md.swa_start = start
        return md


class GqaModulo(ReferenceBackend):
    """GQA: query head ``h`` reads KV head ``h % num_kv_heads`` instead of ``h // group``."""

    def _attend(self, q, keys, values, key_pos, window, md, **kwargs):
        H, Hkv = q.shape[1], keys.shape[2]
        G = H // Hkv
        if G == 1 or Hkv == 1:
            return super()._attend(q, keys, values, key_pos, window, md, **kwargs)
        perm = torch.arange(H, device=q.device).view(G, Hkv).t().reshape(-1)  # slot j holds head perm[j]
        back = torch.empty_like(perm)
        back[perm] = torch.arange(H, device=q.device)
        sinks = kwargs.get("sinks")
        if sinks is not None:
            kwargs = {**kwargs, "sinks": sinks[perm]}
        return super()._attend(q[:, perm], keys, values, key_pos, window, md, **kwargs)[:, back]


class SoftcapDropped(ReferenceBackend):
    """Soft-capping: accepted at construction (the capability is declared) but never applied
    (a compile-time switch left off)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.logit_softcap = None


class SinksDropped(ReferenceBackend):
    """Attention sinks: ``forward(sinks=...)`` is accepted but the sink never joins the
    softmax denominator."""

    def _attend(self, q, keys, values, key_pos, window, md, **kwargs):
        kwargs.pop("sinks", None)
        return super()._attend(q, keys, values, key_pos, window, md, **kwargs)


MODEL_CONTROL = ModelControl
MODEL_MUTANTS = [ScaleFromHeadDim, WindowOneShort, TableStartFromLastQuery, GqaModulo, SoftcapDropped, SinksDropped]
CAUGHT_IN = {
    "ScaleFromHeadDim": "gemma3_text-float32",
    "WindowOneShort": "gemma3_text-float32",
    "TableStartFromLastQuery": "gemma3_text-float32",
    "GqaModulo": "gemma3_text-float32",
    "SoftcapDropped": "gemma2-float32",
    "SinksDropped": "gpt_oss-float32",
}
