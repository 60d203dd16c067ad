"""CIFAR-10 and CIFAR-100 (Krizhevsky, 2009) from the official python pickle archives to PNG shards.

Raw layout: ``--src`` is the extracted folder (``cifar-10-batches-py/``, ``cifar-100-python/``), or
holds it, or holds the downloaded archive (``cifar-10-python.tar.gz``, ``cifar-100-python.tar.gz``),
which is read without extracting it::

    CIFAR-10:  data_batch_1 .. data_batch_5, test_batch, batches.meta (label_names)
    CIFAR-100: train, test, meta (fine_label_names); the label is the fine label (100 classes)

Each pickle holds ``data`` (N x 3072 bytes: the red, green and blue 32 x 32 planes) and the labels. The
pickles are read by :class:`~mmlight.safe_load.PlainUnpickler`, which builds only plain data and NumPy
arrays: a pickle that references anything else is refused, naming the file, and nothing in it runs.
Every image is stored as a lossless PNG. Splits ``train`` (50,000) and ``test`` (10,000).
"""

from __future__ import annotations

import tarfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from mmlight.data.prepare.image_files import png_bytes, write_image_splits
from mmlight.safe_load import PlainUnpickler

#: CIFAR images are about 2.5 kB as PNG: 5,000 per shard, ~12 MB
SAMPLES_PER_SHARD = 5000


@dataclass(frozen=True)
class Cifar:
    """Where one CIFAR release keeps its pickles.

    Args:
        name: dataset name in ``_info.json``.
        folder: the folder inside the archive.
        archive: the official archive's file name.
        splits: split name -> its pickle files.
        meta: the metadata pickle.
        names_key: the key of the class names in it.
        labels_key: the key of the labels in a data pickle.
    """

    name: str
    folder: str
    archive: str
    splits: dict[str, tuple[str, ...]]
    meta: str
    names_key: str
    labels_key: str


CIFAR10 = Cifar(
    "cifar10",
    "cifar-10-batches-py",
    "cifar-10-python.tar.gz",
    {"train": tuple(f"data_batch_{i}" for i in range(1, 6)), "test": ("test_batch",)},
    "batches.meta",
    "label_names",
    "labels",
)
CIFAR100 = Cifar(
    "cifar100",
    "cifar-100-python",
    "cifar-100-python.tar.gz",
    {"train": ("train",), "test": ("test",)},
    "meta",
    "fine_label_names",
    "fine_labels",
)


def _unpickle(data: bytes, where: str) -> dict:
    """The dict pickled in ``data`` (the file ``where``), built by :class:`PlainUnpickler`: a pickle that
    references anything but plain data and NumPy arrays is refused, and nothing in it runs."""
    # the official pickles were written by Python 2: byte-string keys
    content = PlainUnpickler(data, where).load()
    if not isinstance(content, dict):
        raise ValueError(f"{where} holds a {type(content).__name__}, not the dict of a CIFAR pickle")
    return {key.decode() if isinstance(key, bytes) else key: value for key, value in content.items()}


def _reader(src: Path, release: Cifar):
    """A function ``file name -> unpickled dict`` over the folder or the archive found in ``src``."""
    for folder in (src, src / release.folder):
        if (folder / release.meta).is_file():
            return lambda name: _unpickle((folder / name).read_bytes(), str(folder / name))
    if (src / release.archive).is_file():
        archive = tarfile.open(src / release.archive)

        def read(name: str) -> dict:
            member = f"{release.folder}/{name}"
            return _unpickle(archive.extractfile(member).read(), f"{src / release.archive}:{member}")

        return read
    raise FileNotFoundError(
        f"expected the {release.name} pickles ({release.meta}, ...) in {src} or "
        f"{src / release.folder}, or the archive {src / release.archive}"
    )


def cifar_sample(item: tuple[str, bytes, int]) -> dict:
    """``(key, 3072 raw bytes, class index)`` -> a ``png``/``cls`` sample."""
    key, raw, label = item
    pixels = np.frombuffer(raw, dtype=np.uint8).reshape(3, 32, 32).transpose(1, 2, 0)  # (H, W, C)
    return {"__key__": key, "png": png_bytes(Image.fromarray(pixels, mode="RGB")), "cls": str(label)}


def prepare_release(src: Path, out: Path, workers: int, release: Cifar) -> dict:
    """Write ``train`` and ``test`` shards of ``release`` and ``_info.json``."""
    read = _reader(src, release)
    classes = [c.decode() if isinstance(c, bytes) else str(c) for c in read(release.meta)[release.names_key]]
    splits = {}
    for split, files in release.splits.items():
        items = []
        for name in files:
            batch = read(name)
            data, labels = np.asarray(batch["data"], dtype=np.uint8), batch[release.labels_key]
            if data.shape != (len(labels), 3072):
                raise ValueError(f"{release.name} {name}: data has shape {data.shape}, expected ({len(labels)}, 3072)")
            items += [(row.tobytes(), int(label)) for row, label in zip(data, labels)]
        splits[split] = items
    return write_image_splits(
        out, release.name, classes, splits, workers, per_shard=SAMPLES_PER_SHARD, make_sample=cifar_sample
    )
