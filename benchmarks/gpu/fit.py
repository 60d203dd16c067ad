"""Section ``fit``: ``mmlight fit`` of ``configs/deit_small_multimax.yaml`` (then, as time allows,
``deit_small_softmax.yaml``) on one device with ``compile: true``, 300 steps at the step's batch, no
validation and no checkpoint, reading synthetic ImageNet-format shards (``benchmarks/fit_shards.py``)
through the real loader with the config's workers.

The images/s the Throughput callback logs to TensorBoard, averaged past the warm-up, are set beside the
compiled step's of the same variant: the difference is the data pipeline and Lightning's overhead.
Each fit's output ends in ``fit.log``. Every process runs under a timeout from the time left, and
Lightning's ``max_time`` stops the fit before it. ``--smoke`` trains the micro ViT at 16 px for 14
steps at batch 2, logged every 7 (the last log, step 13, is past the warm-up), uncompiled, with one
loader worker, and fits the first config only (the second is recorded as skipped).
"""

from __future__ import annotations

import inspect
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from fit_runs import fit_command, read_scalars  # beside the gpu package

from benchmarks.gpu.record import Run

ROOT = Path(__file__).resolve().parents[2]
#: Seconds one fit needs at least on an H100/H200: start-up, compilation, the steps.
FIT_MIN_S = 120
#: Seconds Lightning gets after its ``max_time`` to shut down.
SHUTDOWN_S = 20


@dataclass(frozen=True)
class FitRun:
    """One short ``mmlight fit`` of a DeiT-small config.

    Args:
        name: label of the record.
        config: the config file, relative to the repository's root.
        step: backend of the ``step`` record of the same attention and output layer.
    """

    name: str
    config: str
    step: str


#: Most telling first: MultiMax, whose kernels run as custom operators inside the compiled network.
FIT_RUNS = [
    FitRun("deit_small_multimax", "configs/deit_small_multimax.yaml", "multimax shipped"),
    FitRun("deit_small_softmax", "configs/deit_small_softmax.yaml", "softmax (SDPA flash)"),
]


def setup(run: Run) -> dict:
    """Steps, batch, steps between logs, loader workers (None: the config's), ``compile``, distinct images,
    overrides."""
    if run.smoke:
        micro = ["--model.init_args.model.variant", "vit_micro", "--model.init_args.model.img_size", "16"]
        micro += ["--model.init_args.model.patch_size", "4", "--data.init_args.augment.image_size", "16"]
        # logged at steps 6 and 13 (0-based): 13 is past the warm-up of one worker, 2 + 10 steps
        return {
            "steps": 14,
            "batch": 2,
            "log_every": 7,
            "workers": 1,
            "compile": False,
            "distinct": 4,
            "overrides": micro,
        }
    return {
        "steps": 300,
        "batch": 256,
        "log_every": 10,
        "workers": None,
        "compile": True,
        "distinct": 256,
        "overrides": [],
    }


def duration(seconds: float) -> str:
    """Lightning's ``max_time`` format, ``DD:HH:MM:SS``."""
    s = max(int(seconds), 1)
    return f"{s // 86400:02d}:{s % 86400 // 3600:02d}:{s % 3600 // 60:02d}:{s % 60:02d}"


def command(run: Run, fit: FitRun, s: dict, shards: Path, logs: Path, seconds: float) -> list[str]:
    """The fit's command line: the shards, ``s``'s steps, batch and ``compile``, no validation or
    checkpoint, TensorBoard logs every ``s``'s ``log_every`` steps (10 on a GPU) under ``logs/fit/<name>``,
    stopped after ``seconds``."""
    import torch

    options = {
        "--trainer.devices": "1",
        "--trainer.num_nodes": "1",
        "--trainer.strategy": "auto",
        "--trainer.max_steps": str(s["steps"]),
        "--trainer.max_time": duration(seconds),
        "--trainer.limit_val_batches": "0",
        "--trainer.num_sanity_val_steps": "0",
        "--trainer.log_every_n_steps": str(s["log_every"]),
        "--trainer.default_root_dir": str(logs),
        "--trainer.logger.init_args.save_dir": str(logs),
        "--trainer.logger.init_args.name": "fit",
        "--trainer.logger.init_args.version": fit.name,
        "--last_checkpoint.save_last": "false",
        "--best_checkpoint.save_top_k": "0",
        "--model.init_args.compile": "true" if s["compile"] else "false",
        "--data.init_args.root": str(shards),
        "--data.init_args.batch_size": str(s["batch"]),
    }
    if s["workers"] is not None:
        options["--data.init_args.num_workers"] = str(s["workers"])
    if not torch.cuda.is_available():
        options["--trainer.accelerator"] = "cpu"
    return fit_command(fit.config, options, s["overrides"])


def last_error(output: str) -> str:
    """The exception line of the output's last traceback (the first line after its indented frames),
    else the last line (a command-line error that stops with a message)."""
    lines = output.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    after = lines[starts[-1] + 1 :] if starts else []
    named = [line for line in after if line.strip() and not line[0].isspace()]
    rest = [line for line in lines if line.strip()]
    return (named[:1] or rest[-1:] or [""])[0].strip()[:200]


