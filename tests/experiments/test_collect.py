"""``mmlight collect`` on run directories written here by hand (no training, no subprocess): each
run's ``fit/final_metrics.json`` (and ``validate/`` or ``test/`` ones) in the layout that
:mod:`mmlight.experiments.table` documents, failures recorded with ``write_status``. The expected
means and standard deviations are computed here with NumPy (population std, ddof=0) from the values
written; the expected Markdown and CSV are spelled out in full."""

import csv
import json
import statistics
from pathlib import Path

import numpy as np
import pytest

from mmlight.commands import collect
from mmlight.experiments.table import load_table, write_status


def write_table(tmp_path: Path, text: str, name: str = "t") -> Path:
    """A table file ``<tmp>/<name>.yaml`` next to an (empty) base config."""
    (tmp_path / "base.yaml").write_text("seed_everything: 0\n")
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return path


def record(path: Path, rec: dict) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "final_metrics.json").write_text(json.dumps(rec))


def write_fit(
    run_dir: Path,
    metrics: dict[str, float],
    *,
    step: int = 10,
    global_step: int = 10,
    best: str | None = None,
    last: str | None = None,
) -> dict:
    """fit's final_metrics.json as FinalMetrics writes it; each metric logged at ``step``."""
    fit = run_dir / "fit"
    checkpoints = {
        "best": best or str(fit / "checkpoints" / "best-0-5.ckpt"),
        "last": last or str(fit / "checkpoints" / "last.ckpt"),
    }
    rec = {
        "stage": "fit",
        "global_step": global_step,
        "epoch": 1,
        "checkpoint": None,
        "checkpoints": checkpoints,
        "metrics": {name: {"value": value, "step": step, "epoch": 1} for name, value in metrics.items()},
    }
    record(fit, rec)
    return rec


def write_eval(run_dir: Path, stage: str, metrics: dict[str, float], checkpoint: str) -> None:
    """A validate/ or test/ final_metrics.json of ``checkpoint``."""
    record(
        run_dir / stage,
        {
            "stage": stage,
            "global_step": 10,
            "epoch": 1,
            "checkpoint": checkpoint,
            "metrics": {name: {"value": value, "step": 10, "epoch": 1} for name, value in metrics.items()},
        },
    )


# A table with every case in one grid: complete cells, a missing seed, a failed and an unfinished
# run, a cell with another metric and scale, a cell with no run at all, rows without some columns,
# paper numbers as a number with paper_std, as per-run lists, and as a one-run list.
GRID = """\
title: Demo grid
config: base.yaml
seeds: [0, 1, 2]
metric: val/acc
checkpoint: last
scale: 100
digits: 2
{extra}
cells:
  a: {{row: R1, column: C1, paper: 50.0, paper_std: 1.5}}
  b: {{row: R1, column: C2, paper: [40.0, 42.0, 47.0]}}
  c: {{row: R2, column: C1}}
  d: {{row: R2, column: C2, paper: [61.0]}}
  e: {{row: R3, column: C1}}
  f: {{row: R3, column: C3, metric: val/loss, scale: 1}}
  g: {{row: R3, column: C4}}
"""
# the value each run's fit records (None: no metrics file); before the table's scale of 100 (f: 1)
VALUES = {
    "a": [0.5, 0.625, 0.75],
    "b": [0.8, 0.9, 0.85],
    "c": [0.9, 0.95, None],
    "d": [0.3, None, None],
    "e": [0.25, 0.25, 0.25],
    "f": [2.0, 3.0, 4.0],
    "g": [None, None, None],
}


@pytest.fixture
def grid(tmp_path):
    """GRID's runs under ``<tmp>/runs``: c/seed2 and g never started, d/seed1 failed (log recorded),
    d/seed2 started (its fit folder exists) but has no result yet."""

    def make(extra: str = ""):
        path = write_table(tmp_path, GRID.format(extra=extra))
        out = tmp_path / "runs"
        for cell, values in VALUES.items():
            metric = "val/loss" if cell == "f" else "val/acc"
            for seed, value in enumerate(values):
                if value is not None:
                    write_fit(out / "t" / cell / f"seed{seed}", {metric: value})
        write_status(out / "t" / "d" / "seed1", status="failed", step="fit", returncode=1, log="/logs/d1.out")
        (out / "t" / "d" / "seed2" / "fit").mkdir(parents=True)
        return path, out

    return make


