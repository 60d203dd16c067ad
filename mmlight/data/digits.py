"""The quick-start data set: scikit-learn's handwritten digits (1,797 real 8x8 images, 10 classes),
written once as PNG shards into a cache folder and then streamed like any other image shard set.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
from PIL import Image

from mmlight.data.images import ImageAugment, ImageShardDataModule
from mmlight.data.shard_writer import plan_shards, write_shards
from mmlight.data.shards import INFO_FILE, prepare_once, read_info, write_info
from mmlight.data.vocab import ClassMap

#: the ten digit classes, in label order.
DIGIT_CLASSES = ClassMap(tuple(str(c) for c in range(10)))


def digit_classes(kept: list[int]) -> ClassMap:
    """The class map of a subset of the digits, relabelled in the order given (label i is ``kept[i]``)."""
    return ClassMap(tuple(DIGIT_CLASSES.names[d] for d in kept))


DIGITS_AUGMENT = ImageAugment(
    image_size=8,
    channels=1,
    scale=(0.7, 1.0),
    hflip=0.0,
    color_jitter=None,
    interpolation="bilinear",
    crop_pct=1.0,
    mean=(0.5,),
    std=(0.5,),
)


def _as_sample(item: tuple[str, bytes, int]) -> dict:
    key, png, label = item
    return {"__key__": key, "png": png, "cls": str(label)}


def check_digits(digits: list[int] | None) -> list[int]:
    """The digits to keep (all ten for None), checked: distinct values in 0..9."""
    digits = list(range(10)) if digits is None else list(digits)
    if not digits or len(set(digits)) != len(digits) or not set(digits) <= set(range(10)):
        raise ValueError(f"digits must be distinct values in 0..9, got {digits}")
    return digits


def write_digits_shards(
    out_dir: Path, val_fraction: float = 0.2, seed: int = 0, maxcount: int = 300, digits: list[int] | None = None
) -> dict:
    """Write the digits as ``train``/``val`` PNG shards with a fixed, seeded split; return the info.
    With ``digits``, only those digits are written, labelled by their position in the list."""
    from sklearn.datasets import load_digits

    kept = check_digits(digits)
    data = load_digits()
    images = np.clip(data.images * 16, 0, 255).astype(np.uint8)  # pixel values 0..16 -> 0..255
    label_of = {d: i for i, d in enumerate(kept)}
    order = np.random.default_rng(seed).permutation(len(images))
    n_val = round(len(images) * val_fraction)
    # the split of all ten digits, then the kept ones of each part: a subset never moves an image
    splits = {"val": order[:n_val], "train": order[n_val:]}
    splits = {name: [i for i in part if data.target[i] in label_of] for name, part in splits.items()}

    def items(indices):
        for i in indices:
            buf = io.BytesIO()
            Image.fromarray(images[i], mode="L").save(buf, format="PNG")
            yield f"digit{i:05d}", buf.getvalue(), label_of[int(data.target[i])]

    info = {
        "dataset": "sklearn-digits",
        "val_fraction": val_fraction,
        "seed": seed,
        "digits": kept,
        **digit_classes(kept).to_dict(),
        "splits": {
            name: write_shards(
                plan_shards(name, list(items(idx)), maxcount), out_dir, _as_sample, desc=f"digits {name}"
            )
            for name, idx in splits.items()
        },
    }
    return write_info(out_dir, info)


class DigitsDataModule(ImageShardDataModule):
    """The digits quick start: shards are written to ``cache_dir`` on first use, then streamed.

    Args:
        cache_dir: where the shards live (written once).
        batch_size: per-device batch size.
        num_workers: DataLoader workers per device.
        augment: image transforms (8x8 grayscale by default).
        val_fraction: fraction of the 1,797 images held out for validation (fixed, seeded split).
        seed: seed of that split.
        digits: keep only these digits, labelled by their position in the list (e.g. ``[5, 6, 7, 8,
            9]``: a task the ``[0, 1, 2, 3, 4]`` quick start never saw, for the fine-tuning quick
            start). None: all ten.
        normalize_on_device: yield uint8 batches normalised after the transfer (see
            :class:`ImageShardDataModule`); off here: 8 x 8 images leave nothing to save, and the
            loaders keep yielding the normalised images the quick start's tests and tools read.
    """

    def __init__(
        self,
        cache_dir: str = "~/.cache/mmlight/digits",
        batch_size: int = 64,
        num_workers: int = 0,
        augment: ImageAugment = DIGITS_AUGMENT,
        val_fraction: float = 0.2,
        seed: int = 0,
        normalize_on_device: bool = False,
        digits: list[int] | None = None,
    ):
        super().__init__(
            os.path.expanduser(cache_dir),
            batch_size,
            num_workers,
            augment,
            shuffle_buffer=2000,
            normalize_on_device=normalize_on_device,
        )
        self.val_fraction = val_fraction
        self.seed = seed
        self.digits = check_digits(digits)

    @property
    def class_map(self) -> ClassMap:
        """The digits kept (all ten by default), known before the shards are written (the class count is linked
        from it when the CLI builds the DataModule, before ``prepare_data``)."""
        return digit_classes(self.digits)

    def prepare_data(self) -> None:
        """Write the shard set into ``cache_dir`` unless one is there (another process writing it is
        waited for: :func:`~mmlight.data.shards.prepare_once`); refuse one split otherwise or of other digits."""
        prepare_once(self.root, self._prepare)

    def _prepare(self) -> None:
        if not (Path(self.root) / INFO_FILE).is_file():
            write_digits_shards(Path(self.root), self.val_fraction, self.seed, digits=self.digits)
            return
        info = read_info(self.root)
        found = (info.get("val_fraction"), info.get("seed"), info.get("digits", list(range(10))))
        if found != (self.val_fraction, self.seed, self.digits):
            raise ValueError(
                f"{self.root} holds digits shards split with val_fraction={found[0]}, seed={found[1]}, "
                f"not {self.val_fraction}, {self.seed}, or of digits {found[2]}, not {self.digits}: "
                "choose another cache_dir or delete that folder"
            )
