"""LastCheckpoint: ``last.ckpt`` at every N steps *and* at each epoch end (Lightning alone skips the
epoch end once a step trigger is set), so which step a resumed run starts from is known."""

import lightning as L
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

from mmlight.callbacks import LastCheckpoint


class SeenAtEpochStart(L.Callback):
    """Records the global step stored in ``last.ckpt`` when each epoch starts."""

    def __init__(self, path):
        self.path, self.steps = path, []

    def on_train_epoch_start(self, trainer, pl_module):
        self.steps.append(torch.load(self.path, weights_only=False)["global_step"] if self.path.exists() else None)


def fit(tmp_path, epochs: int, **checkpoint) -> SeenAtEpochStart:
    seen = SeenAtEpochStart(tmp_path / "last.ckpt")
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=epochs,
        limit_train_batches=3,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[seen, LastCheckpoint(dirpath=tmp_path, save_top_k=0, **checkpoint)],
    )
    trainer.fit(BoringModel())
    return seen


def test_last_checkpoint_at_steps_and_at_every_epoch_end(tmp_path):
    seen = fit(tmp_path, 3, save_last=True, every_n_train_steps=2)
    # 3 steps per epoch: the step trigger alone would leave step 2 after epoch 0 and step 4 after epoch 1
    assert seen.steps == [None, 3, 6]
    assert torch.load(tmp_path / "last.ckpt", weights_only=False)["global_step"] == 9
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_no_last_checkpoint_without_save_last(tmp_path):
    fit(tmp_path, 2, save_last=False, every_n_train_steps=100)
    assert list(tmp_path.iterdir()) == []
