"""Writing and reading webdataset shard sets.

A shard set is a folder of ``{split}-{index:06d}.tar`` files plus ``_info.json``::

    {"splits": {"train": {"num_samples": N, "shards": [{"name": ..., "num_samples": n, "sha256": ...}]}},
     "classes": [...], ...}

Every dataset (the digits quick start, ImageNet, ...) goes through the same writer
(:mod:`mmlight.data.prepare.writer`) and reader.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

INFO_FILE = "_info.json"


def sha256(path: Path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_info(out_dir: Path, info: dict) -> None:
    """Write ``_info.json`` atomically, so a reader never sees a half-written file."""
    tmp = out_dir / (INFO_FILE + ".tmp")
    tmp.write_text(json.dumps(info, indent=2))
    os.replace(tmp, out_dir / INFO_FILE)


def read_info(root: str | Path) -> dict:
    """Read a shard set's ``_info.json``, with a message that names what is missing."""
    path = Path(root) / INFO_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"no shard set at {Path(root)}: expected {path} (write one with `mmlight prepare`)"
        )
    return json.loads(path.read_text())


def split_urls(root: str | Path, info: dict, split: str) -> list[str]:
    """Paths of the shards of ``split``, checked to exist."""
    if split not in info["splits"]:
        raise KeyError(f"shard set {root} has no split {split!r}; it has {sorted(info['splits'])}")
    urls = [str(Path(root) / s["name"]) for s in info["splits"][split]["shards"]]
    missing = [u for u in urls if not Path(u).is_file()]
    if missing:
        raise FileNotFoundError(f"shard set {root} lists shards that are missing: {missing[:3]}")
    return urls
