"""Mutants of issue 40, written BEFORE the sampled worlds (``check_sampled_worlds``): one
plausible kernel bug per dimension of those worlds, each wrong only in a corner that the
suite's hand-picked worlds never visited, so the suite before the sampled worlds passed every
one of them (commit 97958c0 recorded that as strict xfails; the sampled worlds turned them red).

``tests/conformance/test_world_mutants.py`` shows each one is really wrong in its corner (and
right elsewhere, so it is plausible) against float64 attention (``attnplug.oracle``), and that
``check_sampled_worlds`` catches it in the case of its own dimension, quoting a smallest world
that visits the corner.

These are not part of the catalogue's ``SUBTLE`` list (``tests/mutants/__init__.py``), whose
mutants the first round of the suite (``--attnplug-quick``) must catch: the sampled worlds run
after it, in the default run. They are named ``mutants.worlds:ClassName`` wherever a backend
target is given. Each class says, besides its ``WITNESS``:

* ``DIMENSION``: the case of ``check_sampled_worlds`` (``worlds.DIMENSIONS``) that samples its corner;
* ``CORNER``: the corner the hand-picked worlds never visited;
* ``NEEDS``: the world values that catch it.

``WITNESS = ("oracle", corner, elsewhere)``: ``corner`` and ``elsewhere`` are lists of cases
``dict(spec=WorldSpec overrides, plan=[(mode, request indices, new tokens / drafts)],
fill=None | one of instruments.POISONS)`` run on the mutant and compared step by step with
float64 attention: at least one step of a ``corner`` case is out of bounds, every step of every
``elsewhere`` case within them. ``fill``: before each step every KV row that holds no live
token (the sink, slot 0, included) is filled with that value.

Scale (a KV layer buffer past 2**31 elements, the issue's seventh dimension) has its own check
(``check_large_kv_buffers``) and mutant (``tests/mutants/scale.py``).
"""

from __future__ import annotations

import torch

from attnplug import ForwardMode
from attnplug.backends.reference import ReferenceBackend
from attnplug.ops.portable import NO_KEY

from .layout import HALF

__all__ = [
    "GroupIndexByShift",
    "DraftMaskTable4x4",
    "MaskedLoadMultiplies",
    "HalfExpWithoutMax",
    "PackedPrefixLengths",
    "LastPageLenModulo",
    "WORLD_MUTANTS",
]

#: the suite's base world (``TestConfig.spec``) as the witnesses use it: 4 layers (3 SWA, window
#: 4, 1 full), 8 query heads over 2 KV heads of 32, float32, contexts of 64 tokens
_BASE = dict(
    num_layers=4,
    num_heads=8,
    num_kv_heads=2,
    head_dim=32,
    dtype=torch.float32,
    sliding_window=4,
    size=512,
    size_swa=256,
    max_reqs=8,
    max_context_len=64,
)


def _case(plan, fill=None, **spec):
    return dict(spec={**_BASE, **spec}, plan=plan, fill=fill)


#: three prompts, a decode, a verify of 3 drafts, a chunk on the prefixes: the shape of most worlds
_USUAL = [
    ("EXTEND", [0, 1, 2], [5, 12, 9]),
    ("DECODE", [0, 1, 2], None),
    ("TARGET_VERIFY", [0, 1, 2], 3),
    ("EXTEND", [0, 1, 2], [3, 1, 6]),
    ("DRAFT_EXTEND", [0, 1, 2], 2),
]


