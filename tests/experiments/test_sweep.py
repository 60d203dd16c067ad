"""``mmlight sweep`` then ``mmlight collect`` end to end on the tiny table (2 cells x 2 seeds of a
shrunken associative-recall quick start): run directories, skip and resume on a re-run, the written
table against the values computed here from the runs' metrics files and TensorBoard logs, and
missing and failed runs marked."""

import csv
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from mmlight.experiments import collect, sweep
from mmlight.experiments.table import load_table

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tables" / "tiny.yaml"
FAST = ["--", "--data.init_args.train_size", "64", "--trainer.enable_model_summary", "false"]  # 2 steps per epoch


def mmlight(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mmlight.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=900)


def logged_last(run_dir: Path, tag: str) -> float:
    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    return acc.Scalars(tag)[-1].value


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """The tiny table swept once, two runs at a time."""
    out = tmp_path_factory.mktemp("sweep") / "runs"
    result = mmlight("sweep", str(TINY), "--parallel", "2", "--out", str(out), *FAST, cwd=out.parent)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out, result.stdout


@pytest.mark.slow
def test_sweep_writes_ordinary_run_directories(swept):
    out, stdout = swept
    table = load_table(TINY)
    for run in table.runs(out):
        fit = run.directory / "fit"
        assert (fit / "config.yaml").is_file() and (fit / "checkpoints" / "last.ckpt").is_file()
        record = json.loads((fit / "final_metrics.json").read_text())
        assert record["stage"] == "fit" and record["global_step"] == 4  # 2 epochs x 2 steps
        # the recorded value is the last one TensorBoard logged (Lightning logs it at step 3, the
        # last training batch's index)
        assert logged_last(fit, "val/acc") == pytest.approx(record["metrics"]["val/acc"]["value"])
        assert record["metrics"]["val/acc"]["step"] == 4
        assert Path(record["checkpoints"]["last"]) == (fit / "checkpoints" / "last.ckpt").resolve()
        assert f"{run.label}: val/acc = " in stdout
        assert run.status() == "done"


@pytest.mark.slow
def test_collect_writes_mean_and_std_per_cell_and_marks_missing_and_failed(swept, tmp_path):
    out, _ = swept
    table = load_table(TINY)
    values = {run.label: 100 * json.loads((run.directory / "fit" / "final_metrics.json").read_text())
              ["metrics"]["val/acc"]["value"] for run in table.runs(out)}
    collect.main([str(TINY), "--out", str(out)])
    rows = {row["cell"]: row for row in csv.DictReader(open(out / "tiny.csv"))}
    for cell in ("softmax", "multimax"):
        mine = [values[f"{cell}/seed0"], values[f"{cell}/seed1"]]
        assert float(rows[cell]["mean"]) == pytest.approx(statistics.fmean(mine), abs=1e-5)
        assert float(rows[cell]["std"]) == pytest.approx(statistics.pstdev(mine), abs=1e-5)
        assert rows[cell]["n"] == "2"
    text = (out / "tiny.md").read_text()
    assert "| softmax |" in text and "| multimax |" in text and "Runs without a result" not in text

    # the same table over a copy with one run deleted and another recorded as failed
    import shutil

    copy = tmp_path / "runs"
    shutil.copytree(out, copy)
    shutil.rmtree(copy / "tiny" / "softmax" / "seed1")
    (copy / "tiny" / "multimax" / "seed0" / "fit" / "final_metrics.json").unlink()  # as if it crashed
    sweep.main([str(TINY), "--out", str(copy), "--task", "2", "--failed", "3", "--log", "/logs/job-7.out"])
    collect.main([str(TINY), "--out", str(copy)])
    rows = {row["cell"]: row for row in csv.DictReader(open(copy / "tiny.csv"))}
    assert rows["softmax"]["seed1"] == "missing" and rows["softmax"]["n"] == "1"
    assert float(rows["softmax"]["mean"]) == pytest.approx(values["softmax/seed0"], abs=1e-5)
    assert rows["multimax"]["seed0"] == "failed" and rows["multimax"]["n"] == "1"
    text = (copy / "tiny.md").read_text()
    assert "(1/2; missing: seed 1)" in text and "(1/2; failed: seed 0)" in text
    assert "- softmax/seed1: missing" in text and "- multimax/seed0: failed (log: /logs/job-7.out)" in text


@pytest.mark.slow
def test_rerun_skips_finished_runs_and_resumes_an_unfinished_one(swept, tmp_path):
    """A run whose fit never wrote its metrics (killed at the end) is resumed from its last
    checkpoint; with no validation left to run, the final weights are validated, which must
    reproduce the value logged during training."""
    import shutil

    out, _ = swept
    copy = tmp_path / "runs"
    shutil.copytree(out, copy)
    run = load_table(TINY).runs(copy)[1]
    before = json.loads((run.directory / "fit" / "final_metrics.json").read_text())["metrics"]["val/acc"]["value"]
    (run.directory / "fit" / "final_metrics.json").unlink()
    (run.directory / "sweep_status.json").unlink()
    assert run.status() == "unfinished"
    result = mmlight("sweep", str(TINY), "--out", str(copy), *FAST, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:]
    assert result.stdout.count("done, skipped") == 3
    log = (run.directory / "sweep.log").read_text()
    assert f"--ckpt_path last -> {run.directory / 'fit' / 'checkpoints' / 'last.ckpt'}" in log
    record = json.loads((run.directory / "validate" / "final_metrics.json").read_text())
    assert record["stage"] == "validate" and record["global_step"] == 4
    assert record["metrics"]["val/acc"]["value"] == pytest.approx(before)
    assert run.result() == pytest.approx(100 * before)
