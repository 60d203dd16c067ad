"""Oxford Flowers-102 (Nilsback and Zisserman, 2008) from its release files to shards.

Raw layout under ``--src`` (the extracted ``102flowers.tgz`` next to the two label files)::

    jpg/image_00001.jpg ... image_08189.jpg
    imagelabels.mat   ``labels``: the class (1..102) of image i at position i - 1
    setid.mat         ``trnid``, ``valid``, ``tstid``: 1-based image numbers of each split

Splits ``train``, ``val`` and ``test`` (1,020, 1,020 and 6,149 images), as ``setid.mat`` gives them.
The release names no classes; they are ``"1"`` .. ``"102"`` (label ``k`` is class ``str(k + 1)``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mmlight.data.prepare import require
from mmlight.data.prepare.image_files import write_image_splits

NEEDS_SRC = True
SPLIT_KEYS = {"train": "trnid", "val": "valid", "test": "tstid"}


def _mat(path: Path, what: str) -> dict:
    from scipy.io import loadmat

    return loadmat(str(require(path, what)), squeeze_me=True)


def prepare(src: Path, out: Path, workers: int) -> dict:
    """Write ``train``, ``val`` and ``test`` shards and ``_info.json``."""
    labels = np.atleast_1d(_mat(src / "imagelabels.mat", "the labels (imagelabels.mat)")["labels"]).astype(int)
    setid = _mat(src / "setid.mat", "the splits (setid.mat)")
    jpg = require(src / "jpg", "the images (jpg/image_00001.jpg ...)")
    num_classes = int(labels.max())
    splits = {}
    for split, key in SPLIT_KEYS.items():
        ids = np.atleast_1d(setid[key]).astype(int)
        if ids.min() < 1 or ids.max() > len(labels):
            raise ValueError(f"setid.mat {key} lists images outside 1..{len(labels)} (imagelabels.mat)")
        splits[split] = [(str(jpg / f"image_{i:05d}.jpg"), int(labels[i - 1]) - 1) for i in ids]
    classes = [str(k) for k in range(1, num_classes + 1)]
    return write_image_splits(out, "flowers102", classes, splits, workers)
