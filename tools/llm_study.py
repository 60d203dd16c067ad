"""The tiny-LLM study of docs/studies/cpu-llm.md: perplexity at 1x-8x the training context, sink ratio and
massive activations of every run of a table (one reweighting function and gate per cell), then one table
over functions, gates and seeds (not part of CI; the runs come from ``mmlight sweep``):

    mmlight sweep configs/tables/cpu_llm.yaml --parallel 2
    python tools/llm_study.py analyze configs/tables/cpu_llm.yaml --parallel 2
    python tools/llm_study.py report configs/tables/cpu_llm.yaml --out docs/studies/cpu_llm

``analyze`` runs one ``mmlight analyze --robustness --extrapolation`` per cell over the final checkpoints
of its seeds (``runs/analysis/<table>/<cell>/``, the folders ``tools/sink_study.py`` uses), statistics
over 128 validation windows, perplexity by length over 16 windows of 8x the training context, with
``tools/kv_study.py``'s eviction options, so that ``python tools/kv_study.py report`` reads the same
analyses. ``report`` writes ``llm_study.md`` and ``llm_study.json`` (every seed's numbers).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mmlight.analysis.extrapolation import MULTIPLES  # noqa: E402
from mmlight.experiments.table import Cell, Table, load_table  # noqa: E402
from tools.kv_study import cell_options as kv_options  # noqa: E402
from tools.sink_study import ANALYSIS_ROOT, analyze, fmt, mean_std, read_rows, study_parser  # noqa: E402


def seed_numbers(folder: Path) -> dict[int, dict]:
    """Per seed: ``ppl`` per multiple of the training context (the whole windows), ``sink_ratio`` per
    attention layer, and ``massive_ratio`` per block (mean over samples of the largest hidden-state
    magnitude over the median)."""
    found: dict[int, dict] = {}

    def entry(label: str) -> dict:
        return found.setdefault(int(label.removeprefix("seed")), {"ppl": {}, "sink_ratio": {}, "massive_ratio": {}})

    for row in read_rows(folder / "extrapolation.csv"):
        if row["part"] == "window" and row["ppl"] != "":
            entry(row["checkpoint"])["ppl"][int(float(row["multiple"]))] = float(row["ppl"])
    for row in read_rows(folder / "stats.csv"):
        if row["head"] == "" and row["metric"] == "sink_ratio" and row["value"] != "":
            entry(row["checkpoint"])["sink_ratio"][row["layer"]] = float(row["value"])
    for row in read_rows(folder / "massive_activations.csv"):
        if row["metric"] == "ratio" and row["value"] != "":
            entry(row["checkpoint"])["massive_ratio"][row["block"]] = float(row["value"])
    return found


def summarise(cell: Cell, seeds: dict[int, dict]) -> dict:
    """Mean ± std over the analysed seeds of every number of :func:`seed_numbers`; the largest massive
    ratio over blocks, per seed, then over seeds."""

    def spread(part: str) -> dict:
        keys = list(dict.fromkeys(k for s in seeds.values() for k in s[part]))
        return {k: mean_std([s[part][k] for s in seeds.values() if k in s[part]]) for k in keys}

    largest = [max(s["massive_ratio"].values()) for s in seeds.values() if s["massive_ratio"]]
    return {
        "row": cell.row,
        "column": cell.column,
        "seeds": sorted(seeds),
        "ppl": spread("ppl"),
        "sink_ratio": spread("sink_ratio"),
        "massive_ratio_max": mean_std(largest) if largest else None,
    }


def markdown(summaries: dict[str, dict]) -> list[str]:
    """One row per cell: seeds, perplexity at each multiple, sink ratio per layer, largest massive ratio."""
    layers = list(dict.fromkeys(k for s in summaries.values() for k in s["sink_ratio"]))
    head = ["function", "gate", "n", *(f"ppl {m}x" for m in MULTIPLES)]
    head += [f"sink ratio L{i}" for i in range(len(layers))] + ["largest activation / median"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in summaries.values():
        cells = [s["row"], s["column"], str(len(s["seeds"]))]
        cells += [fmt(s["ppl"].get(m), 1) for m in MULTIPLES]
        cells += [fmt(s["sink_ratio"].get(layer), 2) for layer in layers]
        cells.append(fmt(s["massive_ratio_max"], 1))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def report(table: Table, out: Path) -> None:
    summaries, numbers = {}, {}
    for cell in table.cells:
        folder = ANALYSIS_ROOT / table.name / cell.name
        if not (folder / "extrapolation.csv").is_file():
            print(f"{cell.name}: not analysed yet, left out", flush=True)
            continue
        numbers[cell.name] = seed_numbers(folder)
        summaries[cell.name] = summarise(cell, numbers[cell.name])
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"## {table.title}", "", f"Written by `python tools/llm_study.py report {table.path}`.", ""]
    lines += markdown(summaries) + [""]
    (out / "llm_study.md").write_text("\n".join(lines))
    (out / "llm_study.json").write_text(json.dumps({"per_seed": numbers, "summary": summaries}, indent=1))
    print(f"wrote {out / 'llm_study.md'} and llm_study.json")


def main(argv: list[str] | None = None) -> None:
    parser = study_parser(__doc__, "docs/studies/cpu_llm")
    parser.add_argument("--val_batches", type=int, help="analyze: validation batches of the robustness runs")
    parser.add_argument(
        "--no_kv",
        action="store_true",
        help="analyze: robustness cut to sink masking and L2 eviction at r = 0.5, for cells the KV study does not read",
    )
    args = parser.parse_args(argv)
    table = load_table(args.table)
    if args.step == "analyze":
        # 128 of the 188 validation windows of the Python-docs text for the statistics (sink_study's 256 would not fit)
        # 16 windows of 8x the context (8,192 of its 12,028 tokens) for the perplexity at each length
        extra = ("--extrapolation", "--extrapolation_windows", "16", "--num_samples", "128")
        if args.no_kv:
            batches = () if args.val_batches is None else ("--trainer.limit_val_batches", str(args.val_batches))
            options = lambda cell: ("--kv_methods", "l2", "--keep_ratios", "0.5", *batches, *extra)  # noqa: E731
        else:
            options = lambda cell: (*kv_options(cell, args.val_batches, None), *extra)  # noqa: E731
        analyze(table, Path(args.runs), args.parallel, args.only, args.seeds, options)
    else:
        report(table, Path(args.out))


if __name__ == "__main__":
    main()
