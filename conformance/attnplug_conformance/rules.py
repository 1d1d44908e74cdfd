"""The names every conformance failure message starts with: the rule or contract clause that
broke. One place, so that the harness, the instruments and the checks name a rule the same way."""

from __future__ import annotations

__all__ = [
    "RULE_1",
    "RULE_2",
    "RULE_3",
    "ATTENTION",
    "REPLAY",
    "KV_SLOTS",
    "SEQ_LENS_CPU_NONE",
    "CAPABILITIES",
    "FEATURES",
    "MODEL",
    "OPS",
    "SCALE",
    "WORLDS",
    "ALL_RULES",
]

RULE_1 = "rule 1 (hoisted SWA writes)"
RULE_2 = "rule 2 (no host-device sync in graph-replay metadata)"
RULE_3 = "rule 3 (PDL on/off identical)"
ATTENTION = "contract (attention matches the reference)"
REPLAY = "contract (graph replay equals eager)"
KV_SLOTS = "contract (KV written only at the step's slots)"
SEQ_LENS_CPU_NONE = "contract (accepts seq_lens_cpu=None)"
CAPABILITIES = "contract (capabilities are honest)"
FEATURES = "contract (logit soft-cap and attention sinks)"
MODEL = "contract (model logits match transformers)"
OPS = "contract (the op layer over engine-owned caches)"
SCALE = "contract (layer KV buffers past 2**31 elements)"
WORLDS = "contract (attention matches float64 in sampled worlds)"

#: every rule name above, for tools that check a message names one
ALL_RULES = (
    RULE_1,
    RULE_2,
    RULE_3,
    ATTENTION,
    REPLAY,
    KV_SLOTS,
    SEQ_LENS_CPU_NONE,
    CAPABILITIES,
    FEATURES,
    MODEL,
    OPS,
    SCALE,
    WORLDS,
)
