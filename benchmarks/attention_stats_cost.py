"""The cost of the AttentionStats callback against validation, read from real training runs.

The callback logs the time the training loop waits for it: per recording (``attention/seconds``)
and, at the end of the run, for its background thread (``attention/final_wait_seconds``); the time
that thread spent reducing statistics and drawing figures (``attention/reduce_seconds``,
``attention/figure_seconds``, off the loop's path but not free: on a machine without idle cores
they take CPU time from training); and the validation loop's own time at every validation epoch
(``attention/validation_seconds``). This script reads them from the TensorBoard event files of
runs trained with the callback and writes one JSON record per run: the time the loop waited for the
callback as a fraction of the run's total validation time, and the background work beside it::

    python benchmarks/attention_stats_cost.py runs/bench/digits_softmax/version_0 \\
        --out benchmarks/results/attention_stats_cost-cpu-torch2.14_lightning2.6-<YYYYMMDD>.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # as ``python benchmarks/...`` would (tests import it)
from fit_runs import read_scalars  # noqa: E402

TAGS = (
    "attention/seconds",
    "attention/final_wait_seconds",
    "attention/reduce_seconds",
    "attention/figure_seconds",
    "attention/validation_seconds",
)


def read_run(run_dir: Path) -> dict[str, list[float]]:
    """The values of :data:`TAGS` in a run's event files."""
    if not any(run_dir.rglob("events.out.tfevents*")):
        raise SystemExit(f"no TensorBoard events under {run_dir}")
    values = {tag: [value for _, value in points] for tag, points in read_scalars(run_dir, TAGS).items()}
    if not values["attention/seconds"]:
        raise SystemExit(f"{run_dir} was not trained with AttentionStats (no attention/seconds)")
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (runs/<name>/version_<v>)")
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    args = parser.parse_args()
    import os

    import lightning
    import torch

    records = []
    for run in args.runs:
        v = read_run(run)
        callback = sum(v["attention/seconds"]) + sum(v["attention/final_wait_seconds"])
        validation = sum(v["attention/validation_seconds"])
        records.append(
            {
                "run": str(run),
                "validation_epochs": len(v["attention/validation_seconds"]),
                "recordings": len(v["attention/seconds"]),
                "validation_seconds": validation,
                "callback_seconds": callback,
                "recording_seconds": sum(v["attention/seconds"]),
                "final_wait_seconds": sum(v["attention/final_wait_seconds"]),
                "reduce_seconds": sum(v["attention/reduce_seconds"]),
                "figure_seconds": sum(v["attention/figure_seconds"]),
                "ratio": callback / validation,
            }
        )
    meta = {
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "load_average_1_5_15_min": os.getloadavg(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "runs": records}, indent=1) + "\n")
    for r in records:
        print(
            f"{r['run']}: {r['recordings']} recording(s) in {r['validation_epochs']} validation epochs: "
            f"loop waited {r['callback_seconds']:.3f} s (recording {r['recording_seconds']:.3f} s, final wait "
            f"{r['final_wait_seconds']:.3f} s; off the loop: reducing {r['reduce_seconds']:.3f} s, drawing "
            f"{r['figure_seconds']:.2f} s) against validation "
            f"{r['validation_seconds']:.2f} s = {100 * r['ratio']:.1f}%"
        )


if __name__ == "__main__":
    main()
