"""tools/llm_study.py: each seed's perplexity by context multiple, sink ratio and largest massive-activation
ratio read back from an analysis folder, their spread over seeds against NumPy, and the report's row."""

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from mmlight.experiments.table import Cell
from tools import llm_study


def write(path: Path, header, rows) -> None:
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows([header, *rows])


def analysis_folder(folder: Path, ppl: dict[int, list[float]], sink: dict[int, float], ratios: dict[int, list]):
    """An ``mmlight analyze`` folder: whole-window and bucket perplexities per multiple (8x undefined for
    seed 1), a layer's and a head's sink ratio, and each block's massive-activation rows."""
    folder.mkdir(parents=True)
    rows = []
    for seed, values in ppl.items():
        for m, value in zip((1, 2, 4, 8), values):
            rows.append((f"seed{seed}", m, 64 * m, "window", 0, 64 * m, 10, "" if value is None else value))
            rows.append((f"seed{seed}", m, 64 * m, "bucket", 0, 16, 5, 999.0))  # a bucket's row is not read
    header = ("checkpoint", "multiple", "length", "part", "start", "stop", "count", "ppl")
    write(folder / "extrapolation.csv", header, rows)
    stats = [(f"seed{s}", "decoder.layers.0.self_attn", "", "sink_ratio", v) for s, v in sink.items()]
    stats += [(f"seed{s}", "decoder.layers.0.self_attn", 1, "sink_ratio", 7.0) for s in sink]  # per head: not read
    stats += [(f"seed{s}", "decoder.layers.0.self_attn", "", "null_mass", 0.5) for s in sink]
    write(folder / "stats.csv", ("checkpoint", "layer", "head", "metric", "value"), stats)
    massive = []
    for seed, per_block in ratios.items():
        for block, value in enumerate(per_block):
            massive += [(f"seed{seed}", f"block{block}", "ratio", value), (f"seed{seed}", f"block{block}", "top1", 1e6)]
    write(folder / "massive_activations.csv", ("checkpoint", "block", "metric", "value"), massive)


def test_seed_numbers_their_spread_and_the_report(tmp_path, monkeypatch):
    folder = tmp_path / "runs" / "analysis" / "t" / "softmax_gated"
    ppl = {0: [100.0, 120.0, 200.0, 400.0], 1: [110.0, 130.0, 210.0, None]}
    analysis_folder(folder, ppl, {0: 3.0, 1: 5.0}, {0: [2.0, 50.0], 1: [30.0, 10.0]})
    seeds = llm_study.seed_numbers(folder)
    assert seeds[0]["ppl"] == {1: 100.0, 2: 120.0, 4: 200.0, 8: 400.0} and 8 not in seeds[1]["ppl"]
    assert seeds[1]["sink_ratio"] == {"decoder.layers.0.self_attn": 5.0}
    assert seeds[0]["massive_ratio"] == {"block0": 2.0, "block1": 50.0}

    cell = Cell("softmax_gated", "softmax", "headwise gate", Path("x.yaml"), "val/ppl", 1.0)
    summary = llm_study.summarise(cell, seeds)
    assert summary["ppl"][2] == pytest.approx((np.mean([120, 130]), np.std([120, 130])))
    assert summary["ppl"][8] == (400.0, 0.0)  # the one seed where 8x is defined
    assert summary["sink_ratio"]["decoder.layers.0.self_attn"] == pytest.approx((4.0, 1.0))
    assert summary["massive_ratio_max"] == pytest.approx((40.0, 10.0))  # max over blocks, then over seeds

    table = type("T", (), {"name": "t", "title": "T", "path": "t.yaml", "cells": [cell]})()
    monkeypatch.chdir(tmp_path)
    llm_study.report(table, tmp_path / "out")
    row = (tmp_path / "out" / "llm_study.md").read_text().splitlines()[-1]
    want = ["softmax", "headwise gate", "2", "105.0 ± 5.0", "125.0 ± 5.0", "205.0 ± 5.0", "400.0 ± 0.0"]
    assert row == "| " + " | ".join([*want, "4.00 ± 1.00", "40.0 ± 10.0"]) + " |"
    assert (
        json.loads((tmp_path / "out" / "llm_study.json").read_text())["per_seed"]["softmax_gated"]["1"]["ppl"]["1"]
        == 110.0
    )
