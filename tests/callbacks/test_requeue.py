"""SlurmRequeue: SLURM's warning signal, arriving in the middle of a step, leaves a checkpoint written
at the end of that step, from which a resumed run ends bitwise where the uninterrupted one does."""

import os
import signal
import stat
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from mmlight.callbacks.requeue import SlurmRequeue, requeue_job
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


def fit(root, callbacks, ckpt_path=None, signal_inside_step=False, **trainer) -> Regression:
    L.seed_everything(0)
    model = Regression(signal_inside_step)
    trainer = quiet_trainer(max_steps=STEPS, default_root_dir=root, callbacks=callbacks, **trainer)
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


def test_with_lightnings_auto_requeue_off_nothing_is_saved_or_requeued(slurm_job, tmp_path):
    """``SLURMEnvironment(auto_requeue=False)``: the callback installs no handler (the one in place gets the
    signal), writes no checkpoint, runs no ``scontrol``, and the run goes on to its last step."""
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    received = []
    before = signal.signal(signal.SIGUSR1, lambda signum, frame: received.append(signum))
    try:
        callback = SlurmRequeue(every_n_steps=1)
        model = fit(tmp_path, [callback], signal_inside_step=True, plugins=[SLURMEnvironment(auto_requeue=False)])
    finally:
        signal.signal(signal.SIGUSR1, before)
    assert received == [signal.SIGUSR1] and callback.signalled is False  # the signal came, and not to the callback
    assert model.trainer.global_step == STEPS and not slurm_job.exists()
    assert not list(tmp_path.rglob("*.ckpt"))


def test_every_n_steps_is_checked():
    with pytest.raises(ValueError, match="every_n_steps must be at least 1, got 0"):
        SlurmRequeue(every_n_steps=0)


class Strategy:
    """A two-process strategy's ``reduce``: the max of this rank's flag and the other rank's."""

    def __init__(self, other_rank_signalled: bool):
        self.other, self.calls = float(other_rank_signalled), []
        self.root_device = torch.device("cpu")

    def reduce(self, tensor, reduce_op):
        self.calls.append((tensor.item(), reduce_op))
        return torch.maximum(tensor, torch.tensor(self.other))


def stub_trainer(world_size=1, step=0, other_rank_signalled=False, tmp_path=None):
    """What SlurmRequeue reads of a trainer; ``saved`` collects the paths it checkpoints to."""
    trainer = SimpleNamespace(
        world_size=world_size,
        global_step=step,
        is_global_zero=False,  # no scontrol: requeue_job has its own tests
        default_root_dir=str(tmp_path),
        strategy=Strategy(other_rank_signalled),
        saved=[],
    )
    trainer.save_checkpoint = trainer.saved.append
    trainer._checkpoint_connector = SimpleNamespace(hpc_save_path=lambda root: f"{root}/hpc_ckpt_1.ckpt")
    return trainer


def armed(trainer, signalled=False, every_n_steps=10) -> SlurmRequeue:
    """A callback as ``setup`` leaves it under SLURM, its run started at the trainer's step."""
    callback = SlurmRequeue(every_n_steps=every_n_steps)
    callback._signum = signal.SIGUSR1
    callback.on_train_start(trainer, None)
    callback.signalled = signalled
    return callback


def test_processes_compare_notes_every_n_steps_and_save_when_any_was_signalled(tmp_path, caplog):
    trainer = stub_trainer(world_size=2, step=8, other_rank_signalled=True, tmp_path=tmp_path)
    callback = armed(trainer)
    for step in (9, 10):
        trainer.global_step = step
        with caplog.at_level("INFO"):
            callback.on_train_batch_end(trainer, None, None, None, step)
    # step 9: no collective (not a multiple of 10); step 10: this rank's 0 against the other's 1
    assert trainer.strategy.calls == [(0.0, "max")]
    assert trainer.saved == [f"{tmp_path}/hpc_ckpt_1.ckpt"]
    assert f"saving {tmp_path}/hpc_ckpt_1.ckpt at step 10" in caplog.text
    trainer.strategy.other, trainer.global_step = 0.0, 20  # noted and acted on: nothing more to save
    callback.on_train_batch_end(trainer, None, None, None, 20)
    assert trainer.strategy.calls[-1] == (0.0, "max") and len(trainer.saved) == 1


def test_nobody_signalled_saves_nothing_and_one_process_needs_no_collective(tmp_path):
    two = stub_trainer(world_size=2, step=9, tmp_path=tmp_path)
    callback = armed(two)
    two.global_step = 10
    callback.on_train_batch_end(two, None, None, None, 0)
    assert two.strategy.calls == [(0.0, "max")] and two.saved == []
    one = stub_trainer(world_size=1, step=2, tmp_path=tmp_path)
    callback = armed(one, signalled=True)
    one.global_step = 3  # not a multiple of every_n_steps: one process looks at every step
    callback.on_train_batch_end(one, None, None, None, 0)
    assert one.strategy.calls == [] and len(one.saved) == 1


def test_between_accumulated_batches_nothing_is_saved(tmp_path):
    """A batch that ends without an optimiser step (the global step unchanged) is no place for it."""
    trainer = stub_trainer(step=5, tmp_path=tmp_path)
    callback = armed(trainer, signalled=True)
    callback.on_train_batch_end(trainer, None, None, None, 0)  # still step 5: the run's first, accumulating
    assert trainer.saved == []
    trainer.global_step = 6
    callback.on_train_batch_end(trainer, None, None, None, 1)
    assert len(trainer.saved) == 1


def test_outside_slurm_a_multi_process_run_makes_no_collective(tmp_path):
    trainer = stub_trainer(world_size=2, step=9, other_rank_signalled=True, tmp_path=tmp_path)
    callback = SlurmRequeue()  # setup found no SLURM environment: no signal to watch
    callback.on_train_start(trainer, None)
    trainer.global_step = 10
    callback.on_train_batch_end(trainer, None, None, None, 0)
    assert trainer.strategy.calls == [] and trainer.saved == []


def test_default_and_smallest_every_n_steps():
    assert SlurmRequeue().every_n_steps == 10 and SlurmRequeue(every_n_steps=1).every_n_steps == 1


def test_requeue_names_an_array_task_by_its_array_id(slurm_job, monkeypatch, caplog):
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "77")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    with caplog.at_level("INFO"):
        requeue_job()
    assert slurm_job.read_text() == "requeue 77_3\n" and "requeued SLURM job 77_3" in caplog.text


def test_a_failed_requeue_is_a_warning_naming_the_job(slurm_job, monkeypatch, tmp_path):
    failing = tmp_path / "bin" / "scontrol"
    failing.write_text('#!/bin/sh\necho "scontrol: error: Invalid job id specified" >&2\nexit 1\n')
    with pytest.warns(UserWarning, match=r"scontrol requeue 4242 failed \(1\): scontrol: error: Invalid job id"):
        requeue_job()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no scontrol at all (inside a container)
    with pytest.warns(UserWarning, match="could not requeue SLURM job 4242: .*scontrol"):
        requeue_job()
