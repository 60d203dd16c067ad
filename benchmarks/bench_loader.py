"""Image loader throughput: webdataset shards against an ImageFolder over the same JPEGs.

Both paths decode with PIL and apply the same timm DeiT training transform (RandAugment m9 mstd
0.5, colour jitter 0.3, random erasing 0.25, bicubic, 224 px); only the storage and the reader
differ. Reports samples per second per worker and the shard/ImageFolder ratio, as JSON lines under
``benchmarks/results/`` (the table in BENCHMARKS.md comes from them).

    python benchmarks/bench_loader.py --images 2000 --workers 1 2
    python benchmarks/bench_loader.py --src /path/to/ILSVRC2012/train-subset  # real images instead

Without ``--src`` it writes ImageNet-sized JPEGs (random smooth content, ~500x375, quality 90) to a
temporary folder, then prepares shards from them with ``mmlight prepare imagenet``'s code.
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torchvision
from PIL import Image

from mmlight.data import ImageAugment, ImageShardDataModule
from mmlight.data.prepare import prepare

RESULTS = Path(__file__).resolve().parent / "results"
DEIT = ImageAugment(image_size=224, channels=3, scale=(0.08, 1.0), hflip=0.5, auto_augment="rand-m9-mstd0.5-inc1",
                    color_jitter=0.3, re_prob=0.25, interpolation="bicubic", crop_pct=0.875)


def write_fake_imagenet(root: Path, images: int, classes: int = 10, seed: int = 0) -> None:
    """``train/<wnid>/*.JPEG`` plus class-folder ``val/``: smooth random images of ImageNet's size."""
    rng = np.random.default_rng(seed)
    for split, count in (("train", images), ("val", classes)):
        for i in range(count):
            wnid = f"n{i % classes:08d}"
            folder = root / split / wnid
            folder.mkdir(parents=True, exist_ok=True)
            small = rng.integers(0, 255, (24, 32, 3), dtype=np.uint8)  # upsampled: JPEG-like sizes
            image = Image.fromarray(small).resize((500, 375), Image.BICUBIC)
            buf = io.BytesIO()
            image.save(buf, format="JPEG", quality=90)
            (folder / f"{wnid}_{i}.JPEG").write_bytes(buf.getvalue())


def throughput(loader, samples: int) -> float:
    """Samples per second over ``samples`` samples, after one warm-up batch."""
    it = iter(loader)
    next(it)
    seen, start = 0, time.perf_counter()
    for images, _ in it:
        seen += len(images)
        if seen >= samples:
            break
    return seen / (time.perf_counter() - start)


def shard_loader(shards: Path, batch_size: int, workers: int):
    dm = ImageShardDataModule(str(shards), batch_size=batch_size, num_workers=workers, augment=DEIT,
                              shuffle_buffer=1000)
    return dm.train_dataloader()


def folder_loader(raw: Path, batch_size: int, workers: int):
    dataset = torchvision.datasets.ImageFolder(str(raw / "train"), transform=DEIT.build(train=True))
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=workers,
                                       drop_last=True, persistent_workers=workers > 0)


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", type=Path, help="an ImageNet-layout folder (train/<wnid>/, val/) to read")
    parser.add_argument("--images", type=int, default=2000, help="generated training images (without --src)")
    parser.add_argument("--samples", type=int, default=1500, help="samples timed per measurement")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="alternating measurements per loader; the median counts")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # decode and augment are per-worker work; keep the main process out of it
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = args.out or RESULTS / f"loader-{platform.node() or 'host'}-{stamp}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        raw = args.src or Path(tmp) / "raw"
        if args.src is None:
            write_fake_imagenet(raw, args.images)
        shards = Path(tmp) / "shards"
        prepare("imagenet", raw, shards, workers=max(args.workers))
        cpu = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
        with out.open("a") as sink:
            for workers in args.workers:
                loaders = {"webdataset shards": lambda: shard_loader(shards, args.batch_size, workers),
                           "ImageFolder": lambda: folder_loader(raw, args.batch_size, workers)}
                samples = {name: [] for name in loaders}
                for _ in range(args.repeats):  # alternate, so a busy moment hits both alike
                    for name, make in loaders.items():
                        samples[name].append(throughput(make(), args.samples))
                rates = {name: statistics.median(values) for name, values in samples.items()}
                for name, rate in rates.items():
                    record = {"op": "image_loader_deit_train", "backend": name, "device": cpu,
                              "torch": torch.__version__, "torchvision": torchvision.__version__,
                              "workers": workers, "batch_size": args.batch_size, "samples": args.samples,
                              "images": "generated 500x375 JPEG q90" if args.src is None else str(args.src),
                              "samples_per_s": round(rate, 1), "repeats": args.repeats,
                              "samples_per_s_per_worker": round(rate / max(workers, 1), 1),
                              "ratio_to_imagefolder": round(rate / rates["ImageFolder"], 3)}
                    sink.write(json.dumps(record) + "\n")
                    print(json.dumps(record))
    return out


if __name__ == "__main__":
    main()
