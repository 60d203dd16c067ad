"""The tiny table through slurm/sweep.sh as an array job on the real one-node SLURM cluster
(.ci/slurm-cluster.sh; skipped without one): one array task per run, then ``mmlight collect``.
Two of the four runs (one per cell) train under SLURM; the other two are found done, as a
resubmitted array finds the runs it already finished, and their tasks do nothing."""

import csv
import json
import statistics
from pathlib import Path

import pytest

from mmlight.experiments.table import load_table
from tests.helpers.cli import run_mmlight
from tests.helpers.slurm import job_env, sbatch_and_wait

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tables" / "tiny.yaml"
CPU_TASK = ["--ntasks-per-node", "1", "--gpus-per-node", "0", "--cpus-per-task", "1"]


def write_done_fit(run, value: float) -> str:
    """A finished fit's final_metrics.json as FinalMetrics writes it (val/acc = ``value`` at the final
    step 4, checkpoint ``last``): the run is done, as if an earlier array had run it. Its text."""
    fit = run.directory / "fit"
    fit.mkdir(parents=True)
    record = {
        "stage": "fit",
        "global_step": 4,
        "epoch": 1,
        "checkpoint": None,
        "checkpoints": {"best": None, "last": str(fit / "checkpoints" / "last.ckpt")},
        "metrics": {"val/acc": {"value": value, "step": 4, "epoch": 1}},
    }
    (fit / "final_metrics.json").write_text(json.dumps(record))
    return (fit / "final_metrics.json").read_text()


@pytest.mark.slow
def test_array_job_runs_one_run_per_task_and_collect_reads_them(cluster, tmp_path):
    out = tmp_path / "runs" / "tables"
    runs = load_table(TINY).runs(out)  # softmax/seed0, softmax/seed1, multimax/seed0, multimax/seed1
    done = {1: write_done_fit(runs[1], 0.5), 3: write_done_fit(runs[3], 0.25)}
    assert [run.status() for run in runs] == ["missing", "done", "missing", "done"]
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

    for run in runs:
        log = text[run.index]
        assert f"mmlight sweep: task {run.index} done" in log
        if run.index in done:  # found done: no fit, no evaluation, its record untouched
            assert "restart 0" not in log and "of the table's checkpoint" not in log
            assert (run.directory / "fit" / "final_metrics.json").read_text() == done[run.index]
            continue
        assert "restart 0" in log  # train.sh ran the fit
        assert "--ckpt_path last -> no checkpoint yet, starting fresh" in log
        record = json.loads((run.directory / "fit" / "final_metrics.json").read_text())
        assert record["global_step"] == 4 and record["metrics"]["val/acc"]["step"] == 4
        assert (
            f"--seed_everything {run.seed}" in (run.directory / "fit" / "config.yaml").read_text()
            or f"seed_everything: {run.seed}" in (run.directory / "fit" / "config.yaml").read_text()
        )
        assert run.status() == "done"

    run_mmlight("collect", str(TINY), "--out", str(out), check=True, env=job_env(), cwd=tmp_path)
    rows = {row["cell"]: row for row in csv.DictReader(open(out / "tiny.csv"))}
    for cell, (a, b) in {"softmax": runs[:2], "multimax": runs[2:]}.items():
        assert rows[cell]["n"] == "2"
        assert float(rows[cell]["mean"]) == pytest.approx(statistics.fmean([a.result(), b.result()]), abs=1e-5)
