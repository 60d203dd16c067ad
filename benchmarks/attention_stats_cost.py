"""The cost of the AttentionStats callback against validation, read from real training runs.

The callback logs its own wall time (``attention/seconds``) and the validation loop's
(``attention/validation_seconds``) at each recording. This script reads them from the TensorBoard
event files of runs trained with the callback and writes one JSON record per run: the mean ratio
per recording, and amortised over ``every_n_epochs`` validation epochs (the callback runs at one
validation in k)::

    python benchmarks/attention_stats_cost.py --every_n_epochs 2 runs/qs/digits_softmax/version_0 ... \\
        --out benchmarks/results/attention_stats_cost.json
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path


def read_run(run_dir: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = sorted(run_dir.rglob("events.out.tfevents*"))
    if not events:
        raise SystemExit(f"no TensorBoard events under {run_dir}")
    values: dict[str, list[float]] = {"attention/seconds": [], "attention/validation_seconds": [],
                                      "attention/stats_seconds": []}
    for path in events:
        acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in values:
            if tag in acc.Tags()["scalars"]:
                values[tag] += [e.value for e in acc.Scalars(tag)]
    if not values["attention/seconds"]:
        raise SystemExit(f"{run_dir} was not trained with AttentionStats (no attention/seconds)")
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (runs/<name>/version_<v>)")
    parser.add_argument("--every_n_epochs", type=int, required=True, help="the callback's k in those runs")
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    args = parser.parse_args()
    import lightning
    import torch

    records = []
    for run in args.runs:
        v = read_run(run)
        pairs = list(zip(v["attention/seconds"], v["attention/validation_seconds"]))
        ratio = sum(s / val for s, val in pairs) / len(pairs)
        stats_only = v["attention/stats_seconds"]
        ratio_stats = (sum(s / val for s, (_, val) in zip(stats_only, pairs)) / len(pairs)) if stats_only else None
        records.append({"run": str(run), "recordings": len(pairs),
                        "ratio_per_recording_without_figures": ratio_stats,
                        "callback_seconds_mean": sum(s for s, _ in pairs) / len(pairs),
                        "validation_seconds_mean": sum(val for _, val in pairs) / len(pairs),
                        "ratio_per_recording": ratio, "every_n_epochs": args.every_n_epochs,
                        "ratio_amortised": ratio / args.every_n_epochs})
    meta = {"machine": platform.processor() or platform.machine(), "cpus": __import__("os").cpu_count(),
            "torch": torch.__version__, "lightning": lightning.__version__}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "runs": records}, indent=1) + "\n")
    for r in records:
        print(f"{r['run']}: callback {r['callback_seconds_mean']:.2f} s vs validation "
              f"{r['validation_seconds_mean']:.2f} s = {100 * r['ratio_per_recording']:.0f}% per recording, "
              f"{100 * r['ratio_amortised']:.1f}% amortised at k={r['every_n_epochs']}")


if __name__ == "__main__":
    main()
