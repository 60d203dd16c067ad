"""The KV eviction study of docs/studies/kv_eviction.md: every eviction method at every keep ratio on
the runs of a table (one reweighting function per cell), then tables and figures over functions,
methods and seeds (not part of CI). The steps reuse ``tools/sink_study.py``'s runner and helpers:

    mmlight sweep configs/tables/cpu_kv_eviction.yaml --parallel 1
    python tools/kv_study.py analyze configs/tables/cpu_kv_eviction.yaml
    python tools/kv_study.py report configs/tables/cpu_kv_eviction.yaml --out docs/studies/kv_eviction

``analyze`` runs one ``mmlight analyze --robustness --kv_skip_layers 0 --kv_calibrate`` per cell over
the final checkpoints of its seeds (``runs/analysis/<table>/<cell>/``) with every method of
:data:`METHODS` at :data:`KEEP_RATIOS` but 1 (r = 1 evicts nothing: the plain run). ``--val_batches``,
``--nmt_val_batches`` and ``--nmt_max_tokens`` cut the robustness runs to the first validation
batches: 30 evictions per checkpoint, each computing the full attention for the attention loss, are
the cost of the study.
``report`` writes ``kv_study.md`` (the tables), ``kv_study.json`` (every seed's numbers), and
``kv_quality.png`` / ``kv_attention_loss.png`` (the metric and the attention loss against the keep
ratio, one panel per task and method, one line per function).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mmlight.experiments.table import Cell, Table, load_table  # noqa: E402
from tools.sink_study import (  # noqa: E402
    ANALYSIS_ROOT,
    SOLVED_ACC,
    analyze,
    fmt,
    mean_std,
    read_rows,
    study_parser,
)

METHODS = ("l2", "streaming", "qfilters", "expected_attention", "oracle", "random")
KEEP_RATIOS = (1.0, 0.9, 0.7, 0.5, 0.3, 0.1)


def cell_options(
    cell: Cell, val_batches: int | None, nmt_val_batches: int | None, nmt_max_tokens: int | None = None
) -> tuple[str, ...]:
    """The ``mmlight analyze`` options of a cell (besides sink_study's): every method, every ratio but
    1, Q-filters calibrated on the 256 samples; the robustness runs on the first validation batches
    (``nmt_val_batches`` for NMT cells, ``val_batches`` for the others; None: the whole split), NMT
    batches of at most ``nmt_max_tokens`` tokens (None: the config's)."""
    options = ("--kv_calibrate", "--kv_methods", *METHODS, "--keep_ratios", *(f"{r:g}" for r in KEEP_RATIOS[1:]))
    nmt = cell.name.startswith("nmt")
    batches = nmt_val_batches if nmt else val_batches
    if batches is not None:
        options += ("--trainer.limit_val_batches", str(batches))
    if nmt and nmt_max_tokens is not None:
        options += ("--data.init_args.max_tokens", str(nmt_max_tokens))
    return options


def seed_of(label: str) -> int:
    return int(label.removeprefix("seed"))


def seed_numbers(cell: Cell, folder: Path) -> dict[int, dict]:
    """Per seed: ``metric`` (``none`` and ``<method>@<r>``, scaled as the table shows it), ``loss`` and
    ``oracle`` (``<method>@<r>``, pooled over the evicted layers), ``pearson``/``spearman`` (per layer)
    and ``qfilter_cosine`` (the mean cosine between the two halves' filters)."""
    found: dict[int, dict] = {}

    def entry(label):
        return found.setdefault(seed_of(label), {k: {} for k in ("metric", "loss", "oracle", "pearson", "spearman")})

    for row in read_rows(folder / "robustness.csv"):
        if row["intervention"] == "none" or row["intervention"].startswith("kv_"):
            key = "none" if row["intervention"] == "none" else f"{row['intervention'][3:]}@{float(row['level']):g}"
            entry(row["checkpoint"])["metric"][key] = float(row["value"]) * cell.scale
    for row in read_rows(folder / "kv_attention_loss.csv"):
        if row["layer"] == "all" and row["attention_loss"] != "":
            key = f"{row['intervention'][3:]}@{float(row['keep_ratio']):g}"
            entry(row["checkpoint"])["loss"][key] = float(row["attention_loss"])
            entry(row["checkpoint"])["oracle"][key] = float(row["oracle_loss"])
    for row in read_rows(folder / "key_norm_attention.csv"):
        for k in ("pearson", "spearman"):
            if row[k] != "":
                entry(row["checkpoint"])[k][row["layer"]] = float(row[k])
    calibration = json.loads((folder / "qfilters.json").read_text())
    for label, stats in calibration.items():
        entry(label)["qfilter_cosine"] = stats["cosine_mean"]
    return found


def summarise(cell: Cell, results: dict[int, float], seeds: dict[int, dict]) -> dict:
    """Mean ± std over seeds of every number; recall's metric under eviction over the solved runs only."""
    recall = cell.name.startswith("recall")
    solved = sorted(s for s, v in results.items() if v >= SOLVED_ACC) if recall else sorted(results)
    over = [s for s in sorted(seeds) if s in solved]

    def spread(part, seeds_used):
        keys = list(dict.fromkeys(k for s in seeds_used for k in seeds[s][part]))
        return {k: mean_std([seeds[s][part][k] for s in seeds_used if k in seeds[s][part]]) for k in keys}

    every = sorted(seeds)

    def over_ratios(part, seeds_used):  # per method, each seed's mean over the evicting ratios
        out = {}
        for method in METHODS:
            keys = [f"{method}@{r:g}" for r in KEEP_RATIOS[1:]]
            per_seed = [
                statistics.fmean(seeds[s][part][k] for k in keys)
                for s in seeds_used
                if all(k in seeds[s][part] for k in keys)
            ]
            if per_seed:
                out[method] = mean_std(per_seed)
        return out

    return {
        "loss_over_ratios": over_ratios("loss", every),
        "quality_over_ratios": over_ratios("metric", over),
        "row": cell.row,
        "seeds": sorted(results),
        "metric": mean_std(list(results.values())),
        "solved": solved if recall else None,
        "quality_over": over,
        "quality": spread("metric", over) if over else {},
        "loss": spread("loss", every),
        "oracle": spread("oracle", every),
        "pearson": spread("pearson", every),
        "spearman": spread("spearman", every),
        "qfilter_cosine": mean_std([seeds[s]["qfilter_cosine"] for s in every]),
    }


def ratio_table(summaries: dict[str, dict], part: str, digits: int) -> list[str]:
    """Rows function x method, columns the keep ratios (r = 1: the plain run for the metric, 0 loss)."""
    head = ["function", "method", *(f"r={r:g} (c={1 - r:.1g})" for r in KEEP_RATIOS)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in summaries.values():
        for method in METHODS:
            values = s[part]
            cells = [fmt(values.get("none" if r == 1.0 else f"{method}@{r:g}"), digits) for r in KEEP_RATIOS]
            if part != "quality":
                cells[0] = "0"
            if any(c != "—" for c in cells[1:]):
                lines.append(f"| {s['row']} | {method} | " + " | ".join(cells) + " |")
    return lines


def markdown(task: str, summaries: dict[str, dict]) -> list[str]:
    """One task's tables: runs and key-norm correlations, the metric, the attention loss and the excess
    over the oracle, each over keep ratios."""
    recall = next(iter(summaries.values()))["solved"] is not None
    lines = [f"### {task}", "", "| function | seeds | metric | " + ("solved | " if recall else "")]
    lines[-1] += "Q-filter cosine (halves) | Pearson L0 / L1 | Spearman L0 / L1 |"
    lines.append("|---" * (7 if recall else 6) + "|")
    for s in summaries.values():
        layers = sorted(s["spearman"])
        cells = [s["row"], str(len(s["seeds"])), fmt(s["metric"])]
        cells += [f"{len(s['solved'])}/{len(s['seeds'])}"] if recall else []
        cells += [fmt(s["qfilter_cosine"], 3)]
        cells += [" / ".join(fmt(s[k][layer], 2) for layer in layers) for k in ("pearson", "spearman")]
        lines.append("| " + " | ".join(cells) + " |")
    over = "the solved runs" if recall else "every seed"
    lines += [
        "",
        "Mean over the keep ratios 0.9, 0.7, 0.5, 0.3, 0.1 of each seed, then mean ± std over seeds: "
        f"the attention loss (every seed) and the metric (over {over}):",
        "",
    ]
    lines += [
        "| function | "
        + " | ".join(f"loss {m}" for m in METHODS)
        + " | "
        + " | ".join(f"metric {m}" for m in METHODS)
        + " |"
    ]
    lines.append("|---" * (1 + 2 * len(METHODS)) + "|")
    for s in summaries.values():
        cells = [fmt(s["loss_over_ratios"].get(m), 3) for m in METHODS] + [
            fmt(s["quality_over_ratios"].get(m), 1) for m in METHODS
        ]
        lines.append(f"| {s['row']} | " + " | ".join(cells) + " |")
    lines += ["", f"Metric under eviction (over {over}; r = 1 is the plain run):", ""]
    lines += ratio_table(summaries, "quality", 1)
    lines += ["", "Attention loss, pooled over both decoder layers (every seed):", ""]
    lines += ratio_table(summaries, "loss", 3)
    for s in summaries.values():  # the excess over the oracle at the same budget, per method
        s["excess"] = {k: (m - s["oracle"][k][0], sd) for k, (m, sd) in s["loss"].items()}
    lines += [
        "",
        "Excess attention loss over the oracle's at the same budget on the same calls (± the loss's std):",
        "",
    ]
    lines += ratio_table(summaries, "excess", 3)
    return lines + [""]


def figure(tasks: dict[str, dict[str, dict]], part: str, ylabel: str, path: Path) -> None:
    """``part`` against the keep ratio, one panel per (task, method), one line per function."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(s["row"] for summaries in tasks.values() for s in summaries.values()))
    colour = {name: f"C{i % 10}" for i, name in enumerate(names)}
    fig, axes = plt.subplots(len(tasks), len(METHODS), figsize=(3.3 * len(METHODS), 3.0 * len(tasks)), squeeze=False)
    for row, (task, summaries) in enumerate(tasks.items()):
        for col, method in enumerate(METHODS):
            ax = axes[row][col]
            for s in summaries.values():
                pts = [
                    (r, s[part].get("none" if r == 1.0 and part == "quality" else f"{method}@{r:g}"))
                    for r in KEEP_RATIOS
                ]
                pts = [(r, v) for r, v in pts if v is not None]
                if pts:
                    ax.errorbar(
                        *zip(*[(r, m) for r, (m, _) in pts]),
                        yerr=[sd for _, (_, sd) in pts],
                        marker="o",
                        capsize=2,
                        color=colour[s["row"]],
                        label=s["row"],
                        markersize=3,
                    )
            ax.set_title(f"{task}: {method}", fontsize=8)
            ax.set_xlabel("keep ratio r (compression 1 - r)", fontsize=7)
            ax.set_ylabel(ylabel, fontsize=7)
            ax.invert_xaxis()
            ax.grid(alpha=0.3)
        axes[row][0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def earlier_numbers(path: Path | None) -> dict[str, dict]:
    """The per-seed numbers of an earlier report's ``kv_study.json`` (``{cell: {"results", "analysed"}}``,
    seeds as ints again), or none."""
    if path is None:
        return {}
    cells = json.loads(path.read_text())["per_seed"]
    return {
        name: {part: {int(seed): v for seed, v in entry[part].items()} for part in ("results", "analysed")}
        for name, entry in cells.items()
    }


def report(table: Table, runs_root: Path, out: Path, earlier: Path | None = None) -> None:
    """The tables and figures of every cell analysed with every method; a cell without such an analysis
    keeps the per-seed numbers of the ``earlier`` report's ``kv_study.json``, where it has them."""
    tasks: dict[str, dict[str, dict]] = {}
    numbers = {}
    kept = earlier_numbers(earlier)
    for cell in table.cells:
        folder = ANALYSIS_ROOT / table.name / cell.name
        if (folder / "kv_attention_loss.csv").is_file() and (folder / "qfilters.json").is_file():
            seeds = seed_numbers(cell, folder)
            results = {r.seed: r.result() for r in table.runs(runs_root) if r.cell is cell and r.seed in seeds}
            results = {seed: value for seed, value in results.items() if value is not None}
        elif cell.name in kept:
            print(f"{cell.name}: the numbers of {earlier}", flush=True)
            seeds, results = kept[cell.name]["analysed"], kept[cell.name]["results"]
        else:
            print(f"{cell.name}: not analysed with every method (analyze), left out", flush=True)
            continue
        numbers[cell.name] = {"results": results, "analysed": seeds}
        tasks.setdefault(cell.column, {})[cell.name] = summarise(cell, results, seeds)
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"## {table.title}", "", f"Written by `python tools/kv_study.py report {table.path}`.", ""]
    for task, summaries in tasks.items():
        lines += markdown(task, summaries)
    (out / "kv_study.md").write_text("\n".join(lines))
    (out / "kv_study.json").write_text(json.dumps({"per_seed": numbers, "summary": tasks}, indent=1))
    figure(tasks, "quality", "task metric", out / "kv_quality.png")
    figure(tasks, "loss", "attention loss", out / "kv_attention_loss.png")
    print(f"wrote {out / 'kv_study.md'}, kv_study.json, kv_quality.png and kv_attention_loss.png")


def main(argv: list[str] | None = None) -> None:
    parser = study_parser(__doc__, "docs/studies/kv_eviction")
    parser.add_argument("--val_batches", type=int, help="analyze: validation batches of the LM cells (default all)")
    parser.add_argument(
        "--nmt_val_batches", type=int, help="analyze: validation batches of the NMT cells (default all)"
    )
    parser.add_argument("--nmt_max_tokens", type=int, help="analyze: tokens per NMT batch (default: the config's)")
    parser.add_argument(
        "--earlier",
        type=Path,
        help="report: an earlier report's kv_study.json, whose per-seed numbers stand for the cells not analysed now",
    )
    args = parser.parse_args(argv)
    table = load_table(args.table)
    if args.step == "analyze":
        options = lambda cell: cell_options(cell, args.val_batches, args.nmt_val_batches, args.nmt_max_tokens)  # noqa: E731
        analyze(table, Path(args.runs), args.parallel, args.only, args.seeds, options)
    else:
        report(table, Path(args.runs), Path(args.out), args.earlier)


if __name__ == "__main__":
    main()
