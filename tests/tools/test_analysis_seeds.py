"""tools/analysis_seeds.py: seeds grouped by label, layer means and the spread against NumPy."""

import csv
from pathlib import Path

import numpy as np
import pytest

from tools import analysis_seeds

ROOT = Path(__file__).resolve().parents[2]


def write(path: Path, header, rows) -> None:
    path.mkdir(parents=True, exist_ok=True)
    with open(path / ("stats.csv" if "layer" in header else "robustness.csv"), "w", newline="") as f:
        csv.writer(f).writerows([header, *rows])


def test_layer_means_over_seeds_against_numpy(tmp_path, capsys):
    entropy = {0: {"run_a_s0": [1.0, 2.0], "run_b_s0": [0.5, 0.7]}, 1: {"run_a_s1": [1.4, 2.6], "run_b_s1": [0.1, 0.3]}}
    for seed, runs in entropy.items():
        rows = []
        for label, layers in runs.items():
            for i, v in enumerate(layers):
                rows.append((label, f"blocks.{i}", "", "entropy", v))
                rows.append((label, f"blocks.{i}", 0, "entropy", 99.0))  # per-head rows never count
            rows.append((label, "blocks.0", "", "sink_ratio", ""))  # an empty value is skipped
        write(tmp_path / f"s{seed}", ("checkpoint", "layer", "head", "metric", "value"), rows)
        write(
            tmp_path / f"s{seed}",
            ("checkpoint", "intervention", "level", "metric", "value"),
            [(label, "none", 0, "top1", 0.9 - 0.1 * seed) for label in runs],
        )
    grouped = analysis_seeds.over_seeds(
        [analysis_seeds.layer_means(tmp_path / f"s{s}" / "stats.csv") for s in (0, 1)], r"_s\d+$"
    )
    assert set(grouped) == {"run_a", "run_b"}
    assert grouped["run_a"]["entropy"] == pytest.approx([1.5, 2.0])
    means = np.array(grouped["run_b"]["entropy"])
    assert analysis_seeds.cell(list(means)) == f"{means.mean():.3g} ± {means.std(ddof=0):.2g} (2)"
    assert "sink_ratio" not in grouped["run_a"]

    analysis_seeds.main([str(tmp_path / "s0"), str(tmp_path / "s1")])
    out = capsys.readouterr().out
    assert "| run_a | 1.75 ± 0.25 (2) |" in out  # entropy: layer means 1.5 and 2.0
    assert "| run_b | 0.4 ± 0.2 (2) |" in out  # 0.6 and 0.2
    assert "| run_a | 0.85 ± 0.05 (2) |" in out  # robustness 'none 0'


def test_a_directory_without_stats_is_named(tmp_path):
    with pytest.raises(SystemExit, match="has no stats.csv"):
        analysis_seeds.main([str(tmp_path)])
