"""benchmarks/results/ and BENCHMARKS.md: every record file follows the naming pattern and is named in
BENCHMARKS.md, and every table BENCHMARKS.md renders from records is what ``benchmarks/report.py``
renders from them today (so the document cannot drift from its records)."""

import datetime
import importlib
import json
import os
import platform
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import record_name

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
DOC = (ROOT / "BENCHMARKS.md").read_text()

# The blocks as BENCHMARKS.md's method section describes them, parsed here without report.py's regex.
BLOCKS = [
    (paths.split(), body)
    for paths, body in re.findall(r"<!-- report: ([^>\n]+?) -->\n(.*?)<!-- end report -->", DOC, flags=re.DOTALL)
]


def report(paths: list[str]) -> str:
    """``python benchmarks/report.py PATHS`` as a user runs it (the script's folder on its ``sys.path``)."""
    return subprocess.run(
        [sys.executable, "benchmarks/report.py", *paths], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout


def test_every_record_file_follows_the_pattern_and_is_named_in_benchmarks_md():
    files = sorted(path.name for path in RESULTS.iterdir())
    assert files
    off_pattern = [name for name in files if record_name.PATTERN.fullmatch(name) is None]
    assert off_pattern == [], "named off <benchmark>-<device>-<versions>-<YYYYMMDD>[-<tag>].<ext>"
    for name in files:  # the date part is a real day
        datetime.datetime.strptime(record_name.PATTERN.fullmatch(name)["date"], "%Y%m%d")
    unreferenced = [name for name in files if f"benchmarks/results/{name}" not in DOC]
    assert unreferenced == [], "in benchmarks/results/ but not named in BENCHMARKS.md: render or git rm them"


def test_every_record_file_a_report_block_names_exists():
    assert len(BLOCKS) >= 9
    missing = [path for paths, _ in BLOCKS for path in paths if not (ROOT / path).is_file()]
    assert missing == []


@pytest.mark.parametrize("paths, body", BLOCKS, ids=[Path(paths[0]).name for paths, _ in BLOCKS])
def test_each_rendered_table_is_what_report_py_renders_from_its_records(paths, body):
    assert body == report(paths), "run: python benchmarks/report.py --update BENCHMARKS.md"


def test_a_record_file_unreadable_missing_a_field_cut_off_empty_or_not_of_objects_stops_report_py_naming_it(tmp_path):
    source = record_name.newest(list(RESULTS.glob("quickstart_spread-*.jsonl")))
    records = [json.loads(line) for line in source.read_text().splitlines()]
    lacking = tmp_path / source.name
    lacking.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "val/top1"}) + "\n" for r in records))
    cut = tmp_path / "cut" / source.name
    cut.parent.mkdir()
    cut.write_text(source.read_text()[:-20])  # the last line cut off, as a run killed mid-write leaves it
    edited = tmp_path / "edited.json"
    edited.write_text('[\n{"a": 1},\n{"a": 1,,}\n]\n')  # a .json is one document: its line 3 is wrong
    empty = tmp_path / "empty" / source.name
    empty.parent.mkdir()
    empty.write_text("\n")  # a run killed before its first record
    scalar = tmp_path / "scalar" / source.name
    scalar.parent.mkdir()
    scalar.write_text(source.read_text().splitlines()[0] + "\n3\n")  # a hand edit: line 2 is no record
    strings = tmp_path / "strings.json"
    strings.write_text('[{"a": 1}, "a"]')  # one object, then one that is not
    unwritten = tmp_path / "BENCHMARKS.md"  # --update of a doc that is not there
    renamed, folder = tmp_path / "renamed.jsonl", tmp_path / "empty"
    for argv, message in (
        ([str(lacking)], f"{lacking}: a quickstart_spread record has no 'val/top1' field, which its table needs"),
        ([str(cut)], f"{cut}:{len(records)}: not JSON ("),
        ([str(edited)], f"{edited}:3: not JSON ("),
        ([str(empty)], f"{empty}: holds no records"),
        ([str(scalar)], f"{scalar}:2: a record is not a JSON object"),
        ([str(strings)], f"{strings}:1: a record is not a JSON object"),
        ([str(renamed)], f"{renamed}: cannot be read (No such file or directory)"),
        ([str(folder)], f"{folder}: cannot be read (Is a directory)"),
        (["--update", str(unwritten)], f"{unwritten}: cannot be read (No such file or directory)"),
    ):
        run = subprocess.run([sys.executable, "benchmarks/report.py", *argv], cwd=ROOT, capture_output=True, text=True)
        assert (run.returncode, run.stdout) == (1, "")
        assert run.stderr.startswith(message), run.stderr
        assert "Traceback" not in run.stderr