def logged_throughput(events: Path, steady_from: int) -> dict:
    """Mean of the Throughput callback's scalars logged after step ``steady_from``: ``images_per_s``
    (``train/device/samples_per_sec``), ``mfu`` (``train/device/mfu``, None where no peak is known), the
    windows averaged, and the last step logged (0-based)."""
    scalars = read_scalars(events)
    rates = [v for step, v in scalars.get("train/device/samples_per_sec", []) if step > steady_from]
    mfu = [v for step, v in scalars.get("train/device/mfu", []) if step > steady_from]
    return {
        "images_per_s": statistics.mean(rates) if rates else None,
        "mfu": statistics.mean(mfu) if mfu else None,
        "windows": len(rates),
        "last_logged_step": max((step for points in scalars.values() for step, _ in points), default=None),
    }


def write_shards(run: Run, s: dict, shards: Path, log: Path) -> float:
    """One epoch of synthetic shards for ``s``'s steps (``fit_shards.py``, every core); the seconds."""
    began = time.monotonic()
    workers = 1 if run.smoke else (os.cpu_count() or 1)
    argv = [sys.executable, str(ROOT / "benchmarks" / "fit_shards.py"), "--out", str(shards)]
    argv += [
        "--samples",
        str(s["batch"] * (s["steps"] + 1)),
        "--distinct",
        str(s["distinct"]),
        "--workers",
        str(workers),
    ]
    status, output = run.process(argv, run.left(), log, cwd=ROOT)
    if status != 0:
        raise RuntimeError(f"fit_shards.py failed: {last_error(output)}")
    return time.monotonic() - began


def measure(run: Run, fit: FitRun, s: dict, shards: Path, logs: Path) -> dict:
    """Run one fit and read its logged images/s back; the record's fields."""
    import yaml

    from mmlight.callbacks import Throughput

    workers = s["workers"]
    if workers is None:
        workers = yaml.safe_load((ROOT / fit.config).read_text())["data"]["init_args"]["num_workers"]
    window = inspect.signature(Throughput).parameters["window_size"].default
    # after compilation the steps first drain the batches the workers prefetched meanwhile (2 each)
    steady_from = 2 * workers + window
    seconds = max(run.left() - SHUTDOWN_S, 1)  # Lightning stops there
    began = time.monotonic()
    status, output = run.process(
        command(run, fit, s, shards, logs, seconds), seconds + SHUTDOWN_S, run.out_dir / "fit.log", cwd=ROOT
    )
    fields = {"config": fit.config, "compiled": s["compile"], "batch": s["batch"], "max_steps": s["steps"]}
    fields.update(loader_workers=workers, cpus=os.cpu_count(), steady_from_step=steady_from)
    fields["wall_s"] = round(time.monotonic() - began, 1)
    if status != 0:
        why = "killed at the time limit" if status is None else f"exit status {status}"
        return {**fields, "images_per_s": None, "error": f"{why}: {last_error(output)}"}
    fields.update(logged_throughput(logs / "fit" / fit.name, steady_from))
    if not fields["windows"]:
        fields["error"] = f"no samples/s logged past step {steady_from} (last logged: {fields['last_logged_step']})"
    mean = re.search(r"mean throughput: ([\d.]+) samples/s", output)
    fields["end_of_fit_images_per_s"] = float(mean.group(1)) if mean else None
    return fields


def section(run: Run) -> None:
    import tempfile

    import torch

    from mmlight.lightning_cli import MmlightCLI  # noqa: F401 (a missing package is named here, before any work)

    s = setup(run)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the fit's process needs the memory this one cached
    with tempfile.TemporaryDirectory(prefix="gpu_run-fit-") as tmp:
        shards = Path(tmp) / "shards"
        shards_s = round(write_shards(run, s, shards, run.out_dir / "fit.log"), 1)
        for i, fit in enumerate(FIT_RUNS):
            if i and run.smoke:  # the second fit is the first's path with another config: ~25 s of the suite
                run.emit(kind="skipped", section="fit", what=fit.name, reason="smoke: the first fit only")
                continue
            if i and run.left() < FIT_MIN_S:
                run.emit(kind="skipped", section="fit", what=fit.name, reason="time budget")
                continue
            fields = measure(run, fit, s, shards, Path(tmp) / "logs")
            compiled = s["compile"]
            step = run.state.get("steps", {}).get((fit.step, compiled), {})
            step_rate = step["shape"][0] / step["step_ms"] * 1e3 if step.get("step_ms") else None
            rate = fields.get("images_per_s")
            ratio = round(rate / step_rate, 3) if rate and step_rate else None
            run.emit(
                kind="fit",
                backend=fit.name,
                smoke=run.smoke,
                shards_s=shards_s,
                **fields,
                step_backend=fit.step,
                step_images_per_s=step_rate,
                fit_to_step=ratio,
            )
