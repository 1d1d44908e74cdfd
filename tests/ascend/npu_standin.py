"""An EMULATED stand-in, on the host, for the torch_npu operators the ascend backend calls.

It implements what the operators' documentation says they compute and refuse, written from
the documents (not from the backend: it shares no code with ``attnplug_ascend``), so that the
backend's calls can be run, checked and compared with the float64 oracle on a machine without
an NPU. It never ships: it lives in tests/, and everything that reports a run through it says
"emulated". What it cannot tell: the hardware's numerics, its speed, and any behaviour the
documents do not state (each such choice is marked ASSUMED below; docs/ascend.md lists them).

Sources (Ascend/op-plugin ``docs/context``, read 2026-12; quoted by tag in the comments):

* [FIA]  ``torch_npu-npu_fused_infer_attention_score.md`` (v1);
* [FIA2] ``torch_npu-npu_fused_infer_attention_score_v2.md`` (same semantics, renamed arguments);
* [SRC2] op-plugin's C++ of ``npu_fused_infer_attention_score_v2``: the ``learnable_sink``
  argument (the stored [FIA2] predates it); its meaning is GPT-OSS's sinks, as vllm-ascend's
  ``attention_v1.py`` passes the model's ``sinks`` to it;
* [BAND] the band (``sparse_mode=4``) golden of an Ascend FIA accuracy script: the query of row
  ``i`` sits at ``i + S2 - S1`` (aligned to the last key) and sees keys in
  ``[p - pre_tokens, p + next_tokens]``, both ends included; [CAUSAL] mindstudio-probe's
  golden of the compressed masks: ``sparse_mode=3`` masks ``triu(k = S2 - S1 + 1)``;
* [SPA]  ``torch_npu-npu_scatter_pa_kv_cache.md``; the ``"Norm"`` layout
  ``[num_blocks, block_size, num_head, head_size]`` from ops-transformer's ScatterPaKvCache doc;
* [TGB] [TGE] [TUB] [TUE] ``torch_npu-npu-graph_task_group_begin/end.md`` and
  ``torch_npu-npu-graph_task_update_begin/end.md``: capture an operator as a task group,
  re-issue it with new host arguments before a replay, on another stream, behind an
  ``ExternalEvent``.

The graph runtime (``StandIn.npu``, shaped like ``torch.npu``) records what a capture runs, op by
op, with the tensors it touched, and a replay re-executes that record over the same tensors
(as a device graph replays its kernels): host values the capture saw (the attention's length
lists) stay baked in unless a task group is re-issued with ``graph_task_update_begin/end``. A
captured ``ExternalEvent.wait`` makes a replay fail when nobody recorded the event since the
last replay (on hardware the graph would wait forever).
"""

from __future__ import annotations

import contextlib
import math
import types
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

__all__ = ["StandIn", "OperatorError", "STANDIN", "RELAXED", "INT32_MAX"]

INT32_MAX = 2**31 - 1
LAYOUTS = ("BSH", "BSND", "BNSD", "BNSD_BSND", "BSH_NBSD", "BSND_NBSD", "BNSD_NBSD", "TND", "TND_NTD", "NTD_TND")
HALF = (torch.float16, torch.bfloat16)


class OperatorError(RuntimeError):
    """What the real operator raises (an aclnn parameter-check error) for arguments its
    documentation rules out."""


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise OperatorError(message)


def _host_ints(name: str, values) -> List[int]:
    """[FIA] ``actual_seq_lengths``: "int类型数组" (SymInt[]): host integers, never a tensor."""
    _check(isinstance(values, (list, tuple)), f"{name} must be a host list of ints, got {type(values).__name__}")
    out = []
    for v in values:
        _check(isinstance(v, int) and not isinstance(v, bool), f"{name} must hold ints, got {v!r}")
        out.append(int(v))
    return out


def _not_emulated(what: str) -> None:
    raise NotImplementedError(f"emulated stand-in: {what} is not emulated (tests/ascend/npu_standin.py)")


class _Callable:
    """An operator: callable, with its ``.out`` variant as an attribute (as torch_npu's are)."""

    def __init__(self, fn, out) -> None:
        self._fn, self.out = fn, out

    def __call__(self, *args, **kwargs):
        return self._fn(*args, **kwargs)