def test_the_loader_table_holds_each_builds_range_of_rates_and_same_run_ratios():
    """Per Pillow build and copy count, the lowest and highest samples/s of the uint8 shards over the
    build's runs, and of the uint8 / per-copy ratio recomputed within each run from its samples/s, are
    the ends of the table's cells."""
    paths = sorted(str(p.relative_to(ROOT)) for p in RESULTS.glob("loader-*.jsonl"))
    rows = {
        line.split(" | ")[0].strip("| *"): line.strip("|").split(" | ")[1:-1]
        for line in report(paths).splitlines()
        if line.startswith("| ")
    }
    header = [
        cell.strip()
        for cell in next(line for line in report(paths).splitlines() if line.startswith("| pipeline"))
        .strip("|")
        .split(" | ")[1:-1]
    ]
    runs: dict[tuple[int, str], list[dict]] = {}
    for path in paths:
        records = [
            r for r in map(json.loads, (ROOT / path).read_text().splitlines()) if r["op"] == "image_loader_deit_train"
        ]
        build = "Pillow-SIMD" if "pillowsimd" in path else "Pillow 13"
        for copies in (1, 3):
            runs.setdefault((copies, build), []).append(
                {r["backend"]: r["samples_per_s_per_worker"] for r in records if r["copies"] == copies}
            )
    assert len(header) == len(runs) == 4
    for column, name in enumerate(header):
        copies = 1 if name.startswith("1 copy") else 3
        build = "Pillow-SIMD" if "Pillow-SIMD" in name else "Pillow 13"
        assert f"({len(runs[copies, build])} runs)" in name
        uint8 = [run["shards, uint8"] for run in runs[copies, build]]
        ratios = [run["shards, uint8"] / run["shards, per-copy decode"] for run in runs[copies, build]]
        assert rows["shards, uint8"][column].split("-") == [f"{min(uint8):.1f}", f"{max(uint8):.1f}"]
        # the records keep rates to 0.1 and the table ratios to 0.01: together at most 0.006 apart
        ends = [float(end) for end in rows["uint8 / per-copy"][column].split("-")]
        assert ends == pytest.approx([min(ratios), max(ratios)], abs=0.006)


def test_the_step_time_medians_are_the_scripts_own_medians():
    """report.py recomputes each function's median ratio from the rounds; reweighting_step_time.py stored
    its own: the two must agree to the digits shown."""
    paths = sorted(str(p.relative_to(ROOT)) for p in RESULTS.glob("reweighting_step_time-*.json"))
    rows = {line.split(" | ")[0].lstrip("| "): line for line in report(paths).splitlines() if line.startswith("| ")}
    for column, path in enumerate(paths, start=1):
        record = json.loads((ROOT / path).read_text())
        for function, median in record["median_ratio_to_softmax"].items():
            cell = rows[function].strip(" |").split(" | ")[column]
            assert cell.startswith(f"{median:.2f} ("), (function, path)
            ratios = [round_[function] / round_["softmax"] for round_ in record["rounds"]]
            assert statistics.median(ratios) == pytest.approx(median)


def markdown_rows(rendered: str) -> list[list[str]]:
    """The body cells of every Markdown table in ``rendered`` (header and rule rows left out)."""
    lines = [line for line in rendered.splitlines() if line.startswith("|")]
    bodies = [
        line
        for i, line in enumerate(lines)
        if not line.startswith("|---") and not (i + 1 < len(lines) and lines[i + 1].startswith("|---"))
    ]
    return [[cell.strip() for cell in line.strip().strip("|").split(" | ")] for line in bodies]


