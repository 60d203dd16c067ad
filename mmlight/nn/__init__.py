"""Building blocks shared by the models: the one attention entry point (and its observation
point), its timm adapter, and the typed records of attention sites and blocks."""

from mmlight.nn.attention import (
    AttentionObserver,
    AttentionRecorder,
    RecordedAttention,
    ReweightedAttention,
    attention,
    causal_mask,
    observe_attention,
    record_attention,
)
from mmlight.nn.sites import AttentionSite, Block

__all__ = [
    "attention",
    "causal_mask",
    "ReweightedAttention",
    "AttentionObserver",
    "AttentionRecorder",
    "RecordedAttention",
    "observe_attention",
    "record_attention",
    "AttentionSite",
    "Block",
]