def scaled(cell: str) -> list[float]:
    return [v * (1 if cell == "f" else 100) for v in VALUES[cell] if v is not None]


def test_gather_groups_values_and_statuses_by_cell_in_seed_order(grid):
    path, out = grid()
    results = collect.gather(load_table(path), out)
    assert [r.cell.name for r in results] == list("abcdefg")
    assert [run.seed for run in results[0].runs] == [0, 1, 2]
    assert results[0].values == pytest.approx([50.0, 62.5, 75.0])
    assert results[2].values[:2] == pytest.approx([90.0, 95.0]) and results[2].values[2] is None
    assert results[3].statuses == ["done", "failed", "unfinished"]
    assert results[2].statuses == ["done", "done", "missing"]
    assert results[6].statuses == ["missing"] * 3 and results[6].values == [None] * 3
    assert results[5].values == [2.0, 3.0, 4.0]  # its own metric, scale 1


def test_mean_and_population_std_per_cell_match_numpy(grid):
    """mean and std (ddof=0) of the finished seeds against NumPy; no std from a single run, neither
    from none."""
    path, out = grid()
    results = {r.cell.name: r for r in collect.gather(load_table(path), out)}
    for name in "abcef":
        mine = scaled(name)
        assert results[name].finished == pytest.approx(mine)
        assert results[name].mean == pytest.approx(np.mean(mine), abs=1e-12)
        assert results[name].std == pytest.approx(np.std(mine, ddof=0), abs=1e-12)
    assert results["a"].std != pytest.approx(np.std(scaled("a"), ddof=1))  # population, not sample
    assert (results["d"].mean, results["d"].std) == (pytest.approx(30.0), None)
    assert (results["g"].mean, results["g"].std, results["g"].finished) == (None, None, [])


def test_markdown_layout_bold_best_notes_and_paper(grid):
    """The whole written table: one row per row label and one column per column label in file order,
    an empty entry where a row lacks a column, the best mean among the cells with every seed done in
    bold per column (c's higher mean is incomplete), notes on the missing seeds, the paper's mean and
    std (a's given, b's from its three runs: mean 43, pstdev sqrt(26/3)), and each run without a
    result listed with its recorded log."""
    path, out = grid()
    table = load_table(path)
    assert table.higher_is_better
    text = collect.markdown(table, collect.gather(table, out), "mmlight collect t.yaml")
    # the expected numbers, computed independently
    assert f"{np.std([50, 62.5, 75]):.2f}" == "10.21" and f"{np.std([80, 90, 85]):.2f}" == "4.08"
    assert f"{np.std([40, 42, 47]):.2f}" == "2.94" and f"{np.std([2, 3, 4]):.2f}" == "0.82"
    d = out / "t"
    assert text == (
        "# Demo grid\n"
        "\n"
        "val/acc x 100, val/loss from the last checkpoint; mean ± std (population, ddof=0) over seeds [0, 1, 2]; "
        "the paper's numbers after `paper`; the best complete mean of each column in bold. "
        "Written by `mmlight collect t.yaml`.\n"
        "\n"
        "| | C1 | C2 | C3 | C4 |\n"
        "|---|---|---|---|---|\n"
        "| R1 | **62.50 ± 10.21** · paper 50.00 ± 1.50 | **85.00 ± 4.08** · paper 43.00 ± 2.94 |  |  |\n"
        "| R2 | 92.50 ± 2.50 (2/3; missing: seed 2) "
        "| 30.00 (1/3; failed: seed 1; unfinished: seed 2) · paper 61.00 |  |  |\n"
        "| R3 | 25.00 ± 0.00 |  | **3.00 ± 0.82** | — (0/3; missing: seed 0, 1, 2) |\n"
        "\n"
        "Runs without a result:\n"
        "\n"
        f"- c/seed2: missing — {d / 'c' / 'seed2'}\n"
        f"- d/seed1: failed (log: /logs/d1.out) — {d / 'd' / 'seed1'}\n"
        f"- d/seed2: unfinished — {d / 'd' / 'seed2'}\n"
        f"- g/seed0: missing — {d / 'g' / 'seed0'}\n"
        f"- g/seed1: missing — {d / 'g' / 'seed1'}\n"
        f"- g/seed2: missing — {d / 'g' / 'seed2'}\n"
    )


