"""The tests' smallest networks and tasks."""

from __future__ import annotations

import torch

from mmlight.models import ReweightingSpec, ViTConfig
from mmlight.models.beam_search import BeamSearchConfig
from mmlight.models.transformer import TransformerConfig
from mmlight.tasks import Translator

#: the padding id of :func:`tiny_transformer`'s vocabulary
PAD = 1


def micro_vit(**fields) -> ViTConfig:
    """The tests' smallest ViT: ``vit_micro`` on 8x8 one-channel images (the digits fixture's), 10 classes.

    Args:
        fields: any other ``ViTConfig`` field, or one of these five to override.
    """
    return ViTConfig(
        **{"variant": "vit_micro", "img_size": 8, "patch_size": 2, "in_chans": 1, "num_classes": 10, **fields}
    )


def tiny_transformer(**fields) -> TransformerConfig:
    """The tests' small transformer: a 2-layer decoder-only model, d 16, 2 heads, FFN 32, 20 tokens,
    32 positions, ``PAD`` padding (dropout as the config's default).

    Args:
        fields: any other ``TransformerConfig`` field, or one of these to override (``n_encoder_layers``
            above 0 makes an encoder-decoder).
    """
    base = {
        "vocab_size": 20,
        "d_model": 16,
        "n_heads": 2,
        "ffn_dim": 32,
        "n_layers": 2,
        "n_encoder_layers": 0,
        "max_positions": 32,
        "pad_id": PAD,
    }
    return TransformerConfig(**{**base, **fields})


def tiny(n_encoder_layers=0, name="softmax", options=None, **kwargs):
    """``tiny_transformer`` at d 32, FFN 48 over 23 tokens, with the reweighting ``name`` (``options``)."""
    base = {"vocab_size": 23, "d_model": 32, "ffn_dim": 48, "attention": ReweightingSpec(name, options or {})}
    return tiny_transformer(**{**base, "n_encoder_layers": n_encoder_layers, **kwargs})


def tiny_translator(vocab_size: int, attention: str = "multimax", **task) -> Translator:
    torch.manual_seed(0)
    config = tiny_transformer(
        vocab_size=vocab_size,
        n_layers=1,
        n_encoder_layers=1,
        dropout=0.0,
        max_positions=64,
        share_embeddings=True,
        attention=ReweightingSpec(attention),
    )
    return Translator(config, beam=BeamSearchConfig(beam_size=3, max_len_a=1.0, max_len_b=3), **task)
