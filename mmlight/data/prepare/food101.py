"""Food-101 (Bossard et al., 2014) from its release folder to shards.

Raw layout under ``--src`` (the extracted ``food-101.tar.gz``: ``food-101/`` itself or its parent)::

    images/<class>/<id>.jpg
    meta/classes.txt           class names, in label order
    meta/train.txt, test.txt   ``<class>/<id>`` per line (75,750 and 25,250 images)

Splits ``train`` and ``test``, as the lists say. A listed image that is missing or unreadable is
skipped, counted and logged.
"""

from __future__ import annotations

from pathlib import Path

from mmlight.data.prepare import require
from mmlight.data.prepare.image_files import write_image_splits

NEEDS_SRC = True
FOLDER = "food-101"


def _listed(root: Path, split: str, index: dict[str, int]) -> list[tuple[str, int]]:
    items = []
    listing = require(root / "meta" / f"{split}.txt", f"the {split} list (meta/{split}.txt)")
    for line in listing.read_text().split():
        name = line.split("/")[0]
        if name not in index:
            raise ValueError(f"{listing}: {line!r} names class {name!r}, which meta/classes.txt does not list")
        items.append((str(root / "images" / f"{line}.jpg"), index[name]))
    return items


def prepare(src: Path, out: Path, workers: int) -> dict:
    """Write ``train`` and ``test`` shards and ``_info.json`` (classes from meta/classes.txt)."""
    root = src / FOLDER if (src / FOLDER / "meta").is_dir() else src
    classes = require(root / "meta" / "classes.txt", "the class list (meta/classes.txt)").read_text().split()
    index = {name: i for i, name in enumerate(classes)}
    require(root / "images", "the images (images/<class>/<id>.jpg)")
    splits = {split: _listed(root, split, index) for split in ("train", "test")}
    return write_image_splits(out, "food101", classes, splits, workers)
