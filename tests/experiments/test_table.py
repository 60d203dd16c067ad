"""Table files: every table of the paper parses, has the expected runs, and each cell's command is
accepted by the mmlight config parser; bad table files stop with a message naming the key."""

import json
import sys
from pathlib import Path
from unittest import mock

import pytest

from mmlight.cli import MmlightCLI, build_cli
from mmlight.experiments import sweep
from mmlight.experiments.table import TableError, load_table
from mmlight.models import ReweightingSpec

ROOT = Path(__file__).resolve().parents[2]
TABLES = sorted((ROOT / "configs" / "tables").glob("*.yaml"))
EXPECTED_RUNS = {"table1": 12, "table2": 12, "table3": 3, "table4": 15, "table5": 4, "table6": 6,
                 "cpu_reweighting": 54, "tiny": 4}


def test_every_table_file_is_known():
    assert {path.stem for path in TABLES} == set(EXPECTED_RUNS)


@pytest.mark.parametrize("path", TABLES, ids=lambda p: p.stem)
def test_dry_run_lists_every_run(path, capsys, tmp_path):
    sweep.main([str(path), "--dry_run", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    n = EXPECTED_RUNS[path.stem]
    assert out.rstrip().endswith(f"{n} runs")
    listed = [line for line in out.splitlines() if line.startswith("[")]
    assert len(listed) == n and all("(missing)" in line for line in listed)
    commands = [line.strip() for line in out.splitlines() if line.strip().startswith("mmlight fit")]
    assert len(commands) == n and len(set(commands)) == n  # one distinct command per run
    table = load_table(path)
    folders = {str(run.directory) for run in table.runs(tmp_path)}
    assert len(folders) == n and all(folder in out for folder in folders)


def parsed_config(args: list[str]):
    """The namespace LightningCLI builds from ``mmlight fit ARGS``, without building the classes."""
    with mock.patch.object(MmlightCLI, "instantiate_classes", lambda self: None), mock.patch.object(sys, "argv", ["mmlight"]):
        return build_cli(args, run=False).config


@pytest.mark.slow
@pytest.mark.parametrize("path", TABLES, ids=lambda p: p.stem)
def test_each_cell_parses_and_builds_its_reweighting(path, tmp_path):
    """Each cell's overrides are valid config keys and values, and its reweighting options are
    accepted by the function (checked when the model is built, so build that part here)."""
    table = load_table(path)
    for run in table.runs(tmp_path)[:: len(table.seeds)]:  # one seed per cell: seeds parse alike
        args = run.fit_args()
        assert args[0] == "fit" and args[-2:] == ["--ckpt_path", "last"]
        config = parsed_config(args[1:-2])
        assert config.seed_everything == run.seed
        assert config.trainer.logger.init_args.version == "fit"
        model = config.model.init_args.model
        ReweightingSpec(model.attention.name, model.attention.options).build("reference")
        if "model.init_args.model.attention" in run.cell.overrides:
            assert model.attention.name == run.cell.overrides["model.init_args.model.attention"]["name"]


def test_table5_rows_are_the_ablation():
    cells = {cell.name: cell.overrides for cell in load_table(ROOT / "configs/tables/table5.yaml").cells}
    attention = {name: o.get("model.init_args.model.attention", {"name": "softmax"}) for name, o in cells.items()}
    assert attention["softmax"]["name"] == "softmax"
    assert attention["term1"]["options"] == {"order": 1, "terms": "low"}
    assert attention["terms12"]["options"] == {"order": 1}
    assert attention["second_order"]["options"] == {"order": 2}


def write(tmp_path, text: str) -> Path:
    (tmp_path / "base.yaml").write_text("seed_everything: 0\n")
    path = tmp_path / "t.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("text, match", [
    ("config: base.yaml\nmetric: acc\ncells: {a: {}}\n", r"metric must be a logged val/\* or test/\*"),
    ("config: base.yaml\nmetric: val/acc\ncheckpoint: best_ever\ncells: {a: {}}\n", "checkpoint must be 'best' or 'last'"),
    ("config: base.yaml\nmetric: val/acc\nseeds: [0, 0]\ncells: {a: {}}\n", "seeds must be a non-empty list of distinct"),
    ("config: base.yaml\nmetric: val/acc\ncells: {}\n", "cells must be a non-empty mapping"),
    ("config: missing.yaml\nmetric: val/acc\ncells: {a: {}}\n", "base config 'missing.yaml' not found"),
    ("config: base.yaml\nmetric: val/acc\ncels: {a: {}}\n", r"unknown key\(s\) \['cels'\]"),
    ("config: base.yaml\nmetric: val/acc\ncells: {a: {overides: {}}}\n", r"cell 'a' has unknown key\(s\) \['overides'\]"),
    ("config: base.yaml\nmetric: val/acc\ncells: {a: {overrides: {--x: 1}}}\n", "dotted config keys"),
    ("config: base.yaml\nmetric: val/acc\ncells: {a: {paper: high}}\n", "paper must be a finite number"),
    ("config: base.yaml\nmetric: val/acc\ncells: {a/b: {}}\n", "must be letters, digits"),
    ("config: [base.yaml\n", "not valid YAML"),
])
def test_bad_tables_name_the_problem(tmp_path, text, match):
    with pytest.raises(TableError, match=match):
        load_table(write(tmp_path, text))


