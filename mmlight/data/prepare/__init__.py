"""``mmlight prepare <dataset> --src RAW_DIR --out SHARD_DIR``: raw datasets to webdataset shards.

Each dataset module registers a function ``(src, out, workers) -> info`` that reads the standard raw
layout, writes shards through :func:`mmlight.data.shard_writer.write_shards` (parallel,
idempotent, resumable, bad items counted and logged) and finally ``_info.json``.

Preparers import the runtime data modules (shard writer, vocabularies, tokenisers); runtime modules
never import a preparer (``tests/test_layers.py`` checks it).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
from pathlib import Path

#: dataset name -> module that defines ``prepare(src, out, workers)``; imported on use.
DATASETS = {
    "imagenet": "mmlight.data.prepare.imagenet",
    "wikitext103": "mmlight.data.prepare.wikitext",
    "iwslt14": "mmlight.data.prepare.iwslt",
    "digits": "mmlight.data.prepare.digits",
    "imagefolder": "mmlight.data.prepare.imagefolder",
    "cifar10": "mmlight.data.prepare.cifar10",
    "cifar100": "mmlight.data.prepare.cifar100",
    "flowers102": "mmlight.data.prepare.flowers102",
    "food101": "mmlight.data.prepare.food101",
}


def require(path: Path, what: str) -> Path:
    """``path`` if it exists, else a ``FileNotFoundError`` saying which file or folder was expected."""
    if not path.exists():
        raise FileNotFoundError(f"expected {what} at {path}")
    return path


def prepare(dataset: str, src: str | Path | None, out: str | Path, workers: int = 1) -> dict:
    """Prepare ``dataset`` from ``src`` into the shard set ``out``; return its ``_info.json`` content."""
    if dataset not in DATASETS:
        raise ValueError(f"unknown dataset {dataset!r}; choose one of {sorted(DATASETS)}")
    module = importlib.import_module(DATASETS[dataset])
    if src is None and getattr(module, "NEEDS_SRC", True):
        raise ValueError(f"{dataset} needs --src (the raw data folder)")
    if src is not None and not Path(src).is_dir():
        raise FileNotFoundError(f"--src {src} is not a folder")
    return module.prepare(None if src is None else Path(src), Path(out), workers)


def main(argv: list[str] | None = None) -> None:
    """Command-line entry (``mmlight prepare ...``)."""
    parser = argparse.ArgumentParser(prog="mmlight prepare", description=__doc__.splitlines()[0])
    parser.add_argument("dataset", choices=sorted(DATASETS))
    parser.add_argument("--src", help="raw data folder (not needed for digits)")
    parser.add_argument("--out", required=True, help="shard set folder to write (or verify)")
    parser.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1), help="writer processes")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        info = prepare(args.dataset, args.src, args.out, args.workers)
    except (FileNotFoundError, ValueError) as err:
        parser.exit(2, f"mmlight prepare: error: {err}\n")
    counts = ", ".join(
        f"{name} {split['num_samples']} samples ({split.get('num_skipped', 0)} skipped)"
        for name, split in info["splits"].items()
    )
    print(f"{args.dataset} shards in {args.out}: {counts}")
