"""The run: its command line, its sections in order of worth, and the loop that runs them under the budget.

Each section is imported when it starts (a package it lacks is its error, named in the record) and
runs inside a deadline: the time left for the last three (sweep, profile, fit), else its estimate
with some slack. A section that cannot start before the budget ends is recorded as not reached.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from benchmarks.gpu.record import HARD_GRACE_S, Overrun, Run, first_line, release_gpu_cache

RESULTS = Path(__file__).resolve().parents[1] / "results"
#: Default budget in seconds: the last section ends by then; the watchdog ends the run at the budget
#: plus the hard grace (480 + 20 s: within 540 s of the process's start, with its start-up).
BUDGET_S = 480.0
#: Budget under --smoke (Triton's interpreter on a CPU shared with other work is slow).
SMOKE_BUDGET_S = 1500.0
#: Seconds one Triton specialisation takes to compile when neither the offline report nor this run says.
COMPILE_S = 10.0


@dataclass(frozen=True)
class Section:
    """One section of the run.

    Args:
        name: its name (``--only`` takes it; records carry it).
        target: ``"package.module:function"`` imported when the section starts, or a callable; called
            with the run (and the pool's size where ``pool``).
        seconds: estimated seconds on an H100/H200 besides compilations.
        compilations: Triton specialisations and compiled models it compiles, counted one after another
            (a pool's divided by its workers).
        start_s: the least time left in which it starts.
        rest: it may take all the time left (the sections last in worth); else its estimate, with slack.
        pool: it runs checks in the check pool.
    """

    name: str
    target: str | Callable
    seconds: float
    compilations: float = 0
    start_s: float = 5
    rest: bool = False
    pool: bool = False

    def estimate(self, compile_s: float) -> float:
        return self.seconds + self.compilations * compile_s


SECTIONS = [
    Section("preflight", "benchmarks.gpu.preflight:section", 10),
    Section("correctness", "benchmarks.gpu.correctness:section", 5, compilations=3, pool=True),
    # 3 compiled models at ~6 compile-units each (inductor's graphs and kernels, compiled on every core)
    Section("step", "benchmarks.gpu.step:section", 30, compilations=20),
    Section("attention", "benchmarks.gpu.attention:section", 40, compilations=6, pool=True),
    Section("rowwise", "benchmarks.gpu.rowwise:section", 20, compilations=12),
    # the text recipes' networks eager and compiled: 3 compiled models at ~6 compile-units each
    Section("text_step", "benchmarks.gpu.text_step:section", 20, compilations=18),
    Section("sweep", "benchmarks.gpu.sweep:section", 40, compilations=12, rest=True, pool=True),
    Section("profile", "benchmarks.gpu.step:section_profile", 15, rest=True),
    Section("fit", "benchmarks.gpu.fit:section", 120, start_s=30, rest=True),
]
NAMES = [s.name for s in SECTIONS]


def offline_compile_seconds(results: Path = RESULTS) -> tuple[float, str]:
    """Median seconds of one sm_90 specialisation in the newest offline compile report, and its name."""
    reports = sorted(results.glob("compile_report-*.json"))
    for path in reversed(reports):
        seconds = [r["seconds"] for r in json.loads(path.read_text()) if r.get("capability") == 90 and r.get("seconds")]
        if seconds:
            return statistics.median(seconds), path.name
    return COMPILE_S, "no offline compile report"


def allowance(run: Run, section: Section) -> float:
    """Seconds the section may run: all that is left, or its estimate with slack (1.5 times, 30 s at least)."""
    if section.rest:
        return run.left()
    estimate = section.estimate(run.state["compile_s"])
    return min(run.left(), max(1.5 * estimate, estimate + 30))


def run_section(run: Run, section: Section, jobs: int) -> None:
    """Run one section under its deadline; its errors and its cut-off become records."""
    if run.left() < section.start_s:
        run.emit(kind="skipped", section=section.name, reason=f"time budget: {run.left():.0f} s left")
        return
    run.pending.remove(section.name)
    run.current = section.name
    began = time.monotonic()
    seconds = allowance(run, section)
    try:
        with run.limit(seconds, f"section {section.name}") as token:
            target = section.target
            if isinstance(target, str):
                module, function = target.split(":")
                target = getattr(importlib.import_module(module), function)
            target(run, jobs) if section.pool else target(run)
        if token in run.fired:  # its deadline passed inside code that swallowed the overrun
            raise Overrun(run.fired[token], token)
        run.done.append(section.name)
    except Overrun:
        run.cut.append(section.name)
        run.emit(kind="cut", section=section.name, reason=f"section deadline: {seconds:.0f} s")
    except ImportError as error:  # a package the node lacks costs this section only
        run.emit(kind="error", section=section.name, error=first_line(error), missing_package=error.name)
    except Exception as error:  # a failing section must not cost the others
        run.emit(kind="error", section=section.name, error=first_line(error))
    run.current = None
    release_gpu_cache()
    run.emit(
        kind="section", section=section.name, seconds=round(time.monotonic() - began, 1), deadline_s=round(seconds)
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpu_run.py", description="One prepared GPU run of mmlight's kernels and steps.")
    p.add_argument(
        "--out",
        type=Path,
        default=Path(os.environ.get("OUT", RESULTS)),
        help="output folder ($OUT, else benchmarks/results)",
    )
    p.add_argument(
        "--budget",
        type=float,
        default=None,
        help=f"seconds for the sections ({BUDGET_S:.0f}; --smoke {SMOKE_BUDGET_S:.0f})",
    )
    p.add_argument(
        "--hard-grace",
        type=float,
        default=HARD_GRACE_S,
        help="seconds past the budget at which the run is ended whatever runs",
    )
    p.add_argument(
        "--smoke", action="store_true", help="tiny shapes on the CPU (Triton's interpreter): the same control flow"
    )
    p.add_argument("--jobs", type=int, default=None, help="check-pool workers (min(14, CPUs) on a GPU, 1 with --smoke)")
    p.add_argument("--only", nargs="*", choices=NAMES, help="sections to run (all, in their order)")
    return p


def versions() -> dict:
    import torch
    import triton
    from record_name import device_name  # beside the gpu package

    return {"device": device_name(), "torch": torch.__version__, "triton": triton.__version__}


def record_file(out: Path, found: dict, smoke: bool) -> Path:
    """``gpu_run-<device>-torch<v>_triton<v>-<YYYYMMDD>-<HHMM or smoke>.jsonl`` (``record_name.py``)."""
    from record_name import device_part, record_path

    part = [("torch", found["torch"]), ("triton", found["triton"])]
    name = record_path("gpu_run", device_part(found["device"]), part, "jsonl", tag="smoke" if smoke else None).name
    return out / name


def main(argv: list[str] | None = None, sections: list[Section] | None = None, started: float | None = None) -> int:
    """Run the sections (``sections``: another list, for tests) and write the closing record; status 0."""
    args = parser().parse_args(argv)
    import torch

    if not torch.cuda.is_available() and not args.smoke:
        parser().error("the run needs a CUDA GPU; use --smoke to rehearse it on the CPU")
    budget = args.budget if args.budget is not None else (SMOKE_BUDGET_S if args.smoke else BUDGET_S)
    found = versions()
    run = Run(record_file(args.out, found, args.smoke), budget, found, started, args.smoke, args.hard_grace)
    chosen = [s for s in sections or SECTIONS if not args.only or s.name in args.only]
    run.pending = [s.name for s in chosen]
    run.state["compile_s"], source = offline_compile_seconds()
    jobs = args.jobs or (1 if args.smoke else min(14, os.cpu_count() or 1))
    estimates = {s.name: round(s.estimate(run.state["compile_s"])) for s in chosen}
    run.emit(
        kind="plan",
        sections=estimates,
        budget_s=budget,
        compile_s=run.state["compile_s"],
        compile_source=source,
        jobs=jobs,
    )
    for section in chosen:
        run_section(run, section, jobs)
    if torch.cuda.is_available():
        from benchmarks.gpu.preflight import nvidia_smi

        run.emit(kind="env_end", nvidia_smi=nvidia_smi())
    run.close("finished")
    print(f"wrote {run.path}", file=sys.stderr)
    return 0
