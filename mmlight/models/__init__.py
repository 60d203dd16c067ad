"""Networks built from typed configs. Models own the forward pass only."""

from mmlight.models.vit import VARIANTS, ReweightedViT, ReweightingSpec, ViTConfig

__all__ = ["VARIANTS", "ReweightedViT", "ReweightingSpec", "ViTConfig"]
