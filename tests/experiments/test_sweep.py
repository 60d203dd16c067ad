"""``mmlight sweep`` then ``mmlight collect`` end to end on the tiny table (2 cells x 2 seeds of a
shrunken associative-recall quick start): run directories, skip and resume on a re-run, the written
table against the values computed here from the runs' metrics files and TensorBoard logs, and
missing and failed runs marked."""

import contextlib
import csv
import io
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from mmlight.commands import collect, sweep
from mmlight.experiments.table import load_table
from tests.helpers.cli import environment

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tables" / "tiny.yaml"
FAST = ["--", "--data.init_args.train_size", "64", "--trainer.enable_model_summary", "false"]  # 2 steps per epoch


def logged_last(run_dir: Path, tag: str) -> float:
    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    return acc.Scalars(tag)[-1].value


def sweep_in_process(*args: str, cwd: Path) -> str:
    """``mmlight sweep ARGS`` run by :func:`mmlight.commands.sweep.main` in this process (each run's fit
    is still a subprocess), from ``cwd``: its output. The command line's own dispatch to it is the
    SLURM array test's (slurm/sweep.sh calls ``mmlight sweep``); a subprocess here would only import
    Lightning once more."""
    out = io.StringIO()
    try:
        with environment(cwd, {}), contextlib.redirect_stdout(out):
            sweep.main(list(args))
    except SystemExit as err:
        pytest.fail(f"mmlight sweep exited with {err.code}:\n{out.getvalue()[-3000:]}")
    return out.getvalue()


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """The tiny table swept once, two runs at a time."""
    out = tmp_path_factory.mktemp("sweep") / "runs"
    return out, sweep_in_process(str(TINY), "--parallel", "2", "--out", str(out), *FAST, cwd=out.parent)


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
    values = {
        run.label: 100
        * json.loads((run.directory / "fit" / "final_metrics.json").read_text())["metrics"]["val/acc"]["value"]
        for run in table.runs(out)
    }
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
    stdout = sweep_in_process(str(TINY), "--out", str(copy), *FAST, cwd=tmp_path)
    assert stdout.count("done, skipped") == 3
    log = (run.directory / "sweep.log").read_text()
    assert f"--ckpt_path last -> {run.directory / 'fit' / 'checkpoints' / 'last.ckpt'}" in log
    record = json.loads((run.directory / "validate" / "final_metrics.json").read_text())
    assert record["stage"] == "validate" and record["global_step"] == 4
    assert record["metrics"]["val/acc"]["value"] == pytest.approx(before)
    assert run.result() == pytest.approx(100 * before)


# ---------------------------------------------------------------------------------------------------
# Fast tests of the sweep's logic: mmlight itself is replaced by stand-ins (``sweep.execute`` or
# ``subprocess.run``) that write the metrics files FinalMetrics would; no training, no subprocess.

import re  # noqa: E402
import shlex  # noqa: E402
import types  # noqa: E402

from mmlight.experiments.table import TableError, write_status  # noqa: E402


def table_file(tmp_path: Path, text: str) -> Path:
    """A table file ``<tmp>/t.yaml`` next to its base config."""
    (tmp_path / "base.yaml").write_text("seed_everything: 0\n")
    path = tmp_path / "t.yaml"
    path.write_text(text)
    return path


def fit_record(fit_dir: Path, metrics: dict, *, step: int = 10, best: str | None = "auto") -> dict:
    """fit's final_metrics.json as FinalMetrics writes it (global step 10; each metric at ``step``)."""
    rec = {
        "stage": "fit",
        "global_step": 10,
        "epoch": 1,
        "checkpoint": None,
        "checkpoints": {
            "best": str(fit_dir / "checkpoints" / "best.ckpt") if best == "auto" else best,
            "last": str(fit_dir / "checkpoints" / "last.ckpt"),
        },
        "metrics": {k: {"value": v, "step": step, "epoch": 1} for k, v in metrics.items()},
    }
    fit_dir.mkdir(parents=True, exist_ok=True)
    (fit_dir / "final_metrics.json").write_text(json.dumps(rec))
    return rec