def test_lower_is_better_bolds_the_smallest_complete_mean(grid):
    """higher_is_better: false: C1's best complete mean is e's 25 (a's 62.5 is not bold); C2 and C3
    have one complete cell each."""
    path, out = grid("higher_is_better: false")
    table = load_table(path)
    assert not table.higher_is_better
    rows = collect.markdown(table, collect.gather(table, out), "x").splitlines()
    assert rows[6] == "| R1 | 62.50 ± 10.21 · paper 50.00 ± 1.50 | **85.00 ± 4.08** · paper 43.00 ± 2.94 |  |  |"
    assert rows[8] == "| R3 | **25.00 ± 0.00** |  | **3.00 ± 0.82** | — (0/3; missing: seed 0, 1, 2) |"


def test_csv_has_every_column_and_cells_in_file_order(grid):
    """Every CSV column against NumPy and the values written: n, mean, std (ddof=0, empty for one
    run), min, max, the paper's mean and std, each seed's value or its status; six decimals."""
    path, out = grid()
    table = load_table(path)
    csv_path = out / "t.csv"
    collect.write_csv(csv_path, table, collect.gather(table, out))
    rows = list(csv.reader(open(csv_path, newline="")))

    def six(x):
        return f"{x:.6f}"

    a, b, c = scaled("a"), scaled("b"), scaled("c")
    assert rows == [
        ["cell", "row", "column", "n", "mean", "std", "min", "max", "paper", "paper_std", "seed0", "seed1", "seed2"],
        [
            "a",
            "R1",
            "C1",
            "3",
            six(np.mean(a)),
            six(np.std(a)),
            six(min(a)),
            six(max(a)),
            "50.000000",
            "1.500000",
            *map(six, a),
        ],
        [
            "b",
            "R1",
            "C2",
            "3",
            six(np.mean(b)),
            six(np.std(b)),
            six(min(b)),
            six(max(b)),
            "43.000000",
            six(np.std([40, 42, 47])),
            *map(six, b),
        ],
        ["c", "R2", "C1", "2", "92.500000", "2.500000", "90.000000", "95.000000", "", "", *map(six, c), "missing"],
        [
            "d",
            "R2",
            "C2",
            "1",
            "30.000000",
            "",
            "30.000000",
            "30.000000",
            "61.000000",
            "",
            "30.000000",
            "failed",
            "unfinished",
        ],
        ["e", "R3", "C1", "3", "25.000000", "0.000000", "25.000000", "25.000000", "", "", *["25.000000"] * 3],
        [
            "f",
            "R3",
            "C3",
            "3",
            "3.000000",
            six(np.std([2, 3, 4])),
            "2.000000",
            "4.000000",
            "",
            "",
            "2.000000",
            "3.000000",
            "4.000000",
        ],
        ["g", "R3", "C4", "0", "", "", "", "", "", "", "missing", "missing", "missing"],
    ]
    assert rows[1][5] == "10.206207"  # sqrt(312.5 / 3)


def test_min_and_max_are_of_the_finished_runs_in_any_order(tmp_path):
    """min and max are not the first and last seed: values 0.7, 0.2, 0.9 give 20 and 90."""
    path = write_table(
        tmp_path, "config: base.yaml\nseeds: [0, 1, 2]\nmetric: val/acc\ncheckpoint: last\nscale: 100\ncells: {a: {}}\n"
    )
    for seed, value in enumerate([0.7, 0.2, 0.9]):
        write_fit(tmp_path / "runs" / "t" / "a" / f"seed{seed}", {"val/acc": value})
    table = load_table(path)
    collect.write_csv(tmp_path / "t.csv", table, collect.gather(table, tmp_path / "runs"))
    row = next(csv.DictReader(open(tmp_path / "t.csv")))
    assert (row["min"], row["max"]) == ("20.000000", "90.000000")