# ============================================================================ the fused attention
class _Attention:
    """The argument checks and the computation shared by v1 and ``_v2`` (they differ in names
    only: [FIA2] "推荐使用本接口" over the old one with the same semantics)."""

    def __init__(self, relaxed_block_size: bool) -> None:
        self.relaxed_block_size = relaxed_block_size
        self._masks_checked: Dict[Tuple[int, int], bool] = {}
        self.calls = 0

    # ------------------------------------------------------------------ argument checks
    def check(
        self,
        query,
        key,
        value,
        *,
        q_lens,
        kv_lens,
        block_table,
        block_size,
        num_heads,
        num_kv_heads,
        pre_tokens,
        next_tokens,
        input_layout,
        sparse_mode,
        atten_mask,
        inner_precise,
        sinks,
    ) -> Dict[str, Any]:
        _check(input_layout in LAYOUTS, f"input_layout={input_layout!r}: one of {LAYOUTS} ([FIA] input_layout)")
        if input_layout != "TND":
            _not_emulated(f"input_layout={input_layout!r} (only TND)")
        # [FIA] query/key/value: "不支持非连续的Tensor"; query dtype float16/bfloat16
        for name, t in (("query", query), ("key", key), ("value", value)):
            _check(isinstance(t, torch.Tensor), f"{name} must be a tensor")
            _check(t.is_contiguous(), f"{name} is not contiguous (the operator takes contiguous tensors only)")
        _check(query.dtype in HALF, f"query dtype {query.dtype}: float16 or bfloat16 ([FIA] query)")
        _check(key.dtype == query.dtype and value.dtype == query.dtype, "key/value dtype differs from query's")
        # [FIA] "参数key、value中对应tensor的shape需要完全一致"
        _check(key.shape == value.shape, f"key {tuple(key.shape)} and value {tuple(value.shape)} differ")
        _check(query.dim() == 3, f"TND query must be [T, N, D], got {tuple(query.shape)}")
        T, N, D = query.shape
        # [FIA] num_heads: "需要与shape中的query的N轴shape值相同"
        _check(num_heads == N, f"num_heads={num_heads} but the query has {N} heads")
        # [FIA] num_key_value_heads: 0 means equal; "num_heads整除num_key_value_heads ... 比值不能大于64"
        nkv = num_kv_heads or num_heads
        _check(nkv > 0 and num_heads % nkv == 0, f"num_heads={num_heads} is not a multiple of num_kv_heads={nkv}")
        _check(num_heads // nkv <= 64, f"num_heads / num_key_value_heads = {num_heads // nkv} > 64 ([FIA])")
        # [FIA] "支持N轴小于等于256，支持D轴小于等于512"
        _check(N <= 256 and D <= 512, f"N={N} (<= 256), D={D} (<= 512) ([FIA])")
        # [FIA] TND: actual_seq_lengths "必须传入 ... 以该入参元素的数量作为Batch值 ... 后一个元素的值必须
        # 大于等于前一个元素的值，且不能出现负值" (cumulative)
        _check(q_lens is not None, "TND needs actual_seq_lengths / actual_seq_qlen ([FIA])")
        q_cum = _host_ints("actual_seq_qlen", q_lens)
        B = len(q_cum)
        _check(B <= 65536, f"batch {B} > 65536 ([FIA])")
        prev = 0
        for i, c in enumerate(q_cum):
            _check(c >= prev, f"actual_seq_qlen[{i}] = {c} < {prev}: TND query lengths are cumulative ([FIA])")
            prev = c
        _check(not q_cum or q_cum[-1] <= T, f"actual_seq_qlen ends at {q_cum[-1] if q_cum else 0} > T={T}")
        q_len = [c - p for c, p in zip(q_cum, [0] + q_cum[:-1])]
        # [FIA] TND: "actualSeqLengths和actualSeqLengthsKv必须传入"
        _check(kv_lens is not None, "TND needs actual_seq_lengths_kv / actual_seq_kvlen ([FIA])")
        kv = _host_ints("actual_seq_kvlen", kv_lens)
        _check(len(kv) == B, f"actual_seq_kvlen has {len(kv)} entries, actual_seq_qlen {B} (the batch)")
        q_s = max(q_len, default=0)
        paged = block_table is not None
        if paged:
            # [FIA] page attention: with it actual_seq_lengths_kv is each batch's length (not cumulative)
            _check(all(x >= 0 for x in kv), f"actual_seq_kvlen {kv} holds a negative length")
            kv_len = kv
            # [FIA] block_table: int32, "必须为二维，第一维长度需等于B，第二维长度不能小于maxBlockNumPerSeq"
            _check(isinstance(block_table, torch.Tensor) and block_table.dtype == torch.int32, "block_table: int32")
            _check(
                block_table.dim() == 2 and block_table.shape[0] == B,
                f"block_table {tuple(block_table.shape)}: [B={B}, *]",
            )
            _check(isinstance(block_size, int) and block_size > 0, f"block_size={block_size}: page attention needs it")
            need = max((-(-x // block_size) for x in kv), default=0)
            _check(
                block_table.shape[1] >= need, f"block_table has {block_table.shape[1]} columns, a request needs {need}"
            )
            if not self.relaxed_block_size:
                if q_s > 1:  # [FIA] Q_S>1, page attention: "block_size最小为128，最大为512，且要求是128的倍数"
                    _check(block_size % 128 == 0 and 128 <= block_size <= 512, f"block_size={block_size} (Q_S > 1)")
                else:  # [FIA] Q_S=1: "key、value输入类型为float16、bfloat16时需要16对齐"
                    _check(block_size % 16 == 0, f"block_size={block_size} (Q_S = 1: a multiple of 16)")
            # [FIA] TND page attention: kv cache (blocknum, blocksize, H) or (blocknum, KV_N, blocksize, D)
            if key.dim() == 3:
                _check(key.shape[1] == block_size and key.shape[2] == nkv * D, f"key cache {tuple(key.shape)}")
                _check(key.shape[2] <= 65535, "(blocknum, blocksize, H) with KV_N * D > 65535 ([FIA])")
            else:
                _check(key.dim() == 4 and key.shape[1:] == (nkv, block_size, D), f"key cache {tuple(key.shape)}")
            # [FIA] "blocknum不能小于根据actual_seq_lengths_kv和blockSize计算的每个batch的block数量之和"
            blocks = sum(-(-x // block_size) for x in kv)
            _check(key.shape[0] >= blocks, f"the cache has {key.shape[0]} blocks, the batch needs {blocks}")
            # [FIA] Q_S=1 page attention: "key、value各自对应tensor的shape所有维度相乘不能超过int32的表示范围"
            _check(key.numel() <= INT32_MAX, f"key cache of {key.numel()} elements exceeds int32")
        else:
            _check(key.dim() == 3 and key.shape[1:] == (nkv, D), f"TND key must be [T_kv, {nkv}, {D}]")
            prev = 0
            for i, c in enumerate(kv):  # [FIA] TND without paging: cumulative, like the query's
                _check(c >= prev, f"actual_seq_kvlen[{i}] = {c} < {prev}: TND KV lengths are cumulative ([FIA])")
                prev = c
            _check(not kv or kv[-1] <= key.shape[0], f"actual_seq_kvlen ends past the key's {key.shape[0]} rows")
            kv_len = [c - p for c, p in zip(kv, [0] + kv[:-1])]
        # [FIA] sparse_mode: 0..4; "5、6、7、8 ... 均暂不支持"; "取其它值时会报错"
        _check(sparse_mode in (0, 1, 2, 3, 4), f"sparse_mode={sparse_mode}: 0..4 ([FIA])")
        if sparse_mode in (2, 3, 4):
            # [FIA] "sparse_mode=2、3、4时，atten_mask的shape需要为(S, S)或(1, S, S)或(1, 1, S, S)，其中S的值需要固定为
            # 2048，且需要用户保证传入的atten_mask为下三角，不传入atten_mask或者传入的shape不正确报错"
            _check(atten_mask is not None, f"sparse_mode={sparse_mode} needs the 2048 x 2048 atten_mask ([FIA])")
            _check(atten_mask.shape[-2:] == (2048, 2048) and atten_mask.dim() in (2, 3, 4), "atten_mask: 2048 x 2048")
            _check(atten_mask.numel() == 2048 * 2048, f"atten_mask {tuple(atten_mask.shape)}: one 2048 x 2048 matrix")
            _check(atten_mask.dtype in (torch.bool, torch.int8, torch.uint8), "atten_mask: bool, int8 or uint8 ([FIA])")
            self._check_compressed_mask(atten_mask)
        elif sparse_mode == 1 or atten_mask is not None:
            _not_emulated(f"a full atten_mask (sparse_mode={sparse_mode})")
        if sparse_mode == 3:
            # [FIA2] TND: "当sparse_mode=3时，要求每个batch单独的actual_seq_qlen<actual_seq_kvlen"; ASSUMED "<=":
            # vllm-ascend calls prefill without a cached prefix (qlen == kvlen) this way
            bad = [i for i, (a, b) in enumerate(zip(q_len, kv_len)) if a > b]
            _check(not bad, f"sparse_mode=3: request {bad[:1]} has more queries than keys ([FIA2])")
        # [FIA] inner_precise 0..3; "Q_S为1时该参数仅支持inner_precise为0和1"
        _check(inner_precise in (0, 1, 2, 3) and (q_s > 1 or inner_precise in (0, 1)), f"inner_precise={inner_precise}")
        if sinks is not None:  # [SRC2] learnable_sink: one logit per query head
            _check(isinstance(sinks, torch.Tensor) and sinks.shape == (N,), f"learnable_sink must be [{N}]")
            _check(sinks.dtype.is_floating_point, "learnable_sink must be floating")
        return dict(q_cum=q_cum, q_len=q_len, kv_len=kv_len, nkv=nkv, paged=paged)

    def _check_compressed_mask(self, mask: torch.Tensor) -> None:
        """[FIA] "需要用户保证传入的atten_mask为下三角": the compressed mask, True (1) above the
        diagonal. Checked once per tensor version (a host read: the stand-in runs on the host)."""
        key = (mask.data_ptr(), mask._version)
        if key not in self._masks_checked:
            with _disable_current_modes():  # the operator's own check: never part of a graph's record
                want = torch.triu(torch.ones(2048, 2048, dtype=torch.bool, device=mask.device), diagonal=1)
                self._masks_checked[key] = bool(torch.equal(mask.reshape(2048, 2048).bool(), want))
        _check(self._masks_checked[key], "atten_mask is not the compressed 2048 x 2048 mask (True above the diagonal)")

    # ------------------------------------------------------------------ the computation
    def compute(
        self, query, key, value, meta, *, block_table, block_size, scale, pre_tokens, next_tokens, sparse_mode, sinks
    ):
        """``attention_out`` [T, N, D] (query's dtype) and the float32 log-sum-exp [T, N].
        Every host value (lengths) is a Python int here, every device value (the block table,
        the caches) is read with tensor ops only: a graph capture keeps the lengths it saw."""
        self.calls += 1
        T, N, D = query.shape
        nkv, g = meta["nkv"], N // meta["nkv"]
        out = torch.zeros(T, N, D, dtype=torch.float32, device=query.device)
        lse = torch.full((T, N), -math.inf, dtype=torch.float32, device=query.device)
        start = 0
        for b, (s1, s2) in enumerate(zip(meta["q_len"], meta["kv_len"])):
            rows = slice(start, start + s1)
            start += s1
            if s1 == 0:
                continue
            if s2 == 0:  # [FIA] "参数key、value为空tensor（即S2为0），则填充全零的对应shape的输出"
                continue
            k, v = self._keys(key, value, meta, b, s2, block_table, block_size, nkv, D)
            q = query[rows].float().view(s1, nkv, g, D)
            scores = torch.einsum("sngd,tnd->ngst", q, k.float()) * scale  # [nkv, g, S1, S2]
            i = torch.arange(s1, device=query.device)[:, None]
            j = torch.arange(s2, device=query.device)[None, :]
            p = i + (s2 - s1)  # [BAND]/[CAUSAL]: the query of row i is aligned to the last key
            if sparse_mode == 0:
                visible = torch.ones(s1, s2, dtype=torch.bool, device=query.device)  # no mask ([FIA] sparse_mode 0)
            elif sparse_mode == 2:
                visible = j <= i  # leftUpCausal
            elif sparse_mode == 3:
                visible = j <= p  # rightDownCausal ([CAUSAL] triu(k = S2 - S1 + 1) masked)
            else:  # [BAND] band: p - pre_tokens <= j <= p + next_tokens. ASSUMED: applied in TND decode too
                visible = (j >= p - pre_tokens) & (j <= p + next_tokens)
            # Masked columns take no part (the formula's mask): -inf logits, and a column no row
            # sees is never read (ASSUMED of the hardware: a masked key's NaN does not leak)
            scores = torch.where(visible, scores, -math.inf)
            v = torch.where(visible.any(dim=0)[:, None, None], v.float(), 0.0)
            if sinks is not None:  # [SRC2] one more logit per head, in the denominator only
                sink = sinks.float().view(nkv, g, 1, 1).expand(nkv, g, s1, 1)
                scores = torch.cat([scores, sink], dim=-1)
            m = scores.amax(dim=-1, keepdim=True)
            m = torch.where(torch.isfinite(m), m, 0.0)
            e = torch.exp(scores - m)
            denom = e.sum(dim=-1, keepdim=True)
            probs = torch.where(denom > 0, e / denom, 0.0)[..., :s2]  # a row with nothing visible: zeros
            o = torch.einsum("ngst,tnd->sngd", probs, v)
            out[rows] = o.reshape(s1, N, D)
            lse[rows] = (m + torch.log(denom)).squeeze(-1).permute(2, 0, 1).reshape(s1, N)
        return out.to(query.dtype), lse

    @staticmethod
    def _keys(key, value, meta, b, s2, block_table, block_size, nkv, D):
        if not meta["paged"]:
            kv_cum = [0]
            for n in meta["kv_len"]:
                kv_cum.append(kv_cum[-1] + n)
            return key[kv_cum[b] : kv_cum[b] + s2], value[kv_cum[b] : kv_cum[b] + s2]
        n_blocks = -(-s2 // block_size)
        blocks = block_table[b, :n_blocks].long()  # device values, read by the gather only
        if key.dim() == 3:  # (blocknum, blocksize, H)
            k = key.view(key.shape[0], block_size, nkv, D).index_select(0, blocks)
            v = value.view(value.shape[0], block_size, nkv, D).index_select(0, blocks)
        else:  # (blocknum, KV_N, blocksize, D)
            k = key.index_select(0, blocks).permute(0, 2, 1, 3)
            v = value.index_select(0, blocks).permute(0, 2, 1, 3)
        return k.reshape(n_blocks * block_size, nkv, D)[:s2], v.reshape(n_blocks * block_size, nkv, D)[:s2]

    def run(self, query, key, value, args: Dict[str, Any], lse_flag: bool):
        meta = self.check(query, key, value, **args["check"])
        out, lse = self.compute(query, key, value, meta, **args["compute"])
        # [FIA] softmaxLse: (T, N, 1) float32 for TND when asked, else "[1]的值为0的Tensor"
        lse = lse.unsqueeze(-1) if lse_flag else torch.zeros(1, dtype=torch.float32, device=query.device)
        return out, lse


_UNSUPPORTED_V1 = (
    "pse_shift",
    "dequant_scale1",
    "quant_scale1",
    "dequant_scale2",
    "quant_scale2",
    "quant_offset2",
    "antiquant_scale",
    "antiquant_offset",
    "query_padding_size",
    "kv_padding_size",
    "key_antiquant_scale",
    "key_antiquant_offset",
    "value_antiquant_scale",
    "value_antiquant_offset",
    "key_shared_prefix",
    "value_shared_prefix",
    "actual_shared_prefix_len",
    "query_rope",
    "key_rope",
    "key_rope_antiquant_scale",
)
_UNSUPPORTED_V2 = (
    "query_rope",
    "key_rope",
    "pse_shift",
    "dequant_scale_query",
    "dequant_scale_key",
    "dequant_offset_key",
    "dequant_scale_value",
    "dequant_offset_value",
    "dequant_scale_key_rope",
    "quant_scale_out",
    "quant_offset_out",
)


def _v1_args(kw: Dict[str, Any]) -> Tuple[Dict[str, Any], bool]:
    """[FIA] v1's names and defaults."""
    for name in _UNSUPPORTED_V1:
        if kw.pop(name, None) is not None:
            _not_emulated(name)
    for name in ("antiquant_mode", "key_antiquant_mode", "value_antiquant_mode"):
        if kw.pop(name, 0):
            _not_emulated(name)
    args = dict(
        check=dict(
            q_lens=kw.pop("actual_seq_lengths", None),
            kv_lens=kw.pop("actual_seq_lengths_kv", None),
            block_table=kw.get("block_table"),
            block_size=kw.get("block_size", 0),
            num_heads=kw.get("num_heads", 1),
            num_kv_heads=kw.pop("num_key_value_heads", 0),
            pre_tokens=kw.get("pre_tokens", INT32_MAX),
            next_tokens=kw.get("next_tokens", INT32_MAX),
            input_layout=kw.pop("input_layout", "BSH"),
            sparse_mode=kw.get("sparse_mode", 0),
            atten_mask=kw.pop("atten_mask", None),
            inner_precise=kw.pop("inner_precise", 0),
            sinks=None,
        ),
        compute=dict(
            block_table=kw.pop("block_table", None),
            block_size=kw.pop("block_size", 0),
            scale=float(kw.pop("scale", 1.0)),
            pre_tokens=kw.pop("pre_tokens", INT32_MAX),
            next_tokens=kw.pop("next_tokens", INT32_MAX),
            sparse_mode=kw.pop("sparse_mode", 0),
            sinks=None,
        ),
    )
    kw.pop("num_heads", None)
    lse_flag = bool(kw.pop("softmax_lse_flag", False))
    if kw:
        raise TypeError(f"npu_fused_infer_attention_score got unexpected arguments {sorted(kw)}")
    return args, lse_flag


def _v2_args(kw: Dict[str, Any]) -> Tuple[Dict[str, Any], bool]:
    """[FIA2] ``_v2``'s names and defaults, plus [SRC2]'s ``learnable_sink``."""
    for name in _UNSUPPORTED_V2:
        if kw.pop(name, None) is not None:
            _not_emulated(name)
    for name in ("query_quant_mode", "key_quant_mode", "value_quant_mode"):
        if kw.pop(name, 0):
            _not_emulated(name)
    for name in [n for n in kw if n.endswith("_dtype")]:  # [FIA2] reserved, "使用默认值即可"
        if kw.pop(name) is not None:
            _not_emulated(name)
    sinks = kw.pop("learnable_sink", None)
    args = dict(
        check=dict(
            q_lens=kw.pop("actual_seq_qlen", None),
            kv_lens=kw.pop("actual_seq_kvlen", None),
            block_table=kw.get("block_table"),
            block_size=kw.get("block_size", 0),
            num_heads=kw.pop("num_query_heads", 1),
            num_kv_heads=kw.pop("num_key_value_heads", 0),
            pre_tokens=kw.get("pre_tokens", INT32_MAX),
            next_tokens=kw.get("next_tokens", INT32_MAX),
            input_layout=kw.pop("input_layout", "BSH"),
            sparse_mode=kw.get("sparse_mode", 0),
            atten_mask=kw.pop("atten_mask", None),
            inner_precise=kw.pop("inner_precise", 0),
            sinks=sinks,
        ),
        compute=dict(
            block_table=kw.pop("block_table", None),
            block_size=kw.pop("block_size", 0),
            scale=float(kw.pop("softmax_scale", 1.0)),
            pre_tokens=kw.pop("pre_tokens", INT32_MAX),
            next_tokens=kw.pop("next_tokens", INT32_MAX),
            sparse_mode=kw.pop("sparse_mode", 0),
            sinks=sinks,
        ),
    )
    lse_flag = bool(kw.pop("return_softmax_lse", False))
    if kw:
        raise TypeError(f"npu_fused_infer_attention_score_v2 got unexpected arguments {sorted(kw)}")
    return args, lse_flag


# ============================================================================ the graph runtime
_ALLOCATING = frozenset({"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided"})


class _Op:
    """One recorded ATen call: replay re-runs it over the recorded tensors (a fresh result is
    copied where the capture's result lives; an allocation keeps its captured tensor)."""

    def __init__(self, func, args, kwargs, out) -> None:
        self.func, self.args, self.kwargs = func, args, kwargs
        self.outs = tree_flatten(out)[0]

    def replay(self) -> None:
        if self.func.overloadpacket.__name__ in _ALLOCATING:
            return
        new = tree_flatten(self.func(*self.args, **self.kwargs))[0]
        for rec, got in zip(self.outs, new):
            if isinstance(rec, torch.Tensor) and isinstance(got, torch.Tensor):
                if rec.untyped_storage().data_ptr() != got.untyped_storage().data_ptr():
                    rec.copy_(got)


class TaskGroup:
    """[TGB]/[TGE] a task group's handle: the recorded ops of one captured operator call,
    replaced by ``graph_task_update_begin/end`` ([TUB]/[TUE]). ``updates`` counts them."""

    def __init__(self, capture_stream) -> None:
        self.ops: List[Any] = []
        self.capture_stream = capture_stream
        self.updates = 0

    def replay(self) -> None:
        for op in self.ops:
            op.replay()


class _EventWait:
    """A captured ``ExternalEvent.wait`` (+ ``reset``): a replay consumes one ``record``."""

    def __init__(self, event: "ExternalEvent") -> None:
        self.event = event

    def replay(self) -> None:
        if not self.event.recorded:
            raise RuntimeError(
                "emulated NPU graph: replay waits on an ExternalEvent nobody recorded since the last replay "
                "(on hardware the graph would wait forever): re-issue the task (graph_task_update_begin/end) "
                "and record the event before each replay"
            )
        self.event.recorded = 0


class _Recorder(TorchDispatchMode):
    """Appends every ATen call to the innermost open list."""

    def __init__(self, target: List[Any]) -> None:
        super().__init__()
        self.stack: List[List[Any]] = [target]

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.stack[-1].append(_Op(func, args, kwargs, out))
        return out


class Stream:
    def __init__(self, name: str = "side") -> None:
        self.name = name

    def wait_stream(self, other: "Stream") -> None:
        pass

    def __repr__(self) -> str:
        return f"<emulated NPU stream {self.name}>"


class ExternalEvent:
    """[TGB] ``torch.npu.ExternalEvent``: captured ``wait``/``reset``; ``record`` on the update stream."""

    def __init__(self, runtime: "Runtime") -> None:
        self.runtime = runtime
        self.recorded = 0
        self.waits = 0

    def wait(self, stream) -> None:
        rec = self.runtime.recorder
        if rec is not None:
            rec.stack[-1].append(_EventWait(self))
            self.waits += 1

    def reset(self, stream) -> None:
        pass  # part of the captured wait: a replay consumes the record it waited for

    def record(self, stream) -> None:
        self.recorded += 1


class NPUGraph:
    """``torch.npu.NPUGraph`` on the host: capture records, replay re-executes the record."""

    def __init__(self, runtime: "Runtime") -> None:
        self.runtime = runtime
        self.tape: Optional[List[Any]] = None
        self.replays = 0

    def capture_begin(self, pool=None) -> None:
        self.tape = []
        self.runtime._start_capture(self)

    def capture_end(self) -> None:
        self.runtime._end_capture()

    def replay(self) -> None:
        if self.tape is None:
            raise RuntimeError("replay() before capture")
        with torch.no_grad():
            for entry in self.tape:
                entry.replay()
        self.replays += 1


class Runtime:
    """What the backend and ``StreamGraph`` use of ``torch.npu``, on the host."""

    def __init__(self) -> None:
        self.default_stream = Stream("default")
        self.capture_stream = Stream("capture")
        self.current = self.default_stream
        self.recorder: Optional[_Recorder] = None
        self._capturing: Optional[NPUGraph] = None
        self._update: Optional[Tuple[TaskGroup, _Recorder, List[Any]]] = None
        self._pools = 0
        self.updates = 0

    def module(self) -> types.ModuleType:
        """This runtime as a module object (``StreamGraph`` keys its pool by ``__name__``)."""
        mod = types.ModuleType("npu_standin.npu")
        rt = self
        mod.Stream = lambda *a, **k: Stream()
        mod.current_stream = lambda *a: rt.current
        mod.current_device = lambda: 0
        mod.synchronize = lambda *a: None
        mod.device_count = lambda: 1
        mod.graph_pool_handle = rt._pool_handle
        mod.stream = rt._stream_ctx
        mod.graph = rt._graph_ctx
        mod.NPUGraph = lambda: NPUGraph(rt)
        mod.ExternalEvent = lambda: ExternalEvent(rt)
        mod.is_current_stream_capturing = lambda: rt._capturing is not None
        mod.graph_task_group_begin = rt.graph_task_group_begin
        mod.graph_task_group_end = rt.graph_task_group_end
        mod.graph_task_update_begin = rt.graph_task_update_begin
        mod.graph_task_update_end = rt.graph_task_update_end
        mod.runtime = rt
        return mod

    def _pool_handle(self) -> tuple:
        self._pools += 1
        return (0, self._pools)

    @contextlib.contextmanager
    def _stream_ctx(self, s):
        prev, self.current = self.current, s if s is not None else self.current
        try:
            yield
        finally:
            self.current = prev

    @contextlib.contextmanager
    def _graph_ctx(self, g: NPUGraph, pool=None, stream=None):
        prev, self.current = self.current, self.capture_stream
        g.capture_begin(pool)
        try:
            yield
        finally:
            g.capture_end()
            self.current = prev

    def _start_capture(self, g: NPUGraph) -> None:
        if self._capturing is not None:
            raise RuntimeError("emulated NPU graph: a capture is already running")
        self._capturing = g
        self.recorder = _Recorder(g.tape)
        self.recorder.__enter__()

    def _end_capture(self) -> None:
        rec, self.recorder, self._capturing = self.recorder, None, None
        rec.__exit__(None, None, None)

    # [TGB]/[TGE]: a task group inside a capture
    def graph_task_group_begin(self, stream) -> None:
        rec = self.recorder
        if rec is None:
            raise RuntimeError("graph_task_group_begin outside a graph capture ([TGB]: 图捕获阶段)")
        group = TaskGroup(stream)
        rec.stack[-1].append(group)
        rec.stack.append(group.ops)
        self._group = group

    def graph_task_group_end(self, stream) -> TaskGroup:
        rec = self.recorder
        if rec is None or len(rec.stack) < 2:
            raise RuntimeError("graph_task_group_end without graph_task_group_begin")
        rec.stack.pop()
        return self._group

    # [TUB]/[TUE]: re-issue a captured task with new host arguments
    def graph_task_update_begin(self, stream, handle: TaskGroup) -> None:
        if self._capturing is not None:
            raise RuntimeError("graph_task_update_begin during a capture ([TUB]: 图更新阶段)")
        if not isinstance(handle, TaskGroup):
            raise RuntimeError(f"handle must come from graph_task_group_end, got {type(handle).__name__}")
        # [TUB] "图更新阶段的流同图捕获阶段的流必须不同"
        _check(
            stream is not handle.capture_stream and stream is not self.capture_stream, "update on the capture stream"
        )
        ops: List[Any] = []
        rec = _Recorder(ops)
        rec.__enter__()
        self._update = (handle, rec, ops)

    def graph_task_update_end(self, stream) -> None:
        if self._update is None:
            raise RuntimeError("graph_task_update_end without graph_task_update_begin")
        handle, rec, ops = self._update
        self._update = None
        rec.__exit__(None, None, None)
        handle.ops = ops
        handle.updates += 1
        self.updates += 1


# ============================================================================ the operators
class StandIn:
    """The operators, shaped like the ``torch_npu`` module (``load_ops`` reads these names).
    ``relaxed_block_size``: skip the block-size rule ([FIA]: multiples of 128 in [128, 512]
    with more than one query token a request; of 16 with one), so that the conformance suite's
    base page sizes (1, 4) reach the operators; everything else is checked as documented."""

    __version__ = "emulated"

    def __init__(self, *, relaxed_block_size: bool = False) -> None:
        self.relaxed_block_size = relaxed_block_size
        self.SOURCE = "emulated: tests/ascend/npu_standin.py" + (
            " (block-size rule relaxed)" if relaxed_block_size else ""
        )
        self.attention = _Attention(relaxed_block_size)
        self.runtime = Runtime()
        self.npu = self.runtime.module()
        self.stores = 0
        self.poisoned = 0  # slots written twice with different values (undefined on hardware)
        self.npu_fused_infer_attention_score = _Callable(self._fia_v1, self._fia_v1_out)
        self.npu_fused_infer_attention_score_v2 = _Callable(self._fia_v2, self._fia_v2_out)

    # ---------------------------------------------------------------- fused attention
    def _fia_v1(self, query, key, value, **kw):
        args, flag = _v1_args(kw)
        return self.attention.run(query, key, value, args, flag)

    def _fia_v2(self, query, key, value, **kw):
        args, flag = _v2_args(kw)
        return self.attention.run(query, key, value, args, flag)

    @staticmethod
    def _write_out(result, workspace, out) -> None:
        _check(workspace is None or isinstance(workspace, torch.Tensor), "workspace must be a tensor")
        _check(isinstance(out, (list, tuple)) and len(out) == 2, "out=[attention_out, softmax_lse]")
        attn, lse = out
        _check(attn.shape == result[0].shape and attn.dtype == result[0].dtype, "attention_out shape / dtype")
        attn.copy_(result[0])
        if lse.shape == result[1].shape:
            lse.copy_(result[1])
        else:
            lse.zero_()

    def _fia_v1_out(self, query, key, value, *, workspace=None, out=None, **kw):
        self._write_out(self._fia_v1(query, key, value, **kw), workspace, out)
        return tuple(out)

    def _fia_v2_out(self, query, key, value, *, workspace=None, out=None, **kw):
        self._write_out(self._fia_v2(query, key, value, **kw), workspace, out)
        return tuple(out)

    def _npu_fused_infer_attention_score_get_max_workspace(self, query, key, value, **kw):
        args, _ = _v1_args(kw)
        self.attention.check(query, key, value, **args["check"])
        return torch.empty(1 << 12, dtype=torch.uint8, device=query.device)

    def _npu_fused_infer_attention_score_v2_get_max_workspace(self, query, key, value, **kw):
        args, _ = _v2_args(kw)
        self.attention.check(query, key, value, **args["check"])
        return torch.empty(1 << 12, dtype=torch.uint8, device=query.device)

    # ---------------------------------------------------------------- the KV store
    def npu_scatter_pa_kv_cache(
        self,
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        *,
        compress_lens=None,
        compress_seq_offsets=None,
        seq_lens=None,
        cache_mode="PA_NZ",
    ):
        """[SPA] scenario "key: [batch*seq_len, num_head, k_head_size]" into ND ("Norm")
        caches ``[num_blocks, block_size, num_head, head_size]``."""
        if compress_lens is not None or compress_seq_offsets is not None or seq_lens is not None:
            _not_emulated("the compressed scenario (4-D key)")
        # [SPA] cache_mode: None/'Norm' ND layout, 'PA_NZ' (the default) NZ layout
        _check(cache_mode in (None, "Norm", "PA_NZ"), f"cache_mode={cache_mode!r}")
        if cache_mode == "PA_NZ":
            _not_emulated("cache_mode='PA_NZ' (the NZ layout)")
        tensors = (("key", key), ("value", value), ("key_cache", key_cache), ("value_cache", value_cache))
        for name, t in tensors:  # [SPA] "Non-contiguous input parameters are not supported"
            _check(t.is_contiguous(), f"{name} is not contiguous")
            # [SPA] "The data types of key, value, key_cache, and value_cache must be identical"
            _check(t.dtype == key.dtype, f"{name} dtype {t.dtype} differs from key's {key.dtype}")
        # [SPA] "When key and value are both 3D, their first two shape dimensions must be identical"
        _check(
            key.dim() == 3 and value.dim() == 3 and key.shape[:2] == value.shape[:2], "key/value: [T, N, D], same T, N"
        )
        _check(key_cache.dim() == 4 and value_cache.dim() == 4, "key_cache / value_cache: 4 dimensions ([SPA])")
        T, N, Dk = key.shape
        nb, bs = key_cache.shape[:2]
        _check(key_cache.shape[2:] == (N, Dk), f"key_cache {tuple(key_cache.shape)}: [blocks, block_size, {N}, {Dk}]")
        _check(value_cache.shape == (nb, bs, N, value.shape[2]), f"value_cache {tuple(value_cache.shape)}")
        # [SPA] slot_mapping: int32 or int64, one per token
        _check(slot_mapping.dtype in (torch.int32, torch.int64), f"slot_mapping dtype {slot_mapping.dtype}")
        _check(slot_mapping.shape == (T,), f"slot_mapping {tuple(slot_mapping.shape)}: [{T}]")
        slots = slot_mapping.long()
        if T:
            # [SPA] "The value range of slot_mapping must be [0, num_blocks * block_size - 1]" (the
            # stand-in reads the values: it runs on the host; never part of a graph's record)
            with _disable_current_modes():
                lo, hi = int(slots.min()), int(slots.max())
            _check(lo >= 0 and hi < nb * bs, f"slot_mapping holds {lo}..{hi}, outside [0, {nb * bs - 1}]")
        self.stores += 1
        k_flat = key_cache.view(nb * bs, N, Dk)
        v_flat = value_cache.view(nb * bs, N, value.shape[2])
        k_flat[slots] = key
        v_flat[slots] = value
        if T:
            # [SPA] "The element values within slot_mapping must be unique. Accuracy is not guaranteed if
            # duplicate values exist": a duplicated slot whose writes differ gets NaN, so reliance shows
            # (decided on the values of this call: a graph's record keeps only the store above)
            with _disable_current_modes():
                _uniq, inverse, counts = torch.unique(slots, return_inverse=True, return_counts=True)
                dup = counts[inverse] > 1
                if bool(dup.any()):
                    differ = ((k_flat[slots] != key) | (v_flat[slots] != value)).flatten(1).any(dim=1)
                    bad = slots[differ & dup]
                    k_flat[bad] = float("nan")
                    v_flat[bad] = float("nan")
                    self.poisoned += int(bad.numel())


#: the stand-in with every documented rule
STANDIN = StandIn()
#: the same with the block-size rule relaxed (page sizes 1 and 4 reach the operators)
RELAXED = StandIn(relaxed_block_size=True)


def fresh(*, relaxed_block_size: bool = False) -> StandIn:
    """A new stand-in with its own counters and graph runtime."""
    return StandIn(relaxed_block_size=relaxed_block_size)


def tnd_reference_inputs(q_lens: Sequence[int]) -> List[int]:
    """Cumulative query lengths (``actual_seq_qlen``) of per-request counts."""
    out, total = [], 0
    for n in q_lens:
        total += n
        out.append(total)
    return out
