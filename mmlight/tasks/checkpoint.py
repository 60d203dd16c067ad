"""Refuse a checkpoint written by another model or config with a message that says what differs,
before Lightning's ``load_state_dict`` fails deep inside with a wall of key names."""

from __future__ import annotations

import lightning as L


def check_checkpoint_matches(module: L.LightningModule, checkpoint: dict, keys: bool = True) -> None:
    """Raise ``ValueError`` if ``checkpoint['state_dict']`` does not fit ``module``.

    Args:
        module: the LightningModule about to be restored.
        checkpoint: the loaded checkpoint dict (``on_load_checkpoint``'s argument).
        keys: whether missing and unexpected keys are refused too (Lightning's ``strict``); a shape that
            differs always is.
    """
    theirs = {k: tuple(v.shape) for k, v in checkpoint.get("state_dict", {}).items()}
    ours = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    missing, unexpected = sorted(ours.keys() - theirs.keys()), sorted(theirs.keys() - ours.keys())
    if not keys:
        missing, unexpected = [], []
    reshaped = sorted(k for k in ours.keys() & theirs.keys() if ours[k] != theirs[k])
    if not (missing or unexpected or reshaped):
        return
    problems = []
    if missing:
        problems.append(f"{len(missing)} parameter(s) missing from the checkpoint, e.g. {missing[:3]}")
    if unexpected:
        problems.append(f"{len(unexpected)} unknown to this model, e.g. {unexpected[:3]}")
    if reshaped:
        problems.append("shapes differ: " + ", ".join(f"{k} {theirs[k]} vs {ours[k]}" for k in reshaped[:3]))
    theirs_hp, ours_hp = checkpoint.get("hyper_parameters", {}), dict(module.hparams)
    differing = sorted(k for k in ours_hp.keys() | theirs_hp.keys() if str(ours_hp.get(k)) != str(theirs_hp.get(k)))
    hint = f" Hyperparameters that differ: {differing}." if differing else ""
    raise ValueError("the checkpoint was written by another model or config: " + "; ".join(problems) + "." + hint)
