"""The tiny table through slurm/sweep.sh as an array job on the real one-node SLURM cluster
(.ci/slurm-cluster.sh; skipped without one): one array task per run, then ``mmlight collect``."""

import csv
import json
from pathlib import Path

import pytest

from mmlight.experiments.table import load_table
from tests.helpers.cli import run_mmlight
from tests.helpers.slurm import job_env, sbatch_and_wait

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tables" / "tiny.yaml"
CPU_TASK = ["--ntasks-per-node", "1", "--gpus-per-node", "0", "--cpus-per-task", "1"]


@pytest.mark.slow
def test_array_job_runs_one_run_per_task_and_collect_reads_them(cluster, tmp_path):
    command = [
        "sbatch",
        "--parsable",
        "--array=0-3%2",
        "--chdir",
        str(tmp_path),
        "--output",
        str(tmp_path / "job-%A_%a.out"),
        *CPU_TASK,
        str(ROOT / "slurm" / "sweep.sh"),
        str(TINY),
        "--trainer.accelerator",
        "cpu",
        "--data.init_args.train_size",
        "64",
        "--trainer.enable_model_summary",
        "false",
    ]
    result = sbatch_and_wait(command, timeout=1200, env=job_env(), cwd=ROOT)
    array = result.stdout.strip().split(";")[0]
    logs = {i: (tmp_path / f"job-{array}_{i}.out") for i in range(4)}
    text = {i: log.read_text() if log.is_file() else "" for i, log in logs.items()}
    assert result.returncode == 0, result.stderr + "".join(t[-2000:] for t in text.values())

    out = tmp_path / "runs" / "tables"
    for run in load_table(TINY).runs(out):
        log = text[run.index]
        assert "mmlight sweep: task" in log and f"task {run.index} done" in log
        assert "restart 0" in log  # train.sh ran the fit
        assert "--ckpt_path last -> no checkpoint yet, starting fresh" in log
        record = json.loads((run.directory / "fit" / "final_metrics.json").read_text())
        assert record["global_step"] == 4 and record["metrics"]["val/acc"]["step"] == 4
        assert (
            f"--seed_everything {run.seed}" in (run.directory / "fit" / "config.yaml").read_text()
            or f"seed_everything: {run.seed}" in (run.directory / "fit" / "config.yaml").read_text()
        )

    run_mmlight("collect", str(TINY), "--out", str(out), check=True, env=job_env(), cwd=tmp_path)
    rows = list(csv.DictReader(open(out / "tiny.csv")))
    assert [row["n"] for row in rows] == ["2", "2"]

    # a second submission of one task finds its run done and does nothing
    again = sbatch_and_wait([*command[:2], "--array=1", *command[3:]], timeout=600, env=job_env(), cwd=ROOT)
    job = again.stdout.strip().split(";")[0]
    log = (tmp_path / f"job-{job}_1.out").read_text()
    assert again.returncode == 0 and "task 1 done" in log and "restart 0" not in log
