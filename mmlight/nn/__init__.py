"""Building blocks shared by the models: the one attention entry point and its timm adapter."""

from mmlight.nn.attention import ReweightedAttention, attention, causal_mask

__all__ = ["attention", "causal_mask", "ReweightedAttention"]
