"""Render benchmark records (JSON lines from ``bench_multimax.py``) as the Markdown tables of
BENCHMARKS.md, one table per op and shape, with the device and versions in the heading.

    python benchmarks/report.py benchmarks/results/<file>.jsonl >> BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path


def fmt(value, digits=3) -> str:
    if value is None:
        return "–"
    if isinstance(value, dict):
        return " / ".join(fmt(v, digits) for v in value.values())
    return f"{value:.{digits}g}" if isinstance(value, float) else str(value)


def render(records: list[dict]) -> str:
    lines = []
    key = lambda r: (r["device"], r["torch"], r["triton"], r["op"], str(r["shape"]), r["dtype"])  # noqa: E731
    for (device, torch_v, triton_v, op, shape, dtype), group in itertools.groupby(records, key=key):
        group = list(group)
        lines.append(f"\n#### {op} {shape} {dtype} — {device}, torch {torch_v}, triton {triton_v}\n")
        if "step_ms" in group[0] or any("step_ms" in r for r in group):
            lines.append("| backend | step ms | × baseline | peak MB |")
            lines.append("|---|---|---|---|")
            for r in group:
                lines.append(
                    f"| {r['backend']} | {fmt(r.get('step_ms'))} | {fmt(r.get('step_ratio'))} | "
                    f"{fmt(r.get('peak_mem_mb'), 5)} |" + (f" {r['error']}" if r.get("error") else "")
                )
            continue
        lines.append(
            "| backend | fwd ms | bwd ms | fwd × base | bwd × base | GB/s fwd / bwd | % peak fwd / bwd | "
            "TFLOP/s fwd | peak MB |"
        )
        lines.append("|---|---|---|---|---|---|---|---|---|")
        for r in group:
            frac = r.get("frac_peak_bw")
            pct = {k: v and 100 * v for k, v in frac.items()} if frac else None
            lines.append(
                f"| {r['backend']} | {fmt(r.get('fwd_ms'))} | {fmt(r.get('bwd_ms'))} | "
                f"{fmt(r.get('fwd_ratio'))} | {fmt(r.get('bwd_ratio'))} | {fmt(r.get('gbps'), 4)} | "
                f"{fmt(pct)} | {fmt(r.get('tflops_fwd'))} | {fmt(r.get('peak_mem_mb'), 5)} |"
                + (f" {r['error']}" if r.get("error") else "")
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", help="JSON-lines files written by bench_multimax.py")
    paths = parser.parse_args(argv).paths
    records = [json.loads(line) for path in paths for line in Path(path).read_text().splitlines() if line.strip()]
    sys.stdout.write(render(records))


if __name__ == "__main__":
    main()
