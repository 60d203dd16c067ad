"""The project's sbatch scripts on a real one-node SLURM cluster (started by .ci/slurm-cluster.sh):
a 2-task CPU DDP job, and a job preempted mid-run that comes back, resumes from its checkpoint and
ends with the weights of an uninterrupted job."""

import re
import subprocess
import time
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.helpers.checks import assert_same_tensors, wait_for
from tests.helpers.slurm import job_env, sbatch_and_wait

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "configs" / "quickstart" / "digits_multimax.yaml"
CPU_OVERRIDE = ["--ntasks-per-node", "2", "--gpus-per-node", "0", "--cpus-per-task", "1"]


def submit(tmp_path, *overrides, wait=False) -> tuple[int, subprocess.CompletedProcess]:
    command = [
        "sbatch",
        "--parsable",
        "--chdir",
        str(tmp_path),
        "--job-name",
        "mmlight-test",
        "--output",
        str(tmp_path / "job-%j.out"),
        *CPU_OVERRIDE,
        str(ROOT / "slurm" / "train.sh"),
        str(QUICKSTART),
        "--trainer.accelerator",
        "cpu",
        "--data.init_args.cache_dir",
        str(tmp_path / "digits"),
        "--trainer.logger.init_args.save_dir",
        str(tmp_path / "runs"),
        *overrides,
    ]
    if wait:
        result = sbatch_and_wait(command, env=job_env())
    else:
        result = subprocess.run(command, capture_output=True, text=True, env=job_env(), timeout=900)
    job = int(result.stdout.strip().split(";")[0].splitlines()[0]) if result.stdout.strip() else -1
    return job, result


def job_state(job: int) -> str:
    out = subprocess.run(["scontrol", "show", "job", str(job), "-o"], capture_output=True, text=True).stdout
    match = re.search(r"JobState=(\S+)", out)
    return match.group(1) if match else "UNKNOWN"


def scalar_steps(run_dir: Path, tag: str) -> list[list[int]]:
    """Steps of ``tag`` in each TensorBoard event file of ``run_dir``, oldest file first."""
    steps = []
    for events_file in sorted(run_dir.glob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime):
        acc = EventAccumulator(str(events_file))
        acc.Reload()
        if tag in acc.Tags()["scalars"]:
            steps.append([e.step for e in acc.Scalars(tag)])
    return steps


#: the preemption test's options; its reference is one job run with them without a break
RESUMED_RUN = [
    "--trainer.max_epochs",
    "3",
    "--trainer.limit_val_batches",
    "2",
    "--last_checkpoint.every_n_train_steps",
    "5",
]


@pytest.fixture(scope="module")
def uninterrupted_job(cluster, tmp_path_factory) -> tuple[Path, str]:
    """A 2-task DDP job run with :data:`RESUMED_RUN` without a break: its run directory and log."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    job, result = submit(folder, *RESUMED_RUN, wait=True)
    log = (folder / f"job-{job}.out").read_text() if job > 0 else ""
    assert result.returncode == 0 and job_state(job) == "COMPLETED", result.stderr + log[-3000:]
    return folder / "runs" / "digits_multimax" / f"slurm-{job}", log


@pytest.fixture(scope="module")
def uninterrupted(uninterrupted_job) -> dict:
    """The final ``last.ckpt`` of :func:`uninterrupted_job`."""
    run_dir, _ = uninterrupted_job
    return torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)


def assert_same_training_state(final: dict, reference: dict) -> None:
    for key in ("state_dict", "optimizer_states", "lr_schedulers"):
        assert_same_tensors(final[key], reference[key], key)


@pytest.mark.slow
def test_submit_two_task_ddp_job(uninterrupted_job, uninterrupted):
    """The 2-task DDP job that the preemption test below takes as its reference (one job, not one more of
    its own): completed (the fixture checks), each epoch's steps split over both tasks, metrics logged."""
    run_dir, log = uninterrupted_job
    steps_per_epoch = 1438 // (32 * 2)  # 2 tasks of batch 32
    epochs = int(RESUMED_RUN[RESUMED_RUN.index("--trainer.max_epochs") + 1])
    assert uninterrupted["global_step"] == epochs * steps_per_epoch
    assert scalar_steps(run_dir, "val/top1") and scalar_steps(run_dir, "train/loss")
    assert "Final validation metrics" in log


