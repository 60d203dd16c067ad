"""Same seed, same run: each quick start trained three times for ``--steps`` steps on the CPU (seed
0, seed 0 again, seed 1), comparing the per-step training losses that TensorBoard logged.

    python benchmarks/check_reproducible.py                  # the three MultiMax quick starts, 100 steps
    python benchmarks/check_reproducible.py --configs configs/quickstart/lm_softmax.yaml --steps 300

Writes one JSON line per config under ``benchmarks/results/`` (``repro-cpu-<versions>-<date>-<time>.jsonl``)
and exits with status 1 if a same-seed pair differs in any bit or the other seed gives the same losses.
Validation is off (``limit_val_batches 0``): it draws nothing random and only costs time here.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from fit_runs import fit_command, read_scalars  # beside this script, which Python puts on sys.path
from record_name import record_path

ROOT = Path(__file__).resolve().parents[1]
QUICKSTARTS = [ROOT / "configs" / "quickstart" / f"{task}_multimax.yaml" for task in ("digits", "lm", "nmt")]


def train_losses(config: Path, seed: int, steps: int, workdir: Path, cache: Path) -> dict[int, float]:
    """Step -> train/loss of one ``mmlight fit`` run."""
    save_dir = workdir / f"seed{seed}-{len(list(workdir.glob('seed*')))}"
    options = {
        "--seed_everything": str(seed),
        "--trainer.max_steps": str(steps),
        "--trainer.log_every_n_steps": "1",
        "--trainer.limit_val_batches": "0",
        "--trainer.logger.init_args.save_dir": str(save_dir),
    }
    if not config.stem.startswith("lm"):  # the LM quick start's data is generated in memory
        options["--data.init_args.cache_dir"] = str(cache / config.stem.split("_")[0])
    command = fit_command(config, options)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(command, cwd=workdir, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{run.stderr[-3000:]}")
    return dict(read_scalars(save_dir, ["train/loss"])["train/loss"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", type=Path, nargs="+", default=QUICKSTARTS, help="configs to check")
    parser.add_argument("--steps", type=int, default=100, help="training steps per run")
    parser.add_argument("--out", type=Path, default=None, help="JSON lines file (default: results/repro-cpu-...)")
    args = parser.parse_args(argv)
    out = args.out or record_path("repro", "cpu", [("torch", importlib.metadata.version("torch"))], "jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        for config in args.configs:
            runs = [train_losses(config, seed, args.steps, Path(tmp), Path(tmp) / "cache") for seed in (0, 0, 1)]
            same = runs[0] == runs[1] and len(runs[0]) == args.steps
            differing = [s for s in runs[0] if runs[2].get(s) != runs[0][s]]
            record = {
                "check": "same_seed_same_losses",
                "config": str(config.relative_to(ROOT)),
                "steps": args.steps,
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "device": f"{platform.machine()} CPU",
                "python": platform.python_version(),
                "torch": importlib.metadata.version("torch"),
                "logged_steps": [len(r) for r in runs],
                "seed0_twice_bitwise_equal": same,
                "seed1_steps_differing_from_seed0": len(differing),
                "seed1_first_differing_step": min(differing, default=None),
                "seed0_loss_first_last": [runs[0][min(runs[0])], runs[0][max(runs[0])]],
            }
            failed |= not same or not differing
            print(json.dumps(record), flush=True)
            with open(out, "a") as f:
                f.write(json.dumps(record) + "\n")
    print(f"wrote {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
