"""ImageNet (ILSVRC-2012) from its standard folders to shards of the original JPEG bytes.

Raw layout under ``--src``::

    train/<wnid>/*.JPEG
    val/<wnid>/*.JPEG                          class folders, or
    val/ILSVRC2012_val_00000001.JPEG ...       flat, with one of the usual label files in --src:
        LOC_val_solution.csv                   (Kaggle: ``ImageId,PredictionString`` = "<wnid> x y ...")
        ILSVRC2012_validation_ground_truth.txt (devkit: 1-based ILSVRC2012_IDs in file order) plus
        meta.mat                               (devkit: ILSVRC2012_ID -> WNID)

Classes are the sorted training wnids (the usual 0..999 indices). Every image is decoded once to
check it and stored as its original bytes (never re-encoded); an unreadable, truncated or empty
file is skipped, counted and logged with its path. Training images are written in a fixed shuffled
order, so each shard mixes classes (a streaming shuffle buffer cannot mix class-sorted shards).
"""

from __future__ import annotations

import csv
import random
from pathlib import Path

from PIL import Image

from mmlight.data.prepare import require
from mmlight.data.shard_writer import Skipped, plan_shards, write_shards
from mmlight.data.shards import write_info
from mmlight.data.vocab import ClassMap

NEEDS_SRC = True
#: Images per shard: ~110 MB shards on ImageNet, 1,282 for the training set.
SAMPLES_PER_SHARD = 1000
IMAGE_SUFFIXES = {".jpeg", ".jpg", ".png"}
VAL_CSV = "LOC_val_solution.csv"
DEVKIT_LABELS = "ILSVRC2012_validation_ground_truth.txt"
DEVKIT_META = "meta.mat"


def _images(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)


def class_folders(split_dir: Path) -> dict[str, list[Path]]:
    """``{wnid: [image paths]}`` for a folder of class folders."""
    return {d.name: _images(d) for d in sorted(split_dir.iterdir()) if d.is_dir()}


def flat_val_labels(src: Path) -> dict[str, str]:
    """``{image stem: wnid}`` from a Kaggle CSV or the devkit's ground truth and meta.mat."""
    if (src / VAL_CSV).is_file():
        with open(src / VAL_CSV, newline="") as f:
            return {row["ImageId"]: row["PredictionString"].split()[0] for row in csv.DictReader(f)}
    if (src / DEVKIT_LABELS).is_file() and (src / DEVKIT_META).is_file():
        from scipy.io import loadmat

        synsets = loadmat(str(src / DEVKIT_META), squeeze_me=True)["synsets"]
        wnid_of = {int(s["ILSVRC2012_ID"]): str(s["WNID"]) for s in synsets}
        ids = [int(line) for line in (src / DEVKIT_LABELS).read_text().split()]
        return {f"ILSVRC2012_val_{i:08d}": wnid_of[label] for i, label in enumerate(ids, start=1)}
    raise FileNotFoundError(
        f"val/ in {src} holds images directly, so a label file is needed: expected {src / VAL_CSV}, "
        f"or {src / DEVKIT_LABELS} with {src / DEVKIT_META}"
    )


def make_sample(item: tuple[str, int]) -> dict | Skipped:
    """``(path, class index)`` -> a ``jpg``/``cls`` sample, or a skip if the image does not decode."""
    path, label = item
    data = Path(path).read_bytes()
    if not data:
        return Skipped(path, "empty file")
    try:
        with Image.open(Path(path)) as image:
            image.load()  # a full decode: catches truncated files that header checks miss
    except Exception as err:  # PIL raises several types (UnidentifiedImageError, OSError, ...)
        return Skipped(path, f"{type(err).__name__}: {err}")
    return {"__key__": Path(path).stem, "jpg": data, "cls": str(label)}


def _val_items(src: Path, index: dict[str, int]) -> list[tuple[str, int]]:
    val_dir = require(src / "val", "the validation images (val/)")
    folders = class_folders(val_dir)
    if folders:
        unknown = sorted(set(folders) - set(index))
        if unknown:
            raise ValueError(f"val/ has class folders not in train/: {unknown[:5]}")
        return [(str(p), index[wnid]) for wnid, paths in folders.items() for p in paths]
    labels = flat_val_labels(src)
    items = []
    for path in _images(val_dir):
        if path.stem not in labels:
            raise ValueError(f"no label for {path} in the validation label file")
        items.append((str(path), index[labels[path.stem]]))
    return items


def prepare(src: Path, out: Path, workers: int) -> dict:
    """Write ``train`` and ``val`` shards and ``_info.json`` (classes = wnids)."""
    train = class_folders(require(src / "train", "the training images (train/<wnid>/*.JPEG)"))
    if not train:
        raise FileNotFoundError(f"expected class folders train/<wnid>/ in {src / 'train'}")
    classes = sorted(train)
    index = {wnid: i for i, wnid in enumerate(classes)}
    train_items = [(str(p), index[wnid]) for wnid, paths in train.items() for p in paths]
    random.Random(0).shuffle(train_items)
    splits = {"train": train_items, "val": _val_items(src, index)}
    info = {"dataset": "imagenet", **ClassMap(classes).to_dict(), "splits": {}}
    for split, items in splits.items():
        jobs = plan_shards(split, items, SAMPLES_PER_SHARD)
        info["splits"][split] = write_shards(jobs, out, make_sample, workers, desc=f"imagenet {split}")
    return write_info(out, info)
