"""SlurmRequeue: SLURM's warning signal, arriving in the middle of a step, leaves a checkpoint written
at the end of that step, from which a resumed run ends bitwise where the uninterrupted one does."""

import os
import signal
import stat

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from mmlight.callbacks.requeue import SlurmRequeue
from tests.helpers.checks import assert_same_tensors
from tests.helpers.trainer import quiet_trainer

SIGNAL_AT_STEP = 3  # steps counted when the signal arrives, inside the next one
STEPS = 7


class Regression(L.LightningModule):
    """A linear model under SGD with momentum (state in the optimiser too); every batch is the same
    tensor, so a replayed or skipped batch shows only in the weights, not in the data."""

    def __init__(self, signal_inside_step: bool = False):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.signal_inside_step = signal_inside_step

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def optimizer_step(self, *args, **kwargs):
        super().optimizer_step(*args, **kwargs)
        # the weights changed, Lightning has not counted the step yet: the worst place for a checkpoint
        if self.signal_inside_step and self.trainer.global_step == SIGNAL_AT_STEP:
            os.kill(os.getpid(), signal.SIGUSR1)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self):
        x = torch.linspace(-1, 1, 32).reshape(8, 4)
        return DataLoader(TensorDataset(x.repeat(4, 1), x.sum(1, keepdim=True).repeat(4, 1)), batch_size=8)


@pytest.fixture
def slurm_job(monkeypatch, tmp_path):
    """The environment of a one-task SLURM job, with an ``scontrol`` on PATH that records its arguments."""
    for name, value in {"SLURM_JOB_ID": "4242", "SLURM_NTASKS": "1", "SLURM_JOB_NAME": "train"}.items():
        monkeypatch.setenv(name, value)
    for name in ("SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"):
        monkeypatch.delenv(name, raising=False)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "scontrol.log"}\n')
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return tmp_path / "scontrol.log"


def fit(root, callbacks, ckpt_path=None, signal_inside_step=False) -> Regression:
    L.seed_everything(0)
    model = Regression(signal_inside_step)
    trainer = quiet_trainer(max_steps=STEPS, default_root_dir=root, callbacks=callbacks)
    trainer.fit(model, ckpt_path=ckpt_path)
    return model


def test_the_signal_inside_a_step_is_saved_at_its_end_and_resumes_bitwise(slurm_job, tmp_path):
    handler_before = signal.getsignal(signal.SIGUSR1)
    run = fit(tmp_path / "run", [SlurmRequeue()], signal_inside_step=True)  # goes on after the save
    assert signal.getsignal(signal.SIGUSR1) == handler_before
    assert slurm_job.read_text() == "requeue 4242\n"
    saved = tmp_path / "run" / "hpc_ckpt_1.ckpt"
    assert torch.load(saved, weights_only=False)["global_step"] == SIGNAL_AT_STEP + 1

    resumed = fit(tmp_path / "resumed", [], ckpt_path=saved)
    assert_same_tensors(resumed.state_dict(), run.state_dict(), "state_dict")
    assert_same_tensors(resumed.trainer.optimizers[0].state_dict(), run.trainer.optimizers[0].state_dict(), "optimizer")


def test_lightnings_own_handler_alone_saves_a_checkpoint_that_resumes_elsewhere(slurm_job, tmp_path):
    """Why the callback exists: Lightning saves inside the handler, so the step is taken twice."""
    run = fit(tmp_path / "run", [], signal_inside_step=True)
    resumed = fit(tmp_path / "resumed", [], ckpt_path=tmp_path / "run" / "hpc_ckpt_1.ckpt")
    assert not torch.equal(resumed.layer.weight, run.layer.weight)


def test_outside_slurm_the_signal_is_left_alone(monkeypatch, tmp_path):
    monkeypatch.delenv("SLURM_NTASKS", raising=False)
    callback, seen = SlurmRequeue(), []

    class Probe(L.Callback):
        def on_train_start(self, trainer, pl_module):
            seen.append(signal.getsignal(signal.SIGUSR1))

    fit(tmp_path, [callback, Probe()])
    assert seen[0] != callback._note and not list(tmp_path.rglob("hpc_ckpt_*.ckpt"))


def test_every_n_steps_is_checked():
    with pytest.raises(ValueError, match="every_n_steps must be at least 1, got 0"):
        SlurmRequeue(every_n_steps=0)
