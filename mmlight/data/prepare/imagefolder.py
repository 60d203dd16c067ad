"""Any image-folder dataset (the torchvision ``ImageFolder`` layout) to shards.

Raw layout under ``--src``::

    train/<class>/*      one folder per class, any image format Pillow reads
    val/<class>/*        the same classes (or a subset of them)
    test/<class>/*       optional

Classes are the sorted ``train`` folder names. Images are stored or converted as
:mod:`mmlight.data.prepare.image_files` describes; every other file in a class folder is skipped
with its reason.
"""

from __future__ import annotations

from pathlib import Path

from mmlight.data.prepare import require
from mmlight.data.prepare.image_files import write_image_splits

NEEDS_SRC = True
SPLITS = ("train", "val", "test")


def class_files(split_dir: Path) -> dict[str, list[Path]]:
    """``{class: [files]}`` for a folder of class folders (hidden files included: they are skipped
    with a reason later, not silently)."""
    return {d.name: sorted(p for p in d.rglob("*") if p.is_file()) for d in sorted(split_dir.iterdir()) if d.is_dir()}


def prepare(src: Path, out: Path, workers: int) -> dict:
    """Write ``train``, ``val`` (and ``test`` if present) shards and ``_info.json``."""
    train = class_files(require(src / "train", "the training images (train/<class>/*)"))
    if not train:
        raise FileNotFoundError(f"expected class folders train/<class>/ in {src / 'train'}")
    if not (src / "val").is_dir():  # missing, or a file of that name (which would leave no val split, silently)
        raise FileNotFoundError(f"expected the validation images (val/<class>/*) in the folder {src / 'val'}")
    classes = sorted(train)
    index = {name: i for i, name in enumerate(classes)}
    splits = {}
    for split in SPLITS:
        if not (src / split).is_dir():
            continue
        folders = train if split == "train" else class_files(src / split)
        unknown = sorted(set(folders) - set(index))
        if unknown:
            raise ValueError(f"{split}/ has class folders not in train/: {unknown[:5]}")
        splits[split] = [(str(p), index[name]) for name, paths in folders.items() for p in paths]
    return write_image_splits(out, "imagefolder", classes, splits, workers)
