"""Pretrained ViT/DeiT weights for :class:`~mmlight.models.ReweightedViT`: read them, check that they
fit, adapt them the way timm does, and report what was left out.

Sources (``ViTConfig.pretrained``):

* a file: timm's ``.safetensors``/``.pth``/``.bin`` (a bare state dict, or one under ``state_dict``,
  ``state_dict_ema``, ``model_ema`` or ``model`` as the official DeiT files have it; read by
  :func:`timm.models.load_state_dict`, which prefers EMA weights as ``timm`` does), or an mmlight
  Lightning checkpoint ``.ckpt`` (the ``model.vit.`` weights of an ``ImageClassifier``). Both are read as
  data only (:mod:`mmlight.safe_load`): a file whose pickle holds other objects is refused, naming them;
* ``timm:<model name>``: the weights timm gets for that name from its cache, or from the Hugging
  Face hub on a machine that reaches it.

The state dict then goes through timm's own ``checkpoint_filter_fn`` (position embeddings resampled
for another image size, patch embeddings for another patch size) and is loaded with these rules:

* the classifier (``head.*``) is kept when its shape fits ``num_classes`` and dropped otherwise, as
  ``timm.create_model(name, pretrained=True, num_classes=N)`` drops it; the new head keeps the
  model's own initialisation;
* parameters of reweighting modules (MultiMax's ``ranges``/``ts``, a learnable temperature) are new;
* every other key must be present with the same shape, and no key may be left over: another width,
  depth, MLP size, a distilled DeiT (``dist_token``) or a ViT with registers is an error that names
  the keys.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from mmlight.safe_load import load_checkpoint, refusing_code

log = logging.getLogger(__name__)

TIMM_PREFIX = "timm:"
#: where an mmlight ``ImageClassifier`` checkpoint keeps the timm VisionTransformer's weights
MMLIGHT_PREFIX = "model.vit."
HEAD_PREFIX = "head."


class PretrainedMismatch(ValueError):
    """Pretrained weights that do not fit the configured model."""


@dataclass
class LoadReport:
    """What :func:`load_pretrained` did besides copying matching weights.

    Args:
        source: the ``pretrained`` value.
        dropped: keys of the weights that were not loaded (the old classifier), with the reason.
        new: keys of the model that kept their initialisation (the new head, reweighting parameters).
    """

    source: str
    dropped: dict[str, str] = field(default_factory=dict)
    new: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """One line for the log: the source, the dropped keys with their reasons, the new keys."""
        dropped = "; ".join(f"{key}: {reason}" for key, reason in self.dropped.items()) or "none"
        new = ", ".join(self.new[:6]) + (f" ... ({len(self.new)} in all)" if len(self.new) > 6 else "")
        return f"pretrained weights {self.source}: dropped {dropped}; new (initialised here): {new or 'none'}"


def read_pretrained(source: str) -> dict[str, torch.Tensor]:
    """The state dict of a timm ``VisionTransformer`` named by ``source`` (a file or ``timm:<name>``),
    before any adaptation to the model."""
    if source.startswith(TIMM_PREFIX):
        return _timm_weights(source[len(TIMM_PREFIX) :])
    path = Path(source).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"pretrained weights file {path} does not exist (give a file, or timm:<model name>)")
    if path.suffix == ".ckpt":
        return _mmlight_checkpoint(path)
    from timm.models import load_state_dict

    with refusing_code(path):  # timm reads .pth/.bin with weights_only=True, .safetensors as tensors
        return load_state_dict(str(path), use_ema=True)


def _mmlight_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    checkpoint = load_checkpoint(path)
    state = checkpoint.get("state_dict", {})
    weights = {k[len(MMLIGHT_PREFIX) :]: v for k, v in state.items() if k.startswith(MMLIGHT_PREFIX)}
    if not weights:
        raise PretrainedMismatch(f"{path} holds no ImageClassifier weights (no '{MMLIGHT_PREFIX}*' keys)")
    return weights


def _timm_weights(name: str) -> dict[str, torch.Tensor]:
    import timm

    if not timm.is_model(name):  # a pretrained tag (".fb_in1k") is split off by timm itself
        raise ValueError(f"timm has no model {name!r} (timm.list_models('deit*') lists some)")
    try:
        model = timm.create_model(name, pretrained=True)
    except Exception as err:  # the hub client raises OSError subclasses, timm RuntimeError/ValueError
        raise RuntimeError(
            f"timm could not get the weights of {name!r}: they are not in the Hugging Face cache "
            f"({_hub_cache()}) and the hub could not be reached or has no such weights "
            f"({type(err).__name__}: {err}). On a machine with access, run "
            f"`python -c \"import timm; timm.create_model('{name}', pretrained=True)\"` to fill the cache "
            "(set HF_HOME to share it), or save the weights to a file and give its path as `pretrained`."
        ) from err
    return model.state_dict()


def _hub_cache() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def architecture_of(state: dict[str, torch.Tensor]) -> tuple[int, int]:
    """``(embed_dim, depth)`` of a ViT state dict, from the patch embedding and the block indices."""
    if "patch_embed.proj.weight" not in state:
        raise PretrainedMismatch(
            f"the weights are not a timm VisionTransformer: no 'patch_embed.proj.weight' among {_some(state)}"
        )
    embed_dim = state["patch_embed.proj.weight"].shape[0]
    depth = 1 + max((int(k.split(".")[1]) for k in state if k.startswith("blocks.")), default=-1)
    return embed_dim, depth


def load_pretrained(vit: nn.Module, state: dict[str, torch.Tensor], source: str, new_ok: set[str]) -> LoadReport:
    """Copy ``state`` (already adapted by timm's filter) into ``vit``.

    Args:
        vit: the timm ``VisionTransformer`` to fill.
        state: the pretrained weights.
        source: the ``pretrained`` value, for messages.
        new_ok: keys of ``vit`` that may be missing from ``state`` (reweighting parameters).
    """
    from timm.models.vision_transformer import checkpoint_filter_fn

    state = checkpoint_filter_fn(state, vit)
    own = vit.state_dict()
    report = LoadReport(source)
    for key in sorted(k for k in state if k.startswith(HEAD_PREFIX)):
        if key in own and own[key].shape == state[key].shape:
            continue
        shape = tuple(state.pop(key).shape)
        report.dropped[key] = (
            f"shape {shape} does not fit the new head {tuple(own[key].shape)}"
            if key in own
            else f"shape {shape}; the model has no {key}"
        )
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    reshaped = sorted(
        f"{k} {tuple(state[k].shape)} vs {tuple(own[k].shape)}"
        for k in set(own) & set(state)
        if own[k].shape != state[k].shape
    )
    not_new = [k for k in missing if k not in new_ok and not k.startswith(HEAD_PREFIX)]
    if not_new or unexpected or reshaped:
        raise PretrainedMismatch(
            f"the pretrained weights {source} do not fit the model: "
            + "; ".join(
                f"{what}: {', '.join(keys[:8])}{' ...' if len(keys) > 8 else ''}"
                for what, keys in (
                    ("missing", not_new),
                    ("unexpected", unexpected),
                    ("different shape (weights vs model)", reshaped),
                )
                if keys
            )
            + ". Pick the variant, image size, patch size and class_token of the weights' architecture."
        )
    vit.load_state_dict(state, strict=False)
    report.new = missing
    log.info(report.summary())
    return report


def _some(state: dict) -> str:
    keys = list(state)
    return ", ".join(keys[:5]) + (" ..." if len(keys) > 5 else "")
