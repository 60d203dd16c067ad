"""What the tasks' Python API (``translate``, ``score``, ``classify``) shares: the data a task must
carry to be used without a Trainer or a data folder, kept in its checkpoints, and evaluation mode
for the duration of a call."""

from __future__ import annotations

import contextlib
from contextvars import ContextVar

import lightning as L
import torch

from mmlight.safe_load import CHECKPOINT_TYPES, reading_checkpoint
from mmlight.tasks.checkpoint import check_checkpoint_matches

#: the checkpoint entry that holds what a task keeps of its data (its ``data_state()``)
CHECKPOINT_KEY = "mmlight_data"

# A task's hyperparameters hold config dataclasses when it is built in Python (the CLI's hold dicts).
# Lightning's own readers (``--ckpt_path`` of fit/test/predict) call ``torch.load`` with torch's default
# ``weights_only=True``, so they get the same allow-list as ``load_from_checkpoint`` below (complete here:
# the tasks import every config record).
torch.serialization.add_safe_globals(CHECKPOINT_TYPES)

#: ``strict`` of the ``load_from_checkpoint`` call under way (None: the module's ``strict_loading``, as
#: Lightning decides, and outside such a call, e.g. when a fit resumes)
_STRICT: ContextVar[bool | None] = ContextVar("mmlight_load_strict", default=None)


class CarriesData:
    """Mixin of a LightningModule that keeps what it needs of its data (a vocabulary; a label set and
    an evaluation transform): taken from the DataModule in ``setup`` (or by :meth:`use_data`), saved in
    every checkpoint under :data:`CHECKPOINT_KEY`, restored from it by ``load_from_checkpoint``.

    Subclasses implement :meth:`use_data`, :meth:`data_state` and :meth:`load_data_state`.
    """

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path, map_location=None, hparams_file=None, strict=None, **kwargs):
        """Lightning's ``load_from_checkpoint``, reading the file as data only
        (:func:`mmlight.safe_load.reading_checkpoint`): a checkpoint that holds objects other than tensors,
        containers, numbers, strings and mmlight's config records is refused, naming them.

        Args:
            checkpoint_path: the ``.ckpt`` file.
            map_location: where the tensors go (Lightning's argument).
            hparams_file: a YAML file whose hyperparameters replace the checkpoint's (Lightning's argument).
            strict: whether the weights must match the model's keys exactly (Lightning's argument); with
                ``False`` keys may be missing or unknown, but a shape that differs still stops the load.
            **kwargs: hyperparameters that replace the checkpoint's.
        """
        token = _STRICT.set(strict)
        try:
            with reading_checkpoint(checkpoint_path):
                return super().load_from_checkpoint(
                    checkpoint_path, map_location, hparams_file, strict, weights_only=True, **kwargs
                )
        finally:
            _STRICT.reset(token)

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
        strict = _STRICT.get()
        check_checkpoint_matches(self, checkpoint, keys=self.strict_loading if strict is None else strict)
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
