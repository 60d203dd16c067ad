"""benchmarks/attention_stats_cost.py: the loop's wait over the validation time, from TensorBoard
events written here with known values."""

import json
import sys
from pathlib import Path

import pytest
from torch.utils.tensorboard import SummaryWriter

from benchmarks import attention_stats_cost

ROOT = Path(__file__).resolve().parents[1]


def run_script(monkeypatch, *args: str) -> None:
    monkeypatch.setattr(sys, "argv", ["attention_stats_cost.py", *args])
    attention_stats_cost.main()


def test_cost_is_the_loops_wait_over_validation(tmp_path, monkeypatch):
    run = tmp_path / "run" / "version_0"
    writer = SummaryWriter(run)
    for step, seconds in enumerate([0.5, 0.25, 0.75]):
        writer.add_scalar("attention/validation_seconds", seconds * 4, step)  # 2 + 1 + 3 = 6 s
    for step, seconds in enumerate([0.1, 0.2]):
        writer.add_scalar("attention/seconds", seconds, step)
        writer.add_scalar("attention/reduce_seconds", 1.0, step)  # off the loop: not in the ratio
        writer.add_scalar("attention/figure_seconds", 2.0, step)
    writer.add_scalar("attention/final_wait_seconds", 0.3, 9)
    writer.close()
    out = tmp_path / "cost.json"
    run_script(monkeypatch, str(run), "--out", str(out))
    record = json.loads(out.read_text())["runs"][0]
    assert record["validation_epochs"] == 3 and record["recordings"] == 2
    assert record["callback_seconds"] == pytest.approx(0.1 + 0.2 + 0.3)
    assert record["ratio"] == pytest.approx(0.6 / 6.0)
    assert record["reduce_seconds"] == pytest.approx(2.0) and record["figure_seconds"] == pytest.approx(4.0)


def test_a_run_without_the_callback_is_named(tmp_path, monkeypatch):
    writer = SummaryWriter(tmp_path / "run")
    writer.add_scalar("val/loss", 1.0, 0)
    writer.close()
    with pytest.raises(SystemExit, match="was not trained with AttentionStats"):
        run_script(monkeypatch, str(tmp_path / "run"), "--out", str(tmp_path / "c.json"))
