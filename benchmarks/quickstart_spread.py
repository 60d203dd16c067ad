"""The quick starts' results across CPU code paths and thread counts: each config trained in full, as the
README runs it, once per environment, and its last validation metrics read from the run's
``final_metrics.json`` (``mmlight.callbacks.FinalMetrics``).

    python benchmarks/quickstart_spread.py          # both digits quick starts, 1 and 2 threads, AVX-512 and AVX2
    python benchmarks/quickstart_spread.py --configs configs/quickstart/digits_softmax.yaml --threads 1 --isa avx2

An environment is a thread count (``OMP_NUM_THREADS``) and the widest vector instructions that torch's
own kernels (``ATEN_CPU_CAPABILITY``), oneDNN (``ONEDNN_MAX_CPU_ISA``) and MKL
(``MKL_ENABLE_INSTRUCTIONS``) may use, so that one machine stands in for a CPU without AVX-512. Both
change the order of floating-point sums, and a run's numbers with them; the seed is the config's.

Writes one JSON line per run under ``benchmarks/results/``
(``quickstart_spread-cpu-<versions>-<date>-<time>.jsonl``).
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
import time
from pathlib import Path

import yaml

from mmlight.experiments.table import METRICS_FILE, read_metrics

sys.path.insert(0, str(Path(__file__).resolve().parent))  # as ``python benchmarks/...`` would (tests import it)
from fit_runs import fit_command  # noqa: E402
from record_name import cpu_description, record_path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DIGITS = [ROOT / "configs" / "quickstart" / f"digits_{name}.yaml" for name in ("multimax", "softmax")]

#: --isa NAME -> the variables that cap each library's instructions; "native" sets none
ISA = {
    "native": {},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
}


def environment(threads: int, isa: str) -> dict[str, str]:
    """This process's environment with the thread count and instruction cap of one run."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", *ISA["avx2"])}
    return {**env, "OMP_NUM_THREADS": str(threads), **ISA[isa]}


def capability(env: dict[str, str]) -> str:
    """The vector instructions torch's kernels use under ``env`` (``AVX512``, ``AVX2``, ...)."""
    code = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()


def check_configs(configs: list[Path]) -> None:
    """Stop before any training unless every config is an image-classification quick start (the table
    reads its ``val/top1``, and its data module takes a ``cache_dir``)."""
    for config in configs:
        if not config.is_file():
            raise SystemExit(f"{config}: no such config")
        model = (yaml.safe_load(config.read_text()) or {}).get("model", {})
        if not str(model.get("class_path", "")).endswith("ImageClassifier"):
            raise SystemExit(f"{config}: not an image-classification config (its model is {model.get('class_path')})")


def final_val_metrics(save_dir: Path) -> dict[str, float]:
    """The ``val/*`` values of the one ``final_metrics.json`` a fit wrote under ``save_dir``."""
    found = sorted(save_dir.rglob(METRICS_FILE))
    if len(found) != 1:
        raise SystemExit(f"{save_dir}: expected one {METRICS_FILE} from the fit, found {len(found)}")
    metrics = read_metrics(found[0].parent)["metrics"]
    if "val/top1" not in metrics:  # the table's one figure: a fit that never validated has none
        raise SystemExit(f"{found[0]}: no val/top1 (did the fit validate?); it holds {sorted(metrics)}")
    return {name: m["value"] for name, m in sorted(metrics.items()) if name.startswith("val/")}


def fit(config: Path, threads: int, isa: str, workdir: Path) -> dict:
    """One ``mmlight fit --config CONFIG`` run; its last validation scalars and wall time."""
    save_dir = workdir / f"{config.stem}-{threads}-{isa}"
    options = {
        "--trainer.logger.init_args.save_dir": str(save_dir),
        "--data.init_args.cache_dir": str(workdir / "cache" / config.stem.split("_")[0]),
    }
    command = fit_command(config.resolve(), options)
    env = environment(threads, isa)
    start = time.monotonic()
    run = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{run.stderr[-3000:]}")
    return {"fit_s": round(time.monotonic() - start, 1), "capability": capability(env), **final_val_metrics(save_dir)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", type=Path, nargs="+", default=DIGITS, help="quick-start configs to train")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="OMP_NUM_THREADS values")
    parser.add_argument("--isa", nargs="+", choices=sorted(ISA), default=["native", "avx2"], help="instruction caps")
    parser.add_argument(
        "--out", type=Path, default=None, help="JSON lines file (default: results/quickstart_spread-cpu-...)"
    )
    args = parser.parse_args(argv)
    check_configs(args.configs)
    out = args.out or record_path("quickstart_spread", "cpu", [("torch", importlib.metadata.version("torch"))], "jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for config in args.configs:
            for isa in args.isa:
                for threads in args.threads:
                    record = {
                        "check": "quickstart_spread",
                        "config": str(config.resolve().relative_to(ROOT)),
                        "threads": threads,
                        "isa": isa,
                        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                        "device": cpu_description(),
                        "python": platform.python_version(),
                        "torch": importlib.metadata.version("torch"),
                        **fit(config, threads, isa, Path(tmp)),
                    }
                    print(json.dumps(record), flush=True)
                    with open(out, "a") as f:
                        f.write(json.dumps(record) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