def _attention(
    q,
    keys,
    values,
    key_pos,
    md,
    *,
    scaling,
    window,
    softcap,
    sinks,
    causal=None,
    masked_load="where",
    exp_dtype=None,
):
    """``attnplug.ops.portable.attend_gathered`` written out with three places a kernel can go
    wrong: ``causal(kp, qq, md)`` (which keys each query may see before the length and window
    masks; default ``kp <= qq``), ``masked_load`` (``"where"``: the columns no query sees are
    replaced with zeros; ``"multiply"``: multiplied by the 0/1 mask) and ``exp_dtype`` (None:
    ``exp(s - rowmax)`` in float32; a dtype: ``exp(s)`` without the max, in that dtype)."""
    T, H, D = q.shape
    bs, K, Hkv, _ = keys.shape
    G, Q = H // Hkv, md.q_len_max
    cdt = torch.promote_types(q.dtype, torch.float32)
    qp = torch.zeros(bs, Q, H, D, dtype=cdt, device=q.device)
    qp[md.token_req, md.token_idx] = q.to(cdt)
    q_pos = md.q_start[:, None] + torch.arange(Q, device=q.device)
    kp, qq = key_pos[:, None, :], q_pos[:, :, None]
    mask = (kp <= qq) if causal is None else causal(kp, qq, md)
    mask = mask & (kp < md.seq_lens[:, None, None])
    if window is not None:
        mask = mask & (kp > qq - window)
    seen = mask.any(1)[:, :, None, None]
    if masked_load == "multiply":
        keys, values = keys * seen, values * seen
    else:
        keys, values = torch.where(seen, keys, 0), torch.where(seen, values, 0)
    scores = torch.einsum("bqhgd,bkhd->bhgqk", qp.view(bs, Q, Hkv, G, D), keys.to(cdt)) * scaling
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
    sink = None if sinks is None else sinks.to(cdt).view(1, Hkv, G, 1, 1)
    if exp_dtype is None:
        row_max = scores.amax(-1, keepdim=True)
        if sink is not None:
            row_max = torch.maximum(row_max, sink)
        row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
        p = torch.exp(scores - row_max)
        denom = p.sum(-1, keepdim=True)
        if sink is not None:
            denom = denom + torch.exp(sink - row_max)
    else:
        p = torch.exp(scores.to(exp_dtype)).to(cdt)
        denom = p.sum(-1, keepdim=True)
        if sink is not None:
            denom = denom + torch.exp(sink.to(exp_dtype)).to(cdt)
    out = torch.einsum("bhgqk,bkhd->bqhgd", p / denom.clamp_min(torch.finfo(cdt).tiny), values.to(cdt))
    return out.reshape(bs, Q, H, D)[md.token_req, md.token_idx].to(q.dtype)


def _features(backend, sinks):
    return dict(scaling=backend.scaling, softcap=backend.logit_softcap, sinks=sinks)


# ---------------------------------------------------------------------------- 1. head groups
class GroupIndexByShift(ReferenceBackend):
    """Head groups: the KV head of query head ``h`` is ``h >> log2(group)`` with the log
    rounded down (``group.bit_length() - 1``), an index past the last KV head wrapping: exact
    for groups of 1, 2, 4, 8, ... and in MQA, wrong for 3, 5, 6, 7 query heads per KV head."""

    DIMENSION = "head_groups"
    CORNER = "query heads per KV head that are not a power of two (3, 5, 6, 7)"
    NEEDS = "num_heads / num_kv_heads of 3, 5, 6 or 7 with at least 2 KV heads (the hand-picked worlds: 1, 2, 4, 8)"
    WITNESS = (
        "oracle",
        [_case(_USUAL[:2], num_heads=6), _case(_USUAL[:1], num_heads=10), _case(_USUAL[:1], num_heads=14)],
        [
            _case(_USUAL, num_heads=8),
            _case(_USUAL[:2], num_heads=2),
            _case(_USUAL[:2], num_heads=4),
            _case(_USUAL[:2], num_heads=3, num_kv_heads=1),
        ],
    )

    def _attend(self, q, keys, values, key_pos, window, md, *, sinks=None):
        H, Hkv = q.shape[1], keys.shape[2]
        group = H // Hkv
        if group & (group - 1) == 0:
            return super()._attend(q, keys, values, key_pos, window, md, sinks=sinks)
        kv = (torch.arange(H, device=q.device) >> (group.bit_length() - 1)) % Hkv
        return super()._attend(q, keys[:, :, kv], values[:, :, kv], key_pos, window, md, sinks=sinks)


