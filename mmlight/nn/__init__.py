"""Building blocks shared by the models: the one attention entry point (and its observation
point), and its timm adapter."""

from mmlight.nn.attention import (
    AttentionObserver, AttentionRecorder, RecordedAttention, ReweightedAttention, attention, causal_mask,
    observe_attention, record_attention,
)

__all__ = ["attention", "causal_mask", "ReweightedAttention", "AttentionObserver", "AttentionRecorder",
           "RecordedAttention", "observe_attention", "record_attention"]