def test_bad_command_lines_stop_before_any_run(tmp_path, capsys):
    path = write(tmp_path, "config: base.yaml\nmetric: val/acc\ncells: {a: {}, b: {}}\n")
    with pytest.raises(SystemExit, match=r"no cell 'c'; cells are \['a', 'b'\]"):
        sweep.main([str(path), "--only", "c"])
    with pytest.raises(SystemExit, match=r"task 2 out of range: the table has 2 runs \(0-1\)"):
        sweep.main([str(path), "--task", "2", "--print", "fit"])
    with pytest.raises(SystemExit, match="table file .* not found"):
        sweep.main([str(tmp_path / "nope.yaml"), "--dry_run"])


def test_overrides_become_options_the_parser_reads(tmp_path):
    path = write(tmp_path, "config: base.yaml\nmetric: val/acc\noverrides: {trainer.max_epochs: 3}\n"
                           "cells: {a: {overrides: {model.x: {name: multimax, options: {order: 1}}, trainer.max_epochs: 5, "
                           "model.flag: true, model.none: null}}}\n")
    run = load_table(path).runs(tmp_path / "runs")[0]
    args = run.fit_args(["--data.root", "/d"])
    pairs = dict(zip(args[1::2], args[2::2]))  # after "fit", options come in pairs
    assert json.loads(pairs["--model.x"]) == {"name": "multimax", "options": {"order": 1}}
    assert args.count("--trainer.max_epochs") == 1 and pairs["--trainer.max_epochs"] == "5"  # the cell's wins
    assert pairs["--model.flag"] == "true" and pairs["--model.none"] == "null" and pairs["--data.root"] == "/d"
    assert pairs["--config"] == str(tmp_path / "base.yaml") and pairs["--seed_everything"] == "0"
    logger = json.loads(pairs["--trainer.logger"])["init_args"]
    assert Path(logger["save_dir"]) / logger["name"] / logger["version"] == run.directory / "fit"


def test_a_failed_run_is_reported_with_its_log_and_the_others_go_on(tmp_path, capsys, monkeypatch):
    """With mmlight itself replaced by a stand-in (run a fails, run b writes its metrics), the sweep
    reports a's log, finishes b, records both, and exits with status 1."""
    path = write(tmp_path, "config: base.yaml\nmetric: val/acc\ncheckpoint: last\ncells: {a: {}, b: {}}\n")
    calls = []

    def fake_execute(args, log, threads):
        calls.append(args[0])
        run_dir = Path(args[args.index("--trainer.default_root_dir") + 1])
        if "/a/" in str(run_dir):
            log.write_text("Traceback: the data root does not exist\n")
            return 1
        run_dir.mkdir(parents=True)
        (run_dir / "final_metrics.json").write_text(json.dumps(
            {"stage": "fit", "global_step": 10, "metrics": {"val/acc": {"value": 0.5, "step": 10, "epoch": 0}}}))
        return 0

    monkeypatch.setattr(sweep, "execute", fake_execute)
    with pytest.raises(SystemExit) as exit_info:
        sweep.main([str(path), "--out", str(tmp_path / "runs"), "--parallel", "2"])
    assert exit_info.value.code == 1
    out = capsys.readouterr().out
    assert "[0] a/seed0: FAILED in fit (exit 1)" in out and "Traceback: the data root does not exist" in out
    assert "[1] b/seed0: val/acc = 0.5" in out and "1 run(s) finished, 0 already done, 1 failed" in out
    assert calls == ["fit", "fit"]  # b needs no evaluation: fit validated its final step
    a, b = load_table(path).runs(tmp_path / "runs")
    assert (a.status(), b.status(), b.result()) == ("failed", "done", 0.5)
    assert json.loads((a.directory / "sweep_status.json").read_text())["log"] == str(a.directory / "sweep.log")
    # a second sweep retries only the failed run
    calls.clear()
    with pytest.raises(SystemExit):
        sweep.main([str(path), "--out", str(tmp_path / "runs")])
    assert calls == ["fit"] and "[1] b/seed0: done, skipped" in capsys.readouterr().out
