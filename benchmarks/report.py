"""Render benchmark records (JSON lines from ``bench_multimax.py`` or ``gpu_run.py``) as the
Markdown tables of BENCHMARKS.md, one table per op and shape, with the device and versions in the
heading. A ``gpu_run.py`` file (its records carry a ``kind``) also gets the issue's targets against
what was measured, the tile sweep, the kernel switches, the training steps and what was skipped.

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


#: The attention targets: (label, (op, causal length or False for any, ratio key), bound).
TARGETS = [
    ("attention (256, 6, 197, 64) forward / SDPA flash", ("attention", False, "fwd_ratio"), 1.2),
    ("attention (256, 6, 197, 64) backward / SDPA flash", ("attention", False, "bwd_ratio"), 1.5),
    ("causal attention N = 1,024 forward / SDPA flash", ("attention_causal", 1024, "fwd_ratio"), 1.3),
    ("causal attention N = 1,024 backward / SDPA flash", ("attention_causal", 1024, "bwd_ratio"), 2.0),
    ("causal attention N = 4,096 forward / SDPA flash", ("attention_causal", 4096, "fwd_ratio"), 1.3),
    ("causal attention N = 4,096 backward / SDPA flash", ("attention_causal", 4096, "bwd_ratio"), 2.0),
]


def _tuned_attention(records: list[dict], op: str, n: int | bool, key: str):
    """The tuned fused kernel's ratio at an attention op (``n``: the causal length, False: any)."""
    for r in records:
        if r.get("kind") == "timing" and r.get("op") == op and r.get("backend") == "multimax/triton tuned":
            if n is False or r["shape"][2] == n:
                return r.get(key)
    return None


def targets_table(records: list[dict]) -> list[str]:
    """The issue's targets against this run's ratios (each measured against a baseline of the same run)."""
    lines = ["| target | bound | measured | met? |", "|---|---|---|---|"]

    def row(label, value, bound, lower=True, digits=3):
        met = "–" if value is None else ("yes" if (value <= bound if lower else value >= bound) else "no")
        sign = "≤" if lower else "≥"
        lines.append(f"| {label} | {sign} {bound} | {fmt(value, digits)} | {met} |")

    for label, (op, n, key), bound in TARGETS:
        row(label, _tuned_attention(records, op, n, key), bound)
    eager = {r["backend"]: r for r in records if r.get("kind") == "step" and not r.get("compiled")}
    base = eager.get("softmax (SDPA flash)", {}).get("step_ms")
    tuned = eager.get("multimax tuned", {}).get("step_ms")
    row("DeiT-small step, MultiMax tuned / softmax (SDPA flash), eager", tuned / base if tuned and base else None, 1.05)
    fused = [
        r for r in records if r.get("op") == "cross_entropy" and r.get("backend", "").startswith("multimax/triton")
    ]
    ratios = [r["fwd_bwd_ratio"] for r in fused if r.get("fwd_bwd_ratio") and r.get("ok", True)]
    row("MultiMax cross-entropy fw + bw / F.cross_entropy (best setting)", min(ratios, default=None), 0.5)
    copy = next((r["copy_gbps"] for r in records if r.get("kind") == "ceiling"), None)
    rowwise = [r for r in records if r.get("op") == "rowwise" and r.get("ok") and r.get("fwd_ms")]
    best = min(rowwise, key=lambda r: r["fwd_ms"], default=None)
    fraction = best["bytes_fwd"] / best["fwd_ms"] / 1e6 / copy if best and copy else None
    row("row-wise forward, best config, of the measured copy bandwidth", fraction, 0.7, lower=False)
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


def step_table(records: list[dict]) -> list[str]:
    lines = ["| variant | compiled | step ms | × baseline | first step s | peak MB |", "|---|---|---|---|---|---|"]
    for r in records:
        if r.get("kind") == "step":
            lines.append(
                f"| {r['backend']} | {'yes' if r.get('compiled') else 'no'} | {fmt(r.get('step_ms'))} | "
                f"{fmt(r.get('step_ratio'))} | {fmt(r.get('first_step_s'))} | {fmt(r.get('peak_mem_mb'), 5)} |"
                + (f" {r['error']}" if r.get("error") else "")
            )
    return lines


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
    skipped = [r for r in records if r.get("kind") in ("skipped", "error")]
    if skipped:
        lines.append("\n#### Skipped or failed\n")
        lines += [
            " ".join(filter(None, (f"- {r['section']}:", r.get("what"), r.get("reason") or r.get("error"))))
            for r in skipped
        ]
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", help="JSON-lines files written by bench_multimax.py or gpu_run.py")
    paths = parser.parse_args(argv).paths
    for path in paths:
        records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
        sys.stdout.write(render_run(records) if any("kind" in r for r in records) else render(records))


if __name__ == "__main__":
    main()