@pytest.mark.slow
def test_task_count_mismatch_fails_fast(cluster, tmp_path):
    """2 SLURM tasks but --trainer.devices 1: every task stops at once, naming the numbers."""
    start = time.time()
    job, result = submit(tmp_path, "--trainer.devices", "1", wait=True)
    log = (tmp_path / f"job-{job}.out").read_text()
    assert result.returncode != 0 and job_state(job) == "FAILED"
    assert "SLURM started 2 task(s) on 1 node(s), but the trainer expects devices=1 x num_nodes=1" in log
    # no wait at "initializing distributed", whose timeout is 30 minutes; the job's start-up (two Python
    # processes importing Lightning) took 103-109 s on 2 loaded cores, so the bound leaves room for that
    assert time.time() - start < 300


def test_cluster_scripts_parse():
    """Shell syntax of every script in slurm/ (bash -n); runs without SLURM too."""
    for script in sorted((ROOT / "slurm").glob("*.sh")):
        subprocess.run(["bash", "-n", str(script)], check=True)


def checkpoint_step(path: Path) -> int | None:
    """The global step of the checkpoint at ``path``, or None while it is missing or half-written."""
    try:
        return torch.load(path, map_location="cpu", weights_only=False)["global_step"]
    except (FileNotFoundError, EOFError, RuntimeError):
        return None


