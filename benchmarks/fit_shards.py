"""Synthetic ImageNet-format training shards, to time a real ``mmlight fit`` without ImageNet.

The images are ``bench_loader``'s stand-in photographs (:func:`bench_loader.photo_like` at
ImageNet's size distribution, :func:`bench_loader.imagenet_size`, JPEG quality 90), so a loader
worker decodes and augments about what it would on ILSVRC-2012. A pool of ``--distinct`` of them is
generated once and cycled: the loader's cost does not depend on whether two samples share bytes. The
shards and ``_info.json`` are written by mmlight's own writer (:func:`mmlight.data.shard_writer.write_shards`,
:func:`mmlight.data.shards.write_info`), in the layout ``mmlight prepare imagenet`` writes: a ``train``
split of ``jpg``/``cls`` samples, 1,000 per shard, labels of 1,000 classes. There is no validation
split: a timing fit runs without validation.

    python benchmarks/fit_shards.py --out /tmp/synthetic-imagenet --samples 76800 --workers 16
"""

from __future__ import annotations

import argparse
import io
import json
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from bench_loader import imagenet_size, photo_like  # beside this script, which Python puts on sys.path

from mmlight.data.prepare.imagenet import SAMPLES_PER_SHARD
from mmlight.data.shard_writer import plan_shards, write_shards
from mmlight.data.shards import write_info
from mmlight.data.vocab import ClassMap

#: ILSVRC-2012's class count, so that the model's output layer is DeiT's
CLASSES = 1000


def photo_jpeg(seed: int) -> bytes:
    """One stand-in photograph at an ImageNet-like size, as JPEG quality 90."""
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    photo_like(rng, *imagenet_size(rng)).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def make_sample(item: tuple[str, str, int]) -> dict:
    """``(key, pool file, class index)`` -> a ``jpg``/``cls`` sample, as ``mmlight prepare imagenet`` stores one."""
    key, path, label = item
    return {"__key__": key, "jpg": Path(path).read_bytes(), "cls": str(label)}


def write_synthetic_imagenet(out: Path, samples: int, distinct: int = 256, workers: int = 1, seed: int = 0) -> dict:
    """Write ``samples`` training samples cycling ``distinct`` generated JPEGs into ``out``; return ``_info.json``.

    Args:
        out: the shard set folder (created; the image pool goes to ``out/pool``).
        samples: training samples (one epoch of ``samples // batch`` steps).
        distinct: different images generated; the samples cycle through them.
        workers: processes that generate images and write shards.
        seed: seed of the images (image ``i`` from ``seed + i``) and of the labels.
    """
    if samples < 1 or distinct < 1:
        raise ValueError(f"samples and distinct must be >= 1, got {samples} and {distinct}")
    pool = out / "pool"
    pool.mkdir(parents=True, exist_ok=True)
    seeds = range(seed, seed + min(distinct, samples))
    if workers > 1:
        with ProcessPoolExecutor(workers) as executor:
            images = list(executor.map(photo_jpeg, seeds))
    else:
        images = [photo_jpeg(s) for s in seeds]
    files = []
    for i, data in enumerate(images):
        files.append(pool / f"{i:05d}.jpg")
        files[-1].write_bytes(data)
    labels = np.random.default_rng(seed).integers(0, CLASSES, samples)
    items = [(f"synthetic_{i:08d}", str(files[i % len(files)]), int(labels[i])) for i in range(samples)]
    jobs = plan_shards("train", items, SAMPLES_PER_SHARD)
    classes = ClassMap([f"n{i:08d}" for i in range(CLASSES)])
    info = {
        "dataset": "synthetic_imagenet",
        **classes.to_dict(),
        "splits": {"train": write_shards(jobs, out, make_sample, workers, desc="synthetic imagenet")},
        "images": {
            "distinct": len(files),
            "mean_kib": round(sum(len(d) for d in images) / len(images) / 1024, 1),
            "how": "bench_loader.photo_like at bench_loader.imagenet_size, JPEG quality 90",
        },
    }
    return write_info(out, info)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="shard set folder to write")
    parser.add_argument("--samples", type=int, required=True, help="training samples")
    parser.add_argument("--distinct", type=int, default=256, help="different images generated (default 256)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes (default: every core)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    info = write_synthetic_imagenet(args.out, args.samples, args.distinct, args.workers, args.seed)
    print(json.dumps({"samples": info["splits"]["train"]["num_samples"], **info["images"]}))
    return info


if __name__ == "__main__":
    main()
