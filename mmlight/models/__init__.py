"""Networks built from typed configs. Models own the forward pass only."""

from mmlight.models.beam_search import BeamSearchConfig  # a checkpoint record, so imported with the rest
from mmlight.models.transformer import TransformerConfig, TransformerLM, TransformerSeq2Seq
from mmlight.models.vit import VARIANTS, ReweightedViT, ViTConfig
from mmlight.reweighting import ReweightingSpec

__all__ = [
    "VARIANTS",
    "BeamSearchConfig",
    "ReweightedViT",
    "ReweightingSpec",
    "ViTConfig",
    "TransformerConfig",
    "TransformerLM",
    "TransformerSeq2Seq",
]
