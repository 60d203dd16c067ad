"""What the tasks' Python API (``translate``, ``score``, ``classify``) shares: the data a task must
carry to be used without a Trainer or a data folder, kept in its checkpoints, and evaluation mode
for the duration of a call."""

from __future__ import annotations

import contextlib

import lightning as L
import torch

from mmlight.models.beam_search import BeamSearchConfig
from mmlight.models.transformer import TransformerConfig
from mmlight.models.vit import ViTConfig
from mmlight.reweighting.spec import ReweightingSpec
from mmlight.tasks.checkpoint import check_checkpoint_matches

#: the checkpoint entry that holds what a task keeps of its data (its ``data_state()``)
CHECKPOINT_KEY = "mmlight_data"

#: the config dataclasses that a task's hyperparameters hold when it is built in Python (the CLI's hold
#: dicts). ``torch.load`` reads checkpoints with ``weights_only=True`` by default (Lightning's
#: ``load_from_checkpoint`` too), which rebuilds only allow-listed classes: these are plain records of
#: numbers, strings and tuples.
CONFIG_TYPES = [TransformerConfig, ViTConfig, ReweightingSpec, BeamSearchConfig]
torch.serialization.add_safe_globals(CONFIG_TYPES)


class CarriesData:
    """Mixin of a LightningModule that keeps what it needs of its data (a vocabulary; a label set and
    an evaluation transform): taken from the DataModule in ``setup`` (or by :meth:`use_data`), saved in
    every checkpoint under :data:`CHECKPOINT_KEY`, restored from it by ``load_from_checkpoint``.

    Subclasses implement :meth:`use_data`, :meth:`data_state` and :meth:`load_data_state`.
    """

    def use_data(self, datamodule: L.LightningDataModule) -> None:
        """Take what the task keeps from ``datamodule`` (e.g. for a checkpoint written without it)."""
        raise NotImplementedError

    def data_state(self) -> dict:
        """What the task keeps of its data, in plain types ({} when it has none yet)."""
        raise NotImplementedError

    def load_data_state(self, state: dict) -> None:
        """Restore :meth:`data_state`'s result; a DataModule attached before keeps its own, if equal."""
        raise NotImplementedError

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        state = self.data_state()
        if state:
            checkpoint[CHECKPOINT_KEY] = state

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        check_checkpoint_matches(self, checkpoint)
        if CHECKPOINT_KEY in checkpoint:
            self.load_data_state(checkpoint[CHECKPOINT_KEY])

    def missing(self, what: str, datamodule: str) -> RuntimeError:
        """The error for a call that needs ``what`` of the data when the task has none."""
        return RuntimeError(
            f"this {type(self).__name__} has no {what}: its checkpoint was written before mmlight kept them "
            f"in checkpoints (or the model was never attached to data). Attach the data it was trained on "
            f"once: `model.use_data({datamodule}(...))` with the data section of the run's config.yaml; "
            "checkpoints written afterwards carry it"
        )


@contextlib.contextmanager
def evaluating(module: torch.nn.Module):
    """Evaluation mode without gradients for the block; the module's mode is restored after it."""
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        module.train(was_training)


def device_of(module: torch.nn.Module) -> torch.device:
    """Where the module's parameters are (the inputs of a call are moved there)."""
    return next(module.parameters()).device
