"""Section ``correctness``: the shipped kernels against the fp32 reference, as ``mmlight doctor`` checks
them (its checks, shapes and tolerances: row-wise MultiMax, attention at DeiT-small's shape, causal
attention at N = 1,024, the cross-entropy at an LM vocabulary), bf16 on a GPU and fp32 under the
interpreter, without the doctor's timings.

The checks run in the check pool, in parallel, each recorded as it finishes; they compile the shipped
kernels into Triton's cache for the sections after this one. Their seconds, over the kernels each
compiles, are this device's cost of one compilation, which the estimates of the later sections use.
"""

from __future__ import annotations

import statistics
import time

from benchmarks.gpu.pool import run_pool
from benchmarks.gpu.record import Run

#: Triton kernels each doctor check compiles (forward and backward): row-wise 2, attention 3 (forward,
#: dK/dV, dQ), causal attention 3, cross-entropy 2.
KERNELS = {"row-wise": 2, "attention": 3, "causal": 3, "cross-entropy": 2}
#: Seconds one check may take (compilations included).
CHECK_LIMIT_S = 120


def kernels_of(check_name: str) -> int:
    return next((n for prefix, n in KERNELS.items() if check_name.startswith(prefix)), 2)


def doctor_check(index: int) -> dict:
    """``mmlight doctor``'s check ``index`` on this machine (in a pool worker), and its seconds."""
    import torch

    from mmlight.commands.doctor import CHECKS, run_check

    began = time.monotonic()
    row = run_check(CHECKS[index], torch.cuda.is_available(), timed=False)
    return {**row, "seconds": round(time.monotonic() - began, 2)}


def section(run: Run, jobs: int) -> None:
    from mmlight.commands.doctor import CHECKS

    per_kernel = []

    def record(index: int, verdict: dict) -> None:
        name = CHECKS[index].name
        run.emit(kind="doctor", **{"check": name, **verdict})
        if verdict.get("seconds"):
            per_kernel.append(verdict["seconds"] / kernels_of(name))

    tasks = [("benchmarks.gpu.correctness:doctor_check", (i,)) for i in range(len(CHECKS))]
    unchecked = run_pool(run, tasks, jobs, CHECK_LIMIT_S, record)
    for index in unchecked:
        run.emit(kind="skipped", section="correctness", what=CHECKS[index].name, reason="time budget")
    if per_kernel:
        run.state["compile_s"] = round(statistics.median(per_kernel), 2)
        run.emit(kind="compile_cost", seconds_per_kernel=run.state["compile_s"], checks=len(per_kernel))
