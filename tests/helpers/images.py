"""Images and image shards the data tests share."""

from __future__ import annotations

import io
import json
import random

import numpy as np
import torch
import webdataset as wds
from PIL import Image

from mmlight.data import ImageAugment

DEIT_16 = ImageAugment(image_size=16, auto_augment="rand-m9-mstd0.5-inc1", color_jitter=0.3, re_prob=0.5)


def smooth_jpeg(width: int, height: int, seed: int = 0) -> bytes:
    """A smooth colour image (DCT scaling is near exact on it), JPEG quality 95."""
    small = np.random.default_rng(seed).integers(0, 255, (6, 8, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(small).resize((width, height), Image.BICUBIC).save(buf, format="JPEG", quality=95)
    return buf.getvalue()


def seeded(seed: int) -> None:
    """Seed every source timm's transform draws from (RandAugment picks its ops with numpy)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def box_mask(boxes: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """``(H, W)`` bool: the union of ``(top, left, height, width)`` rows, painted with a loop."""
    mask = torch.zeros(height, width, dtype=torch.bool)
    for top, left, h, w in boxes.tolist():
        mask[top : top + h, left : left + w] = True
    return mask


def write_image_shards(root, n=40, per_shard=7, corrupt=(5,)):
    """``n`` random JPEGs (3 classes) in shards of ``per_shard``; samples in ``corrupt`` are not images."""
    root.mkdir(parents=True, exist_ok=True)
    shards = []
    for s in range(0, n, per_shard):
        name = f"train-{s // per_shard:06d}.tar"
        with wds.TarWriter(str(root / name)) as writer:
            for i in range(s, min(n, s + per_shard)):
                pixels = np.random.default_rng(i).integers(0, 255, (20, 24, 3), dtype=np.uint8)
                buf = io.BytesIO()
                Image.fromarray(pixels).save(buf, format="JPEG")
                image = b"not a jpeg" if i in corrupt else buf.getvalue()
                writer.write({"__key__": f"img{i:04d}", "jpg": image, "cls": str(i % 3).encode()})
        shards.append({"name": name, "num_samples": min(n, s + per_shard) - s})
    info = {"classes": ["a", "b", "c"], "splits": {"train": {"num_samples": n, "shards": shards}}}
    (root / "_info.json").write_text(json.dumps(info))
    return root


DEIT_LIKE = ImageAugment(image_size=16, auto_augment="rand-m9-mstd0.5-inc1", re_prob=0.5, scale=(0.3, 1.0))