@pytest.mark.slow
def test_job_signalled_then_preempted_comes_back_twice_and_resumes(cluster, uninterrupted, tmp_path, monkeypatch):
    """One 2-task DDP job interrupted twice, each time coming back and resuming, that ends with the
    weights, optimiser and schedule of the same job run without a break (bitwise):

    1. the signal SLURM sends before the time limit (sent by hand to the batch shell, as
       --signal=B:USR1 does): the shell forwards it to the tasks, the job is requeued (by Lightning's
       handler, or by the script's fallback where that handler does not requeue) and resumes from
       the newest checkpoint;
    2. then, once the resumed run has saved a periodic checkpoint of its own, a hard requeue
       (``scontrol requeue``, as a preemption does): it comes back and resumes from that
       ``last.ckpt``, not from step 0.
    """
    monkeypatch.setenv("MMLIGHT_REQUEUE_GRACE", "20")  # exported to the batch script by sbatch
    epochs = 3
    job, result = submit(tmp_path, *RESUMED_RUN)
    assert result.returncode == 0, result.stderr
    run_dir = tmp_path / "runs" / "digits_multimax" / f"slurm-{job}"
    last = run_dir / "checkpoints" / "last.ckpt"
    out = tmp_path / f"job-{job}.out"

    def requeue_and_release(what: str) -> int:
        """Wait until the job is requeued, then release it; the step of the newest checkpoint while it waits."""
        wait_for(lambda: job_state(job) in ("PENDING", "REQUEUED") or None, 120, what)
        newest = max(checkpoint_step(path) or 0 for path in run_dir.rglob("*.ckpt"))
        # a requeued job waits ~2 minutes (BeginTime) before it may start again; release it now
        subprocess.run(["scontrol", "update", f"jobid={job}", "StartTime=now"], check=True)
        return newest

    # 1. the time-limit signal
    wait_for(lambda: last.is_file(), 300, "a first checkpoint")
    subprocess.run(["scancel", "--signal=USR1", "--batch", str(job)], check=True)
    resume_step = requeue_and_release("the job to be requeued after the signal")

    # 2. a hard requeue once the resumed run has saved a periodic checkpoint beyond its resume point

    def resumed_and_saved():
        step = checkpoint_step(last) if "restart 1" in out.read_text() else None
        return step if step is not None and step > resume_step else None

    saved = wait_for(resumed_and_saved, 300, "a checkpoint saved by the resumed run")
    subprocess.run(["scontrol", "requeue", str(job)], check=True)
    requeue_and_release("the job to be requeued by scontrol")
    wait_for(lambda: job_state(job) in ("COMPLETED", "FAILED", "CANCELLED"), 600, "the requeued job to finish")

    log = out.read_text()
    assert job_state(job) == "COMPLETED", log[-3000:]
    assert "forwarding it to the training tasks" in log
    assert "restart 0" in log and "restart 1" in log and "restart 2" in log  # the same job ran three times
    resumed_from = re.findall(r"--ckpt_path last -> (\S+\.ckpt)", log)
    assert resumed_from, "the requeued run did not resume from a checkpoint"
    assert checkpoint_step(resumed_from[0]) > 0  # after the signal
    assert resumed_from[-1].endswith("last.ckpt")  # after the hard requeue: the periodic checkpoint

    final = torch.load(last, map_location="cpu", weights_only=False)
    assert final["global_step"] == epochs * (1438 // (32 * 2))  # the interrupted epochs completed too
    assert final["epoch"] == epochs - 1
    *_, later = scalar_steps(run_dir, "train/loss")
    assert min(later) > saved - 5  # the last run continued from its checkpoint, not from step 0
    assert_same_training_state(final, uninterrupted)


@pytest.fixture(scope="module")
def text_shards(tmp_path_factory):
    from tests.helpers.text_fixtures import write_text_shard_sets

    return write_text_shard_sets(tmp_path_factory.mktemp("text"))


@pytest.mark.slow
@pytest.mark.parametrize(
    "script, run_name", [("wikitext103.sh", "lm_wikitext103_multimax"), ("iwslt14.sh", "nmt_iwslt14_multimax")]
)
def test_lm_and_nmt_scripts_run_their_paper_config(cluster, text_shards, tmp_path, script, run_name):
    """slurm/wikitext103.sh and slurm/iwslt14.sh, unchanged, as a 2-task CPU job on fixture shards
    (DATA=...), with the model narrowed so that the test is quick."""
    from tests.helpers.text_fixtures import FIXTURE_BATCHES, vocab_size

    dataset = script.removesuffix(".sh")
    data = text_shards[dataset]
    narrow = [
        "--model.init_args.model.d_model",
        "32",
        "--model.init_args.model.ffn_dim",
        "64",
        "--model.init_args.model.n_layers",
        "1",
    ]
    if dataset == "iwslt14":
        narrow += ["--model.init_args.model.n_encoder_layers", "1", "--model.init_args.beam.beam_size", "2"]
    command = [
        "sbatch",
        "--parsable",
        "--chdir",
        str(tmp_path),
        "--output",
        str(tmp_path / "job-%j.out"),
        *CPU_OVERRIDE,
        str(ROOT / "slurm" / script),
        "--trainer.accelerator",
        "cpu",
        "--trainer.precision",
        "32",
        "--trainer.max_steps",
        "2",
        "--trainer.log_every_n_steps",
        "1",
        "--data.init_args.num_workers",
        "0",
        "--model.init_args.model.vocab_size",
        str(vocab_size(data)),
        *narrow,
        *FIXTURE_BATCHES[dataset],
        "--trainer.logger.init_args.save_dir",
        str(tmp_path / "runs"),
    ]
    # the script finds train.sh in the submission directory; CONFIG is absolute because the job runs in tmp_path
    env = {**job_env(), "DATA": str(data), "CONFIG": str(ROOT / "configs" / f"{run_name}.yaml")}
    result = sbatch_and_wait(command, env=env, cwd=ROOT)
    job = int(result.stdout.strip().split(";")[0]) if result.stdout.strip() else -1
    log = (tmp_path / f"job-{job}.out").read_text() if job > 0 else ""
    assert result.returncode == 0 and job_state(job) == "COMPLETED", result.stderr + log[-3000:]
    run_dir = tmp_path / "runs" / run_name / f"slurm-{job}"
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)["global_step"] == 2
    assert scalar_steps(run_dir, "train/loss")
