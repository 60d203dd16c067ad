"""What the image-file preparers share (``imagefolder``, ``flowers102``, ``food101``): one image file
to one shard sample, and the splits to shards and ``_info.json``.

An image is stored as its original bytes when it is a JPEG or PNG in RGB or greyscale (``L``; the
loader converts it to the model's channels). Anything else that Pillow reads (a GIF's first frame, a
CMYK JPEG, a palette or 16-bit PNG, BMP, WebP, TIFF) is converted to RGB, composited on white
where it has transparency, and stored as a lossless PNG; each conversion is logged with the file
and its reason. A file Pillow cannot decode, an empty file or a listed file that is missing is
skipped, counted and logged (``Skipped``), never silently dropped.
"""

from __future__ import annotations

import io
import logging
import random
from pathlib import Path

from PIL import Image

from mmlight.data.shard_writer import Skipped, plan_shards, write_shards
from mmlight.data.shards import write_info

log = logging.getLogger(__name__)
#: (format, mode) pairs stored unchanged
KEPT = {("JPEG", "RGB"), ("JPEG", "L"), ("PNG", "RGB"), ("PNG", "L")}
#: images per shard: about 100 MB of typical photos
SAMPLES_PER_SHARD = 1000

#: one sample to write: (key, image file path, class index)
ImageItem = tuple[str, str, int]


def as_rgb(image: Image.Image) -> Image.Image:
    """``image`` in RGB, transparent pixels composited on white."""
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def png_bytes(image: Image.Image) -> bytes:
    """``image`` encoded as a PNG."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def image_sample(item: ImageItem) -> dict | Skipped:
    """``(key, path, class index)`` -> a ``jpg``/``png`` + ``cls`` sample, or a skip with its reason."""
    key, path, label = item
    if not Path(path).is_file():
        return Skipped(path, "listed but missing")
    data = Path(path).read_bytes()
    if not data:
        return Skipped(path, "empty file")
    try:
        with Image.open(io.BytesIO(data)) as image:
            kind = (image.format, image.mode)
            image.load()  # a full decode: catches truncated files that header checks miss
            if kind in KEPT:
                return {"__key__": key, "jpg" if kind[0] == "JPEG" else "png": data, "cls": str(label)}
            converted = png_bytes(as_rgb(image))
    except Exception as err:  # PIL raises several types (UnidentifiedImageError, OSError, ...)
        return Skipped(path, f"not a readable image ({type(err).__name__}: {err})")
    log.info("converted %s (%s %s) to an RGB PNG", path, *kind)
    return {"__key__": key, "png": converted, "cls": str(label)}


def write_image_splits(
    out: Path,
    dataset: str,
    classes: list[str],
    splits: dict[str, list[tuple[str, int]]],
    workers: int,
    shuffle: tuple[str, ...] = ("train",),
    per_shard: int = SAMPLES_PER_SHARD,
    make_sample=image_sample,
) -> dict:
    """Write every split's ``(path or raw item, class index)`` list as shards and ``_info.json``.

    Args:
        out: the shard set folder.
        dataset: its name in ``_info.json``.
        classes: class names, in label order.
        splits: split name -> its items in the raw data's order.
        workers: writer processes.
        shuffle: splits written in a fixed shuffled order (seed 0), so that each shard mixes classes
            (a streaming shuffle buffer cannot mix class-sorted shards).
        per_shard: samples per shard.
        make_sample: ``(key, item, class index)`` -> sample; :func:`image_sample` for image files.
    """
    info = {"dataset": dataset, "classes": classes, "splits": {}}
    for split, items in splits.items():
        keyed = [(f"{split}{i:07d}", item, label) for i, (item, label) in enumerate(items)]
        if split in shuffle:
            random.Random(0).shuffle(keyed)
        jobs = plan_shards(split, keyed, per_shard)
        info["splits"][split] = write_shards(jobs, out, make_sample, workers, desc=f"{dataset} {split}")
    write_info(out, info)
    return info
