"""ViT / DeiT from timm with every attention layer routed through a reweighting function, and an
optional MultiMax modulation of the output logits (the paper's Table 2).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from timm.layers import PatchEmbed
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from mmlight import reweighting
from mmlight.models.pretrained import PretrainedMismatch, architecture_of, load_pretrained, read_pretrained
from mmlight.nn import ReweightedAttention
from mmlight.nn.gate import GateKind
from mmlight.nn.sites import AttentionSite, Block, reweighting_modules, sites_by_name
from mmlight.reweighting import ReweightingSpec
from mmlight.reweighting.backend import Backend
from mmlight.safe_load import checkpoint_record

#: Named architectures: (embed_dim, depth, num_heads). DeiT sizes from Touvron et al. (2021).
VARIANTS: dict[str, tuple[int, int, int]] = {
    "deit_tiny": (192, 12, 3),
    "deit_small": (384, 12, 6),
    "deit_base": (768, 12, 12),
    "vit_micro": (64, 4, 4),  # the CPU quick start
}


@checkpoint_record
@dataclass
class ViTConfig:
    """Architecture of the image classifier.

    Args:
        variant: a key of :data:`VARIANTS`, fixing width, depth and heads.
        img_size: input resolution (square).
        patch_size: patch side in pixels.
        in_chans: input channels.
        num_classes: classifier outputs.
        global_pool: ``avg`` (GAP over patch tokens, the paper's choice) or ``token`` (CLS token).
        class_token: prepend a CLS token. None: when ``global_pool`` is ``token``, or when the
            ``pretrained`` weights have one (DeiT and ViT weights do, also for an ``avg`` head).
        drop_path_rate: stochastic depth at the last block (linearly increasing).
        attention: the reweighting function of every attention layer (one instance per layer).
        gate: gated attention (Qiu et al. 2025) in every attention layer: ``none``, ``headwise`` (one
            sigmoid gate per head) or ``elementwise`` (one per channel), computed from the layer's input
            and applied to each head's output before the projection (:mod:`mmlight.nn.gate`).
        output_multimax: apply a learnable MultiMax sigma to the logits before the loss.
        output_multimax_order: its order (1 or 2).
        output_multimax_terms: ``both`` or ``low`` (term (1) only; the paper's Table 5 ablation).
        output_multimax_init_std: its ``init_std``; 0 starts it at the identity (see
            :class:`~mmlight.reweighting.MultiMax`).
        pretrained: start from these weights: a file (timm ``.safetensors``/``.pth``, an official
            DeiT ``.pth``, an mmlight ``.ckpt``) or ``timm:<model name>`` (timm's cache or the hub).
            The reweighting modules and, unless its shape fits ``num_classes``, the head are new;
            position embeddings are resampled to ``img_size`` as timm does
            (:mod:`mmlight.models.pretrained`).
        backend: how every reweighting in the model is computed: ``auto`` (Triton kernels on CUDA,
            eager PyTorch on the CPU), ``reference``, ``compile`` or ``triton``.
    """

    variant: Literal["deit_tiny", "deit_small", "deit_base", "vit_micro"] = "deit_small"
    img_size: int = 224
    patch_size: int = 16
    in_chans: int = 3
    num_classes: int = 1000
    global_pool: Literal["avg", "token"] = "avg"
    class_token: bool | None = None
    drop_path_rate: float = 0.1
    attention: ReweightingSpec = field(default_factory=ReweightingSpec)
    gate: GateKind = "none"
    output_multimax: bool = False
    output_multimax_order: int = 2
    output_multimax_terms: Literal["both", "low"] = "both"
    output_multimax_init_std: float = 0.02
    backend: Backend = "auto"
    pretrained: str | None = None

    def __post_init__(self):
        # jsonargparse (4.53) reads `--model.init_args.model.pretrained null` as the string "None" when
        # the model is given by class path: a fine-tuning config could not be switched off from the
        # command line. No weights file is named "None".
        if self.pretrained in ("None", "null", ""):
            self.pretrained = None


def _check_variant(variant: str, found: tuple[int, int], source: str) -> None:
    """Stop when the pretrained weights' width and depth are not those of ``variant``."""
    embed_dim, depth, _ = VARIANTS[variant]
    if found != (embed_dim, depth):
        fitting = [name for name, (d, n, _) in VARIANTS.items() if (d, n) == found] or ["none of the variants"]
        raise PretrainedMismatch(
            f"the pretrained weights {source} are another architecture: width {found[0]}, {found[1]} blocks; "
            f"model.variant {variant} has width {embed_dim}, {depth} blocks (fitting: {', '.join(fitting)})"
        )


class ContiguousPatchEmbed(PatchEmbed):
    """timm's patch embedding, its tokens ``(B, N, C)`` returned contiguous.

    timm flattens the convolution's ``(B, C, H, W)`` output and transposes it, so the tokens are a
    ``(B, C, N)``-strided view. Without a class token (whose concatenation copies them) every residual
    add keeps that layout, and each LayerNorm then copies its input in the forward and its gradient's
    partner in the backward: four copies per block and step (48 in DeiT-small, as many as its matrix
    products move). One copy here replaces them; the values are the same.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).contiguous()  # (B, N, C)


def _class_token(config: ViTConfig, weights: dict | None) -> bool:
    """Whether the model has a CLS token (see :attr:`ViTConfig.class_token`)."""
    wanted = config.class_token
    if wanted is None:
        wanted = config.global_pool == "token" or (weights is not None and "cls_token" in weights)
    if config.global_pool == "token" and not wanted:
        raise ValueError("global_pool: token needs class_token: true (or null)")
    return wanted


class ReweightedViT(nn.Module):
    """A timm ``VisionTransformer`` whose attention layers use ``config.attention``.

    Args:
        config: the architecture.
    """

    def __init__(self, config: ViTConfig):
        super().__init__()
        self.config = config
        embed_dim, depth, num_heads = VARIANTS[config.variant]
        weights = read_pretrained(config.pretrained) if config.pretrained else None
        if weights is not None:
            _check_variant(config.variant, architecture_of(weights), config.pretrained)
        class_token = _class_token(config, weights)
        self.vit = VisionTransformer(
            img_size=config.img_size,
            patch_size=config.patch_size,
            in_chans=config.in_chans,
            num_classes=config.num_classes,
            global_pool=config.global_pool,
            class_token=class_token,
            # timm puts the final norm after the pooling (fc_norm) for avg pooling; pretrained
            # weights say where theirs is
            fc_norm=None if weights is None else "fc_norm.weight" in weights,
            embed_dim=embed_dim,
            depth=depth,
            num_heads=num_heads,
            drop_path_rate=config.drop_path_rate,
            attn_layer=ReweightedAttention,
            embed_layer=ContiguousPatchEmbed,
        )
        for block in self.vit.blocks:
            block.attn.reweight = config.attention.build(
                config.backend, num_heads, causal=False, site="ViT self-attention"
            )
            block.attn.set_gate(config.gate)
        self.output = None
        if config.output_multimax:
            self.output = reweighting.MultiMax(
                order=config.output_multimax_order,
                terms=config.output_multimax_terms,
                init_std=config.output_multimax_init_std,
                backend=config.backend,
            )
        self.pretrained_report = None
        if weights is not None:
            new_keys = {  # the reweightings' and gates' parameters, which plain attention weights lack
                f"blocks.{i}.attn.{part}.{name}"
                for i, block in enumerate(self.vit.blocks)
                for part in ("reweight", "out_gate")
                if getattr(block.attn, part) is not None
                for name, _ in getattr(block.attn, part).named_parameters()
            }
            self.pretrained_report = load_pretrained(self.vit, weights, config.pretrained, new_keys)

    def attention_sites(self) -> dict[str, AttentionSite]:
        """Each attention layer as a typed record, by its stable name (``blocks.<i>``), in depth order:
        the names that monitoring and attention analysis report."""
        return sites_by_name(
            [
                AttentionSite(f"blocks.{i}", "self", "blocks", i, block.attn.reweight, gate=block.attn.out_gate)
                for i, block in enumerate(self.vit.blocks)
            ]
        )

    def reweighting_sites(self) -> dict[str, reweighting.Reweighting]:
        """The reweighting module of every attention site, plus ``output`` when the logits are modulated."""
        return reweighting_modules(self.attention_sites(), self.output)

    def blocks(self) -> list[Block]:
        """The transformer blocks in depth order; their CLS token (if any) is a prefix, not a patch."""
        prefix = self.vit.num_prefix_tokens
        return [Block(f"blocks.{i}", "blocks", i, block, prefix) for i, block in enumerate(self.vit.blocks)]

    def no_weight_decay(self) -> set[str]:
        """Names of parameters to exclude from weight decay besides 1-D ones (timm's convention)."""
        return {f"vit.{name}" for name in self.vit.no_weight_decay()}

    def head_parameter_names(self) -> set[str]:
        """Names of the classifier's parameters (the new head when fine-tuning)."""
        return {f"vit.head.{name}" for name, _ in self.vit.head.named_parameters()}

    def layer_ids(self) -> dict[str, int]:
        """Depth of every parameter for layer-wise learning-rate decay, as BEiT counts it: 0 for the
        patch and position embeddings and the class token, ``i + 1`` for block ``i``, and
        ``depth + 1`` for everything above (final norm, head, output MultiMax)."""
        ids = {name: len(self.vit.blocks) + 1 for name, _ in self.named_parameters()}
        ids.update({f"vit.patch_embed.{name}": 0 for name, _ in self.vit.patch_embed.named_parameters()})
        ids.update({f"vit.{name}": 0 for name in ("pos_embed", "cls_token") if getattr(self.vit, name) is not None})
        for i, block in enumerate(self.vit.blocks):
            ids.update({f"vit.blocks.{i}.{name}": i + 1 for name, _ in block.named_parameters()})
        return ids

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Class scores ``(B, num_classes)``: the logits, modulated by the output MultiMax if any."""
        logits = self.vit(images)  # (B, num_classes)
        if self.output is not None:
            logits = self.output.modulate(logits)
        return logits

    def loss(self, images: torch.Tensor, labels: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
        """Mean cross-entropy of ``forward(images)`` against hard ``labels`` ``(B,)``; with an output
        MultiMax it runs fused (sigma, log-softmax and NLL in one kernel) on the Triton backend."""
        logits = self.vit(images)  # (B, num_classes)
        if self.output is not None:
            return self.output.cross_entropy(logits, labels, label_smoothing=label_smoothing)
        return F.cross_entropy(logits, labels, label_smoothing=label_smoothing)