@pytest.mark.parametrize(
    "paper, paper_std, expected",
    [
        (28.7, None, (28.7, None)),
        (28.7, 0.16, (28.7, 0.16)),
        ([1.0, 2.0, 6.0], None, (3.0, statistics.pstdev([1.0, 2.0, 6.0]))),  # pstdev: sqrt(14/3)
        ([1.0, 2.0, 6.0], 0.5, (3.0, 0.5)),  # the paper's own std wins over the runs'
        ([4.5], None, (4.5, None)),
        ([1.0, 4.0], None, (2.5, 1.5)),  # two runs have a std
        (None, None, (None, None)),
    ],
)
def test_paper_value_is_a_number_or_the_mean_and_pstdev_of_the_paper_runs(paper, paper_std, expected, tmp_path):
    text = "config: base.yaml\nmetric: val/acc\ncells:\n  a: {}\n"
    cell = load_table(write_table(tmp_path, text)).cells[0]
    cell.paper, cell.paper_std = paper, paper_std
    mean, std = collect.paper_value(cell)
    for got, want in ((mean, expected[0]), (std, expected[1])):
        assert got is None if want is None else got == pytest.approx(want)
    if isinstance(paper, list) and len(paper) == 3 and paper_std is None:
        assert std == pytest.approx(np.std([1.0, 2.0, 6.0]))  # the same reference by NumPy


def test_paper_list_and_paper_std_parsed_from_the_table_file(tmp_path):
    path = write_table(
        tmp_path, "config: base.yaml\nmetric: val/acc\ndigits: 1\ncells: {a: {paper: [10, 12], paper_std: 0.25}}\n"
    )
    table = load_table(path)
    assert collect.paper_value(table.cells[0]) == (11.0, 0.25)
    text = collect.markdown(table, collect.gather(table, tmp_path / "runs"), "x")
    assert "| a | — (0/1; missing: seed 0) · paper 11.0 ± 0.2 |" in text  # 0.25 -> "0.2" (round half to even)


def test_digits_and_scale(tmp_path):
    """digits: 3 and a cell's own scale (1000) over the table's (100): 0.5 and 0.75 -> 500 and 750,
    mean 625 ± 125 in three decimals; the header names the scale."""
    path = write_table(
        tmp_path,
        "config: base.yaml\nseeds: [0, 1]\nmetric: val/acc\ncheckpoint: last\n"
        "scale: 100\ndigits: 3\ncells: {a: {scale: 1000}, b: {}}\n",
    )
    out = tmp_path / "runs"
    for seed, value in enumerate([0.5, 0.75]):
        write_fit(out / "t" / "a" / f"seed{seed}", {"val/acc": value})
        write_fit(out / "t" / "b" / f"seed{seed}", {"val/acc": value})
    table = load_table(path)
    lines = collect.markdown(table, collect.gather(table, out), "x").splitlines()
    assert lines[2].startswith("val/acc x 1000, val/acc x 100 from the last checkpoint; ")
    assert lines[2].endswith("over seeds [0, 1]; the best complete mean of each column in bold. Written by `x`.")
    assert lines[4:] == ["| | val/acc |", "|---|---|", "| a | **625.000 ± 125.000** |", "| b | 62.500 ± 12.500 |"]


def test_scale_one_is_not_named_and_digits_zero(tmp_path):
    path = write_table(tmp_path, "config: base.yaml\nseeds: [0, 1]\nmetric: test/bleu\ndigits: 0\ncells: {a: {}}\n")
    out = tmp_path / "runs"
    for seed, value in enumerate([27.25, 28.75]):
        fit = write_fit(out / "t" / "a" / f"seed{seed}", {})
        write_eval(out / "t" / "a" / f"seed{seed}", "test", {"test/bleu": value}, fit["checkpoints"]["best"])
    table = load_table(path)
    lines = collect.markdown(table, collect.gather(table, out), "x").splitlines()
    assert lines[2].startswith("test/bleu from the best checkpoint; ")
    assert lines[6] == "| a | **28 ± 1** |"  # mean 28.0, std 0.75


