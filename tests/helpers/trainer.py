"""Trainers for tests."""

from __future__ import annotations


def quiet_trainer(**options):
    """A one-device CPU ``lightning.Trainer`` that writes and prints nothing of its own: no logger, no
    checkpoints, no progress bar, no model summary.

    Args:
        options: any other ``Trainer`` argument (``max_steps``, ``callbacks``, ...), or one of these to override.
    """
    import lightning as L  # here, not at the top: most tests never build a Trainer

    quiet = {
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    return L.Trainer(**{**quiet, **options})
