"""The one-node SLURM cluster of the tests (.ci/slurm-cluster.sh): jobs submitted and waited for."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.helpers.checks import wait_for


def job_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TRITON_INTERPRET"))}
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"  # the `mmlight` of this environment
    env["OMP_NUM_THREADS"] = "1"
    return env


#: the states in which a job (or an array task) has ended for good
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def job_records(job: int | str) -> list[dict[str, str]]:
    """scontrol's fields of a job: one dict per array task (one for a plain job)."""
    out = subprocess.run(["scontrol", "show", "job", str(job), "-o"], capture_output=True, text=True).stdout
    return [dict(re.findall(r"(\w+)=(\S*)", line)) for line in out.splitlines() if "JobState=" in line]


def sbatch_and_wait(command: list[str], timeout: float = 900, **run) -> subprocess.CompletedProcess:
    """``command`` (an ``sbatch --parsable``), then a poll each second until every task of the job has
    ended. What ``sbatch --wait`` does, without its growing poll interval (a 12-second job took 42 s
    with it here). The exit code is the highest of the tasks', or 1 where one was killed by a signal."""
    submitted = subprocess.run(command, capture_output=True, text=True, timeout=60, **run)
    if submitted.returncode != 0:
        return submitted
    job = submitted.stdout.strip().split(";")[0].splitlines()[0]

    def ended():
        records = job_records(job)
        return records if records and all(r["JobState"] in ENDED for r in records) else None

    codes = [tuple(map(int, r["ExitCode"].split(":"))) for r in wait_for(ended, timeout, f"job {job} to end")]
    code = max(1 if signal else status for status, signal in codes)
    return subprocess.CompletedProcess(command, code, submitted.stdout, submitted.stderr)
