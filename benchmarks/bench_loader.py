"""DeiT training input pipeline: where a loader worker's time goes, and samples/s per worker of
mmlight's shard loader against torchvision's ImageFolder with the same timm transform.

Every loader applies timm's DeiT training transform (RandomResizedCrop 0.08-1 bicubic 224 px, flip,
RandAugment m9 mstd 0.5, random erasing 0.25; colour jitter 0.3 is configured but timm ignores it
under RandAugment) to the same JPEGs. Measured side by side in one run, alternating, median of
``--repeats``:

* ``ImageFolder``: ``torchvision.datasets.ImageFolder`` + the timm transform + ``DataLoader``;
  with repeated augmentation through a sampler that yields each index 3 times in a row (DeiT's
  ``RASampler`` on one rank), so every copy is decoded again, as in DeiT;
* ``shards, per-copy decode``: mmlight's earlier pipeline (each copy decoded and
  transformed by the timm transform, ``torch.stack`` collation), rebuilt here as the baseline;
* ``shards``: ``ImageShardDataModule(normalize_on_device=False)`` (mmlight.data.image_decode):
  crop box drawn first, JPEG decoded at reduced size (``draft``), one decode per
  repeated-augmentation group, batch rows normalised and erased in place in shared memory; also
  with ``draft_decode=False``;
* ``shards, uint8``: ``ImageShardDataModule`` as configured for DeiT (``normalize_on_device=True``):
  the same, but the rows are plain copies of the uint8 pixels and only the erasing boxes are drawn
  in the worker; converting, normalising and erasing happen after the transfer, on the device
  (``mmlight.data.on_device``). That step's cost on this CPU, in the main process, is timed apart
  (``device_step_ms_per_sample``): on a GPU it takes microseconds.

It also splits one worker's per-sample time into read, decode, augment, collate and transfer (the
batch handed to the main process through a ``multiprocessing`` pickle, as a DataLoader worker
does; plus the copy into pinned memory when CUDA is present), for the ImageFolder path and for
mmlight's two. JSON lines go to ``benchmarks/results/``; BENCHMARKS.md has the table.

    python benchmarks/bench_loader.py                      # generated photograph-like JPEGs
    python benchmarks/bench_loader.py --src /path/to/ILSVRC2012  # real ones (train/<wnid>/*.JPEG)

Without ``--src`` it writes stand-in photographs (:func:`photo_like`) at ImageNet's size
distribution (:func:`imagenet_size`) as JPEG quality 90.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import math
import platform
import random
import statistics
import tempfile
import time
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import numpy as np
import timm
import torch
import torchvision
import webdataset as wds
from PIL import Image, ImageDraw, ImageFilter
from record_name import cpu_description, record_path  # beside this script, which Python puts on sys.path
from torch.utils.data import default_collate

from mmlight.data import ImageAugment, ImageShardDataModule
from mmlight.data.image_decode import (
    AugmentGroup,
    NormalizedBatches,
    SplitTransform,
    Uint8Batches,
    open_image,
    pillow_build,
)
from mmlight.data.images import ImageStream
from mmlight.data.on_device import normalized_batch
from mmlight.data.prepare import prepare
from mmlight.data.shards import MemberReader, iter_tar, read_info, split_urls
from mmlight.data.skips import SkipCounter
from mmlight.data.streaming import RankRandom, ResumableLoader, StreamDataset, batched, resampled_samples, shuffled

DEIT = ImageAugment(
    image_size=224,
    channels=3,
    scale=(0.08, 1.0),
    hflip=0.5,
    auto_augment="rand-m9-mstd0.5-inc1",
    color_jitter=0.3,
    re_prob=0.25,
    interpolation="bicubic",
    crop_pct=0.875,
)
STAGES = ("read", "decode", "augment", "collate", "transfer")


def imagenet_size(rng: np.random.Generator) -> tuple[int, int]:
    """``(W, H)`` drawn to resemble ILSVRC-2012 train: most images have a long side of 500 px and a
    4:3 or 3:2 aspect, about a tenth are portrait, a minority are smaller or much larger; the mean
    comes out near ImageNet's (about 490 x 390, see the run's ``images`` record)."""
    long_side = 500 if rng.random() < 0.7 else int(np.clip(rng.lognormal(math.log(480), 0.45), 120, 2000))
    aspect = rng.choice([4 / 3, 3 / 2, 1.0, 5 / 4, 16 / 9], p=[0.5, 0.3, 0.05, 0.1, 0.05])
    short_side = max(int(round(long_side / aspect)), 32)
    return (short_side, long_side) if rng.random() < 0.12 else (long_side, short_side)


def photo_like(rng: np.random.Generator, width: int, height: int) -> Image.Image:
    """A stand-in photograph that compresses like one: a colour field with a 1/f-like spectrum
    (six octaves of bicubically upsampled noise, amplitude 0.6 per octave, channels mixed so colours
    correlate), a few hard-edged objects, a slight blur, then sensor-like noise (sigma 12-22)."""
    field = np.zeros((height, width, 3), np.float32)
    for octave in range(6):
        cells = 2 ** (octave + 1)
        grid_h = max(2, height * cells // max(width, height)) + 1
        grid_w = max(2, width * cells // max(width, height)) + 1
        noise = rng.normal(0, 1, (grid_h, grid_w, 3)).astype(np.float32)
        up = [np.asarray(Image.fromarray(noise[..., c]).resize((width, height), Image.BICUBIC)) for c in range(3)]
        field += np.stack(up, -1) * 0.6**octave
    field = field @ (rng.normal(0, 0.4, (3, 3)) + np.eye(3)).T.astype(np.float32)
    field = (field - field.mean()) / (field.std() + 1e-6) * 45 + rng.uniform(90, 160, 3)
    image = Image.fromarray(np.clip(field, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(image)
    for _ in range(rng.integers(3, 12)):
        x0, y0 = rng.integers(0, width), rng.integers(0, height)
        x1, y1 = x0 + rng.integers(10, max(width // 2, 11)), y0 + rng.integers(10, max(height // 2, 11))
        draw.ellipse((x0, y0, x1, y1), fill=tuple(int(v) for v in rng.integers(0, 255, 3)))
    pixels = np.asarray(image.filter(ImageFilter.GaussianBlur(rng.uniform(0.5, 1.5)))).astype(np.float32)
    pixels += rng.normal(0, rng.uniform(12, 22), pixels.shape)
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def write_fake_imagenet(root: Path, images: int, classes: int = 10, seed: int = 0) -> dict:
    """``train/<wnid>/*.JPEG`` and class-folder ``val/`` of :func:`photo_like` images (quality 90);
    returns their mean size and bytes."""
    rng = np.random.default_rng(seed)
    sizes, nbytes = [], []
    for split, count in (("train", images), ("val", classes)):
        for i in range(count):
            wnid = f"n{i % classes:08d}"
            folder = root / split / wnid
            folder.mkdir(parents=True, exist_ok=True)
            size = imagenet_size(rng)
            buf = io.BytesIO()
            photo_like(rng, *size).save(buf, format="JPEG", quality=90)
            (folder / f"{wnid}_{i}.JPEG").write_bytes(buf.getvalue())
            sizes.append(size)
            nbytes.append(len(buf.getvalue()))
    return {
        "images": images,
        "mean_width": round(float(np.mean([w for w, _ in sizes])), 1),
        "mean_height": round(float(np.mean([h for _, h in sizes])), 1),
        "mean_kib": round(float(np.mean(nbytes)) / 1024, 1),
        "seed": seed,
        "how": "bench_loader.photo_like at bench_loader.imagenet_size, JPEG quality 90",
    }


# --- per-stage split of one worker's time ---------------------------------------------------------


@contextlib.contextmanager
def as_worker():
    """Collate as inside a DataLoader worker, where batches are allocated in shared memory."""
    worker = torch.utils.data._utils.worker
    worker._worker_info = worker.WorkerInfo(id=0, num_workers=1, seed=0, dataset=None)
    try:
        yield
    finally:
        worker._worker_info = None


def _transfer(batch) -> None:
    """A worker's batch on its way to the training step: the pickle through shared memory that a
    DataLoader worker queue does, then the copy into pinned memory when CUDA exists."""
    images = ForkingPickler.loads(ForkingPickler.dumps(batch))[0]
    if torch.cuda.is_available():
        images.pin_memory()


class StageClock:
    """Accumulates seconds per stage: ``with clock("decode"): ...``."""

    def __init__(self):
        self.seconds = dict.fromkeys(STAGES + ("device",), 0.0)

    @contextlib.contextmanager
    def __call__(self, stage: str):
        start = time.perf_counter()
        yield
        self.seconds[stage] += time.perf_counter() - start


def stage_times_imagefolder(files: list[Path], samples: int, batch_size: int, copies: int) -> dict:
    """Seconds per stage for ImageFolder + timm (each copy decoded, as DeiT's sampler makes it):
    file read, PIL decode, the timm transform, ``default_collate``, transfer."""
    transform, clock = DEIT.build(train=True), StageClock()
    paths = (path for path in itertools.cycle(files) for _ in range(copies))
    for _ in range(samples // batch_size):
        batch = []
        for path in itertools.islice(paths, batch_size):
            with clock("read"):
                data = path.read_bytes()
            with clock("decode"):
                image = Image.open(io.BytesIO(data)).convert("RGB")  # ImageFolder's loader
            with clock("augment"):
                batch.append((transform(image), 0))
        with clock("collate"), as_worker():
            batch = default_collate(batch)
        with clock("transfer"):
            _transfer(batch)
    return clock.seconds


def stage_times_shards(
    urls: list[str], samples: int, batch_size: int, copies: int, draft: bool, uint8: bool = False
) -> dict:
    """Seconds per stage for mmlight: tar read, crop draw and (reduced) decode, crops and PIL ops,
    the batch written in shared memory (convert, normalise, erase; or with ``uint8`` the pixels
    copied and the erasing boxes drawn), transfer; with ``uint8`` also ``device``: the on-device
    step (convert, normalise, erase) run here, on the CPU, as the main process would without a GPU."""
    split, clock = SplitTransform(DEIT.build(train=True)), StageClock()
    group = AugmentGroup(3, split, copies, draft=draft)
    batches = (Uint8Batches if uint8 else NormalizedBatches)(batch_size, split, partial=False)
    records = (data for _ in itertools.count() for url in urls for name, data in iter_tar(url) if name.endswith(".jpg"))
    for _ in range(samples // batch_size):
        pending = []
        while len(pending) < batch_size:
            with clock("read"):
                data = next(records)
            with clock("decode"):
                draws, scale = group.draw(data, copies)
                image = open_image(data, "RGB", scale)
            with clock("augment"):
                pending += [(crop, 0) for crop in group.augment(image, draws, scale)]
        with clock("collate"), as_worker():
            batch = batches.collate(pending[:batch_size])
        with clock("transfer"):
            _transfer(batch)
        with clock("device"):
            normalized_batch(batch, DEIT.mean, DEIT.std)
    return clock.seconds


# --- whole loaders, side by side ------------------------------------------------------------------


class RepeatedIndices(torch.utils.data.Sampler):
    """Each index of a random permutation ``copies`` times in a row: DeiT's ``RASampler`` on one rank
    (it keeps the first ``1/copies`` of the repeated list per epoch; the rate is what is measured)."""

    def __init__(self, size: int, copies: int):
        self.size, self.copies = size, copies

    def __iter__(self):
        return (i for i in torch.randperm(self.size).tolist() for _ in range(self.copies))

    def __len__(self):
        return self.size * self.copies


def folder_loader(raw: Path, batch_size: int, workers: int, copies: int):
    dataset = torchvision.datasets.ImageFolder(str(raw / "train"), transform=DEIT.build(train=True))
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=RepeatedIndices(len(dataset), copies),
        num_workers=workers,
        drop_last=True,
        persistent_workers=workers > 0,
    )


def shard_loader(shards: Path, batch_size: int, workers: int, copies: int, draft: bool = True, uint8: bool = False):
    dm = ImageShardDataModule(
        str(shards),
        batch_size=batch_size,
        num_workers=workers,
        augment=DEIT,
        shuffle_buffer=500,
        repeated_augmentation=copies,
        draft_decode=draft,
        normalize_on_device=uint8,
    )
    return dm.train_dataloader()


class PerCopyStream(ImageStream):
    """mmlight's earlier training stream, kept here as the baseline: each copy repeated as a
    reference before the shuffle buffer, then read, decoded and put through the timm transform on
    its own (per-sample float tensors, ``torch.stack``)."""

    def __init__(self, urls: list[str], batch_size: int, copies: int, counter: SkipCounter):
        super().__init__(urls, batch_size, 500, copies, None, counter)
        self.transform = DEIT.build(train=True)
        self.reader = MemberReader()

    def units(self, rand: RankRandom, count_skips: bool):
        refs = resampled_samples(self.urls, rand.python("shards"), None)
        copies = (ref for ref in refs for _ in range(self.repeats))
        return batched(shuffled(copies, self.shuffle_buffer, rand.python("shuffle")), self.batch_size)

    def materialise(self, unit: list[dict]):
        images = [self.transform(open_image(self.reader.read(ref["__url__"], *ref["jpg"]), "RGB")) for ref in unit]
        return torch.stack(images), torch.tensor([int(self.reader.read(ref["__url__"], *ref["cls"])) for ref in unit])


def per_copy_shard_loader(shards: Path, batch_size: int, workers: int, copies: int):
    info = read_info(shards)
    urls = split_urls(shards, info, "train")
    stream = PerCopyStream(urls, batch_size, copies, SkipCounter())
    steps = info["splits"]["train"]["num_samples"] // batch_size
    return ResumableLoader(StreamDataset(stream, steps, seed=0, rank=0), workers, world_size=1)


def child_pids() -> list[int]:
    """This process's live children (the loader workers while a loader is iterated)."""
    children = []
    for task in Path("/proc/self/task").glob("*/children"):
        children += [int(pid) for pid in task.read_text().split()]
    return children


