"""The dataset preparers: raw datasets to webdataset shards (the command is :mod:`mmlight.commands.prepare`).

Each dataset module registers a function ``(src, out, workers, **options) -> info`` that reads the standard raw
layout, writes shards through :func:`mmlight.data.shard_writer.write_shards` (parallel,
idempotent, resumable, bad items counted and logged) and finally ``_info.json``.

Preparers import the runtime data modules (shard writer, vocabularies, tokenisers); runtime modules
never import a preparer (``tests/test_layers.py`` checks it).
"""

from __future__ import annotations

import importlib
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
    "text": "mmlight.data.prepare.text",
    "python-docs": "mmlight.data.prepare.python_docs",
}


def require(path: Path, what: str) -> Path:
    """``path`` if it exists, else a ``FileNotFoundError`` saying which file or folder was expected."""
    if not path.exists():
        raise FileNotFoundError(f"expected {what} at {path}")
    return path


def dataset_module(dataset: str):
    """The module that prepares ``dataset`` (imported now)."""
    if dataset not in DATASETS:
        raise ValueError(f"unknown dataset {dataset!r}; choose one of {sorted(DATASETS)}")
    return importlib.import_module(DATASETS[dataset])


def prepare(
    dataset: str, src: str | Path | list[str | Path] | None, out: str | Path, workers: int = 1, **options
) -> dict:
    """Prepare ``dataset`` from ``src`` into the shard set ``out``; return its ``_info.json`` content.

    ``src`` is one raw data folder, or a list of paths for a module that takes several (``SRC_NARGS``);
    ``options`` are the module's own (its ``add_arguments``)."""
    module = dataset_module(dataset)
    if src is None and getattr(module, "NEEDS_SRC", True):
        raise ValueError(f"{dataset} needs --src (the raw data folder)")
    if isinstance(src, (list, tuple)):
        return module.prepare([Path(s) for s in src], Path(out), workers, **options)
    if src is not None and not Path(src).is_dir():
        raise FileNotFoundError(f"--src {src} is not a folder")
    return module.prepare(None if src is None else Path(src), Path(out), workers, **options)