# ---------------------------------------------------------------------------- 2. speculative widths
class DraftMaskTable4x4(ReferenceBackend):
    """Speculative widths: TARGET_VERIFY / DRAFT_EXTEND read the causal mask among the drafts
    from a 4 x 4 table with clamped indices (draft ``i`` sees draft ``j`` iff ``min(j, 3) <=
    min(i, 3)``): exact for up to 4 drafts; from 5 on, the 4th and later drafts see every later
    draft."""

    DIMENSION = "draft_widths"
    CORNER = "more than 4 draft tokens per request (num_draft_tokens > 4)"
    NEEDS = "TARGET_VERIFY or DRAFT_EXTEND with num_draft_tokens >= 5 (the hand-picked worlds: 2 and 3)"
    WITNESS = (
        "oracle",
        [_case(_USUAL[:1] + [("TARGET_VERIFY", [0, 1, 2], 6)]), _case(_USUAL[:1] + [("DRAFT_EXTEND", [0, 1, 2], 5)])],
        [_case(_USUAL), _case(_USUAL[:1] + [("TARGET_VERIFY", [0, 1, 2], 4), ("DRAFT_EXTEND", [0, 1, 2], 4)])],
    )

    _speculative = False

    def init_forward_metadata(self, batch):
        self._speculative = batch.forward_mode.is_speculative
        super().init_forward_metadata(batch)

    def init_forward_metadata_capture_cuda_graph(self, batch):
        self._speculative = batch.forward_mode.is_speculative
        super().init_forward_metadata_capture_cuda_graph(batch)

    def init_forward_metadata_replay_cuda_graph(self, batch):
        self._speculative = batch.forward_mode.is_speculative
        super().init_forward_metadata_replay_cuda_graph(batch)

    @staticmethod
    def _table_mask(kp, qq, md):
        start = md.q_start[:, None, None]
        i, j = qq - start, kp - start  # draft indices of the query and of the key (j < 0: prefix)
        return torch.where(j >= 0, j.clamp_max(3) <= i.clamp_max(3), kp <= qq)

    def _attend(self, q, keys, values, key_pos, window, md, *, sinks=None):
        if not self._speculative or md.q_len_max <= 4:
            return super()._attend(q, keys, values, key_pos, window, md, sinks=sinks)
        return _attention(
            q, keys, values, key_pos, md, window=window, causal=self._table_mask, **_features(self, sinks)
        )


# ---------------------------------------------------------------------------- 3. poison
class MaskedLoadMultiplies(ReferenceBackend):
    """Poison: the columns no query sees (the sink, slots past a request's end, evicted SWA
    positions) are zeroed by multiplying the loaded k/v with the 0/1 mask instead of selecting
    zeros: exact while those rows hold finite values, NaN output when one holds NaN or ±Inf
    (``0 * NaN``, ``0 * Inf``)."""

    DIMENSION = "poison"
    CORNER = "KV rows holding no live token (the sink, slot 0) that hold NaN or ±Inf"
    NEEDS = "NaN or ±Inf (not finite noise) in the backend's KV rows no request owns, slot 0 included"
    WITNESS = (
        "oracle",
        [_case(_USUAL[:2], fill="nan"), _case(_USUAL[:1], fill="inf")],
        [_case(_USUAL, fill="noise"), _case(_USUAL)],
    )

    def _attend(self, q, keys, values, key_pos, window, md, *, sinks=None):
        return _attention(q, keys, values, key_pos, md, window=window, masked_load="multiply", **_features(self, sinks))


# ---------------------------------------------------------------------------- 4. half-precision magnitudes
class HalfExpWithoutMax(ReferenceBackend):
    """Half precision: the softmax takes ``exp(s)`` of the logits cast to the input's half
    type, without subtracting the row's maximum first (sums and P·V in float32): within the
    tolerance while logits stay small, ``inf / inf`` once a logit passes log(65504) ≈ 11.1 in
    float16 (≈ 88.7 in bfloat16; there the logits rounded to 8 bits before ``exp`` already cost
    about 2 % from logits of about 20 on). float32 inputs take the reference's path."""

    DIMENSION = "half_magnitudes"
    CORNER = "float16 / bfloat16 logits larger than log(max of the dtype) (11.1 in float16)"
    NEEDS = "a float16 world with logits above 11.1 (scaling or q.k large), or bfloat16 above 88.7"
    WITNESS = (
        "oracle",
        [
            _case(_USUAL[:2], dtype=torch.float16, scaling=1.0),
            _case(_USUAL[:1], dtype=torch.bfloat16, scaling=24.0),
        ],
        [
            _case(_USUAL, dtype=torch.float16),
            _case(_USUAL, dtype=torch.bfloat16),
            _case(_USUAL[:2], scaling=4.0),
        ],
    )

    def _attend(self, q, keys, values, key_pos, window, md, *, sinks=None):
        if q.dtype not in HALF:
            return super()._attend(q, keys, values, key_pos, window, md, sinks=sinks)
        return _attention(q, keys, values, key_pos, md, window=window, exp_dtype=q.dtype, **_features(self, sinks))