def peak_rss_mib(pids: list[int]) -> float | None:
    """The largest peak resident set (VmHWM) among ``pids``, MiB; includes pages shared with the
    parent and the shared-memory batches the worker wrote."""
    peaks = []
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        peaks += [int(line.split()[1]) / 1024 for line in status.splitlines() if line.startswith("VmHWM:")]
    return round(max(peaks), 1) if peaks else None


def measure(loader, samples: int) -> tuple[float, float | None]:
    """(samples per second over ``samples`` samples after one warm-up batch, workers' peak RSS)."""
    it = iter(loader)
    next(it)
    seen, start = 0, time.perf_counter()
    for batch in it:
        seen += len(batch[0])
        if seen >= samples:
            break
    rate = seen / (time.perf_counter() - start)
    peak = peak_rss_mib(child_pids())
    del it
    return rate, peak


def versions() -> dict:
    return {
        "device": cpu_description(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "timm": timm.__version__,
        "pillow": pillow_build(),
        "webdataset": getattr(wds, "__version__", "?"),
    }


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", type=Path, help="an ImageNet-layout folder (train/<wnid>/*.JPEG, val/) to read")
    parser.add_argument("--images", type=int, default=1000, help="generated training images (without --src)")
    parser.add_argument("--samples", type=int, default=640, help="samples timed per loader measurement")
    parser.add_argument("--stage-samples", type=int, default=256, help="samples timed per stage split")
    parser.add_argument("--workers", type=int, nargs="+", default=[1])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--copies", type=int, default=3, help="repeated augmentation (DeiT: 3)")
    parser.add_argument("--repeats", type=int, default=3, help="alternating measurements per loader; the median counts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # decode and augment are per-worker work; one thread per worker
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    pillow = tuple(pillow_build().rsplit(" ", 1))  # ("Pillow-SIMD", "12.1.1.post0")
    out = args.out or record_path("loader", "cpu", [("torch", torch.__version__), pillow], "jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    common = {**versions(), "batch_size": args.batch_size, "seed": args.seed}
    with tempfile.TemporaryDirectory() as tmp, out.open("a") as sink:

        def emit(record: dict) -> None:
            record = {**record, **common}
            sink.write(json.dumps(record) + "\n")
            print(json.dumps(record), flush=True)

        raw = args.src or Path(tmp) / "raw"
        images = {"images": str(args.src)} if args.src else write_fake_imagenet(raw, args.images)
        common["image_set"] = images.get("how", str(args.src))
        emit({"op": "images", **images})
        shards = Path(tmp) / "shards"
        prepare("imagenet", raw, shards, workers=max(args.workers))
        urls = split_urls(shards, read_info(shards), "train")
        files = sorted((raw / "train").rglob("*.JPEG"))
        for copies in sorted({1, args.copies}):
            splits = {
                "ImageFolder": lambda: stage_times_imagefolder(files, args.stage_samples, args.batch_size, copies),
                "shards": lambda: stage_times_shards(urls, args.stage_samples, args.batch_size, copies, True),
                "shards, uint8": lambda: stage_times_shards(
                    urls, args.stage_samples, args.batch_size, copies, True, uint8=True
                ),
            }
            runs = {name: [] for name in splits}
            for _ in range(args.repeats):  # alternate, as for the loaders; the median per stage counts
                for name, run in splits.items():
                    runs[name].append(run())
            for name, seconds in runs.items():
                per_sample = {
                    k: round(statistics.median(r[k] for r in seconds) / args.stage_samples * 1e3, 3) for k in STAGES
                }
                emit(
                    {
                        "op": "stage_ms_per_sample",
                        "backend": name,
                        "copies": copies,
                        "samples": args.stage_samples,
                        "repeats": args.repeats,
                        **per_sample,
                        "total": round(sum(per_sample.values()), 3),
                    }
                )
                if name == "shards, uint8":  # the main process's step after the transfer, here on the CPU
                    device = statistics.median(r["device"] for r in seconds) / args.stage_samples * 1e3
                    emit(
                        {
                            "op": "device_step_ms_per_sample",
                            "backend": name,
                            "copies": copies,
                            "on": "cpu",
                            "threads": torch.get_num_threads(),
                            "samples": args.stage_samples,
                            "repeats": args.repeats,
                            "ms": round(device, 3),
                        }
                    )
        for workers in args.workers:
            loaders = {
                ("ImageFolder", 1): lambda: folder_loader(raw, args.batch_size, workers, 1),
                ("ImageFolder", args.copies): lambda: folder_loader(raw, args.batch_size, workers, args.copies),
                ("shards, per-copy decode", 1): lambda: per_copy_shard_loader(shards, args.batch_size, workers, 1),
                ("shards, per-copy decode", args.copies): lambda: per_copy_shard_loader(
                    shards, args.batch_size, workers, args.copies
                ),
                ("shards", 1): lambda: shard_loader(shards, args.batch_size, workers, 1),
                ("shards", args.copies): lambda: shard_loader(shards, args.batch_size, workers, args.copies),
                ("shards, no draft", args.copies): lambda: shard_loader(
                    shards, args.batch_size, workers, args.copies, draft=False
                ),
                ("shards, uint8", 1): lambda: shard_loader(shards, args.batch_size, workers, 1, uint8=True),
                ("shards, uint8", args.copies): lambda: shard_loader(
                    shards, args.batch_size, workers, args.copies, uint8=True
                ),
            }
            runs = {key: [] for key in loaders}
            for _ in range(args.repeats):  # alternate, so a busy moment hits all alike
                for key, make in loaders.items():
                    runs[key].append(measure(make(), args.samples))
            rates = {key: statistics.median(r for r, _ in values) for key, values in runs.items()}
            for (name, copies), rate in rates.items():
                peaks = [p for _, p in runs[(name, copies)] if p is not None]
                emit(
                    {
                        "op": "image_loader_deit_train",
                        "backend": name,
                        "copies": copies,
                        "workers": workers,
                        "samples": args.samples,
                        "repeats": args.repeats,
                        "samples_per_s": round(rate, 1),
                        "samples_per_s_per_worker": round(rate / max(workers, 1), 1),
                        "ratio_to_imagefolder": round(rate / rates[("ImageFolder", copies)], 3),
                        "ratio_to_per_copy_shards": round(rate / rates[("shards, per-copy decode", copies)], 3),
                        "peak_rss_mib_per_worker": max(peaks) if peaks else None,
                    }
                )
    return out


if __name__ == "__main__":
    main()
