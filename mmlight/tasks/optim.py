"""Optimiser parameter groups and learning-rate schedules shared by the tasks."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from mmlight.reweighting import Reweighting


def reweighting_parameter_ids(model: nn.Module) -> set[int]:
    """``id`` of every parameter that belongs to a reweighting module of ``model``."""
    return {id(p) for m in model.modules() if isinstance(m, Reweighting) for p in m.parameters()}


def param_groups(model: nn.Module, weight_decay: float, lr_scale: Callable[[str], float] | None = None) -> list[dict]:
    """Split ``model``'s trainable parameters into decayed and non-decayed groups.

    Not decayed: 1-D and 0-D parameters (biases, norms), names in ``model.no_weight_decay()``
    (position embeddings, class token), and every parameter of a reweighting module (MultiMax's
    ``ranges``/``ts``, a learnable temperature): decay would pull them toward plain softmax.

    Args:
        model: the network.
        weight_decay: decay of the decayed group.
        lr_scale: learning-rate multiplier of a parameter by its name in ``model``; one group per
            (decay, multiplier) pair, each with its multiplier under ``lr_scale`` (the task sets the
            group's ``lr`` to the peak times it). None: every multiplier is 1, so two groups.
    """
    skip_names = set(model.no_weight_decay()) if hasattr(model, "no_weight_decay") else set()
    skip_ids = reweighting_parameter_ids(model)
    groups: dict[tuple[bool, float], list[nn.Parameter]] = {(True, 1.0): [], (False, 1.0): []}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        decayed = not (p.ndim <= 1 or name in skip_names or id(p) in skip_ids)
        groups.setdefault((decayed, 1.0 if lr_scale is None else lr_scale(name)), []).append(p)
    return [
        {"params": params, "weight_decay": weight_decay if decayed else 0.0, "lr_scale": scale}
        for (decayed, scale), params in groups.items()
        if params or scale == 1.0
    ]


def warmup_cosine(
    optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.0
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup from 0 over ``warmup_steps``, then cosine decay to ``min_lr_ratio`` x the peak
    at ``total_steps``. Step it once per optimiser step."""
    if not 0 <= warmup_steps <= total_steps:
        raise ValueError(f"need 0 <= warmup_steps ({warmup_steps}) <= total_steps ({total_steps})")

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def warmup_inverse_sqrt(optimizer: torch.optim.Optimizer, warmup_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """fairseq's ``inverse_sqrt``: linear warmup from 0 to the peak over ``warmup_steps``, then the
    peak x ``sqrt(warmup_steps / step)``. Step ``n`` (1-based) of the optimiser runs at factor
    ``n / warmup_steps`` while ``n < warmup_steps``; the two pieces meet at ``n = warmup_steps``."""
    if warmup_steps < 1:
        raise ValueError(f"inverse_sqrt needs warmup_steps >= 1, got {warmup_steps}")

    def factor(step: int) -> float:
        n = step + 1
        return n / warmup_steps if n < warmup_steps else math.sqrt(warmup_steps / n)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