def eval_record(stage_dir: Path, metrics: dict, checkpoint: str) -> None:
    stage_dir.mkdir(parents=True, exist_ok=True)
    (stage_dir / "final_metrics.json").write_text(
        json.dumps(
            {
                "stage": stage_dir.name,
                "global_step": 10,
                "epoch": 1,
                "checkpoint": checkpoint,
                "metrics": {k: {"value": v, "step": 10, "epoch": 1} for k, v in metrics.items()},
            }
        )
    )


class Clock:
    """Stands in for the ``time`` module in ``sweep``: time() returns the given ticks in turn."""

    def __init__(self, *ticks: float):
        self.ticks = list(ticks)

    def time(self) -> float:
        return self.ticks.pop(0)

    strftime = staticmethod(__import__("time").strftime)


def option(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


BEST_TEST = "config: base.yaml\nmetric: test/acc\nscale: 10\ncells: {a: {}}\n"


def test_run_one_fits_then_tests_the_best_checkpoint_and_records_done(tmp_path, capsys, monkeypatch):
    """checkpoint best with a test/* metric: fit (with the extra options and the threads), then
    ``test --ckpt_path <best>`` in the run's test/ folder; the scaled value is printed and the run
    recorded as done with its log and the seconds it took (a fake clock: 100 -> 112.34)."""
    run = load_table(table_file(tmp_path, BEST_TEST)).runs(tmp_path / "runs")[0]
    calls = []

    def stand_in(args, log, threads):
        calls.append((args, log, threads))
        if args[0] == "fit":
            fit_record(Path(option(args, "--trainer.default_root_dir")), {"val/loss": 1.0})
        else:
            eval_record(
                Path(option(args, "--trainer.default_root_dir")), {"test/acc": 0.25}, option(args, "--ckpt_path")
            )
        return 0

    monkeypatch.setattr(sweep, "execute", stand_in)
    monkeypatch.setattr(sweep, "time", Clock(100.0, 112.34, 112.6))
    assert sweep.run_one(run, ["--data.root", "/d"], 3) == "done"
    log = run.directory / "sweep.log"
    assert [(a[0], lg, th) for a, lg, th in calls] == [("fit", log, 3), ("test", log, 3)]
    fit_args, test_args = calls[0][0], calls[1][0]
    assert fit_args[-2:] == ["--ckpt_path", "last"] and option(fit_args, "--data.root") == "/d"
    assert test_args[:3] == ["test", "--config", str(tmp_path / "base.yaml")]
    assert test_args[-2:] == ["--ckpt_path", str(run.directory / "fit" / "checkpoints" / "best.ckpt")]
    assert option(test_args, "--data.root") == "/d" and option(test_args, "--seed_everything") == "0"
    assert option(test_args, "--trainer.default_root_dir") == str(run.directory / "test")
    assert json.loads(option(test_args, "--trainer.logger"))["init_args"]["version"] == "test"
    assert (
        capsys.readouterr().out == "[0] a/seed0: fit ...\n[0] a/seed0: test ...\n[0] a/seed0: test/acc = 2.5 (13 s)\n"
    )
    assert json.loads((run.directory / "sweep_status.json").read_text()) == {
        "status": "done",
        "log": str(log),
        "seconds": 12.3,
    }
    assert run.status() == "done" and run.result() == 2.5


def test_run_one_skips_a_done_run(tmp_path, capsys, monkeypatch):
    """A run with its result is not run again and nothing is written."""
    path = table_file(tmp_path, "config: base.yaml\nmetric: val/acc\ncheckpoint: last\nseeds: [4, 5]\ncells: {a: {}}\n")
    run = load_table(path).runs(tmp_path / "runs")[1]
    fit_record(run.directory / "fit", {"val/acc": 0.5})
    monkeypatch.setattr(sweep, "execute", lambda *a: pytest.fail("a done run was executed"))
    assert sweep.run_one(run, [], None) == "skipped"
    assert capsys.readouterr().out == "[1] a/seed5: done, skipped\n"
    assert sorted(p.name for p in run.directory.iterdir()) == ["fit"]


def test_run_one_with_fit_done_only_evaluates(tmp_path, capsys, monkeypatch):
    """A finished fit (metrics file present) is not fitted again: only the evaluation runs."""
    run = load_table(table_file(tmp_path, BEST_TEST)).runs(tmp_path / "runs")[0]
    fit_record(run.directory / "fit", {})
    steps = []

    def stand_in(args, log, threads):
        steps.append(args[0])
        eval_record(run.directory / "test", {"test/acc": 0.5}, option(args, "--ckpt_path"))
        return 0

    monkeypatch.setattr(sweep, "execute", stand_in)
    assert sweep.run_one(run, [], None) == "done"
    assert steps == ["test"] and "[0] a/seed0: test/acc = 5 (" in capsys.readouterr().out


def test_run_one_fit_that_exits_0_without_metrics_fails(tmp_path, capsys, monkeypatch):
    """fit exits 0 but writes no final_metrics.json: a failure of fit, with the reason, the log
    and its last lines (indented); no evaluation is tried."""
    run = load_table(table_file(tmp_path, BEST_TEST)).runs(tmp_path / "runs")[0]
    steps = []

    def stand_in(args, log, threads):
        steps.append(args[0])
        log.write_text("".join(f"line {i}\n" for i in range(30)))
        return 0

    monkeypatch.setattr(sweep, "execute", stand_in)
    assert sweep.run_one(run, [], None) == "failed"
    assert steps == ["fit"]
    log = run.directory / "sweep.log"
    reason = "fit exited 0 but wrote no final_metrics.json (keep mmlight.callbacks.FinalMetrics in trainer.callbacks)"
    assert json.loads((run.directory / "sweep_status.json").read_text()) == {
        "status": "failed",
        "step": "fit",
        "returncode": 0,
        "log": str(log),
        "reason": reason,
    }
    tail = "".join(f"    line {i}\n" for i in range(5, 30))  # the last 25 lines
    assert (
        capsys.readouterr().out
        == f"[0] a/seed0: fit ...\n[0] a/seed0: FAILED in fit (exit 0): {reason}\n  log: {log}\n{tail}"
    )
    assert run.status() == "failed"


def test_run_one_failed_evaluation_is_recorded_with_its_exit_code(tmp_path, capsys, monkeypatch):
    run = load_table(table_file(tmp_path, BEST_TEST)).runs(tmp_path / "runs")[0]
    fit_record(run.directory / "fit", {})
    monkeypatch.setattr(sweep, "execute", lambda args, log, threads: 2)
    assert sweep.run_one(run, [], None) == "failed"
    status = json.loads((run.directory / "sweep_status.json").read_text())
    assert (status["step"], status["returncode"], status["reason"]) == ("eval", 2, "")
    log = run.directory / "sweep.log"
    assert capsys.readouterr().out == f"[0] a/seed0: test ...\n[0] a/seed0: FAILED in eval (exit 2)\n  log: {log}\n\n"


def test_run_one_without_a_best_checkpoint_fails_in_eval_before_running_it(tmp_path, capsys, monkeypatch):
    """fit recorded no best checkpoint (its monitor was not logged): eval fails with that reason and
    no exit code, and nothing is executed."""
    run = load_table(table_file(tmp_path, BEST_TEST)).runs(tmp_path / "runs")[0]
    rec = fit_record(run.directory / "fit", {}, best=None)
    monkeypatch.setattr(sweep, "execute", lambda *a: pytest.fail("executed"))
    assert sweep.run_one(run, [], None) == "failed"
    reason = (
        f"a/seed0: fit recorded no 'best' checkpoint (checkpoints: {rec['checkpoints']}); "
        "is best_checkpoint's monitor logged?"
    )
    status = json.loads((run.directory / "sweep_status.json").read_text())
    assert (status["step"], status["returncode"], status["reason"]) == ("eval", None, reason)
    assert capsys.readouterr().out.startswith(f"[0] a/seed0: FAILED in eval (exit None): {reason}\n")


def test_run_one_without_the_metric_fails_in_collect(tmp_path, capsys, monkeypatch):
    """checkpoint last, fit's final validation lacks the metric: the last checkpoint is validated;
    when that lacks it too, the run fails in ``collect`` (exit 0) naming the metric."""
    path = table_file(tmp_path, "config: base.yaml\nmetric: val/acc\ncheckpoint: last\ncells: {a: {}}\n")
    run = load_table(path).runs(tmp_path / "runs")[0]
    steps = []

    def stand_in(args, log, threads):
        steps.append(args[0])
        if args[0] == "fit":
            fit_record(run.directory / "fit", {"val/loss": 0.1})
        else:
            assert option(args, "--ckpt_path") == str(run.directory / "fit" / "checkpoints" / "last.ckpt")
            eval_record(run.directory / "validate", {"val/loss": 0.1}, option(args, "--ckpt_path"))
        return 0

    monkeypatch.setattr(sweep, "execute", stand_in)
    assert sweep.run_one(run, [], None) == "failed"
    assert steps == ["fit", "validate"]
    reason = "no val/acc from the last checkpoint in the metrics files; is the metric logged?"
    status = json.loads((run.directory / "sweep_status.json").read_text())
    assert (status["step"], status["returncode"], status["reason"]) == ("collect", 0, reason)
    assert f"[0] a/seed0: FAILED in collect (exit 0): {reason}\n" in capsys.readouterr().out


def test_tail_is_the_last_lines_indented(tmp_path):
    log = tmp_path / "x.log"
    assert sweep.tail(log) == ""  # no log yet
    log.write_text("a\nb\nc\n")
    assert sweep.tail(log, lines=2) == "    b\n    c"
    assert sweep.tail(log) == "    a\n    b\n    c"
    log.write_bytes(b"caf\xe9 \xff\nok\n")  # not UTF-8: replaced, never an error while reporting
    assert sweep.tail(log) == "    caf\ufffd \ufffd\n    ok"


def test_execute_appends_a_header_and_runs_this_python_with_omp_threads(tmp_path, monkeypatch):
    """``subprocess.run`` replaced: the log keeps its old content and gets a dated header with the
    command, flushed before the run; the command is this interpreter's ``-m mmlight.cli``; output
    goes to the log; OMP_NUM_THREADS is set to the threads unless already set, not set without
    threads; the rest of the environment is passed; the exit code is returned."""
    seen = {}

    def fake_run(cmd, stdout, stderr, env):
        seen.update(cmd=cmd, stdout=stdout.name, stderr=stderr, env=env, log=Path(stdout.name).read_text())
        return types.SimpleNamespace(returncode=5)

    monkeypatch.setattr(sweep.subprocess, "run", fake_run)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("MMLIGHT_TEST_MARKER", "kept")
    log = tmp_path / "sweep.log"
    log.write_text("old\n")
    assert sweep.execute(["fit", "--x", "a b"], log, 3) == 5
    assert seen["cmd"] == [sys.executable, "-m", "mmlight.cli", "fit", "--x", "a b"]
    assert seen["stdout"] == str(log) and seen["stderr"] == subprocess.STDOUT
    assert re.fullmatch(r"old\n\n=== \d{4}-\d\d-\d\d \d\d:\d\d:\d\d mmlight fit --x 'a b'\n", seen["log"])
    assert seen["env"]["OMP_NUM_THREADS"] == "3" and seen["env"]["MMLIGHT_TEST_MARKER"] == "kept"
    assert "OMP_NUM_THREADS" not in os.environ  # the sweep's own environment is left alone
    assert sweep.execute(["validate"], log, None) == 5
    assert "OMP_NUM_THREADS" not in seen["env"] and seen["log"].count("\n=== ") == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    sweep.execute(["test"], log, 3)
    assert seen["env"]["OMP_NUM_THREADS"] == "7"


def test_execute_runs_a_real_command(tmp_path, monkeypatch):
    """With a stand-in interpreter (a shell script) the output lands in the log after the header."""
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\necho "args: $*  threads: $OMP_NUM_THREADS"\necho oops >&2\nexit 4\n')
    fake.chmod(0o755)
    monkeypatch.setattr(sweep.sys, "executable", str(fake))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    log = tmp_path / "sweep.log"
    assert sweep.execute(["fit", "--a", "1"], log, 2) == 4
    lines = log.read_text().splitlines()
    assert lines[0] == "" and lines[1].endswith(" mmlight fit --a 1")
    assert lines[2:] == ["args: -m mmlight.cli fit --a 1  threads: 2", "oops"]


def test_run_all_gives_each_run_its_share_of_the_cores(tmp_path, monkeypatch):
    """threads per run: none with one at a time, else cores // parallel, at least 1; the counts of
    each outcome; every run once, with the extra options."""
    runs = load_table(
        table_file(tmp_path, "config: base.yaml\nmetric: val/acc\nseeds: [0, 1]\ncells: {a: {}, b: {}}\n")
    ).runs(tmp_path / "runs")
    outcome = {"a/seed0": "done", "a/seed1": "skipped", "b/seed0": "failed", "b/seed1": "done"}
    seen = []

    def stand_in(run, extra, threads):
        seen.append((run.label, extra, threads))
        return outcome[run.label]

    monkeypatch.setattr(sweep, "run_one", stand_in)
    monkeypatch.setattr(sweep.os, "cpu_count", lambda: 8)
    for parallel, threads in [(1, None), (2, 4), (3, 2), (16, 1)]:
        seen.clear()
        assert sweep.run_all(runs, ["--x"], parallel) == {"done": 2, "skipped": 1, "failed": 1}
        assert sorted(seen) == [(label, ["--x"], threads) for label in sorted(outcome)]
    monkeypatch.setattr(sweep.os, "cpu_count", lambda: None)
    seen.clear()
    sweep.run_all(runs, [], 2)
    assert {threads for _, _, threads in seen} == {1}


def test_run_all_runs_in_parallel(tmp_path, monkeypatch):
    """--parallel 2 over four runs: two runs are under way at the same time (each waits for the
    other at a barrier), never three (each stays a while after the barrier, counting the runs under
    way)."""
    import threading
    import time

    runs = load_table(
        table_file(tmp_path, "config: base.yaml\nmetric: val/acc\nseeds: [0, 1]\ncells: {a: {}, b: {}}\n")
    ).runs(tmp_path)
    barrier = threading.Barrier(2, timeout=10)
    lock, active, most = threading.Lock(), [0], [0]

    def stand_in(run, extra, threads):
        barrier.wait()
        with lock:
            active[0] += 1
            most[0] = max(most[0], active[0])
        time.sleep(0.05)
        with lock:
            active[0] -= 1
        return "done"

    monkeypatch.setattr(sweep, "run_one", stand_in)
    assert sweep.run_all(runs, [], 2) == {"done": 4, "skipped": 0, "failed": 0}
    assert most[0] == 2


def test_select_by_task_or_cells(tmp_path):
    table = load_table(
        table_file(tmp_path, "config: base.yaml\nmetric: val/acc\nseeds: [0, 1]\ncells: {a: {}, b: {}}\n")
    )
    out = str(tmp_path / "runs")

    def labels(runs):
        return [run.label for run in runs]

    assert labels(sweep.select(table, out, None, None)) == ["a/seed0", "a/seed1", "b/seed0", "b/seed1"]
    assert labels(sweep.select(table, out, [], None)) == ["a/seed0", "a/seed1", "b/seed0", "b/seed1"]
    assert labels(sweep.select(table, out, ["b"], None)) == ["b/seed0", "b/seed1"]
    assert labels(sweep.select(table, out, ["b", "a"], None)) == ["a/seed0", "a/seed1", "b/seed0", "b/seed1"]
    assert labels(sweep.select(table, out, None, 0)) == ["a/seed0"]
    assert labels(sweep.select(table, out, ["a"], 3)) == ["b/seed1"]  # --task wins
    assert sweep.select(table, out, None, 2)[0].directory == tmp_path / "runs" / "t" / "b" / "seed0"
    for task in (-1, 4):
        with pytest.raises(TableError, match=re.escape(f"task {task} out of range: the table has 4 runs (0-3)")):
            sweep.select(table, out, None, task)
    with pytest.raises(TableError, match=r"no cell 'c'"):
        sweep.select(table, out, ["a", "c"], None)


def test_parse_args_defaults_extra_options_and_errors(capsys):
    args, extra = sweep.parse_args(["t.yaml", "--only", "a", "--", "--x", "1", "--", "y"])
    assert extra == ["--x", "1", "--", "y"]  # everything after the first --
    assert vars(args) == {
        "table": "t.yaml",
        "dry_run": False,
        "only": ["a"],
        "parallel": 1,
        "out": "runs/tables",
        "task": None,
        "print_step": None,
        "failed": None,
        "log": None,
    }
    args, extra = sweep.parse_args(["t.yaml", "--task", "0", "--print", "eval", "--parallel", "2"])
    assert (args.task, args.print_step, args.parallel, extra) == (0, "eval", 2, [])
    args, _ = sweep.parse_args(["t.yaml", "--task", "0", "--failed", "0", "--log", "l"])
    assert (args.failed, args.log) == (0, "l")
    capsys.readouterr()
    for argv, message in [
        (["t.yaml", "--parallel", "0"], "--parallel must be at least 1, got 0"),
        (["t.yaml", "--print", "fit"], "--print and --failed need --task N"),
        (["t.yaml", "--failed", "0"], "--print and --failed need --task N"),
    ]:
        with pytest.raises(SystemExit) as info:
            sweep.parse_args(argv)
        assert info.value.code == 2 and capsys.readouterr().err.endswith(f"error: {message}\n")


def test_dry_run_lists_runs_statuses_and_the_evaluation(tmp_path, capsys):
    """The header (cells x seeds, the metrics, the checkpoint), each run with its index, folder,
    status and fit command, the evaluation note (with its exception for checkpoint last and
    validate-only metrics), and the count of listed runs (--only lists a subset)."""
    path = table_file(
        tmp_path,
        "config: base.yaml\nmetric: val/acc\ncheckpoint: last\nseeds: [0, 1]\ncells: {a: {}, b: {metric: val/loss}}\n",
    )
    out = tmp_path / "runs"
    table = load_table(path)
    runs = table.runs(out)
    fit_record(runs[0].directory / "fit", {"val/acc": 0.5})
    write_status(runs[1].directory, status="failed")
    runs[2].directory.mkdir(parents=True)
    sweep.main([str(path), "--dry_run", "--out", str(out), "--", "--x", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "t: 2 cells x 2 seeds; metric val/acc, val/loss from the last checkpoint"
    for i, (run, status) in enumerate(zip(runs, ["done", "failed", "unfinished", "missing"])):
        assert lines[1 + 2 * i] == f"[{i}] {run.label}  {run.directory}  ({status})"
        assert lines[2 + 2 * i].startswith("    mmlight fit --config ")
        assert shlex.split(lines[2 + 2 * i]) == ["mmlight", *run.fit_args(["--x", "1"])]
    assert lines[9:] == [
        "    (then `mmlight validate ... --ckpt_path <last checkpoint>` unless fit validated the final step)",
        "4 runs",
    ]
    sweep.main([str(path), "--dry_run", "--out", str(out), "--only", "b"])
    lines = capsys.readouterr().out.splitlines()
    assert (
        lines[0].startswith("t: 2 cells x 2 seeds;") and lines[-1] == "2 runs" and lines[1].startswith("[2] b/seed0 ")
    )


@pytest.mark.parametrize(
    "text, note",
    [
        (
            "metric: test/acc\ncheckpoint: last\ncells: {a: {}}",
            "(then `mmlight test ... --ckpt_path <last checkpoint>`)",
        ),
        (
            "metric: val/acc\ncheckpoint: best\ncells: {a: {}}",
            "(then `mmlight validate ... --ckpt_path <best checkpoint>`)",
        ),
        (
            "metric: val/acc\ncheckpoint: last\ncells: {a: {}, b: {metric: test/acc}}",
            "(then `mmlight test/validate ... --ckpt_path <last checkpoint>`)",
        ),
    ],
)
def test_dry_run_evaluation_note(tmp_path, capsys, text, note):
    sweep.main([str(table_file(tmp_path, "config: base.yaml\n" + text + "\n")), "--dry_run", "--out", str(tmp_path)])
    assert capsys.readouterr().out.splitlines()[-2] == "    " + note


def test_print_step_for_slurm(tmp_path, capsys):
    """``--task N --print fit|eval``: fit's config then its options (without --ckpt_path last), one
    per line, until fit is done; then the evaluation's whole command; nothing once the run is done
    or when fit's final validation is the result."""
    path = table_file(
        tmp_path,
        "config: base.yaml\nmetric: test/acc\noverrides: {trainer.max_epochs: 3}\nseeds: [0, 1]\ncells: {a: {}}\n",
    )
    out = tmp_path / "runs"
    run = load_table(path).runs(out)[1]

    def printed(step):
        sweep.main([str(path), "--out", str(out), "--task", "1", "--print", step, "--", "--data.root", "/d"])
        return capsys.readouterr().out

    lines = printed("fit").splitlines()
    assert lines[:9] == [
        str(tmp_path / "base.yaml"),
        "--trainer.max_epochs",
        "3",
        "--data.root",
        "/d",
        "--seed_everything",
        "1",
        "--trainer.logger",
        lines[8],
    ]
    assert json.loads(lines[8]) == {
        "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
        "init_args": {"save_dir": str(out / "t" / "a"), "name": "seed1", "version": "fit"},
    }
    assert lines[9:] == ["--trainer.default_root_dir", str(run.directory / "fit")]
    with pytest.raises(
        SystemExit,
        match=re.escape(
            f"mmlight sweep: a/seed1: fit has not finished ({run.directory / 'fit' / 'final_metrics.json'} is missing)"
        ),
    ):
        printed("eval")

    fit_record(run.directory / "fit", {"test/acc": 0.5})  # fit's own test/* value never counts
    assert printed("fit") == "\n"
    lines = printed("eval").splitlines()
    assert lines[:3] == ["test", "--config", str(tmp_path / "base.yaml")]
    assert lines[-2:] == ["--ckpt_path", str(run.directory / "fit" / "checkpoints" / "best.ckpt")]
    assert lines[-4:-2] == ["--trainer.default_root_dir", str(run.directory / "test")]
    eval_record(run.directory / "test", {"test/acc": 0.5}, str(run.directory / "fit" / "checkpoints" / "best.ckpt"))
    assert printed("eval") == "\n"


def test_print_step_eval_is_empty_when_fit_validated_the_final_step(tmp_path, capsys):
    """checkpoint last: a validation before the final step needs ``validate`` of the last
    checkpoint; one at the final step is the result, and nothing is printed."""
    path = table_file(tmp_path, "config: base.yaml\nmetric: val/acc\ncheckpoint: last\ncells: {a: {}}\n")
    run = load_table(path).runs(tmp_path / "runs")[0]
    fit_record(run.directory / "fit", {"val/acc": 0.5}, step=8)  # validated before the end
    sweep.print_step(run, "eval", [])
    assert capsys.readouterr().out.splitlines()[-2:] == [
        "--ckpt_path",
        str(run.directory / "fit" / "checkpoints" / "last.ckpt"),
    ]
    fit_record(run.directory / "fit", {"val/acc": 0.5}, step=10)
    write_status(run.directory, status="failed")  # an old failure: the value makes the run done
    assert run.eval_args([]) is None and run.status() == "done"
    sweep.print_step(run, "eval", [])
    assert capsys.readouterr().out == "\n"


def test_print_step_refuses_an_argument_with_a_newline(tmp_path, capsys):
    path = table_file(tmp_path, 'config: base.yaml\nmetric: val/acc\ncells: {a: {overrides: {model.x: "a\\nb"}}}\n')
    with pytest.raises(
        SystemExit,
        match="^mmlight sweep: a/seed0: an argument contains a newline, which slurm/sweep.sh cannot pass on$",
    ):
        sweep.main([str(path), "--out", str(tmp_path / "runs"), "--task", "0", "--print", "fit"])
    assert capsys.readouterr().out == ""


def test_failed_records_the_failure_for_collect(tmp_path, capsys):
    """``--task N --failed CODE --log FILE`` writes run N's status and prints nothing."""
    path = table_file(tmp_path, "config: base.yaml\nmetric: val/acc\nseeds: [0, 1]\ncells: {a: {}}\n")
    out = tmp_path / "runs"
    sweep.main([str(path), "--out", str(out), "--task", "1", "--failed", "0", "--log", "/logs/7.out"])
    assert json.loads((out / "t" / "a" / "seed1" / "sweep_status.json").read_text()) == {
        "status": "failed",
        "step": "slurm",
        "returncode": 0,
        "log": "/logs/7.out",
    }
    assert not (out / "t" / "a" / "seed0").exists() and capsys.readouterr().out == ""
    assert load_table(path).runs(out)[1].status() == "failed"


def test_main_runs_the_selected_runs_and_sums_up(tmp_path, capsys, monkeypatch):
    """Without --dry_run: run_all gets the selected runs, the extra options and --parallel; the
    summary names the counts; exit status 0 when nothing failed."""
    path = table_file(tmp_path, "config: base.yaml\nmetric: val/acc\nseeds: [0, 1]\ncells: {a: {}, b: {}}\n")
    seen = {}

    def stand_in(runs, extra, parallel):
        seen.update(labels=[run.label for run in runs], extra=extra, parallel=parallel)
        return {"done": 1, "skipped": 1, "failed": 0}

    monkeypatch.setattr(sweep, "run_all", stand_in)
    sweep.main([str(path), "--only", "b", "--parallel", "2", "--out", str(tmp_path / "runs"), "--", "--x"])
    assert seen == {"labels": ["b/seed0", "b/seed1"], "extra": ["--x"], "parallel": 2}
    assert capsys.readouterr().out == (
        f"t: 1 run(s) finished, 1 already done, 0 failed; `mmlight collect {path}` writes the table\n"
    )


def test_help_describes_every_option(capsys, monkeypatch):
    """``mmlight sweep --help``: the usage line and each option with its metavar and help, as
    written here (whitespace normalised; a wide terminal keeps the usage on one line)."""
    monkeypatch.setenv("COLUMNS", "300")
    with pytest.raises(SystemExit) as info:
        sweep.parse_args(["--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    segments = [
        "usage: mmlight sweep [-h] [--dry_run] [--only CELL [CELL ...]] [--parallel N] [--out OUT] [--task N] "
        "[--print {fit,eval}] [--failed CODE] [--log LOG] table ",
        " ``mmlight sweep TABLE``: run every (cell, seed) of a table (see :mod:`mmlight.experiments.table`). ",
        " table a table file, e.g. configs/tables/table4.yaml ",
        " --dry_run list every run and its command; run nothing ",
        " --only CELL [CELL ...] run only these cells ",
        " --parallel N runs at the same time (default 1) ",
        " --out OUT root of the run directories (default runs/tables) ",
        " --task N one run by its index (as SLURM_ARRAY_TASK_ID) ",
        " --print {fit,eval} with --task: print that step's arguments, one per line (for slurm/sweep.sh) ",
        " --failed CODE with --task: record that the run failed ",
    ]
    position = 0
    for segment in segments:  # in this order
        position = text.index(segment, position) + len(segment) - 1
    assert text.endswith(" --log LOG with --failed: the run's log file")
    assert "Options after" not in text  # the description is the docstring's first paragraph only


def test_help_keeps_the_description_as_written(capsys, monkeypatch):
    """The description is printed raw: a narrow terminal does not re-wrap it."""
    monkeypatch.setenv("COLUMNS", "40")
    with pytest.raises(SystemExit):
        sweep.parse_args(["--help"])
    assert (
        "\n``mmlight sweep TABLE``: run every (cell, seed) of a table (see :mod:`mmlight.experiments.table`).\n"
        in capsys.readouterr().out
    )


def test_bad_option_values_are_refused(capsys):
    """--print takes fit or eval; --task, --failed and --parallel take integers."""
    for argv, message in [
        (["t", "--task", "0", "--print", "all"], "argument --print: invalid choice: 'all'"),
        (["t", "--task", "x"], "argument --task: invalid int value: 'x'"),
        (["t", "--task", "0", "--failed", "x"], "argument --failed: invalid int value: 'x'"),
        (["t", "--parallel", "x"], "argument --parallel: invalid int value: 'x'"),
    ]:
        with pytest.raises(SystemExit):
            sweep.parse_args(argv)
        assert message in capsys.readouterr().err