def test_the_kernel_table_has_one_cell_per_record_with_its_times():
    """bench_multimax.py's records: each (op, shape, dtype) is one row, its first record the baseline cell
    and each other record the cell under its backend's column, with the record's times to three
    significant digits, or its error's kind; every record has a cell and no cell is made up."""
    for path in sorted(RESULTS.glob("multimax-*.jsonl")):
        records = [json.loads(line) for line in path.read_text().splitlines()]
        rendered = report([str(path.relative_to(ROOT))])
        header = next(line for line in rendered.splitlines() if line.startswith("| op |"))
        columns = [cell.strip() for cell in header.strip().strip("|").split(" | ")]
        rows = {tuple(row[:3]): row for row in markdown_rows(rendered) if len(row) == len(columns)}
        filled = sum(cell != "" for row in rows.values() for cell in row[3:])
        ops = [r for r in records if "step_ms" not in r]
        assert filled == len(ops)
        seen = set()
        for r in ops:
            row = rows[(r["op"], str(r["shape"]), r["dtype"])]
            first = (r["op"], str(r["shape"]), r["dtype"]) not in seen
            seen.add((r["op"], str(r["shape"]), r["dtype"]))
            cell = row[3].removeprefix(f"{r['backend']}: ") if first else row[columns.index(r["backend"])]
            if r.get("error"):
                assert r["error"].startswith(cell)
            else:
                assert cell.startswith(f"{r['fwd_ms']:.3g} / {r['bwd_ms']:.3g} ms")
                assert first or f"{r['fwd_ratio']:.3g}× / {r['bwd_ratio']:.3g}×" in cell
                shown_mb = float(re.search(r"([\d,.]+) MB", cell).group(1).replace(",", ""))
                assert shown_mb == pytest.approx(r["peak_mem_mb"], rel=5e-3)  # 3 digits, or whole MB from 100
        steps = {tuple(row[:4]): row for row in markdown_rows(rendered) if len(row) == 8}
        for r in (r for r in records if "step_ms" in r):
            assert steps[(r["op"], str(r["shape"]), r["dtype"], r["backend"])][4] == f"{r['step_ms']:.3g}"


def test_the_compile_table_counts_each_kernels_specialisations_per_target():
    """compile_report.py's records, counted here per kernel and sm: the table's ``a / b`` cells."""
    for path in sorted(RESULTS.glob("compile_report-*.json")):
        records = json.loads(path.read_text())
        rows = {row[0]: row for row in markdown_rows(report([str(path.relative_to(ROOT))]))}
        assert sorted(rows) == sorted({r["kernel"] for r in records})
        for kernel, row in rows.items():
            counts = [sum(r["kernel"] == kernel and r["capability"] == sm for r in records) for sm in (80, 90)]
            registers = [
                max(r["registers"] for r in records if r["kernel"] == kernel and r["capability"] == sm)
                for sm in (80, 90)
            ]
            assert row[1] == " / ".join(map(str, counts)) and row[2] == " / ".join(map(str, registers))


def test_record_path_names_a_file_the_pattern_accepts():
    when = datetime.datetime(2026, 11, 23, 13, 28, tzinfo=datetime.timezone.utc)
    versions = [("torch", "2.14.1+cu130"), ("Pillow-SIMD", "12.1.1.post0")]
    path = record_name.record_path("loader", "cpu", versions, "jsonl", when=when, folder=Path("out"))
    assert path == Path("out/loader-cpu-torch2.14_pillowsimd12.1-20261123-1328.jsonl")
    assert record_name.PATTERN.fullmatch(path.name)["tag"] == "1328"
    lm = record_name.record_path("reweighting_step_time", "cpu", versions[:1], "json", tag="lm", when=when)
    assert lm.name == "reweighting_step_time-cpu-torch2.14-20261123-lm.json"
    assert record_name.record_path("repro", "cpu", versions[:1], "jsonl", tag="", when=when).name == (
        "repro-cpu-torch2.14-20261123.jsonl"
    )
    with pytest.raises(ValueError, match="naming pattern"):
        record_name.record_path("Loader Bench", "cpu", versions, "jsonl", when=when)
    with pytest.raises(ValueError, match="does not start with a number"):
        record_name.version_part("torch", "unknown")


@pytest.mark.parametrize(
    "name, part",
    [
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA A100-SXM4-80GB", "a100"),
        ("NVIDIA GeForce RTX 3090", "3090"),
        ("cpu (x86_64)", "cpu"),
    ],
)
def test_device_part_is_the_gpu_model_or_cpu(name, part):
    assert record_name.device_part(name) == part


