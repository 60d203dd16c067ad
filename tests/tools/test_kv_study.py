"""tools/kv_study.py: each seed's numbers read back from an analysis folder, and their spread over seeds
against NumPy (recall's metric under eviction over the solved runs only)."""

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from mmlight.experiments.table import Cell
from tools import kv_study


def write(path: Path, header, rows) -> None:
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows([header, *rows])


def analysis_folder(folder: Path, acc: dict[int, float], loss: dict[int, float]) -> None:
    """An ``mmlight analyze`` folder of two seeds: plain and l2 at r = 0.5 for the metric; the attention
    loss of l2 at 0.5 per layer and pooled; key-norm correlations; Q-filter stability."""
    folder.mkdir(parents=True)
    robustness = []
    for seed, value in acc.items():
        robustness += [(f"seed{seed}", "none", 0, "acc", value), (f"seed{seed}", "sink_masking", 1, "acc", 0.0)]
        robustness.append((f"seed{seed}", "kv_l2", 0.5, "acc", value / 2))
    write(folder / "robustness.csv", ("checkpoint", "intervention", "level", "metric", "value"), robustness)
    losses = []
    for seed, value in loss.items():
        losses.append((f"seed{seed}", "kv_l2", 0.5, 0.5, 1, 10, 99.0, 99.0))  # a layer's row is not read
        losses.append((f"seed{seed}", "kv_l2", 0.5, 0.5, "all", 20, value, value / 4))
    write(
        folder / "kv_attention_loss.csv",
        (
            "checkpoint",
            "intervention",
            "keep_ratio",
            "compression_ratio",
            "layer",
            "rows",
            "attention_loss",
            "oracle_loss",
        ),
        losses,
    )
    norms = [(f"seed{s}", "decoder.layers.0.self_attn", 30, -0.1 * (s + 1), "") for s in acc]
    write(folder / "key_norm_attention.csv", ("checkpoint", "layer", "pairs", "pearson", "spearman"), norms)
    (folder / "qfilters.json").write_text(json.dumps({f"seed{s}": {"cosine_mean": 0.9 + 0.01 * s} for s in acc}))


def test_seed_numbers_and_their_spread_against_numpy(tmp_path):
    cell = Cell("recall_softmax", "softmax", "recall", Path("x.yaml"), "val/acc", 100.0)
    analysis_folder(tmp_path / "a", {0: 1.0, 1: 0.8, 2: 0.2}, {0: 0.3, 1: 0.5, 2: 0.4})
    seeds = kv_study.seed_numbers(cell, tmp_path / "a")
    assert seeds[1]["metric"] == {"none": 80.0, "l2@0.5": 40.0}  # scaled; sink masking left out
    assert seeds[2]["loss"] == {"l2@0.5": 0.4} and seeds[2]["oracle"] == {"l2@0.5": 0.1}
    assert seeds[0]["pearson"] == {"decoder.layers.0.self_attn": -0.1} and seeds[0]["spearman"] == {}
    summary = kv_study.summarise(cell, {0: 100.0, 1: 80.0, 2: 20.0}, seeds)
    assert summary["solved"] == [0] and summary["quality_over"] == [0]  # only seed 0 reached 90%
    assert summary["quality"]["l2@0.5"] == pytest.approx((50.0, 0.0))
    losses = np.array([0.3, 0.5, 0.4])
    assert summary["loss"]["l2@0.5"] == pytest.approx((losses.mean(), losses.std(ddof=0)))
    assert summary["oracle"]["l2@0.5"] == pytest.approx((losses.mean() / 4, (losses / 4).std(ddof=0)))
    assert summary["qfilter_cosine"] == pytest.approx((0.91, np.std([0.9, 0.91, 0.92])))
    nmt = Cell("nmt_softmax", "softmax", "nmt", Path("x.yaml"), "val/bleu", 1.0)
    assert kv_study.summarise(nmt, {0: 100.0, 1: 80.0, 2: 20.0}, seeds)["quality_over"] == [0, 1, 2]


def test_each_methods_mean_over_the_keep_ratios_against_numpy():
    """A method's summary over the ratios: each seed's mean over r = 0.9 ... 0.1, then mean ± std over
    seeds; a method without every ratio has none."""
    cell = Cell("recall_ssmax", "ssmax", "recall", Path("x.yaml"), "val/acc", 100.0)
    ratios = kv_study.KEEP_RATIOS[1:]
    losses = {0: [0.1, 0.2, 0.3, 0.4, 0.5], 1: [0.2, 0.2, 0.4, 0.6, 0.9]}
    seeds = {
        s: {
            "metric": {"none": 100.0, **{f"qfilters@{r:g}": 100.0 * (1 - v) for r, v in zip(ratios, values)}},
            "loss": {f"qfilters@{r:g}": v for r, v in zip(ratios, values)} | {"l2@0.5": 0.7},
            "oracle": {},
            "pearson": {},
            "spearman": {},
            "qfilter_cosine": 1.0,
        }
        for s, values in losses.items()
    }
    summary = kv_study.summarise(cell, {0: 100.0, 1: 100.0}, seeds)
    per_seed = np.array([np.mean(v) for v in losses.values()])
    assert summary["loss_over_ratios"] == {"qfilters": pytest.approx((per_seed.mean(), per_seed.std()))}
    assert summary["quality_over_ratios"]["qfilters"] == pytest.approx(
        (100 * (1 - per_seed.mean()), 100 * per_seed.std())
    )


def test_a_report_from_an_earlier_reports_numbers_equals_the_report_from_the_analysis(tmp_path, monkeypatch):
    """``report --earlier``: a cell whose analysis folder is gone keeps the per-seed numbers of the earlier
    ``kv_study.json`` (seeds read back as ints), so its tables and summary are the ones the analysis gave;
    a cell in neither is left out."""
    from types import SimpleNamespace

    analysed = Cell("recall_softmax", "softmax", "recall", Path("x.yaml"), "val/acc", 100.0)
    never = Cell("recall_ssmax", "ssmax", "recall", Path("x.yaml"), "val/acc", 100.0)
    analysis_folder(tmp_path / "runs" / "analysis" / "t" / analysed.name, {0: 1.0, 1: 0.95}, {0: 0.3, 1: 0.5})
    runs = [SimpleNamespace(cell=analysed, seed=s, result=lambda v=v: v) for s, v in ((0, 100.0), (1, 95.0))]
    table = SimpleNamespace(name="t", title="T", path="t.yaml", cells=[analysed, never], runs=lambda root: runs)
    monkeypatch.chdir(tmp_path)
    kv_study.report(table, tmp_path / "runs", tmp_path / "first")
    (tmp_path / "runs" / "analysis" / "t" / analysed.name / "qfilters.json").unlink()  # not analysed any more
    kv_study.report(table, tmp_path / "runs", tmp_path / "again", tmp_path / "first" / "kv_study.json")
    first, again = (json.loads((tmp_path / d / "kv_study.json").read_text()) for d in ("first", "again"))
    assert again == first and set(first["per_seed"]) == {"recall_softmax"}
    assert (tmp_path / "again" / "kv_study.md").read_text() == (tmp_path / "first" / "kv_study.md").read_text()
    assert kv_study.earlier_numbers(tmp_path / "first" / "kv_study.json")["recall_softmax"]["results"] == {
        0: 100.0,
        1: 95.0,
    }
