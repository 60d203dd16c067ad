"""A training process killed with SIGKILL mid-epoch resumes from its last checkpoint with global
step, optimiser, learning-rate schedule and EMA consistent."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "quickstart" / "digits_multimax.yaml"


def fit(tmp_path, epochs):
    command = [sys.executable, "-m", "mmlight.cli", "fit", "--config", str(QUICKSTART),
               "--trainer.max_epochs", str(epochs), "--trainer.limit_val_batches", "1",
               "--model.init_args.ema_decay", "0.9", "--last_checkpoint.every_n_train_steps", "5",
               "--data.init_args.cache_dir", str(tmp_path / "digits"),
               "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"), "--ckpt_path", "last"]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.Popen(command, cwd=tmp_path, env={**env, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def load(path):
    return torch.load(path, map_location="cpu", weights_only=False)


@pytest.mark.slow
def test_sigkill_mid_epoch_then_resume(tmp_path):
    steps_per_epoch = 1438 // 32
    last = tmp_path / "runs" / "digits_multimax" / "version_0" / "checkpoints" / "last.ckpt"
    process = fit(tmp_path, epochs=2)
    deadline = time.time() + 300
    while time.time() < deadline:  # kill once a mid-epoch checkpoint exists
        if last.is_file():
            try:
                if 10 <= load(last)["global_step"] < steps_per_epoch:
                    break
            except (EOFError, RuntimeError):
                pass  # being written: Lightning writes to a temporary file and renames, but retry
        time.sleep(0.2)
    process.send_signal(signal.SIGKILL)
    process.wait()
    saved = load(last)
    killed_at = saved["global_step"]
    assert 10 <= killed_at < steps_per_epoch, "the kill should land mid-epoch"

    resumed = fit(tmp_path, epochs=2)
    output = resumed.communicate(timeout=600)[0]
    assert resumed.returncode == 0, output[-3000:]
    assert f"--ckpt_path last -> {last.relative_to(tmp_path)}" in output or str(last) in output
    final = load(tmp_path / "runs" / "digits_multimax" / "version_1" / "checkpoints" / "last.ckpt")
    step = final["global_step"]
    assert step == 2 * steps_per_epoch  # nothing lost, nothing repeated
    # optimiser, schedule and EMA all counted every step across the kill
    adam_steps = {int(s["step"]) for s in final["optimizer_states"][0]["state"].values()}
    assert adam_steps == {step}
    assert final["lr_schedulers"][0]["last_epoch"] == step
    assert int(final["state_dict"]["ema.n_averaged"]) == step
    # the resumed run started from the checkpoint's weights, not from a fresh initialisation
    assert int(saved["state_dict"]["ema.n_averaged"]) == killed_at
