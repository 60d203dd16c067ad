"""Training-step time of each reweighting function relative to softmax on a CPU quick start.

Each round trains every function for ``--steps`` steps in this process, one after another in a
rotating order (side by side, so a change of machine load hits all of them alike), and keeps the
median time of a step after ``--warmup`` steps: forward, backward and optimiser step, between
Lightning's ``on_train_batch_start`` and ``on_train_batch_end``. The record gives every round's
medians and, per function, the median over rounds of its ratio to softmax in the same round::

    OMP_NUM_THREADS=1 python benchmarks/reweighting_step_time.py configs/quickstart/lm_softmax.yaml \\
        --out benchmarks/results/reweighting_step_time-cpu-torch2.14-<YYYYMMDD>-lm.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch

FUNCTIONS = [
    "softmax",
    "multimax",
    "sparsemax",
    "entmax15",
    "evsoftmax",
    "topk",
    "softmax1",
    "softpick",
    "sigmoid",
    "ssmax",
    "alpha_entmax",
    "stickbreaking",
]


class StepTimer(L.Callback):
    """Seconds of every training step (forward, backward, optimiser step)."""

    def __init__(self):
        self.seconds: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seconds.append(time.perf_counter() - self._start)


def median_step(config: str, name: str, steps: int, warmup: int, runs: str) -> float:
    """The median step time of ``steps`` steps of ``config`` with ``name`` in every attention layer."""
    from mmlight.cli import build_cli

    args = [
        "--config",
        config,
        "--model.init_args.model.attention",
        json.dumps({"name": name, "options": {}}),
        "--trainer.max_steps",
        str(steps),
        "--trainer.limit_val_batches",
        "0",
        "--trainer.logger.init_args.save_dir",
        runs,
        "--trainer.default_root_dir",
        runs,
    ]
    cli = build_cli(args, run=False)
    timer = StepTimer()
    cli.trainer.callbacks.insert(0, timer)  # first: the other callbacks' batch-end work is not timed
    cli.trainer.fit(cli.model, cli.datamodule)
    return statistics.median(timer.seconds[warmup:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    parser.add_argument("--functions", nargs="+", default=FUNCTIONS)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if "softmax" not in args.functions:
        parser.error("softmax is the reference: keep it in --functions")
    rounds = []
    with tempfile.TemporaryDirectory() as runs:
        for r in range(args.rounds):
            order = args.functions[r % len(args.functions) :] + args.functions[: r % len(args.functions)]
            rounds.append({name: median_step(args.config, name, args.steps, args.warmup, runs) for name in order})
            print(f"round {r}: " + ", ".join(f"{n} {s * 1e3:.1f} ms" for n, s in rounds[-1].items()), flush=True)
    ratios = {name: statistics.median(rd[name] / rd["softmax"] for rd in rounds) for name in args.functions}
    record = {
        "config": args.config,
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": rounds,
        "median_ratio_to_softmax": ratios,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "load_average_1_5_15_min": os.getloadavg(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print("step time / softmax: " + ", ".join(f"{n} {v:.2f}" for n, v in ratios.items()))


if __name__ == "__main__":
    main()