def test_metric_from_the_last_checkpoint_needs_a_validation_at_the_final_step(tmp_path):
    """checkpoint: last. fit's own value counts when logged at the final step (a); a value logged
    before it (b: step 8 of 10) does not, unless validate/ evaluated the last checkpoint (c: the
    path written differently, same file); an evaluation of another checkpoint (d) does not count;
    an evaluation of the last checkpoint wins over fit's own value (e)."""
    path = write_table(
        tmp_path, "config: base.yaml\nmetric: val/acc\ncheckpoint: last\ncells: {a: {}, b: {}, c: {}, d: {}, e: {}}\n"
    )
    out = tmp_path / "runs"
    write_fit(out / "t" / "a" / "seed0", {"val/acc": 0.5})
    write_fit(out / "t" / "b" / "seed0", {"val/acc": 0.5}, step=8)
    fit = write_fit(out / "t" / "c" / "seed0", {"val/acc": 0.5}, step=8)
    last = Path(fit["checkpoints"]["last"])
    write_eval(
        out / "t" / "c" / "seed0",
        "validate",
        {"val/acc": 0.625},
        str(last.parent / ".." / last.parent.name / last.name),
    )
    fit = write_fit(out / "t" / "d" / "seed0", {"val/acc": 0.5}, step=8)
    write_eval(out / "t" / "d" / "seed0", "validate", {"val/acc": 0.625}, fit["checkpoints"]["best"])
    fit = write_fit(out / "t" / "e" / "seed0", {"val/acc": 0.5})
    write_eval(out / "t" / "e" / "seed0", "validate", {"val/acc": 0.75}, fit["checkpoints"]["last"])
    results = collect.gather(load_table(path), out)
    assert [r.values[0] for r in results] == [0.5, None, 0.625, None, 0.75]
    assert [r.statuses[0] for r in results] == ["done", "unfinished", "done", "unfinished", "done"]


def test_metric_from_the_best_checkpoint_is_read_from_the_evaluation_of_that_checkpoint(tmp_path):
    """checkpoint: best, a test/* metric: fit's own value never counts (a, even at the final step);
    test/ of the best checkpoint does (b); test/ of the last one does not (c), nor a validate/
    folder (d), nor test/ without the metric (e)."""
    path = write_table(
        tmp_path, "config: base.yaml\nmetric: test/acc\nscale: 10\ncells: {a: {}, b: {}, c: {}, d: {}, e: {}}\n"
    )
    out = tmp_path / "runs"
    write_fit(out / "t" / "a" / "seed0", {"test/acc": 0.5})
    for cell, stage, checkpoint, metric in [
        ("b", "test", "best", "test/acc"),
        ("c", "test", "last", "test/acc"),
        ("d", "validate", "best", "test/acc"),
        ("e", "test", "best", "test/f1"),
    ]:
        fit = write_fit(out / "t" / cell / "seed0", {})
        write_eval(out / "t" / cell / "seed0", stage, {metric: 0.25}, fit["checkpoints"][checkpoint])
    results = collect.gather(load_table(path), out)
    assert [r.values[0] for r in results] == [None, 2.5, None, None, None]


def test_an_evaluation_without_a_recorded_checkpoint_does_not_count(tmp_path):
    """A test/ record whose checkpoint is null (or fit recorded no best) is not the best checkpoint's."""
    path = write_table(tmp_path, "config: base.yaml\nmetric: test/acc\ncells: {a: {}, b: {}}\n")
    out = tmp_path / "runs"
    fit = write_fit(out / "t" / "a" / "seed0", {})
    write_eval(out / "t" / "a" / "seed0", "test", {"test/acc": 0.25}, None)
    fit = write_fit(out / "t" / "b" / "seed0", {})
    fit["checkpoints"] = {"best": None, "last": fit["checkpoints"]["last"]}
    record(out / "t" / "b" / "seed0" / "fit", fit)
    write_eval(out / "t" / "b" / "seed0", "test", {"test/acc": 0.25}, None)
    assert [r.values[0] for r in collect.gather(load_table(path), out)] == [None, None]


def test_status_file_done_without_metrics_is_unfinished_and_failed_without_log_shows_none(tmp_path):
    """A recorded ``done`` whose metrics are gone is ``unfinished``; a failure recorded without a log
    (``sweep --failed`` without ``--log``) is listed without one."""
    path = write_table(tmp_path, "config: base.yaml\nseeds: [0, 1]\nmetric: val/acc\ncells: {a: {}}\n")
    out = tmp_path / "runs"
    write_status(out / "t" / "a" / "seed0", status="done", log="/l/0.log")
    write_status(out / "t" / "a" / "seed1", status="failed", step="slurm", returncode=3, log=None)
    table = load_table(path)
    results = collect.gather(table, out)
    assert results[0].statuses == ["unfinished", "failed"]
    lines = collect.markdown(table, results, "x").splitlines()
    assert lines[-2:] == [
        f"- a/seed0: unfinished (log: /l/0.log) — {out / 't' / 'a' / 'seed0'}",
        f"- a/seed1: failed — {out / 't' / 'a' / 'seed1'}",
    ]
    assert lines[6] == "| a | — (0/2; unfinished: seed 0; failed: seed 1) |"