# ---------------------------------------------------------------------------- 5. batch composition
class PackedPrefixLengths(ReferenceBackend):
    """Batch composition: the cached-prefix lengths of an EXTEND batch are packed (the requests
    with a prefix first, as a split "paged prefix" launch lists only those) and read back by
    batch index. Exact when every request has a prefix, when none has, and when the fresh
    prompts come after the cached ones; wrong once a fresh prompt (prefix 0) comes BEFORE a
    request with a cached prefix: their prefix lengths trade places."""

    DIMENSION = "batch_composition"
    CORNER = "an EXTEND batch with a fresh prompt (prefix 0) before a request with a cached prefix"
    NEEDS = (
        "an EXTEND batch ordered [fresh, cached, ...] (the hand-picked worlds: all fresh, all cached, "
        "or [cached, fresh] in the scenario and the model check)"
    )
    WITNESS = (
        "oracle",
        [
            _case([("EXTEND", [0, 1], [5, 9]), ("EXTEND", [2, 0, 1], [6, 3, 2])]),
            _case([("EXTEND", [0], [7]), ("EXTEND", [1, 0, 2], [5, 2, 4])]),
        ],
        [
            _case(_USUAL),
            _case([("EXTEND", [0, 1], [5, 9]), ("EXTEND", [0, 1, 2], [3, 2, 6])]),
            _case([("EXTEND", [0], [5]), ("EXTEND", [0, 1, 2, 3, 4], [2, 3, 4, 5, 6])]),
        ],
    )

    def _build_metadata(self, batch, q_len_max):
        md = super()._build_metadata(batch, q_len_max)
        if batch.extend_seq_lens is not None and batch.forward_mode is ForwardMode.EXTEND and batch.batch_size > 1:
            prefix = md.q_start
            has = prefix > 0
            order = torch.sort((~has).to(torch.int8), stable=True).indices  # requests with a prefix first
            slot = torch.arange(prefix.shape[0], device=prefix.device)
            md.q_start = torch.where(slot < has.sum(), prefix[order], 0)
        return md


# ---------------------------------------------------------------------------- 6. page sizes and lengths
class LastPageLenModulo(ReferenceBackend):
    """Page edges: past one 32-key tile, the paged path (page size > 1) takes the number of
    keys in a request's last page as ``seq_len % page_size``: a sequence that ends exactly on
    a page edge (a full last page) loses its last page's keys. Exact at page size 1 (the
    token-granular table), for sequences of up to 32 keys, and whenever the last page is
    partial."""

    DIMENSION = "page_edges"
    CORNER = "a sequence of more than 32 keys ending exactly on a page edge at page size > 1"
    NEEDS = (
        "page size > 1 with a request longer than 32 tokens whose length is a multiple of the page size "
        "(the hand-picked paged worlds stop at 21 tokens; the model check's page-4 case at about 30)"
    )
    WITNESS = (
        "oracle",
        [
            _case([("EXTEND", [0, 1], [36, 9]), ("DECODE", [0, 1], None)], page_size=4),
            _case([("EXTEND", [0, 1], [47, 13]), ("DECODE", [0, 1], None)], page_size=16, sliding_window=None),
        ],
        [
            _case(_USUAL, page_size=4),
            _case([("EXTEND", [0, 1], [37, 9]), ("DECODE", [0, 1], None)], page_size=4),
            _case([("EXTEND", [0, 1], [36, 9]), ("DECODE", [0, 1], None)]),
            _case([("EXTEND", [0, 1], [16, 12]), ("TARGET_VERIFY", [0, 1], 3)], page_size=4),
        ],
    )

    def _attend(self, q, keys, values, key_pos, window, md, *, sinks=None):
        ps = self.pool.page_size
        if ps > 1:
            seq = md.seq_lens[:, None]
            full_last_page = (seq > 32) & (seq % ps == 0)
            dropped = full_last_page & (key_pos >= seq - ps) & (key_pos < seq)
            key_pos = torch.where(dropped, NO_KEY, key_pos)
        return super()._attend(q, keys, values, key_pos, window, md, sinks=sinks)


#: every mutant of this module, in the issue's order of dimensions
WORLD_MUTANTS = [
    GroupIndexByShift,
    DraftMaskTable4x4,
    MaskedLoadMultiplies,
    HalfExpWithoutMax,
    PackedPrefixLengths,
    LastPageLenModulo,
]
