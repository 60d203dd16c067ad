"""``mmlight prepare <dataset> --src RAW_DIR --out SHARD_DIR``: raw datasets to webdataset shards.

The datasets and what each reads are :data:`mmlight.data.prepare.DATASETS`; this module is the
command line around :func:`mmlight.data.prepare.prepare`.
"""

from __future__ import annotations

import argparse
import logging
import os

from mmlight.data.prepare import DATASETS, prepare


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
