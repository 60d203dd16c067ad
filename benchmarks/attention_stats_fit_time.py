"""Whole-fit wall time with and without the AttentionStats callback, alternating runs of one quick
start (the callback's own timings in ``attention_stats_cost.py`` count only what the training loop
waited; this shows what its background work costs the run as a whole)::

    OMP_NUM_THREADS=1 python benchmarks/attention_stats_fit_time.py configs/quickstart/lm_softmax.yaml \\
        --pairs 3 --out benchmarks/results/attention_stats_fit_time-cpu-torch2.14-<YYYYMMDD>-figures_on.json
    # --callback_args --trainer.callbacks.figures off     (the same without figures)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from fit_runs import fit_command  # beside this script, which Python puts on sys.path

CALLBACK = "--trainer.callbacks+=mmlight.callbacks.AttentionStats"


def timed_fit(config: str, extra: list[str], save_dir: str) -> float:
    """Seconds of one ``mmlight fit`` subprocess (interpreter start and imports included)."""
    command = fit_command(config, {"--trainer.logger.init_args.save_dir": save_dir}, extra)
    start = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    parser.add_argument("--pairs", type=int, default=3, help="runs with and without, alternating")
    parser.add_argument(
        "--callback_args",
        nargs=argparse.REMAINDER,
        default=[],
        help="options for the callback, e.g. --trainer.callbacks.figures off",
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    without, with_callback = [], []
    with tempfile.TemporaryDirectory() as runs:
        for _ in range(args.pairs):
            without.append(timed_fit(args.config, [], runs))
            with_callback.append(timed_fit(args.config, [CALLBACK, *args.callback_args], runs))
    differences = [w - o for w, o in zip(with_callback, without)]
    record = {
        "config": args.config,
        "callback_args": args.callback_args,
        "without_s": without,
        "with_s": with_callback,
        "paired_difference_s": differences,
        "mean_difference_s": statistics.mean(differences),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "load_average_1_5_15_min": os.getloadavg(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(
        f"{args.config} {' '.join(args.callback_args)}: with - without = "
        + ", ".join(f"{d:+.2f} s" for d in differences)
        + f" (mean {record['mean_difference_s']:+.2f} s; "
        f"fits without: {min(without):.1f}-{max(without):.1f} s)"
    )


if __name__ == "__main__":
    main()
