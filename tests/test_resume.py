"""A training process killed with SIGKILL and resumed with ``--ckpt_path last`` ends exactly where an
uninterrupted run ends: same weights, optimiser and schedule state, EMA and per-step losses, for the
digits quick start (augmentation, mixup/cutmix, EMA) and the language-model quick start (dropout).
Both kills land mid-epoch and the runs cross an epoch boundary after the resume."""

import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.helpers.checks import assert_same_tensors
from tests.helpers.cli import mmlight_argv, mmlight_in_process

ROOT = Path(__file__).resolve().parents[1]


class KillAtStep(Callback):
    """SIGKILL this process at the start of the batch after ``step`` optimiser steps (the checkpoint
    of step ``step`` is then on disk): no handler, no flush, nothing saved on the way out.

    Args:
        step: the global step to die at.
    """

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


RUNS = {
    # 1438 training digits / 32 = 44 steps per epoch: killed at 25, ends at 50 in epoch 1
    "digits": (
        ROOT / "configs" / "quickstart" / "digits_multimax.yaml",
        "digits_multimax",
        25,
        [
            "--model.init_args.ema_decay",
            "0.9",
            "--model.init_args.mixup_alpha",
            "0.8",
            "--model.init_args.cutmix_alpha",
            "1.0",
            "--trainer.limit_val_batches",
            "1",
        ],
    ),
    # 640 sequences / 64 = 10 steps per epoch: killed at 15, ends at 30 in epoch 2
    "lm": (
        ROOT / "configs" / "quickstart" / "lm_multimax.yaml",
        "lm_multimax",
        15,
        [
            "--data.init_args.train_size",
            "640",
            "--data.init_args.val_size",
            "64",
            "--model.init_args.model.dropout",
            "0.1",
            "--model.init_args.warmup_steps",
            "5",
        ],
    ),
}


def arguments(workdir: Path, run: str, *extra: str) -> list[str]:
    """The command line after ``mmlight`` that fits ``run`` in ``workdir``."""
    config, _, kill_at, overrides = RUNS[run]
    args = [
        "fit",
        "--config",
        str(config),
        *overrides,
        "--trainer.max_steps",
        str(2 * kill_at),
        "--trainer.log_every_n_steps",
        "1",
        "--trainer.enable_model_summary",
        "false",
        "--last_checkpoint.every_n_train_steps",
        "5",
        "--trainer.logger.init_args.save_dir",
        str(workdir / "runs"),
        *extra,
    ]
    if run == "digits":
        args += ["--data.init_args.cache_dir", str(workdir / "digits")]  # one per run: two run at once
    workdir.mkdir(parents=True, exist_ok=True)
    return args


def start(workdir: Path, run: str, *extra: str) -> subprocess.Popen:
    """``mmlight fit`` of ``run`` in ``workdir``, in a process of its own (one thread)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    command = mmlight_argv(*arguments(workdir, run, *extra))
    return subprocess.Popen(command, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def fit_in_process(workdir: Path, run: str) -> None:
    """The same fit in this process, on one thread as the processes of :func:`start` compute (the
    reference backend either way: ``auto`` takes the Triton kernels for CUDA tensors only)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        mmlight_in_process(*arguments(workdir, run), cwd=workdir)
    finally:
        torch.set_num_threads(threads)


def finished(process: subprocess.Popen) -> subprocess.CompletedProcess:
    out, err = process.communicate(timeout=900)
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def fit(workdir: Path, run: str, *extra: str) -> subprocess.CompletedProcess:
    return finished(start(workdir, run, *extra))


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


def losses(run_dir: Path) -> dict[int, float]:
    """Step -> ``train/loss`` from a run directory's TensorBoard events."""
    out = {}
    for events in run_dir.glob("events.out.tfevents.*"):
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
        acc.Reload()
        if "train/loss" in acc.Tags()["scalars"]:
            out.update({e.step: e.value for e in acc.Scalars("train/loss")})
    return out


@pytest.mark.slow
@pytest.mark.parametrize("run", list(RUNS))
def test_sigkill_then_resume_equals_an_uninterrupted_run(tmp_path, run):
    _, name, kill_at, _ = RUNS[run]
    killer = ["--trainer.callbacks+=tests.test_resume.KillAtStep", f"--trainer.callbacks.step={kill_at}"]
    killing = start(tmp_path / "killed", run, *killer)
    try:
        # the uninterrupted run in this process (a cold import of Lightning fewer), beside the killed one
        fit_in_process(tmp_path / "straight", run)
    finally:
        killed = finished(killing)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    runs = tmp_path / "killed" / "runs" / name
    assert load(runs / "version_0" / "checkpoints" / "last.ckpt")["global_step"] == kill_at

    resumed = fit(tmp_path / "killed", run, "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "--ckpt_path last -> " in resumed.stdout and "version_0" in resumed.stdout

    reference = load(tmp_path / "straight" / "runs" / name / "version_0" / "checkpoints" / "last.ckpt")
    final = load(runs / "version_1" / "checkpoints" / "last.ckpt")
    assert final["global_step"] == reference["global_step"] == 2 * kill_at
    for key in ("state_dict", "optimizer_states", "lr_schedulers", "loops"):
        assert_same_tensors(final[key], reference[key], key)
    reference_losses = losses(tmp_path / "straight" / "runs" / name / "version_0")
    resumed_losses = losses(runs / "version_1")
    assert sorted(resumed_losses) == [s for s in sorted(reference_losses) if s >= kill_at]
    assert resumed_losses == {s: reference_losses[s] for s in resumed_losses}
