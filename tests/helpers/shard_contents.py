"""Reading a written shard set back, for the preparers' tests."""

import io
import json
import tarfile
from collections import defaultdict
from pathlib import Path

import numpy as np
from PIL import Image


def split_samples(root: Path, split: str) -> dict[str, dict[str, bytes]]:
    """``{key: {extension: bytes}}`` of every sample of ``split``, read with ``tarfile``."""
    info = json.loads((root / "_info.json").read_text())
    samples = defaultdict(dict)
    for shard in info["splits"][split]["shards"]:
        with tarfile.open(root / shard["name"]) as tar:
            for member in tar.getmembers():
                key, ext = member.name.split(".", 1)
                samples[key][ext] = tar.extractfile(member).read()
    return dict(samples)


def image_bytes(sample: dict[str, bytes]) -> bytes:
    return sample.get("jpg", sample.get("png"))


def pixels(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)))


def encoded(pixels: np.ndarray, fmt: str, mode: str | None = None, **save) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels, mode=mode).save(buf, format=fmt, **save)
    return buf.getvalue()