def test_newest_is_the_latest_date_then_the_latest_time_of_that_day():
    names = [
        "quickstart_spread-cpu-torch2.14-20261128-0915.jsonl",
        "quickstart_spread-cpu-torch2.14-20261128-2250.jsonl",
        "quickstart_spread-cpu-torch2.15-20261127-2359.jsonl",
        "quickstart_spread-cpu-torch2.14-20261128.jsonl",  # no tag: older than any tagged run of its day
    ]
    for order in (names, names[::-1]):  # glob's order is the file system's: the answer must not follow it
        assert record_name.newest([Path(n) for n in order]).name == names[1]
    with pytest.raises(ValueError, match="notes.txt"):
        record_name.newest([Path(names[0]), Path("notes.txt")])


def test_a_span_is_low_high_or_one_figure_where_they_agree_to_the_digits_shown(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # report.py imports record_name from beside it
    span = importlib.import_module("report").span
    assert span([2.5, 1.04, 1.96], 1) == "1.0-2.5"  # min and max, in that order, whatever the input's
    assert span([3.14, 3.141, 3.1], 1) == "3.1"
    assert span([96.14, 96.16], 1) == "96.1-96.2"  # apart once rounded: both shown
    assert span([7], 0) == "7"


def test_cpu_description_names_the_first_processors_model_and_the_core_count(tmp_path):
    # /proc/cpuinfo's raw format: one block per logical CPU, "key<TAB>: value" lines
    cpuinfo = tmp_path / "cpuinfo"
    fields = (
        "vendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC 9654 96-Core Processor\n"
    )
    blocks = [f"processor\t: {n}\n{fields}" for n in (0, 1)]
    cpuinfo.write_text("\n".join(blocks))
    machine, cores = platform.machine(), f"{os.cpu_count()} cores"
    assert record_name.cpu_description(cpuinfo) == f"{machine}, AMD EPYC 9654 96-Core Processor, {cores}"
    assert record_name.cpu_description(tmp_path / "absent") == f"{machine}, {cores}"
    cpuinfo.write_text("processor\t: 0\nCPU implementer\t: 0x41\n")  # aarch64's cpuinfo has no model name
    assert record_name.cpu_description(cpuinfo) == f"{machine}, {cores}"


def test_the_cpu_compile_table_recomputes_the_ratio_and_the_steps_to_repay_from_the_times():
    """compile_cpu.py's records: compiled / eager and the steps that repay the compile time (the first
    compiled step over the time each later step saves), recomputed here from the step times."""
    for path in sorted(RESULTS.glob("compile_cpu-*.json")):
        record = json.loads(path.read_text())
        rows = {row[0]: row for row in markdown_rows(report([str(path.relative_to(ROOT))]))}
        assert sorted(rows) == sorted(f["function"] for f in record["results"])
        for f in record["results"]:
            eager, compiled = f["eager_step_ms"], f["compiled_step_ms"]
            repay = f["first_compiled_step_s"] / ((eager - compiled) / 1e3)
            assert rows[f["function"]][1:4] == [f"{eager:.0f} ms", f"{compiled:.0f} ms", f"{compiled / eager:.2f}"]
            assert rows[f["function"]][5] == f"{repay:,.0f}"


def test_the_quickstart_table_puts_each_run_under_its_environment_and_ends_with_the_range():
    """quickstart_spread.py's records, looked up here by config, instructions and threads: the cell under
    each ``CAPABILITY, THREADS`` column is that run's val/top1, and the last cell the extremes."""
    for path in sorted(RESULTS.glob("quickstart_spread-*.jsonl")):
        records = [json.loads(line) for line in path.read_text().splitlines()]
        lines = [
            line.strip("|").split(" | ")
            for line in report([str(path.relative_to(ROOT))]).splitlines()
            if line.startswith("| ")
        ]
        header, rows = [cell.strip() for cell in lines[0]], {row[0].strip("` "): row for row in lines[1:]}
        assert header[0] == "config" and header[-1] == "range"
        assert set(rows) == {r["config"] for r in records}
        for r in records:
            column = header.index(f"{r['capability']}, {r['threads']}")
            assert rows[r["config"]][column].strip() == f"{100 * r['val/top1']:.1f}%"
        for config, row in rows.items():
            top1 = [100 * r["val/top1"] for r in records if r["config"] == config]
            assert len(row) == len(header) == len(top1) + 2
            assert row[-1].strip(" *") == f"{min(top1):.1f}-{max(top1):.1f}%"


def test_the_quickstart_table_gives_runs_of_one_environment_one_column(tmp_path):
    """On a CPU without AVX-512, the AVX2 cap changes nothing: torch reports AVX2 for both, and the capped
    runs share the uncapped runs' column (its range) instead of a second column with the same heading."""
    base = {"date": "2026-11-28T10:00:00+00:00", "device": "x86_64, 2 cores", "python": "3.12.3", "torch": "2.14.1"}
    runs = [  # (isa, threads, val/top1 in images of 359)
        ("native", 1, 340), ("native", 2, 343), ("avx2", 1, 341), ("avx2", 2, 343),
    ]  # fmt: skip
    path = tmp_path / "quickstart_spread-cpu-torch2.14-20261128-1000.jsonl"
    records = [
        {**base, "check": "quickstart_spread", "config": "configs/quickstart/digits_multimax.yaml", "isa": isa}
        | {"threads": threads, "capability": "AVX2", "val/top1": images / 359}
        for isa, threads, images in runs
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    lines = [line.strip("|").split(" | ") for line in report([str(path)]).splitlines() if line.startswith("| ")]
    header, row = [cell.strip() for cell in lines[0]], [cell.strip(" *") for cell in lines[1]]
    assert header == ["config", "AVX2, 1", "AVX2, 2", "range"]
    one, two = f"{100 * 340 / 359:.1f}-{100 * 341 / 359:.1f}%", f"{100 * 343 / 359:.1f}%"
    assert row == [
        "`configs/quickstart/digits_multimax.yaml`",
        one,
        two,
        f"{100 * 340 / 359:.1f}-{100 * 343 / 359:.1f}%",
    ]


def test_the_readme_promises_the_digits_quick_starts_measured_ranges():
    """The expected results are the newest quickstart_spread.py record's ranges: in points in the README,
    in points and in images of 359 in docs/experiments.md."""
    path = record_name.newest(list(RESULTS.glob("quickstart_spread-*.jsonl")))
    records = [json.loads(line) for line in path.read_text().splitlines()]
    readme, experiments = (ROOT / "README.md").read_text(), (ROOT / "docs" / "experiments.md").read_text()
    for config in ("digits_multimax", "digits_softmax"):
        top1 = sorted(r["val/top1"] for r in records if Path(r["config"]).stem == config)
        images = [top1[0] * 359, top1[-1] * 359]
        assert images == pytest.approx([round(n) for n in images], abs=1e-3)  # whole images of 359
        points = f"{100 * top1[0]:.1f}-{100 * top1[-1]:.1f}%"
        assert points in readme, f"README.md should promise {points} for {config}"
        promise = f"{points} ({round(images[0])}-{round(images[1])} of 359"
        assert promise in experiments, f"docs/experiments.md should promise {promise} for {config}"


def test_the_prepare_text_table_recomputes_each_rate_and_its_ratio_to_encode_batch_from_the_seconds():
    """bench_prepare_text.py's records: tokens over each round's seconds, the median over rounds, and each
    over encode_batch in the same round, recomputed here; the preparation's row is its own."""
    paths = sorted(RESULTS.glob("prepare_text-*.json"))
    assert paths
    for path in paths:
        record = json.loads(path.read_text())
        rows = markdown_rows(report([str(path.relative_to(ROOT))]))
        names = [row[0].split("`")[1] for row in rows]
        assert names == ["tokenizers", "tokenizers", "mmlight prepare text --workers 1"]
        for row, key in zip(rows, ("encode_batch", "encode_batch_fast", "prepare")):
            seconds = [r[f"{key}_s"] for r in record["rounds"]]
            assert row[1].split(" ")[0] == f"{statistics.median(record['tokens'] / s / 1e3 for s in seconds):.0f}"
            ratio = statistics.median(r["encode_batch_s"] / r[f"{key}_s"] for r in record["rounds"])
            assert row[2] == f"{ratio:.2f}"
        assert rows[2][2] == f"{record['ratio_prepare_over_encode_batch']:.2f}"
