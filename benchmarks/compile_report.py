"""Compile every Triton kernel specialisation for sm_80 (A100) and sm_90 (H100), without a GPU,
and record registers, spills and shared memory (see `benchmarks/compile_check.py`).

    python benchmarks/compile_report.py            # full matrix, both targets, ~15 min on 2 cores
    python benchmarks/compile_report.py --matrix shipped
    python benchmarks/compile_report.py --family attention --dtype bf16   # recompile a part
    python benchmarks/compile_report.py --matrix shipped --switch PARAM_SUMS_PER_PROGRAM

Writes ``benchmarks/results/compile_report-cpu-<versions>-<date>-<matrix>[_<switches>].json`` and ``.md``
(a summary table per kernel and target, then one row per compiled kernel; ``--switch`` turns kernel
switches of ``mmlight/kernels/attention.py``, ``cross_entropy.py`` or ``rowwise.py`` on and adds their
names to the tag); ``benchmarks/report.py`` renders the summary in BENCHMARKS.md. Rerun it
whenever a kernel or its tile sizes change. Exit status 1 if any kernel fails a check.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from dataclasses import asdict
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # before mmlight.kernels is imported: the compiled kernels

import json  # noqa: E402

import compile_check  # noqa: E402  (beside this script, which Python puts on sys.path)
import torch  # noqa: E402
import triton  # noqa: E402
from record_name import PATTERN, newest, record_path  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
FAMILIES = ("rowwise", "attention", "cross_entropy")


def render(results: list[compile_check.Compiled], matrix: str) -> str:
    """The Markdown report: versions, the summary table, the per-kernel table."""
    failing = sum(bool(r.problems) for r in results)
    head = (
        f"Kernels compiled offline for sm_80 and sm_90 (matrix `{matrix}`) with triton {triton.__version__} "
        f"and its bundled ptxas, torch {torch.__version__}, on {platform.machine()} without a GPU. "
        f"{len(results)} specialisations, {failing} failing a check (spills, shared memory above "
        f"163 KB / 227 KB, registers x threads above 64K).\n"
    )
    return "\n".join(
        [
            head,
            compile_check.summary_table(results),
            "",
            compile_check.TABLE_HEADER,
            *map(compile_check.format_row, results),
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--matrix", choices=("shipped", "full"), default="full")
    parser.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1))
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--family",
        nargs="+",
        choices=FAMILIES,
        default=list(FAMILIES),
        help="recompile only these kernel families; the report keeps the other rows",
    )
    parser.add_argument(
        "--dtype",
        nargs="+",
        choices=list(compile_check.DTYPES),
        default=list(compile_check.DTYPES),
        help="recompile only these dtypes; the report keeps the other rows",
    )
    parser.add_argument(
        "--switch",
        nargs="+",
        default=[],
        metavar="NAME",
        help="kernel switches of mmlight/kernels/attention.py, cross_entropy.py or rowwise.py to turn on "
        "(e.g. PARAM_SUMS_PER_PROGRAM)",
    )
    args = parser.parse_args(argv)
    from mmlight.kernels import attention, cross_entropy, rowwise

    for name in args.switch:
        module = next(
            (m for m in (attention, cross_entropy, rowwise) if isinstance(getattr(m, name, None), bool)), None
        )
        if module is None or not name.isupper():
            parser.error(
                f"{name} is not a kernel switch of mmlight/kernels/attention.py, cross_entropy.py or rowwise.py"
            )
        setattr(module, name, True)
    cases = compile_check.full_matrix() if args.matrix == "full" else compile_check.shipped_cases()
    cases = [case for case in cases if case.family in args.family and case.dtype in args.dtype]
    results = compile_check.check_cases(
        cases, compile_check.CAPABILITIES, args.jobs, log=lambda line: print(line, file=sys.stderr, flush=True)
    )
    args.out.mkdir(parents=True, exist_ok=True)
    versions = [("triton", triton.__version__), ("torch", torch.__version__)]
    tag = "_".join([args.matrix, *(name.lower() for name in args.switch)])
    json_path = record_path("compile_report", "cpu", versions, "json", tag=tag, folder=args.out)
    md_path = json_path.with_name(json_path.name.removesuffix(".json") + ".md")
    earlier = [p for p in args.out.glob(f"compile_report-*-{tag}.json") if PATTERN.fullmatch(p.name)]
    if earlier:  # keep the rows of the families and dtypes not recompiled, from the latest report
        latest = newest(earlier)
        kept = [
            compile_check.Compiled(**row)
            for row in json.loads(latest.read_text())
            if not (row["family"] in args.family and row["dtype"] in args.dtype)
        ]
        results = kept + results
    json_path.write_text(json.dumps([asdict(r) for r in results], indent=1) + "\n")
    md_path.write_text(render(results, args.matrix))
    print(f"wrote {json_path} and {md_path}")
    return 1 if any(r.problems for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
