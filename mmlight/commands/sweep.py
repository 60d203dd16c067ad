"""``mmlight sweep TABLE``: run every (cell, seed) of a table (see :mod:`mmlight.experiments.table`).

::

    mmlight sweep configs/tables/table4.yaml --dry_run           # list runs, folders and commands
    mmlight sweep configs/tables/table4.yaml --parallel 2        # run them here, two at a time
    mmlight sweep configs/tables/table4.yaml --only softmax -- --data.init_args.root /data/iwslt14

Options after ``--`` are given to every run. A run is ``mmlight fit ... --ckpt_path last`` in its own
run directory, then, when the metric needs it, ``mmlight test`` (or ``validate``) of the table's
checkpoint. Re-running skips finished runs and resumes unfinished ones from their newest
checkpoint; a failed run is reported with the end of its log and the others go on.

``slurm/sweep.sh`` uses ``--task N --print fit|eval`` (the arguments of run N's steps, one per line,
nothing when the step is done) and ``--task N --failed CODE`` (record a failure for ``collect``).
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mmlight.experiments.table import Run, Table, TableError, load_table, write_status

LOG_FILE = "sweep.log"
_PRINT_LOCK = threading.Lock()


def say(message: str) -> None:
    """Print a whole message at once: parallel runs report from several threads."""
    with _PRINT_LOCK:
        sys.stdout.write(message + "\n")
        sys.stdout.flush()


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The sweep's own options, and the mmlight options after ``--`` that go to every run."""
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(
        prog="mmlight sweep", description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("table", help="a table file, e.g. configs/tables/table4.yaml")
    parser.add_argument("--dry_run", action="store_true", help="list every run and its command; run nothing")
    parser.add_argument("--only", nargs="+", metavar="CELL", help="run only these cells")
    parser.add_argument("--parallel", type=int, default=1, metavar="N", help="runs at the same time (default 1)")
    parser.add_argument("--out", default="runs/tables", help="root of the run directories (default runs/tables)")
    parser.add_argument("--task", type=int, metavar="N", help="one run by its index (as SLURM_ARRAY_TASK_ID)")
    parser.add_argument(
        "--print",
        choices=("fit", "eval"),
        dest="print_step",
        help="with --task: print that step's arguments, one per line (for slurm/sweep.sh)",
    )
    parser.add_argument("--failed", type=int, metavar="CODE", help="with --task: record that the run failed")
    parser.add_argument("--log", help="with --failed: the run's log file")
    args = parser.parse_args(argv)
    if args.parallel < 1:
        parser.error(f"--parallel must be at least 1, got {args.parallel}")
    if (args.print_step is not None or args.failed is not None) and args.task is None:
        parser.error("--print and --failed need --task N")
    return args, extra


def select(table: Table, out: str, only: list[str] | None, task: int | None) -> list[Run]:
    """The runs a command acts on; unknown cells or an index out of range stop it with a message."""
    runs = table.runs(out)
    if task is not None:
        if not 0 <= task < len(runs):
            raise TableError(
                f"{table.path}: task {task} out of range: the table has {len(runs)} runs (0-{len(runs) - 1})"
            )
        return [runs[task]]
    if only:
        for name in only:
            table.cell(name)  # raises, naming the cells
        runs = [run for run in runs if run.cell.name in only]
    return runs


def command_line(args: list[str]) -> str:
    return shlex.join(["mmlight", *args])


def dry_run(table: Table, runs: list[Run], extra: list[str]) -> None:
    stages = sorted({cell.eval_stage for cell in table.cells})
    eval_note = f"then `mmlight {'/'.join(stages)} ... --ckpt_path <{table.checkpoint} checkpoint>`"
    if table.checkpoint == "last" and stages == ["validate"]:
        eval_note += " unless fit validated the final step"
    metrics = sorted({cell.metric for cell in table.cells})
    print(
        f"{table.name}: {len(table.cells)} cells x {len(table.seeds)} seeds; metric {', '.join(metrics)} "
        f"from the {table.checkpoint} checkpoint"
    )
    for run in runs:
        print(f"[{run.index}] {run.label}  {run.directory}  ({run.status()})")
        print(f"    {command_line(run.fit_args(extra))}")
    print(f"    ({eval_note})")
    print(f"{len(runs)} runs")


def execute(args: list[str], log: Path, threads: int | None) -> int:
    """Run ``mmlight *args`` with this interpreter, appending its output to ``log``; the exit code."""
    env = dict(os.environ)
    if threads is not None:
        env.setdefault("OMP_NUM_THREADS", str(threads))  # parallel runs share the cores
    with open(log, "a") as out:
        out.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {command_line(args)}\n")
        out.flush()
        return subprocess.run(
            [sys.executable, "-m", "mmlight.cli", *args], stdout=out, stderr=subprocess.STDOUT, env=env
        ).returncode


def tail(path: Path, lines: int = 25) -> str:
    text = path.read_text(errors="replace").splitlines() if path.is_file() else []
    return "\n".join("    " + line for line in text[-lines:])


def run_one(run: Run, extra: list[str], threads: int | None) -> str:
    """Fit (resuming), then evaluate when needed; returns the run's status after it."""
    if run.status() == "done":
        say(f"[{run.index}] {run.label}: done, skipped")
        return "skipped"
    run.directory.mkdir(parents=True, exist_ok=True)
    log = run.directory / LOG_FILE
    start = time.time()
    for step in ("fit", "eval"):
        try:
            if step == "fit":
                args = None if run.fit_done() else run.fit_args(extra)
            else:
                args = run.eval_args(extra)
        except FileNotFoundError as err:
            return failed(run, step, None, log, str(err))
        if args is None:
            continue
        say(f"[{run.index}] {run.label}: {args[0]} ...")
        code = execute(args, log, threads)
        if code != 0:
            return failed(run, step, code, log)
        if step == "fit" and not run.fit_done():
            return failed(
                run,
                step,
                code,
                log,
                "fit exited 0 but wrote no final_metrics.json "
                "(keep mmlight.callbacks.FinalMetrics in trainer.callbacks)",
            )
    value = run.result()
    if value is None:
        return failed(
            run,
            "collect",
            0,
            log,
            f"no {run.cell.metric} from the {run.table.checkpoint} checkpoint "
            "in the metrics files; is the metric logged?",
        )
    write_status(run.directory, status="done", log=str(log), seconds=round(time.time() - start, 1))
    say(f"[{run.index}] {run.label}: {run.cell.metric} = {value:.4g} ({time.time() - start:.0f} s)")
    return "done"


def failed(run: Run, step: str, code: int | None, log: Path, reason: str = "") -> str:
    write_status(run.directory, status="failed", step=step, returncode=code, log=str(log), reason=reason)
    say(
        f"[{run.index}] {run.label}: FAILED in {step} (exit {code}){': ' + reason if reason else ''}\n"
        f"  log: {log}\n{tail(log)}"
    )
    return "failed"


def run_all(runs: list[Run], extra: list[str], parallel: int) -> dict[str, int]:
    threads = max(1, (os.cpu_count() or 1) // parallel) if parallel > 1 else None
    with ThreadPoolExecutor(max_workers=parallel) as pool:
        outcomes = list(pool.map(lambda run: run_one(run, extra, threads), runs))
    return {status: outcomes.count(status) for status in ("done", "skipped", "failed")}


def print_step(run: Run, step: str, extra: list[str]) -> None:
    """For slurm/sweep.sh: fit's arguments as slurm/train.sh takes them (config, then overrides),
    or the evaluation's full mmlight arguments; nothing when the step has nothing to do."""
    if step == "fit":
        args = [] if run.fit_done() else run.fit_args(extra)[2:-2]  # drop "fit --config" and "--ckpt_path last"
    else:
        args = [] if run.status() == "done" else (run.eval_args(extra) or [])
    if any("\n" in arg for arg in args):
        raise TableError(f"{run.label}: an argument contains a newline, which slurm/sweep.sh cannot pass on")
    print("\n".join(args))


def main(argv: list[str]) -> None:
    args, extra = parse_args(list(argv))
    try:
        table = load_table(args.table)
        runs = select(table, args.out, args.only, args.task)
        if args.print_step:
            print_step(runs[0], args.print_step, extra)
            return
        if args.failed is not None:
            write_status(runs[0].directory, status="failed", step="slurm", returncode=args.failed, log=args.log)
            return
        if args.dry_run:
            dry_run(table, runs, extra)
            return
    except (TableError, FileNotFoundError) as err:
        raise SystemExit(f"mmlight sweep: {err}") from None
    counts = run_all(runs, extra, args.parallel)
    print(
        f"{table.name}: {counts['done']} run(s) finished, {counts['skipped']} already done, {counts['failed']} failed; "
        f"`mmlight collect {args.table}` writes the table"
    )
    if counts["failed"]:
        raise SystemExit(1)