def test_main_writes_both_files_and_prints_the_table_and_a_summary(grid, capsys):
    """``mmlight collect TABLE --out DIR``: DIR/<table>.md and .csv, the Markdown printed, then how
    many runs have a result (15 of GRID's 21: a, b, e, f 3 each, c 2, d 1)."""
    path, out = grid()
    collect.main([str(path), "--out", str(out)])
    printed = capsys.readouterr().out
    md, csv_path = out / "t.md", out / "t.csv"
    text = md.read_text()
    assert f"Written by `mmlight collect {path} --out {out}`." in text
    table = load_table(path)
    assert text == collect.markdown(table, collect.gather(table, out), f"mmlight collect {path} --out {out}")
    assert printed == text + f"\n15/21 runs have a result; wrote {md} and {csv_path}\n"
    assert [row["cell"] for row in csv.DictReader(open(csv_path))] == list("abcdefg")


def test_main_default_out_is_runs_tables_and_not_named(tmp_path, capsys, monkeypatch):
    """Without --out: runs/tables under the working directory (created), the command without --out."""
    path = write_table(tmp_path, "config: base.yaml\nmetric: val/acc\ncells: {a: {}}\n")
    monkeypatch.chdir(tmp_path)
    collect.main(["t.yaml"])
    text = (tmp_path / "runs" / "tables" / "t.md").read_text()
    assert "Written by `mmlight collect t.yaml`." in text
    assert (tmp_path / "runs" / "tables" / "t.csv").is_file()
    assert capsys.readouterr().out.endswith(
        f"\n0/1 runs have a result; wrote {Path('runs/tables/t.md')} and {Path('runs/tables/t.csv')}\n"
    )
    assert path.is_file()


def test_main_stops_with_the_table_error(tmp_path):
    with pytest.raises(SystemExit, match=r"^mmlight collect: table file .*nope.yaml not found$"):
        collect.main([str(tmp_path / "nope.yaml"), "--out", str(tmp_path)])
    path = write_table(tmp_path, "config: base.yaml\nmetric: val/acc\ncells: {a: {}}\n")
    (tmp_path / "runs" / "t" / "a" / "seed0" / "fit").mkdir(parents=True)
    (tmp_path / "runs" / "t" / "a" / "seed0" / "fit" / "final_metrics.json").write_text("{not json")
    with pytest.raises(
        SystemExit,
        match=r"^mmlight collect: .*final_metrics.json is not valid JSON .*; "
        r"delete it to re-run that step$",
    ):
        collect.main([str(path), "--out", str(tmp_path / "runs")])
    assert not (tmp_path / "runs" / "t.md").exists()


def test_mean_std_and_fmt():
    """The text of one value: '—' for none, the std after ±, digits decimals."""
    assert collect.mean_std(None, None, 2) == "—"
    assert collect.mean_std(1.23456, None, 3) == "1.235"
    assert collect.mean_std(1.0, 0.125, 1) == "1.0 ± 0.1"
    assert collect.fmt(None, 2) == "" and collect.fmt(2.0, 0) == "2"


def test_help_describes_the_options(capsys, monkeypatch):
    """``mmlight collect --help``: usage, the docstring's first paragraph, each option's help."""
    monkeypatch.setenv("COLUMNS", "300")
    with pytest.raises(SystemExit) as info:
        collect.main(["--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert text.startswith(
        "usage: mmlight collect [-h] [--out OUT] table ``mmlight collect TABLE``: the table of a "
        "sweep, from each run's ``final_metrics.json``. "
    )
    assert " ``final_metrics.json``. positional arguments: table a table file, e.g. configs/tables/table4.yaml " in text
    assert text.endswith(" --out OUT root of the run directories and of the written table")
