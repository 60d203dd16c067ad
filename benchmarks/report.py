"""Render benchmark records (the files in ``benchmarks/results/``) as the Markdown tables of BENCHMARKS.md.

    python benchmarks/report.py benchmarks/results/<file> [<file> ...]
    python benchmarks/report.py --update BENCHMARKS.md     # every table of BENCHMARKS.md, again

Each file's kind is recognised from its records: ``gpu_run.py`` (its records carry a ``kind``: the
targets (``targets.py``) against what was measured, the tile sweep, the kernel switches, the training steps, the
fits beside them, what was skipped, then the kernels' tables), ``bench_multimax.py`` (a row per op and
shape, a column per backend, the device and versions in the heading), ``bench_loader.py``,
``bench_resume.py``, ``check_reproducible.py``, ``pillow_build_pixels.py``, ``attention_stats_cost.py``,
``attention_stats_fit_time.py``, ``reweighting_step_time.py``, ``compile_report.py``, ``compile_cpu.py`` and
``bench_prepare_text.py``.
Files of one kind render as one table, side by side (the loader's runs, the step-time configs); each table
starts with a line naming the device, the versions and the date (from the file name, ``record_name.py``'s
pattern, where the records hold none).
BENCHMARKS.md holds this output between ``<!-- report: FILES -->`` and ``<!-- end report -->``, and
``tests/benchmarks/test_results_files.py`` checks that it still equals it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

from record_name import PATTERN  # beside this script, which Python puts on sys.path
from targets import TARGETS


def fmt(value, digits=3) -> str:
    if value is None:
        return "–"
    if isinstance(value, dict):
        return " / ".join(fmt(v, digits) for v in value.values())
    return f"{value:.{digits}g}" if isinstance(value, float) else str(value)


def render(records: list[dict], date: str | None = None) -> str:
    """``bench_multimax.py``: a line naming the device, versions and ``date`` (``""``: a file named off the
    pattern, such as a smoke run's, has none; None: the line is left out, for a caller that names them),
    then one table of the operators (a row per op, shape and dtype, a column per backend: :func:`op_cells`)
    and one of the training steps."""
    lines = []
    key = lambda r: (r["device"], r["torch"], r["triton"])  # noqa: E731
    for (device, torch_v, triton_v), group in itertools.groupby(records, key=key):
        group = list(group)
        ops = [r for r in group if "step_ms" not in r]
        steps = [r for r in group if "step_ms" in r]
        if date is not None:
            lines.append(f"\n{device}, torch {torch_v}, triton {triton_v}{'; ' + date if date else ''}.\n")
        if ops:
            lines += op_table(ops)
        if steps:
            lines.append("")
            lines += table(
                ["step", "shape", "dtype", "backend", "step ms", "× baseline", "peak MB", "error"],
                [
                    [
                        r["op"],
                        str(r["shape"]),
                        r["dtype"],
                        r["backend"],
                        r.get("step_ms"),
                        r.get("step_ratio"),
                        fmt(r.get("peak_mem_mb"), 5),
                        short_error(r.get("error")),
                    ]
                    for r in steps
                ],
            )
    return "\n".join(lines) + "\n"


def op_table(ops: list[dict]) -> list[str]:
    """The operator timings side by side: a row per (op, shape, dtype), whose first backend is its baseline
    (the ratios' denominator), then a column per other backend, in the order the records name them."""
    rows: dict[tuple, list[dict]] = {}
    for r in ops:
        rows.setdefault((r["op"], str(r["shape"]), r["dtype"]), []).append(r)
    baselines = {id(group[0]) for group in rows.values()}
    backends = list(dict.fromkeys(r["backend"] for r in ops if id(r) not in baselines))
    legend = (
        "Each cell: forward / backward ms, × the baseline's, peak MB, and the share of the bandwidth peak "
        "where counted; or the error's kind."
    )
    body = []
    for (op, shape, dtype), group in rows.items():
        by_backend = {r["backend"]: r for r in group[1:]}
        cells = [op_cell(by_backend[b], ratios=True) if b in by_backend else "" for b in backends]
        body.append([op, shape, dtype, f"{group[0]['backend']}: {op_cell(group[0], ratios=False)}", *cells])
    return [legend, "", *table(["op", "shape", "dtype", "baseline", *backends], body)]


def op_cell(r: dict, ratios: bool) -> str:
    """One backend's figures: ``0.18 / 1.4 ms, 1.4× / 2.38×, 40.6 MB, 22 / 9.6% peak``, or its error's kind."""
    if r.get("error"):
        return short_error(r["error"])
    parts = [f"{fmt(r.get('fwd_ms'))} / {fmt(r.get('bwd_ms'))} ms"]
    if ratios:
        parts.append(f"{fmt(r.get('fwd_ratio'))}× / {fmt(r.get('bwd_ratio'))}×")
    parts.append(megabytes(r.get("peak_mem_mb")))
    if r.get("frac_peak_bw"):
        parts.append(f"{percents(r['frac_peak_bw'])}% peak")
    return ", ".join(parts)


def megabytes(mb: float | None) -> str:
    """A peak memory: whole megabytes with thousands separators from 100 MB up, three digits below."""
    if mb is None:
        return "– MB"
    return f"{mb:,.0f} MB" if mb >= 100 else f"{mb:.3g} MB"


def percents(frac: dict | None) -> str:
    """Fractions of the bandwidth peak (forward / backward) as percentages; ``–`` where not measured."""
    return fmt({k: v and 100 * v for k, v in frac.items()} if frac else None)


def short_error(error: str | None) -> str:
    """A recorded error cut to its kind: the first two ``:``-separated parts, up to the first sentence's
    end (``out of memory: CUDA out of memory``); the record keeps the whole message."""
    if not error:
        return ""
    return ":".join(error.split(":")[:2]).split(". ")[0].strip()


Records = list[dict]


def read(path: Path) -> str:
    """The text of ``path``; a file that is not there or cannot be read (a mistyped or renamed name, a
    folder) stops with the file named."""
    try:
        return path.read_text()
    except OSError as error:
        raise SystemExit(f"{path}: cannot be read ({error.strerror})") from error


def load(path: Path) -> Records:
    """A record file's records: one per line of a ``.jsonl``, the list or the one object of a ``.json``."""
    text = read(path)
    records = []
    for number, line in enumerate(text.splitlines() if path.suffix == ".jsonl" else [text], 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as error:  # a run killed mid-write, or a hand edit
            # error.lineno counts within the text parsed: the line itself in a .jsonl, the file in a .json
            raise SystemExit(f"{path}:{number + error.lineno - 1}: not JSON ({error.msg})") from error
        values = value if isinstance(value, list) else [value]
        if not all(isinstance(record, dict) for record in values):  # a hand edit: a record is a JSON object
            raise SystemExit(f"{path}:{number}: a record is not a JSON object")
        records += values
    return records


def all_records(paths: list[Path]) -> Records:
    """The records of ``paths``, in order."""
    return [record for path in paths for record in load(path)]


def headed_table(heading: str, header: list[str], rows: list[list]) -> str:
    """A line naming the device, versions and date, then the table."""
    return "\n".join([heading, "", *table(header, rows)]) + "\n"


def run_date(path: Path) -> str:
    """The run's date from the file name (``20261123`` -> ``2026-11-23``); an error for a name off the pattern."""
    match = PATTERN.fullmatch(path.name)
    if match is None:
        raise SystemExit(f"{path}: not named <benchmark>-<device>-<versions>-<YYYYMMDD>[-<tag>].<ext>")
    day = match["date"]
    return f"{day[:4]}-{day[4:6]}-{day[6:]}"


def dates(paths: list[Path]) -> str:
    """The distinct run dates of ``paths``, in order."""
    return ", ".join(sorted({run_date(path) for path in paths}))


def named_dates(paths: list[Path]) -> str:
    """:func:`dates` of the paths named by the pattern; the others (a smoke run's file) have none."""
    return dates([path for path in paths if PATTERN.fullmatch(path.name)])


def table(header: list[str], rows: list[list]) -> list[str]:
    """A Markdown table, every cell through :func:`fmt` unless already a string."""
    cells = [[cell if isinstance(cell, str) else fmt(cell) for cell in row] for row in rows]
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(c) + " |" for c in cells)]


def percent(share: float) -> str:
    """A share as a percentage with two significant digits, never in exponent form (``3.7e-05`` -> ``0.0037%``)."""
    value = 100 * share
    decimals = max(0, 1 - math.floor(math.log10(value))) if value > 0 else 0
    return f"{value:.{decimals}f}%"


def pillow_name(build: str) -> str:
    """``13.0.0`` (how the first loader records wrote stock Pillow) -> ``Pillow 13.0.0``; a named build as is."""
    return build if " " in build else f"Pillow {build}"


LOADER_PIPELINES = ("ImageFolder", "shards, per-copy decode", "shards", "shards, no draft", "shards, uint8")


def copies_label(copies: int) -> str:
    return f"{copies} cop{'y' if copies == 1 else 'ies'}"


def span(values: list[float], digits: int) -> str:
    """``low-high`` of a build's runs (one figure when they agree to the digits shown)."""
    low, high = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
    return low if low == high else f"{low}-{high}"


def loader_rates(runs: list[Records]) -> list[str]:
    """Samples/s per worker of each pipeline, one column per copy count and Pillow build holding the range
    over that build's runs; then the uint8 shards' ratios to the per-copy pipeline and to ImageFolder,
    each computed within its own run before the range is taken."""
    builds: dict[str, list[dict]] = {}
    for run in runs:
        rates = {(r["backend"], r["copies"]): r for r in run if r["op"] == "image_loader_deit_train"}
        builds.setdefault(pillow_name(run[0]["pillow"]), []).append(rates)
    columns = [(copies, build) for copies in (1, 3) for build in builds]

    def cells(pipeline: str, field: str, digits: int) -> list[str]:
        """One range per column of ``field`` in the pipeline's records; "–" where no run has it."""
        found = [
            [rates[pipeline, copies][field] for rates in builds[build] if (pipeline, copies) in rates]
            for copies, build in columns
        ]
        return [span(values, digits) if values else "–" for values in found]

    rows = []
    for pipeline in LOADER_PIPELINES:
        rss = [
            r["peak_rss_mib_per_worker"]
            for run in runs
            for r in run
            if r.get("backend") == pipeline and r["op"] == "image_loader_deit_train"
        ]
        rows.append([pipeline, *cells(pipeline, "samples_per_s_per_worker", 1), f"{span(rss, 0)} MiB"])
    for base, field in (("per-copy", "ratio_to_per_copy_shards"), ("ImageFolder", "ratio_to_imagefolder")):
        rows.append([f"**uint8 / {base}**", *cells("shards, uint8", field, 2), ""])
    header = [f"{copies_label(copies)}, {build} ({len(builds[build])} runs)" for copies, build in columns]
    return table(["pipeline", *header, "worker peak RSS"], rows)


def loader_stages(runs: list[Records]) -> list[str]:
    """ms per output sample of each stage with 3 copies, per Pillow build: the median over its runs."""
    builds: dict[str, list[Records]] = {}
    for run in runs:
        builds.setdefault(pillow_name(run[0]["pillow"]), []).append(run)
    stages = ("read", "decode", "augment", "collate", "transfer", "total")
    rows = []
    for build, build_runs in builds.items():
        for pipeline in ("ImageFolder", "shards, uint8"):
            of = [r for run in build_runs for r in run if r.get("backend") == pipeline and r.get("copies") == 3]
            found = [r for r in of if r["op"] == "stage_ms_per_sample"]
            steps = [r["ms"] for r in of if r["op"] == "device_step_ms_per_sample"]
            rows.append(
                [f"{pipeline}, {build}"]
                + [f"{statistics.median(r[s] for r in found):.2f}" for s in stages]
                + [f"{statistics.median(steps):.2f}" if steps else "–"]
            )
    return table(["pipeline, build", *stages, "on-device step (this CPU)"], rows)


def render_loader(paths: list[Path]) -> str:
    """``bench_loader.py``: the runs' rates side by side (:func:`loader_rates`), then where the time goes
    (:func:`loader_stages`)."""
    runs = [load(path) for path in paths]
    first = next(r for r in runs[0] if r["op"] == "image_loader_deit_train")
    images = next(r for r in runs[0] if r["op"] == "images")
    heading = (
        f"{first['device']}; Python {first['python']}, torch {first['torch']}, torchvision {first['torchvision']}, "
        f"timm {first['timm']}, webdataset {first['webdataset']}; {images['images']} images "
        f"(mean {images['mean_width']} × {images['mean_height']} px, {images['mean_kib']} KiB, seed {images['seed']}), "
        f"batch {first['batch_size']}, {first['workers']} worker, median of {first['repeats']} measurements of "
        f"{first['samples']} samples; {dates(paths)}. Samples/s per worker, the range over each build's runs:"
    )
    stages = "Where the time goes, ms per output sample, 3 copies (one process, median over each build's runs):"
    return "\n".join([heading, "", *loader_rates(runs), "", stages, "", *loader_stages(runs)]) + "\n"


def render_resume(paths: list[Path]) -> str:
    """``bench_resume.py``: the replay to a saved position against decoding the samples it skips."""
    records = all_records(paths)
    r0 = records[0]
    heading = (
        f"{r0['device']}; Python {r0['python']}, torch {r0['torch']}; batch {r0['batch_size']} per rank, shuffle "
        f"buffer {r0['shuffle_buffer']}, an epoch of {r0['epoch_samples']:,} samples; {dates(paths)}."
    )
    rows = [
        [
            r["ranks"],
            f"{r['skipped_samples']:,}",
            f"{r['replay_s']} s",
            f"{r['replay_us_per_sample']} µs",
            f"{r['decode_s_for_skipped']:,} s ({r['decode_ms_per_sample']} ms per sample)",
            r["replay_over_decode"],
        ]
        for r in records
    ]
    header = ["ranks", "samples skipped per rank", "replay", "per sample", "decoding them instead", "replay / decoding"]
    return headed_table(heading, header, rows)


def render_repro(paths: list[Path]) -> str:
    """``check_reproducible.py``: per config, whether seed 0 twice gave the same losses bit for bit, and
    how many of seed 1's steps differ."""
    records = all_records(paths)
    r0 = records[0]
    versions = f"Python {r0['python']}" + (f", torch {r0['torch']}" if "torch" in r0 else "")
    heading = f"{r0['device']}; {versions}; {r0['steps']} steps per run; {dates(paths)}."
    rows = [
        [
            f"`{r['config']}`",
            "yes" if r["seed0_twice_bitwise_equal"] else "**no**",
            f"{r['seed1_steps_differing_from_seed0']} of {r['steps']}",
            " -> ".join(f"{loss:.4f}" for loss in r["seed0_loss_first_last"]),
        ]
        for r in records
    ]
    header = [
        "config",
        "seed 0 twice: bitwise equal",
        "seed 1: steps differing from seed 0",
        "seed 0 loss, first -> last",
    ]
    return headed_table(heading, header, rows)


def render_quickstart_spread(paths: list[Path]) -> str:
    """``quickstart_spread.py``: per quick start, its last ``val/top1`` in each environment (instruction
    cap and thread count) and the range over them."""
    records = all_records(paths)
    r0 = records[0]
    heading = (
        f"{r0['device']}; Python {r0['python']}, torch {r0['torch']}; each config's seed, one run per `--isa` and "
        f"thread count; {dates(paths)}. Last `val/top1` by the instructions torch used and the thread count:"
    )
    # a column per environment torch reports (instructions used, threads): a cap at or above what the CPU
    # has changes nothing, and its runs share the uncapped runs' column. This CPU's own first; fewer threads first.
    runs = sorted(records, key=lambda r: (r["isa"] != "native", r["isa"], r["threads"]))
    envs = list(dict.fromkeys((r["capability"], r["threads"]) for r in runs))
    rows = []
    for config in dict.fromkeys(r["config"] for r in records):
        top1 = {
            env: [100 * r["val/top1"] for r in runs if r["config"] == config and (r["capability"], r["threads"]) == env]
            for env in envs
        }
        cells = [f"{span(top1[env], 1)}%" if top1[env] else "–" for env in envs]
        spread = span([value for values in top1.values() for value in values], 1)
        rows.append([f"`{config}`", *cells, f"**{spread}%**"])
    header = [f"{capability}, {threads}" for capability, threads in envs]
    return headed_table(heading, ["config", *header, "range"], rows)


def render_pillow_pixels(paths: list[Path]) -> str:
    """``pillow_build_pixels.py``: how far two Pillow builds move the DeiT augmentation's uint8 pixels."""
    records = all_records(paths)
    r0 = records[0]
    heading = (
        f"{r0['device']}; Python {r0['python']}, torch {r0['torch']}, torchvision {r0['torchvision']}, timm "
        f"{r0['timm']}; {r0['images']} images, seeds 0-{r0['images'] - 1}; {dates(paths)}."
    )
    rows = [
        [
            f"{r['a']} / {r['b']}",
            "yes" if r["decoded_identical"] == 1.0 else f"{100 * r['decoded_identical']:.2f}%",
            percent(r["crop"]["share_differing"]),
            r["crop"]["max_levels"],
            percent(r["crop"]["share_differing_by_more_than_1"]),
            percent(r["augmented"]["share_differing"]),
            percent(r["augmented"]["share_differing_by_more_than_1"]),
            f"{r['augmented']['mean_a']:.3f} / {r['augmented']['mean_b']:.3f}",
        ]
        for r in records
    ]
    header = [
        "A / B",
        "decoded identical",
        "crop: values differing",
        "crop: max levels",
        "crop: > 1 level",
        "augmented: values differing",
        "augmented: > 1 level",
        "augmented mean A / B",
    ]
    return headed_table(heading, header, rows)


def load_average(record: dict) -> str:
    return " / ".join(f"{v:.1f}" for v in record["load_average_1_5_15_min"])


def render_attention_stats_cost(paths: list[Path]) -> str:
    """``attention_stats_cost.py``: what the training loop waited for ``AttentionStats``, over validation."""
    lines = []
    for path in paths:
        (record,) = load(path)
        meta = record["meta"]
        lines += [
            f"{meta['machine']}, {meta['cpus']} CPUs; torch {meta['torch']}, lightning {meta['lightning']}, "
            f"`OMP_NUM_THREADS={meta['omp_num_threads']}`, load average (1 / 5 / 15 min) {load_average(meta)}; "
            f"{run_date(path)}.",
            "",
        ]
        rows = [
            [
                f"`{Path(r['run']).parent.name}`",
                f"{r['validation_epochs']} ({r['validation_seconds']:.2f} s)",
                r["recordings"],
                f"{r['callback_seconds']:.3f} s",
                f"**{100 * r['ratio']:.1f}%**",
                f"{r['reduce_seconds']:.3f} s, {r['figure_seconds']:.2f} s",
            ]
            for r in record["runs"]
        ]
        header = [
            "run",
            "validation epochs (total time)",
            "recordings",
            "loop waited",
            "loop / validation",
            "background: reduce, draw",
        ]
        lines += table(header, rows)
    return "\n".join(lines) + "\n"


def render_fit_time(paths: list[Path]) -> str:
    """``attention_stats_fit_time.py``: whole-fit seconds with and without the callback, alternating pairs."""
    records = all_records(paths)
    r0 = records[0]
    heading = f"`{r0['config']}`, `OMP_NUM_THREADS={r0['omp_num_threads']}`; {dates(paths)}."
    rows = [
        [
            " ".join(r["callback_args"]) or "(defaults)",
            " / ".join(f"{s:.1f}" for s in r["without_s"]),
            " / ".join(f"{s:.1f}" for s in r["with_s"]),
            " / ".join(f"{d:+.1f}" for d in r["paired_difference_s"]),
            f"{r['mean_difference_s']:+.2f} s",
            load_average(r),
        ]
        for r in records
    ]
    header = ["callback arguments", "fit without, s", "fit with, s", "with − without, s", "mean", "load average"]
    return headed_table(heading, header, rows)


def render_step_time(paths: list[Path]) -> str:
    """``reweighting_step_time.py``: each function's step time over softmax's in the same round, the median
    over rounds with the range in brackets, one column per config."""
    records = all_records(paths)
    r0 = records[0]
    heading = (
        f"{r0['machine']}, {r0['cpu_count']} CPUs; Python {r0['python']}, torch {r0['torch']}, "
        f"{r0['torch_threads']} intra-op thread; median of steps {r0['warmup'] + 1}-{r0['steps']} per round, "
        f"{len(r0['rounds'])} rounds; load average (1 / 5 / 15 min) "
        + ", ".join(load_average(r) for r in records)
        + f"; {dates(paths)}."
    )
    columns, ratios = [], []
    for r in records:
        softmax_ms = [1e3 * round_["softmax"] for round_ in r["rounds"]]
        columns.append(f"`{Path(r['config']).name}` (softmax {span(softmax_ms, 0)} ms/step)")
        ratios.append(
            {f: [round_[f] / round_["softmax"] for round_ in r["rounds"]] for f in r["median_ratio_to_softmax"]}
        )
    functions = list(dict.fromkeys(f for r in records for f in r["median_ratio_to_softmax"]))
    rows = [
        [f]
        + [f"{statistics.median(by[f]):.2f} ({min(by[f]):.2f}-{max(by[f]):.2f})" if f in by else "–" for by in ratios]
        for f in functions
    ]
    return headed_table(heading, ["function", *columns], rows)


def render_compile_cpu(paths: list[Path]) -> str:
    """``compile_cpu.py``: each function's eager and compiled step, their ratio, the first compiled step
    (compilation included) and the steps the compiled network needs to repay it."""
    tables = []
    for path in paths:
        r = load(path)[0]
        heading = (
            f"{r['machine']}, {r['threads']} thread; Python {r['python']}, torch {r['torch']}; Inductor caches "
            f"{r['inductor_caches']}; batch {r['batch']}, median of {r['steps']} steps after {r['warmup']} warm-up "
            f"steps, seed {r['seed']}, one run; {run_date(path)}. {r['note'][0].upper()}{r['note'][1:]}."
        )
        rows = [
            [
                f["function"],
                f"{f['eager_step_ms']:.0f} ms",
                f"{f['compiled_step_ms']:.0f} ms",
                f"{f['step_ratio_compiled_over_eager']:.2f}",
                f"{f['first_compiled_step_s']:.0f} s",
                f"{f['steps_to_recover_compile_time']:,.0f}",
            ]
            for f in r["results"]
        ]
        header = [
            "function",
            "eager step",
            "compiled step",
            "compiled / eager",
            "first compiled step",
            "steps to repay it",
        ]
        tables.append(headed_table(heading, header, rows))
    return "\n".join(tables)


def render_compile_report(paths: list[Path]) -> str:
    """``compile_report.py``: per kernel and target, the specialisations compiled and their largest
    register and shared-memory use."""
    import compile_check  # imports torch and the kernels: only for this kind

    lines = []
    for path in paths:
        rows = [compile_check.Compiled(**row) for row in load(path)]
        failing = sum(bool(r.problems) for r in rows)
        lines += [
            f"{len(rows)} specialisations, {failing} failing; {run_date(path)}.",
            "",
            compile_check.summary_table(rows),
        ]
    return "\n".join(lines) + "\n"


#: Where each attention target reads its ratio: (op, causal length or False for any, ratio key).
ATTENTION_TARGETS = {
    "attention_fwd": ("attention", False, "fwd_ratio"),
    "attention_bwd": ("attention", False, "bwd_ratio"),
    "causal_1024_fwd": ("attention_causal", 1024, "fwd_ratio"),
    "causal_1024_bwd": ("attention_causal", 1024, "bwd_ratio"),
    "causal_4096_fwd": ("attention_causal", 4096, "fwd_ratio"),
    "causal_4096_bwd": ("attention_causal", 4096, "bwd_ratio"),
}


def _tuned_attention(records: list[dict], op: str, n: int | bool, key: str):
    """The tuned fused kernel's ratio at an attention op (``n``: the causal length, False: any), else the
    shipped kernel's (a run whose sweep the budget cut)."""
    for backend in ("multimax/triton tuned", "multimax/triton shipped"):
        for r in records:
            if r.get("kind") == "timing" and r.get("op") == op and r.get("backend") == backend:
                if n is False or r["shape"][2] == n:
                    return r.get(key)
    return None


def measured_targets(records: list[dict]) -> dict[str, float | None]:
    """This run's value for each key of ``targets.TARGETS`` (None where the run has none)."""
    values = {key: _tuned_attention(records, *where) for key, where in ATTENTION_TARGETS.items()}
    eager = {r["backend"]: r for r in records if r.get("kind") == "step" and not r.get("compiled")}
    base = eager.get("softmax (SDPA flash)", {}).get("step_ms")
    tuned = eager.get("multimax tuned", eager.get("multimax shipped", {})).get("step_ms")
    values["step"] = tuned / base if tuned and base else None
    fused = [
        r for r in records if r.get("op") == "cross_entropy" and r.get("backend", "").startswith("multimax/triton")
    ]
    ratios = [r["fwd_bwd_ratio"] for r in fused if r.get("fwd_bwd_ratio") and r.get("ok", True)]
    values["cross_entropy"] = min(ratios, default=None)
    copy = next((r["copy_gbps"] for r in records if r.get("kind") == "ceiling"), None)
    rowwise = [r for r in records if r.get("op") == "rowwise" and r.get("ok") and r.get("fwd_ms")]
    best = min(rowwise, key=lambda r: r["fwd_ms"], default=None)
    values["rowwise"] = best["bytes_fwd"] / best["fwd_ms"] / 1e6 / copy if best and copy else None
    return values


def targets_table(records: list[dict]) -> list[str]:
    """The targets (``targets.py``) against this run's values (each measured against a baseline of the same run)."""
    lines = ["| target | bound | measured | met? |", "|---|---|---|---|"]
    measured = measured_targets(records)
    for key, target in TARGETS.items():
        value = measured[key]
        within = value is not None and (value <= target.bound if target.at_most else value >= target.bound)
        met = "–" if value is None else ("yes" if within else "no")
        sign = "≤" if target.at_most else "≥"
        lines.append(f"| {target.label} | {sign} {target.bound} | {fmt(value, 3)} | {met} |")
    return lines


def sweep_table(records: list[dict]) -> list[str]:
    """Per shape and kernel: candidates checked and passed, the fastest config and its time."""
    checks: dict[tuple, list[bool]] = {}
    for r in records:
        if r.get("kind") == "check":
            checks.setdefault((r["shape_name"], r["kernel"]), []).append(bool(r["ok"]))
    lines = [
        "| shape | kernel | checked | passed | fastest (m, n, warps, stages) | ms | shipped ms |",
        "|---|---|---|---|---|---|---|",
    ]
    shipped = {r["shape_name"]: r for r in records if r.get("kind") == "sweep" and r.get("kernel") is None}
    timed: dict[tuple, list[dict]] = {}
    for r in records:
        if r.get("kind") == "sweep" and r.get("kernel"):
            timed.setdefault((r["shape_name"], r["kernel"]), []).append(r)
    for (shape, kernel), group in timed.items():
        phase = "fwd_ms" if kernel == "forward" else "bwd_ms"
        best = min(group, key=lambda r: r[phase])
        c = best["config"]
        # causal 4,096 has causal 1,024's specialisation: its candidates were checked there
        results = checks.get(("causal_1k" if shape == "causal_4k" else shape, kernel), [])
        lines.append(
            f"| {shape} {best['shape']} | {kernel} | {len(results)} | {sum(results)} | "
            f"{c['block_m']}, {c['block_n']}, {c['num_warps']}, {c['num_stages']} | {fmt(best[phase])} | "
            f"{fmt(shipped.get(shape, {}).get(phase))} |"
        )
    return lines


def switch_table(records: list[dict]) -> list[str]:
    lines = ["| shape | switch | value | fwd ms | bwd ms |", "|---|---|---|---|---|"]
    for r in records:
        if r.get("kind") == "switch":
            lines.append(
                f"| {r['shape_name']} | {r['switch']} | {r['value']} | {fmt(r.get('fwd_ms'))} | "
                f"{fmt(r.get('bwd_ms'))} |"
            )
    return lines


def record_rows(records: list[dict], kind: str, row) -> list[str]:
    """``row(r)`` for each record of ``kind``, the record's error (if any) after the row."""
    return [row(r) + (f" {r['error']}" if r.get("error") else "") for r in records if r.get("kind") == kind]


def step_table(records: list[dict]) -> list[str]:
    def row(r: dict) -> str:
        return (
            f"| {r['backend']} | {'yes' if r.get('compiled') else 'no'} | {fmt(r.get('step_ms'))} | "
            f"{fmt(r.get('step_ratio'))} | {fmt(r.get('first_step_s'))} | {fmt(r.get('peak_mem_mb'), 5)} |"
        )

    header = ["| variant | compiled | step ms | × baseline | first step s | peak MB |", "|---|---|---|---|---|---|"]
    return header + record_rows(records, "step", row)


def text_step_table(records: list[dict]) -> list[str]:
    """Each text recipe's step, eager and compiled, with the compiled one's ratio to eager."""

    def row(r: dict) -> str:
        return (
            f"| `{r['config']}` | {r['vocab']:,} | {r['shape'][0]} × {r['shape'][1]} | "
            f"{'yes' if r['compiled'] else 'no'} | {fmt(r.get('step_ms'))} | {fmt(r.get('compiled_over_eager'))} | "
            f"{fmt(r.get('tokens_per_s'), 5)} | {fmt(r.get('first_step_s'))} | {fmt(r.get('peak_mem_mb'), 5)} |"
        )

    header = [
        "| config | vocabulary | batch × tokens | compiled | step ms | compiled / eager | tokens/s | first step s "
        "| peak MB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    return header + record_rows(records, "text_step", row)


def fit_table(records: list[dict]) -> list[str]:
    """Each ``mmlight fit``'s logged images/s (mean of the windows past the warm-up) beside the training
    step's of the same variant, and their ratio: what the data pipeline and Lightning leave of the step's rate."""

    def row(r: dict) -> str:
        mfu = r.get("mfu")
        return (
            f"| `{Path(r['config']).name}`{' (smoke)' if r.get('smoke') else ''} | "
            f"{'yes' if r.get('compiled') else 'no'} | {r['batch']} | "
            f"{r['max_steps']} ({fmt(r.get('last_logged_step'))}) | {r['loader_workers']} / {r['cpus']} | "
            f"{fmt(r.get('images_per_s'), 4)} | {percent(mfu) if mfu else '–'} | {r['step_backend']} | "
            f"{fmt(r.get('step_images_per_s'), 4)} | {fmt(r.get('fit_to_step'))} |"
        )

    header = [
        "| config | compiled | batch | steps (last logged) | loader workers / CPUs | fit images/s | MFU | "
        "step variant | step images/s | fit / step |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    return header + record_rows(records, "fit", row)


def render_run(records: list[dict]) -> str:
    """The Markdown of one ``gpu_run.py`` file."""
    first = records[0]
    env = next((r for r in records if r.get("kind") == "env"), {})
    ceiling = next((r for r in records if r.get("kind") == "ceiling"), {})
    lines = [
        f"\n### {first['device']}, torch {first['torch']}, triton {first['triton']}\n",
        f"Python {env.get('python', '–')}, CUDA {env.get('cuda', '–')}, cuDNN {env.get('cudnn', '–')}; "
        f"nvidia-smi at the start: {env.get('nvidia_smi') or '–'}. Measured ceilings: copy "
        f"{fmt(ceiling.get('copy_gbps'), 4)} GB/s (read + write), bf16 matrix product "
        f"{fmt(ceiling.get('bf16_mm_tflops'), 4)} TFLOP/s.\n",
        "#### Targets\n",
        *targets_table(records),
        "\n#### Tile sweep (each candidate checked against fp32 first)\n",
        *sweep_table(records),
        "\n#### Kernel switches (tuned tiles)\n",
        *switch_table(records),
        "\n#### Training step (× baseline: eager against softmax with SDPA flash, compiled against timm's)\n",
        *step_table(records),
    ]
    if any(r.get("kind") == "text_step" for r in records):
        lines += [
            "\n#### Text recipes' training step, eager and compiled (bf16 autocast, fused AdamW, one GPU's batch)\n",
            *text_step_table(records),
        ]
    if any(r.get("kind") == "fit" for r in records):
        lines += [
            "\n#### mmlight fit on synthetic ImageNet shards (images/s past the warm-up; fit / step: the data "
            "pipeline and Lightning's overhead)\n",
            *fit_table(records),
        ]
    skipped = [r for r in records if r.get("kind") in ("skipped", "error", "cut")]
    end = next((r for r in records if r.get("kind") == "end"), {})
    if skipped or end.get("not_reached"):
        lines.append("\n#### Skipped, failed or cut off\n")
        lines += [
            " ".join(filter(None, (f"- {r['section']}:", r.get("what"), r.get("reason") or r.get("error"))))
            for r in skipped
        ]
        lines += [f"- {name}: not reached ({end['reason']})" for name in end.get("not_reached", [])]
    timings = [r for r in records if r.get("kind") == "timing" and r.get("op") != "cross_entropy"]
    ce = [r for r in records if r.get("kind") == "timing" and r.get("op") == "cross_entropy"]
    lines.append("\n#### Kernels\n")
    lines.append(render(timings).rstrip())
    if ce:
        lines += [
            "",
            "| cross-entropy backend | fwd ms | fwd + bwd ms | × F.cross_entropy | peak MB |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['backend']} | {fmt(r.get('fwd_ms'))} | {fmt(r.get('fwd_bwd_ms'))} | "
            f"{fmt(r.get('fwd_bwd_ratio'))} | {fmt(r.get('peak_mem_mb'), 5)} |"
            for r in ce
        ]
    return "\n".join(lines) + "\n"


def render_prepare_text(paths: list[Path]) -> str:
    """``bench_prepare_text.py``: tokens/s on one thread of ``tokenizers`` alone and of ``mmlight prepare text``
    on the same text, medians over rounds with the range, and each over ``encode_batch`` in the same round."""
    return "\n".join(prepare_text_table(load(path)[0], run_date(path)) for path in paths)


def prepare_text_table(r: dict, date: str) -> str:
    """The table of one ``bench_prepare_text.py`` record."""
    heading = (
        f"{r['machine']}; Python {r['python']}, tokenizers {r['tokenizers']}, numpy {r['numpy']}; the python-docs "
        f"corpus: {r['documents']:,} documents, {r['bytes'] / 1e6:.1f} MB, {r['tokens']:,} tokens of a "
        f"{r['vocab_size']:,}-token byte-level BPE (trained once in {r['train_tokenizer_s']:.1f} s, not compared); "
        f"one thread each, {len(r['rounds'])} rounds side by side; load average (1 / 5 / 15 min) {load_average(r)}; "
        f"{date}."
    )
    labels = {
        "encode_batch": "`tokenizers` `encode_batch` (documents in memory)",
        "encode_batch_fast": "`tokenizers` `encode_batch_fast` (documents in memory)",
        "prepare": "`mmlight prepare text --workers 1` (read, split, encode, write shards)",
    }
    rows = []
    for key, label in labels.items():
        rates = [r["tokens"] / round_[f"{key}_s"] / 1e3 for round_ in r["rounds"]]
        ratios = [round_["encode_batch_s"] / round_[f"{key}_s"] for round_ in r["rounds"]]
        rows.append([label, f"{statistics.median(rates):.0f} ({span(rates, 0)})", f"{statistics.median(ratios):.2f}"])
    return headed_table(heading, ["", "k tokens/s per core (range)", "× encode_batch"], rows)


#: Each kind of record file: how to recognise one of its records, and its renderer.
KINDS: dict[str, tuple[Callable[[dict], bool], Callable[[list[Path]], str]]] = {
    "gpu_run": (lambda r: "kind" in r, lambda paths: "".join(render_run(load(path)) for path in paths)),
    "multimax": (
        lambda r: "fwd_ms" in r or "step_ms" in r,
        lambda paths: render(all_records(paths), named_dates(paths)),
    ),
    "loader": (lambda r: r.get("op") == "images", render_loader),
    "resume": (lambda r: r.get("bench") == "resume_replay", render_resume),
    "repro": (lambda r: r.get("check") == "same_seed_same_losses", render_repro),
    "quickstart_spread": (lambda r: r.get("check") == "quickstart_spread", render_quickstart_spread),
    "pillow_build_pixels": (lambda r: r.get("op") == "pillow_build_pixels", render_pillow_pixels),
    "attention_stats_cost": (lambda r: "runs" in r and "meta" in r, render_attention_stats_cost),
    "attention_stats_fit_time": (lambda r: "paired_difference_s" in r, render_fit_time),
    "reweighting_step_time": (lambda r: "median_ratio_to_softmax" in r, render_step_time),
    "compile_report": (lambda r: "kernel" in r and "capability" in r, render_compile_report),
    "compile_cpu": (lambda r: r.get("benchmark") == "compile_cpu", render_compile_cpu),
    "prepare_text": (lambda r: r.get("benchmark") == "prepare_text", render_prepare_text),
}


def kind_of(path: Path) -> str:
    """The kind of a record file, from its first record (an error naming the file if none matches)."""
    records = load(path)
    if not records:  # a run killed before its first record, or an empty hand-made file
        raise SystemExit(f"{path}: holds no records")
    for kind, (matches, _) in KINDS.items():
        if matches(records[0]):
            return kind
    raise SystemExit(f"{path}: not a record file of a known benchmark ({', '.join(KINDS)})")


def render_files(paths: list[Path]) -> str:
    """The tables of ``paths``: files of one kind together, the kinds in the order they first appear."""
    by_kind: dict[str, list[Path]] = {}
    for path in paths:
        by_kind.setdefault(kind_of(path), []).append(path)
    return "\n".join(render_kind(kind, kind_paths) for kind, kind_paths in by_kind.items())


def render_kind(kind: str, paths: list[Path]) -> str:
    """The tables of record files of one kind; a record without a field its table needs (an older script's,
    or a hand edit) stops with the files and the field named."""
    render = KINDS[kind][1]  # kind_of has checked the kind
    try:
        return render(paths)
    except KeyError as error:
        names = ", ".join(str(path) for path in paths)
        raise SystemExit(f"{names}: a {kind} record has no {error.args[0]!r} field, which its table needs") from error


#: A rendered block of BENCHMARKS.md: the record files (relative to the repository root), then their tables.
BLOCK = re.compile(r"<!-- report: (?P<paths>[^>]+?) -->\n(?P<body>.*?)<!-- end report -->", re.DOTALL)


def update(doc: Path) -> str:
    """``doc`` with every block between ``<!-- report: FILES -->`` and ``<!-- end report -->`` rendered
    again from its files (named relative to the folder ``doc`` is in)."""

    def rendered(block: re.Match) -> str:
        paths = [doc.parent / name for name in block["paths"].split()]
        return f"<!-- report: {block['paths']} -->\n{render_files(paths)}<!-- end report -->"

    return BLOCK.sub(rendered, read(doc))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", type=Path, help="record files under benchmarks/results/")
    parser.add_argument("--update", type=Path, metavar="DOC", help="render DOC's report blocks again, in place")
    args = parser.parse_args(argv)
    if args.update:
        args.update.write_text(update(args.update))
    elif args.paths:
        sys.stdout.write(render_files(args.paths))
    else:
        parser.error("name record files, or --update BENCHMARKS.md")


if __name__ == "__main__":
    main()
