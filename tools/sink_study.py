"""The sink study (docs/studies/cpu-sinks.md): ``mmlight analyze --robustness`` of every run of a table,
then one table and one figure over functions and seeds (not part of CI; the runs come from ``mmlight sweep``).

    mmlight sweep configs/tables/cpu_sinks.yaml --parallel 2
    python tools/sink_study.py analyze configs/tables/cpu_sinks.yaml --parallel 2
    python tools/sink_study.py report configs/tables/cpu_sinks.yaml --out docs/analysis/cpu_sinks

``analyze`` runs one ``mmlight analyze`` per cell over the final checkpoints of all its seeds
(``runs/analysis/<table>/<cell>/``), with ``--kv_skip_layers 0``: the quick-start models have two
decoder layers, so the default of 2 would evict nothing; and at the keep ratios of :data:`KEEP_RATIOS`
but 1, which evicts nothing (its metric is the plain run's, tested). A cell whose ``robustness.csv`` already
covers every seed is skipped. ``report`` reads those folders and writes ``sink_study.md`` (the table),
``sink_study.json`` (every seed's numbers) and ``kv_eviction.png`` (the metric against the keep ratio,
one line per function). A cell without an analysis folder keeps the per-seed numbers that an earlier
``sink_study.json`` in the output folder holds for it, so new cells can be added to a report whose
older runs are gone. Gated cells also get their gate statistics (mean gate and fraction below 0.1 per layer).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mmlight.experiments.table import Cell, Table, load_table

ANALYSIS_ROOT = Path("runs/analysis")
SINK_LEVELS = (1, 5, 10)
KEEP_RATIOS = (1.0, 0.9, 0.7, 0.5, 0.3)
#: a recall run has learnt the task above this validation accuracy (%): runs end near 100% or near 30%
SOLVED_ACC = 90.0
#: per-layer statistics read from each analysed run (the gate's only where the model is gated)
LAYER_STATS = ("sink_ratio", "null_mass", "gate_mean", "gate_below_0.1")


def cell_checkpoints(table: Table, cell: Cell, runs_root: Path) -> dict[int, Path]:
    """Seed -> final checkpoint of each finished run of ``cell``."""
    found = {}
    for run in table.runs(runs_root):
        ckpt = run.directory / "fit" / "checkpoints" / "last.ckpt"
        if run.cell is cell and run.fit_done() and ckpt.is_file():  # not a run still training
            found[run.seed] = ckpt
    return found


def analyzed_seeds(out: Path) -> set[int]:
    """Seeds whose robustness rows ``out/robustness.csv`` holds (checkpoint labels ``seedN``)."""
    path = out / "robustness.csv"
    if not path.is_file():
        return set()
    with open(path) as f:
        return {int(row["checkpoint"].removeprefix("seed")) for row in csv.DictReader(f)}


def analyze_cell(
    cell: Cell, ckpts: dict[int, Path], out: Path, threads: int, options: tuple[str, ...] | None = None
) -> str:
    """``mmlight analyze --robustness`` of ``ckpts`` into ``out`` with ``options`` (default: this
    study's keep ratios, :data:`KEEP_RATIOS` but 1); returns a line for the log."""
    if not ckpts:
        return f"{cell.name}: no finished run"
    if analyzed_seeds(out) >= set(ckpts):
        return f"{cell.name}: done, skipped"
    if options is None:
        options = ("--keep_ratios", *(f"{r:g}" for r in KEEP_RATIOS[1:]))  # r = 1 is the plain run (tested)
    command = [
        *(sys.executable, "-m", "mmlight.cli", "analyze", "--config", str(cell.config)),
        *("--robustness", "--kv_skip_layers", "0", "--num_samples", "256", "--out", str(out)),
        *options,
        *("--ckpt_path", *(str(ckpts[seed]) for seed in sorted(ckpts))),
    ]
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "analyze.log", "w") as log:
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        code = subprocess.call(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    if code != 0:
        return f"{cell.name}: failed (exit {code}, see {out / 'analyze.log'})"
    return f"{cell.name}: done"


def analyze(
    table: Table, runs_root: Path, parallel: int, only: list[str], seeds: list[int] | None, options_of=None
) -> None:
    """:func:`analyze_cell` of each cell (``only`` those, if given) over its finished ``seeds`` (all if
    None), ``parallel`` at a time, with ``options_of(cell)`` as its options (None: the default)."""
    threads = max(1, (os.cpu_count() or 1) // parallel)
    jobs = []
    for cell in table.cells:
        if only and cell.name not in only:
            continue
        ckpts = {s: c for s, c in cell_checkpoints(table, cell, runs_root).items() if seeds is None or s in seeds}
        options = None if options_of is None else options_of(cell)
        jobs.append((cell, ckpts, ANALYSIS_ROOT / table.name / cell.name, threads, options))
    with ThreadPoolExecutor(max_workers=parallel) as pool:
        for line in pool.map(lambda job: analyze_cell(*job), jobs):
            print(line, flush=True)


def read_rows(path: Path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


def seed_numbers(cell: Cell, out: Path) -> dict[int, dict]:
    """Per seed: the task metric (scaled as the table shows it) plain and under each intervention, and
    the per-layer sink ratio and null mass (and gate statistics, for a gated model) of every attention layer."""
    found: dict[int, dict] = {}
    for row in read_rows(out / "robustness.csv"):
        seed = int(row["checkpoint"].removeprefix("seed"))
        key = row["intervention"] if row["intervention"] == "none" else f"{row['intervention']}@{float(row['level']):g}"
        found.setdefault(seed, {"metric": {}, "sink_ratio": {}, "null_mass": {}})["metric"][key] = (
            float(row["value"]) * cell.scale
        )
    for row in read_rows(out / "stats.csv"):
        seed = int(row["checkpoint"].removeprefix("seed"))
        if row["head"] == "" and row["metric"] in LAYER_STATS and row["value"] != "":
            found[seed].setdefault(row["metric"], {})[row["layer"]] = float(row["value"])
    return found


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and population standard deviation (as ``mmlight collect``)."""
    return statistics.fmean(values), statistics.pstdev(values)


def summarise(cell: Cell, results: dict[int, float], seeds: dict[int, dict]) -> dict:
    """A cell's table entries: the task metric of every seed's run (``results``), and mean ± std over
    the analysed seeds (``seeds``) of the rest; for recall, the solved runs, and the interventions over
    the solved analysed runs alone (a stalled model's robustness says nothing of the function)."""
    recall = cell.name.startswith("recall")
    solved = sorted(seed for seed, value in results.items() if value >= SOLVED_ACC) if recall else None
    over = sorted(s for s in seeds if solved is None or s in solved)
    keys = list(next(iter(seeds.values()))["metric"])
    summary = {
        "row": cell.row,
        "seeds": sorted(results),
        "metric": mean_std(list(results.values())),
        "solved": solved,
        "interventions_over": over,
        "interventions": {key: mean_std([seeds[s]["metric"][key] for s in over]) if over else None for key in keys},
    }
    for stat in LAYER_STATS:
        layers = sorted(next(iter(seeds.values())).get(stat, {}))
        if layers:
            summary[stat] = {layer: mean_std([seeds[s][stat][layer] for s in seeds]) for layer in layers}
    return summary


def short_layer(name: str) -> str:
    """``decoder.layers.1.self_attn`` -> ``dec-self 1``."""
    stack, _, index, kind = name.split(".")
    return f"{stack[:3]}-{kind.removesuffix('_attn')} {index}"


def fmt(pair: tuple[float, float] | None, digits: int = 1) -> str:
    if pair is None:
        return "—"
    mean, std = (round(v, digits) + 0.0 for v in pair)  # + 0.0: no "-0.000"
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def markdown(title: str, summaries: dict[str, dict]) -> list[str]:
    """One task's tables: metric and interventions; sink ratio and null mass per layer."""
    first = next(iter(summaries.values()))
    recall = first["solved"] is not None
    head = ["function", "metric", *(["solved"] if recall else []), "n", "plain"]
    head += [f"sinks k={k}" for k in SINK_LEVELS] + [f"L2 r={r:g}" for r in KEEP_RATIOS[1:]]
    head += [f"stream r={r:g}" for r in KEEP_RATIOS[1:]]
    lines = [f"### {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in summaries.values():
        cells = [s["row"], fmt(s["metric"])]
        if recall:
            cells.append(f"{len(s['solved'])}/{len(s['seeds'])}")
        cells += [str(len(s["interventions_over"])), fmt(s["interventions"].get("none"))]
        cells += [fmt(s["interventions"].get(f"sink_masking@{k}")) for k in SINK_LEVELS]
        cells += [fmt(s["interventions"].get(f"kv_{m}@{r:g}")) for m in ("l2", "streaming") for r in KEEP_RATIOS[1:]]
        lines.append("| " + " | ".join(cells) + " |")
    layers = list(first["null_mass"])
    own = [n for n in layers if "self" in n]  # sinks are keys of the layer's own stack (cross-attention: none)
    lines += ["", "| function | " + " | ".join(f"sink ratio {short_layer(n)}" for n in own)]
    lines[-1] += " | " + " | ".join(f"null mass {short_layer(n)}" for n in layers) + " |"
    lines.append("|---|" + "---|" * (len(own) + len(layers)))
    for s in summaries.values():
        cells = [fmt(s["sink_ratio"].get(n), 2) for n in own] + [fmt(s["null_mass"].get(n), 3) for n in layers]
        lines.append(f"| {s['row']} | " + " | ".join(cells) + " |")
    gated = [s for s in summaries.values() if "gate_mean" in s]
    if gated:
        lines += ["", "| function | " + " | ".join(f"gate mean {short_layer(n)}" for n in layers)]
        lines[-1] += " | " + " | ".join(f"gates < 0.1 {short_layer(n)}" for n in layers) + " |"
        lines.append("|---|" + "---|" * (2 * len(layers)))
        for s in gated:
            cells = [fmt(s["gate_mean"].get(n), 3) for n in layers] + [
                fmt(s["gate_below_0.1"].get(n), 3) for n in layers
            ]
            lines.append(f"| {s['row']} | " + " | ".join(cells) + " |")
    return lines + [""]


def figure(tasks: dict[str, dict[str, dict]], path: Path) -> None:
    """The metric against the keep ratio (L2 and StreamingLLM eviction), one line per function."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(s["row"] for summaries in tasks.values() for s in summaries.values()))
    colour = {name: f"C{i % 10}" for i, name in enumerate(names)}  # one colour per function in every panel
    fig, axes = plt.subplots(2, len(tasks), figsize=(5.5 * len(tasks), 7.5), squeeze=False)
    for col, (task, summaries) in enumerate(tasks.items()):
        for row, method in enumerate(("l2", "streaming")):
            ax = axes[row][col]
            for s in summaries.values():
                points = [
                    (r, s["interventions"]["none" if r == 1.0 else f"kv_{method}@{r:g}"])
                    for r in KEEP_RATIOS
                    if s["interventions"].get("none" if r == 1.0 else f"kv_{method}@{r:g}")
                ]
                if points:
                    ax.errorbar(
                        [r for r, _ in points],
                        [m for _, (m, _) in points],
                        yerr=[sd for _, (_, sd) in points],
                        marker="o",
                        capsize=2,
                        color=colour[s["row"]],
                        label=s["row"],
                    )
            ax.set_title(f"{task}: {'L2-norm' if method == 'l2' else 'StreamingLLM'} eviction")
            ax.set_xlabel("keep ratio r")
            ax.invert_xaxis()
            ax.grid(alpha=0.3)
        axes[0][col].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def earlier_numbers(path: Path) -> dict[str, dict]:
    """``{cell: {"results": {seed: metric}, "analysed": {seed: numbers}}}`` of an earlier report's
    ``sink_study.json`` (seeds as ints), or nothing when there is none."""
    if not path.is_file():
        return {}
    per_seed = json.loads(path.read_text())["per_seed"]
    return {
        cell: {part: {int(seed): value for seed, value in entry[part].items()} for part in ("results", "analysed")}
        for cell, entry in per_seed.items()
    }


def report(table: Table, runs_root: Path, out: Path) -> None:
    tasks: dict[str, dict[str, dict]] = {}
    numbers = {}
    earlier = earlier_numbers(out / "sink_study.json")
    for cell in table.cells:
        folder = ANALYSIS_ROOT / table.name / cell.name
        if (folder / "robustness.csv").is_file():
            seeds = seed_numbers(cell, folder)
            results = {run.seed: run.result() for run in table.runs(runs_root) if run.cell is cell}
        elif cell.name in earlier:
            print(f"{cell.name}: not analysed here, numbers from {out / 'sink_study.json'}", flush=True)
            seeds, results = earlier[cell.name]["analysed"], earlier[cell.name]["results"]
        else:
            print(f"{cell.name}: not analysed yet, left out", flush=True)
            continue
        results = {seed: value for seed, value in results.items() if value is not None}
        if not results:
            print(f"{cell.name}: no run has a result, left out", flush=True)
            continue
        numbers[cell.name] = {"results": results, "analysed": seeds}
        tasks.setdefault(cell.column, {})[cell.name] = summarise(cell, results, seeds)
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"## {table.title}", "", f"Written by `python tools/sink_study.py report {table.path}`.", ""]
    for task, summaries in tasks.items():
        lines += markdown(task, summaries)
    (out / "sink_study.md").write_text("\n".join(lines))
    (out / "sink_study.json").write_text(json.dumps({"per_seed": numbers, "summary": tasks}, indent=1))
    figure(tasks, out / "kv_eviction.png")
    print(f"wrote {out / 'sink_study.md'}, sink_study.json and kv_eviction.png")


def study_parser(description: str, out: str) -> argparse.ArgumentParser:
    """The options of a study over a table's runs: its two steps, the runs, and the report's folder ``out``."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", choices=("analyze", "report"))
    parser.add_argument("table", help="a table file whose runs `mmlight sweep` made")
    parser.add_argument("--runs", default="runs/tables", help="root of the sweep's run directories")
    parser.add_argument("--parallel", type=int, default=1, help="analyze: analyses at the same time")
    parser.add_argument("--only", nargs="+", default=[], metavar="CELL", help="analyze: only these cells")
    parser.add_argument("--seeds", nargs="+", type=int, help="analyze: only these seeds (default: every seed)")
    parser.add_argument("--out", default=out, help="report: output folder")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = study_parser(__doc__, "docs/analysis/cpu_sinks").parse_args(argv)
    table = load_table(args.table)
    if args.step == "analyze":
        analyze(table, Path(args.runs), args.parallel, args.only, args.seeds)
    else:
        report(table, Path(args.runs), Path(args.out))


if __name__ == "__main__":
    main()
