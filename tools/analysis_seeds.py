"""Mean and spread over seeds of ``mmlight analyze`` outputs: one Markdown table of the layer-mean
statistics and one of the robustness results, one row per run with its seed suffix removed.

    python tools/analysis_seeds.py docs/analysis/digits runs/analysis/digits_s1 runs/analysis/digits_s2

Each directory is one ``mmlight analyze --out DIR`` (``stats.csv``, optionally ``robustness.csv``);
its checkpoints are labelled by run name, and ``--seed_suffix`` (a regex, ``_s\\d+$`` by default) is
cut from the labels to group the same run across seeds. Printed as ``mean ± std (n)``, the standard
deviation over seeds with ddof = 0 (as ``mmlight collect``).
"""

from __future__ import annotations

import argparse
import csv
import re
import statistics
from collections import defaultdict
from pathlib import Path

COLUMNS = (
    "entropy",
    "normalized_entropy",
    "multimodality",
    "sparsity",
    "frac_below_1e-3",
    "frac_zero",
    "max_weight",
    "token_similarity",
    "rollout_discrepancy",
    "sink_ratio",
)


def layer_means(stats_csv: Path) -> dict[str, dict[str, float]]:
    """``{checkpoint: {metric: mean over layers}}`` from the per-layer rows (empty ``head``)."""
    values: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    with open(stats_csv, newline="") as f:
        for row in csv.DictReader(f):
            if row["head"] == "" and row["value"] != "":
                values[row["checkpoint"]][row["metric"]].append(float(row["value"]))
    return {ckpt: {m: statistics.fmean(v) for m, v in metrics.items()} for ckpt, metrics in values.items()}


def robustness(robustness_csv: Path) -> dict[str, dict[str, float]]:
    """``{checkpoint: {"intervention level": value}}``."""
    found: dict[str, dict[str, float]] = defaultdict(dict)
    with open(robustness_csv, newline="") as f:
        for row in csv.DictReader(f):
            found[row["checkpoint"]][f"{row['intervention']} {row['level']}"] = float(row["value"])
    return found


def over_seeds(per_dir: list[dict[str, dict[str, float]]], suffix: str) -> dict[str, dict[str, list[float]]]:
    """``{run: {key: [value per seed]}}``, runs grouped by their label without the seed suffix."""
    grouped: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for tables in per_dir:
        for label, values in tables.items():
            for key, value in values.items():
                grouped[re.sub(suffix, "", label)][key].append(value)
    return grouped


def cell(values: list[float], scale: float = 1.0) -> str:
    mean, std = statistics.fmean(values) * scale, statistics.pstdev(values) * scale
    return f"{mean:.3g} ± {std:.2g} ({len(values)})"


def markdown(grouped: dict[str, dict[str, list[float]]], columns: list[str]) -> str:
    lines = ["| run | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for run, values in grouped.items():
        lines.append(f"| {run} | " + " | ".join(cell(values[c]) if values.get(c) else "" for c in columns) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dirs", nargs="+", type=Path, help="mmlight analyze output directories, one per seed")
    parser.add_argument("--seed_suffix", default=r"_s\d+$", help="regex cut from checkpoint labels")
    args = parser.parse_args(argv)
    for d in args.dirs:
        if not (d / "stats.csv").is_file():
            raise SystemExit(f"{d} has no stats.csv: not an `mmlight analyze --out` directory")
    stats = over_seeds([layer_means(d / "stats.csv") for d in args.dirs], args.seed_suffix)
    print("Layer means, mean ± std over seeds (n seeds):\n")
    print(markdown(stats, list(COLUMNS)))
    tables = [robustness(d / "robustness.csv") for d in args.dirs if (d / "robustness.csv").is_file()]
    if tables:
        grouped = over_seeds(tables, args.seed_suffix)
        keys = list(dict.fromkeys(k for values in grouped.values() for k in values))
        print("\nRobustness (the task metric), mean ± std over seeds (n seeds):\n")
        print(markdown(grouped, keys))


if __name__ == "__main__":
    main()
