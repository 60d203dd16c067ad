"""``mmlight collect TABLE``: the table of a sweep, from each run's ``final_metrics.json``.

::

    mmlight collect configs/tables/table4.yaml            # writes runs/tables/table4.md and .csv

Runs are grouped by cell: mean ± standard deviation over the seeds that finished (population std,
ddof = 0, the convention of the paper's Table 6), laid out in the table's rows and columns with the
paper's numbers beside ours. A run without a result is marked ``missing`` (never started),
``unfinished`` (started, no result yet) or ``failed`` (with its log), never dropped silently.
"""

from __future__ import annotations

import argparse
import csv
import statistics
from dataclasses import dataclass
from pathlib import Path

from mmlight.experiments.table import Cell, Run, Table, TableError, load_table, read_status


@dataclass
class CellResult:
    """A cell's runs and their values.

    Args:
        cell: the cell.
        runs: its runs, one per seed.
        values: the reported value of each run, None where there is none.
        statuses: each run's status (``done``, ``failed``, ``unfinished``, ``missing``).
    """

    cell: Cell
    runs: list[Run]
    values: list[float | None]
    statuses: list[str]

    @property
    def finished(self) -> list[float]:
        return [v for v in self.values if v is not None]

    @property
    def mean(self) -> float | None:
        return statistics.fmean(self.finished) if self.finished else None

    @property
    def std(self) -> float | None:
        return statistics.pstdev(self.finished) if len(self.finished) > 1 else None


def gather(table: Table, out: str | Path) -> list[CellResult]:
    """Every cell's runs with their values and statuses."""
    runs = table.runs(out)
    results = []
    for cell in table.cells:
        own = [run for run in runs if run.cell is cell]
        results.append(CellResult(cell, own, [run.result() for run in own], [run.status() for run in own]))
    return results


def fmt(value: float | None, digits: int) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def mean_std(mean: float | None, std: float | None, digits: int) -> str:
    if mean is None:
        return "—"
    return fmt(mean, digits) + ("" if std is None else f" ± {fmt(std, digits)}")


def paper_value(cell: Cell) -> tuple[float | None, float | None]:
    """The paper's mean and std for a cell (from its per-run numbers when it gives them)."""
    if isinstance(cell.paper, list):
        return statistics.fmean(cell.paper), cell.paper_std if cell.paper_std is not None else (
            statistics.pstdev(cell.paper) if len(cell.paper) > 1 else None
        )
    return cell.paper, cell.paper_std


def entry(result: CellResult, table: Table, best: bool) -> str:
    """One cell of the Markdown table: ours (bold when best), seeds finished, the paper's."""
    ours = mean_std(result.mean, result.std, table.digits)
    if best:
        ours = f"**{ours}**"
    n, total = len(result.finished), len(result.runs)
    if n < total:
        by_status: dict[str, list[str]] = {}
        for run, status in zip(result.runs, result.statuses):
            if status != "done":
                by_status.setdefault(status, []).append(str(run.seed))
        ours += (
            f" ({n}/{total}; "
            + "; ".join(f"{status}: seed {', '.join(seeds)}" for status, seeds in by_status.items())
            + ")"
        )
    mean, std = paper_value(result.cell)
    return ours if mean is None else f"{ours} · paper {mean_std(mean, std, table.digits)}"


def markdown(table: Table, results: list[CellResult], command: str) -> str:
    rows = list(dict.fromkeys(r.cell.row for r in results))
    columns = list(dict.fromkeys(r.cell.column for r in results))
    pick = max if table.higher_is_better else min
    # per column (columns may be different tasks), among the cells with every seed done
    best = {
        col: pick([r.mean for r in results if r.cell.column == col and len(r.finished) == len(r.runs)], default=None)
        for col in columns
    }
    grid = {(r.cell.row, r.cell.column): r for r in results}
    with_paper = any(r.cell.paper is not None for r in results)
    metrics = ", ".join(
        dict.fromkeys(f"{r.cell.metric}{f' x {r.cell.scale:g}' if r.cell.scale != 1 else ''}" for r in results)
    )
    lines = [
        f"# {table.title}",
        "",
        f"{metrics} from the {table.checkpoint} "
        f"checkpoint; mean ± std (population, ddof=0) over seeds {table.seeds}"
        f"{'; the paper' + chr(39) + 's numbers after `paper`' if with_paper else ''}; the best complete mean of "
        f"each column in bold. Written by `{command}`.",
        "",
        "| | " + " | ".join(columns) + " |",
        "|---" * (len(columns) + 1) + "|",
    ]
    for row in rows:
        cells = [
            entry(grid[row, col], table, best[col] is not None and grid[row, col].mean == best[col])
            if (row, col) in grid
            else ""
            for col in columns
        ]
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    problems = [(run, status) for r in results for run, status in zip(r.runs, r.statuses) if status != "done"]
    if problems:
        lines += ["", "Runs without a result:", ""]
        for run, status in problems:
            recorded = read_status(run.directory) or {}
            log = f" (log: {recorded['log']})" if recorded.get("log") else ""
            lines.append(f"- {run.label}: {status}{log} — {run.directory}")
    return "\n".join(lines) + "\n"


def write_csv(path: Path, table: Table, results: list[CellResult]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(
            [
                "cell",
                "row",
                "column",
                "n",
                "mean",
                "std",
                "min",
                "max",
                "paper",
                "paper_std",
                *[f"seed{s}" for s in table.seeds],
            ]
        )
        for r in results:
            paper, paper_std = paper_value(r.cell)
            per_seed = [fmt(v, 6) if v is not None else status for v, status in zip(r.values, r.statuses)]
            writer.writerow(
                [
                    r.cell.name,
                    r.cell.row,
                    r.cell.column,
                    len(r.finished),
                    fmt(r.mean, 6),
                    fmt(r.std, 6),
                    fmt(min(r.finished), 6) if r.finished else "",
                    fmt(max(r.finished), 6) if r.finished else "",
                    fmt(paper, 6),
                    fmt(paper_std, 6),
                    *per_seed,
                ]
            )


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="mmlight collect", description=__doc__.split("\n\n")[0])
    parser.add_argument("table", help="a table file, e.g. configs/tables/table4.yaml")
    parser.add_argument("--out", default="runs/tables", help="root of the run directories and of the written table")
    args = parser.parse_args(list(argv))
    try:
        table = load_table(args.table)
        results = gather(table, args.out)
    except TableError as err:
        raise SystemExit(f"mmlight collect: {err}") from None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = f"mmlight collect {args.table}" + (f" --out {args.out}" if args.out != "runs/tables" else "")
    text = markdown(table, results, command)
    (out / f"{table.name}.md").write_text(text)
    write_csv(out / f"{table.name}.csv", table, results)
    print(text, end="")
    done = sum(s == "done" for r in results for s in r.statuses)
    total = sum(len(r.runs) for r in results)
    print(f"\n{done}/{total} runs have a result; wrote {out / (table.name + '.md')} and {out / (table.name + '.csv')}")
