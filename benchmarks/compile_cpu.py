"""Compile time and step-time ratio of the whole network compiled (the tasks' ``compile`` option)
against eager, on the CPU, for the digits quick start's model and batch.

For each function the task of ``configs/quickstart/digits_multimax.yaml`` (micro ViT, 8x8 digits,
batch 32, MultiMax on the logits for MultiMax) takes ``--steps`` training steps on a fixed synthetic
batch (forward, backward, AdamW step) eagerly, then compiled with Inductor (``compile: true``): the
first compiled step (compilation included) is the compile time, the median of the steps after
``--warmup`` more is the step time. Inductor's caches are off, so every compile time is a cold one.
Writes one JSON record::

    OMP_NUM_THREADS=1 python benchmarks/compile_cpu.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")  # cold compiles, read at import

import torch  # noqa: E402
from record_name import cpu_description, record_path  # noqa: E402  (beside this script, which Python puts on sys.path)

from mmlight.models import ReweightingSpec, ViTConfig  # noqa: E402
from mmlight.tasks import ImageClassifier  # noqa: E402


def quick_start_task(name: str, compile: bool) -> ImageClassifier:
    """The digits quick start's task with attention ``name`` (its MultiMax on the logits for multimax)."""
    model = ViTConfig(
        variant="vit_micro",
        img_size=8,
        patch_size=2,
        in_chans=1,
        num_classes=10,
        drop_path_rate=0.0,
        attention=ReweightingSpec(name),
        output_multimax=name == "multimax",
    )
    return ImageClassifier(model, lr=2e-3, lr_reference_batch=None, label_smoothing=0.1, compile=compile)


def step_times(task: ImageClassifier, batch, steps: int) -> list[float]:
    """Seconds of each of ``steps`` training steps (loss through the task's compile option, backward,
    AdamW step)."""
    optimizer = torch.optim.AdamW(task.parameters(), lr=2e-3)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        loss = task.compiled(task.model.loss, *batch, label_smoothing=0.1)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return times


def measure(name: str, steps: int, warmup: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    batch = (torch.randn(32, 1, 8, 8, generator=g), torch.randint(0, 10, (32,), generator=g))
    torch.manual_seed(seed)
    eager = step_times(quick_start_task(name, False), batch, warmup + steps)[warmup:]
    torch._dynamo.reset()
    torch.manual_seed(seed)
    compiled = step_times(quick_start_task(name, True), batch, 1 + warmup + steps)
    eager_step, compiled_step = statistics.median(eager), statistics.median(compiled[1 + warmup :])
    return {
        "function": name,
        "eager_step_ms": 1e3 * eager_step,
        "compiled_step_ms": 1e3 * compiled_step,
        "step_ratio_compiled_over_eager": compiled_step / eager_step,
        "first_compiled_step_s": compiled[0],
        "steps_to_recover_compile_time": compiled[0] / max(eager_step - compiled_step, 1e-12)
        if compiled_step < eager_step
        else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--functions", nargs="+", default=["softmax", "multimax"])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out", type=Path, default=None, help="JSON file (default: results/compile_cpu-cpu-<torch>-<date>)"
    )
    args = parser.parse_args()
    rows = [measure(name, args.steps, args.warmup, args.seed) for name in args.functions]
    record = {
        "benchmark": "compile_cpu",
        "machine": cpu_description(),
        "threads": torch.get_num_threads(),
        "inductor_caches": "off" if os.environ["TORCHINDUCTOR_FORCE_DISABLE_CACHES"] == "1" else "on",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "steps": args.steps,
        "warmup": args.warmup,
        "seed": args.seed,
        "batch": 32,
        "note": "a CPU shared with other jobs (load average 10-13 on 2 cores while measured): absolute "
        "times vary with their load; eager and compiled of one function run one after the other",
        "results": rows,
    }
    out = args.out or record_path("compile_cpu", "cpu", [("torch", torch.__version__)], "json", tag="")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
