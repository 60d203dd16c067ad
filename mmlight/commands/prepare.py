"""``mmlight prepare <dataset> --src RAW_DIR --out SHARD_DIR``: raw datasets to webdataset shards.

The datasets and what each reads are :data:`mmlight.data.prepare.DATASETS`; this module is the
command line around :func:`mmlight.data.prepare.prepare`. A dataset module may take several ``--src``
paths (``SRC_NARGS``) and options of its own (``add_arguments(parser)``), which
``mmlight prepare <dataset> --help`` lists.
"""

from __future__ import annotations

import argparse
import logging
import os

from mmlight.data.prepare import DATASETS, dataset_module, prepare


def main(argv: list[str] | None = None) -> None:
    """Command-line entry (``mmlight prepare ...``)."""
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("dataset", nargs="?")
    chosen, _ = first.parse_known_args(argv)  # the dataset's module may add options of its own
    module = dataset_module(chosen.dataset) if chosen.dataset in DATASETS else None
    parser = argparse.ArgumentParser(prog="mmlight prepare", description=__doc__.splitlines()[0])
    parser.add_argument("dataset", choices=sorted(DATASETS))
    parser.add_argument(
        "--src",
        nargs=getattr(module, "SRC_NARGS", None),
        help=getattr(module, "SRC_HELP", "raw data folder (not needed for digits)"),
    )
    parser.add_argument("--out", required=True, help="shard set folder to write (or verify)")
    parser.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1), help="writer processes")
    if hasattr(module, "add_arguments"):
        module.add_arguments(parser.add_argument_group(f"{chosen.dataset} options"))
    args = parser.parse_args(argv)
    options = {k: v for k, v in vars(args).items() if k not in ("dataset", "src", "out", "workers")}
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        info = prepare(args.dataset, args.src, args.out, args.workers, **options)
    except (FileNotFoundError, ValueError, ImportError) as err:
        parser.exit(2, f"mmlight prepare: error: {err}\n")
    counts = ", ".join(
        f"{name} {split['num_samples']} samples ({split.get('num_skipped', 0)} skipped)"
        for name, split in info["splits"].items()
    )
    bad = f"; {info['num_skipped']} bad inputs skipped, named in _info.json" if "num_skipped" in info else ""
    print(f"{args.dataset} shards in {args.out}: {counts}{bad}")
