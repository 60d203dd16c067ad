"""SLURM's warning signal: the checkpoint written at the end of a training step, then the job requeued."""

from __future__ import annotations

import os
import signal
import subprocess

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.environments import SLURMEnvironment
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn


class SlurmRequeue(Callback):
    """Takes over Lightning's handler of SLURM's warning signal (``--signal=B:USR1@300`` in
    ``slurm/train.sh``) in a ``fit`` under SLURM with auto-requeue on.

    Lightning writes ``hpc_ckpt_<n>.ckpt`` from inside the signal handler, at whatever line each process
    is on: after the optimiser's step but before the step is counted, the checkpoint holds the new
    weights with the old step count, and the resumed run takes that step twice. This handler only notes
    the signal. At the end of a training step, where ``last.ckpt`` is also written, the processes agree
    that one of them has it, every :attr:`every_n_steps` steps (a collective; one process needs none),
    write ``hpc_ckpt_<n>.ckpt`` and rank 0 requeues the job. Training goes on until SLURM stops the job,
    as under Lightning's handler; a signal that comes during validation is acted on at the next step.

    Args:
        every_n_steps: how often, in training steps, the processes of a multi-process run compare notes
            (each comparison waits for the accelerator once); a single process looks at every step.
    """

    def __init__(self, every_n_steps: int = 10):
        if every_n_steps < 1:
            raise ValueError(f"SlurmRequeue: every_n_steps must be at least 1, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self.signalled = False
        self._signum: int | None = None
        self._previous = None
        self._step: int | None = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        self._signum = None  # a callback reused outside SLURM watches nothing
        environment = trainer._accelerator_connector.cluster_environment
        if stage != "fit" or not isinstance(environment, SLURMEnvironment) or not environment.auto_requeue:
            return
        # installed before Lightning's, which then leaves the signal alone (it skips one already handled);
        # the environment's signal is SIGUSR1 unless a config names another
        self._signum = environment.requeue_signal
        self._previous = signal.signal(self._signum, self._note)

    def _note(self, signum, frame) -> None:
        self.signalled = True

    def on_train_start(self, trainer, pl_module) -> None:
        self._step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # only right after an optimiser step: between accumulated batches the gradients are half-summed
        stepped, self._step = trainer.global_step != self._step, trainer.global_step
        if self._signum is None or not stepped or not self._agreed(trainer):
            return
        self.signalled = False
        path = trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir)
        rank_zero_info(f"mmlight: SLURM's warning signal: saving {path} at step {trainer.global_step}")
        trainer.save_checkpoint(path)
        if trainer.is_global_zero:
            requeue_job()

    def _agreed(self, trainer) -> bool:
        if trainer.world_size == 1:
            return self.signalled
        if trainer.global_step % self.every_n_steps:
            return False
        flag = torch.tensor(float(self.signalled), device=trainer.strategy.root_device)
        return bool(trainer.strategy.reduce(flag, reduce_op="max").item())

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if self._signum is not None:
            signal.signal(self._signum, self._previous)
            self._signum = None


def requeue_job() -> None:
    """``scontrol requeue`` this job (an array task by its array id); a failure is a warning, since
    ``slurm/train.sh`` requeues from the batch shell after a grace period too."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array_job else os.environ["SLURM_JOB_ID"]
    try:
        result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        rank_zero_warn(f"mmlight: could not requeue SLURM job {job}: {err}")
        return
    if result.returncode:
        rank_zero_warn(f"mmlight: scontrol requeue {job} failed ({result.returncode}): {result.stderr.strip()}")
    else:
        rank_zero_info(f"mmlight: requeued SLURM job {job}")
