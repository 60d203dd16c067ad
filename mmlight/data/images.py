"""Streaming image classification data from webdataset shards (``{jpg|png}`` image bytes + ``cls``)."""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import webdataset as wds
from PIL import Image, ImageOps
from timm.data import auto_augment as timm_auto_augment
from timm.data import create_transform

from mmlight.data.image_decode import AugmentGroup, NormalizedBatches, SplitTransform, Uint8Batches, flatten, open_image
from mmlight.data.on_device import normalized_batch
from mmlight.data.shards import MemberReader, split_urls
from mmlight.data.skips import SkipCounter, Skipping, is_kept
from mmlight.data.streaming import RankRandom, ShardDataModule, StreamSource, batched, resampled_samples, shuffled
from mmlight.data.vocab import ClassMap


def _posterize(img: Image.Image, bits_to_keep: int, **_) -> Image.Image:
    """timm's posterize op, with ``bits_to_keep == 0`` giving the black image that older Pillow
    returned. Pillow 13 raises for 0 bits, and timm's RandAugment reaches 0 bits whenever a sampled
    magnitude hits its cap of 10 (about 2% of posterize calls with DeiT's ``rand-m9-mstd0.5-inc1``),
    which would stop a training run mid-epoch."""
    if bits_to_keep >= 8:
        return img
    if bits_to_keep <= 0:
        return Image.new(img.mode, img.size)
    return ImageOps.posterize(img, bits_to_keep)


for _name in ("Posterize", "PosterizeIncreasing", "PosterizeOriginal"):
    timm_auto_augment.NAME_TO_OP[_name] = _posterize  # read when a transform is built


@dataclass
class ImageAugment:
    """Image transforms, passed to :func:`timm.data.create_transform`.

    Args:
        image_size: side of the (square) network input.
        channels: 3 (RGB) or 1 (grayscale); images are converted on decode.
        scale: RandomResizedCrop area range for training.
        hflip: horizontal flip probability.
        auto_augment: timm policy string such as ``rand-m9-mstd0.5-inc1``, or None.
        color_jitter: colour jitter strength (ignored by timm when auto_augment is set).
        re_prob: random erasing probability.
        interpolation: resize interpolation.
        crop_pct: evaluation centre-crop fraction.
        mean: normalisation mean per channel.
        std: normalisation std per channel.
    """

    image_size: int = 224
    channels: Literal[1, 3] = 3
    scale: tuple[float, float] = (0.08, 1.0)
    hflip: float = 0.5
    auto_augment: str | None = None
    color_jitter: float | None = 0.4
    re_prob: float = 0.0
    interpolation: str = "bicubic"
    crop_pct: float = 0.875
    mean: tuple[float, ...] = (0.485, 0.456, 0.406)
    std: tuple[float, ...] = (0.229, 0.224, 0.225)

    def build(self, train: bool):
        if len(self.mean) != self.channels or len(self.std) != self.channels:
            raise ValueError(f"mean/std need {self.channels} values, got {self.mean} and {self.std}")
        common = dict(
            input_size=(self.channels, self.image_size, self.image_size),
            interpolation=self.interpolation,
            mean=self.mean,
            std=self.std,
        )
        if not train:
            return create_transform(is_training=False, crop_pct=self.crop_pct, **common)
        return create_transform(
            is_training=True,
            scale=self.scale,
            hflip=self.hflip,
            auto_augment=self.auto_augment,
            color_jitter=self.color_jitter or 0.0,
            re_prob=self.re_prob,
            **common,
        )


def eval_images(images: list[Image.Image | str | Path], augment: ImageAugment) -> torch.Tensor:
    """Images through the evaluation transform of ``augment``, as the validation loader makes them
    (with ``normalize_on_device`` False): ``(B, C, H, W)`` float32.

    Args:
        images: PIL images (converted to ``augment.channels``) or paths of image files (decoded as
            the shards' image bytes are).
        augment: the image transforms of the data config.
    """
    split = SplitTransform(augment.build(train=False))
    mode = AugmentGroup(augment.channels, split).mode
    rows = []
    for i, image in enumerate(images):
        if isinstance(image, (str, Path)):
            image = open_image(Path(image).read_bytes(), mode)
        elif not isinstance(image, Image.Image):
            raise TypeError(f"image {i} is a {type(image).__name__}; give PIL images or paths of image files")
        rows.append((split.pil_ops(image if image.mode == mode else image.convert(mode)), 0))
    return NormalizedBatches(len(rows), split, partial=True).collate(rows)[0]


class ReadSample:
    """Sample reference (member ``(offset, size)`` values, see
    :func:`mmlight.data.streaming.resampled_samples`) -> the sample with its bytes, then ``fn`` of it.

    Args:
        fn: what to apply to the read sample.
    """

    def __init__(self, fn):
        self.fn = fn
        self.reader = MemberReader()

    def __call__(self, ref: dict):
        sample = {k: v if k.startswith("__") else self.reader.read(ref["__url__"], *v) for k, v in ref.items()}
        return self.fn(sample)


def copy_groups(refs: Iterable[dict], copies: int, batch_size: int, rng: random.Random) -> Iterator[list[dict]]:
    """Batches of ``batch_size`` rows, each image's ``copies`` rows consecutive in the stream, as groups:
    references carrying ``__copies__`` (its rows in this batch; an image whose copies straddle two
    batches is one group in each) and ``__rows__`` (their positions in the batch, a permutation drawn
    from ``rng`` so that copies are not neighbours, e.g. for mixup's flipped pairs)."""
    slots = (ref for ref in refs for _ in range(copies))
    for batch in batched(slots, batch_size):
        rows = list(range(batch_size))
        rng.shuffle(rows)
        groups: list[dict] = []
        last = None
        for row, ref in zip(rows, batch):
            if ref is last:
                groups[-1]["__copies__"] += 1
                groups[-1]["__rows__"].append(row)
            else:
                groups.append({**ref, "__copies__": 1, "__rows__": [row]})
                last = ref
        yield groups


class ImageStream(StreamSource):
    """Training batches of an image shard set: resampled shards, a shuffle buffer of images, each
    image's ``repeats`` copies in one batch (or two, at a boundary) at rows drawn for them; a batch
    is read and decoded only when materialised, each image once for all of its copies
    (:class:`~mmlight.data.image_decode.AugmentGroup`), straight into a shared-memory batch
    (:class:`~mmlight.data.image_decode.Uint8Batches` or
    :class:`~mmlight.data.image_decode.NormalizedBatches`). A sample that fails to read or decode
    is logged, counted, and its rows taken by copies of other rows of the batch, so batches keep
    their size (mixup needs an even one) and later batches are unaffected.

    Args:
        urls: training shards.
        batch_size: rows per batch.
        shuffle_buffer: rows held in the shuffle buffer, copies included: it holds
            ``shuffle_buffer // repeats`` encoded images.
        repeats: copies of each image (repeated augmentation).
        decode: the read sample (its ``__copies__``) -> that many augmented ``(PIL image, label)``
            pairs; None for a stream whose units are only replayed (benchmarks).
        counter: where skipped samples are counted.
        uint8: yield uint8 batches with the erasing boxes (:class:`~mmlight.data.image_decode.Uint8Batches`)
            instead of normalised float32 ones.
    """

    def __init__(
        self,
        urls: list[str],
        batch_size: int,
        shuffle_buffer: int,
        repeats: int,
        decode: AugmentGroup | None,
        counter: SkipCounter,
        uint8: bool = False,
    ):
        self.urls, self.batch_size, self.shuffle_buffer, self.repeats = urls, batch_size, shuffle_buffer, repeats
        self.counter = counter
        self.load = Skipping(ReadSample(decode), counter)
        batches = Uint8Batches if uint8 else NormalizedBatches
        self.collate = batches(batch_size, decode.split, partial=False) if decode is not None else None

    def units(self, rand: RankRandom, count_skips: bool):
        refs = resampled_samples(self.urls, rand.python("shards"), self.counter if count_skips else None)
        images = shuffled(refs, max(self.shuffle_buffer // self.repeats, 1), rand.python("shuffle"))
        return copy_groups(images, self.repeats, self.batch_size, rand.python("order"))

    def materialise(self, unit: list[dict]) -> tuple:
        rows: list = [None] * self.batch_size
        for group in unit:
            copies = self.load(group)
            for row, copy in zip(group["__rows__"], copies or [None] * group["__copies__"]):
                rows[row] = copy
        kept = [row for row in rows if is_kept(row)]
        if not kept:
            raise RuntimeError(
                f"no sample of a training batch could be read, e.g. {unit[0]['__key__']} in {unit[0]['__url__']}"
            )
        return self.collate.collate([row if is_kept(row) else kept[i % len(kept)] for i, row in enumerate(rows)])


class ImageShardDataModule(ShardDataModule):
    """Streams an image shard set: for training resampled shards with a fixed epoch length (every
    rank runs the same number of steps) in an order fixed by the seed, resumable at any batch
    (:class:`ImageStream`); for validation each shard read once.

    Args:
        root: folder holding the shards and ``_info.json``.
        batch_size: per-device batch size.
        num_workers: DataLoader worker processes per device.
        augment: the image transforms.
        shuffle_buffer: training rows held in the shuffle buffer, repeated-augmentation copies
            included: it holds ``shuffle_buffer // repeated_augmentation`` encoded images (about
            110 KiB each on ImageNet), the memory the buffer had when copies were repeated before it.
        train_split: name of the training split in ``_info.json``.
        val_split: name of the validation split.
        test_split: name of the split that ``test`` and ``predict`` read.
        repeated_augmentation: training copies of each image, each augmented independently from
            one decode (DeiT uses 3). The copies go to random rows of the same batch (or of two
            consecutive ones), as DeiT's sampler puts them in one global batch. The epoch length
            stays one pass's worth of samples, so an epoch sees ``1/repeats`` of the distinct
            images, as with DeiT's sampler.
        draft_decode: decode each training JPEG at 1/2, 1/4 or 1/8 of its size when every crop
            drawn for it keeps at least the network's input size at that scale (the crop boxes are
            drawn first, on the full-size geometry). False decodes at full size: timm's pixels exactly.
        normalize_on_device: the loaders yield uint8 images ``(B, H, W, C)``, labels and, for
            training with random erasing, the erasing boxes (drawn in the worker with timm's random
            calls); :meth:`on_after_batch_transfer` then converts, normalises and erases on the
            device, so the training and evaluation steps see the same ``(B, C, H, W)`` float32
            images as with False (the erasing noise is N(0, 1) from a per-batch seeded device
            generator instead of the worker's CPU generator). A quarter of the bytes per batch to
            send and copy, and 11-15% less worker time per sample with DeiT's transform
            (BENCHMARKS.md, "Image loader"). Code that
            iterates the loaders itself applies ``on_after_batch_transfer(batch, 0)`` to each batch.
            False: the worker writes normalised, erased float32 batches.
    """

    def __init__(
        self,
        root: str,
        batch_size: int = 64,
        num_workers: int = 4,
        augment: ImageAugment = ImageAugment(),
        shuffle_buffer: int = 5000,
        train_split: str = "train",
        val_split: str = "val",
        test_split: str = "val",
        repeated_augmentation: int = 1,
        draft_decode: bool = True,
        normalize_on_device: bool = True,
    ):
        super().__init__(root, num_workers, val_split, test_split)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if repeated_augmentation < 1:
            raise ValueError(f"repeated_augmentation must be >= 1, got {repeated_augmentation}")
        self.repeated_augmentation = repeated_augmentation
        self.draft_decode = draft_decode
        self.normalize_on_device = normalize_on_device
        self.batch_size = batch_size
        self.augment = augment
        self.shuffle_buffer = shuffle_buffer
        self.train_split = train_split

    @property
    def class_map(self) -> ClassMap:
        """The data's label set (``classes`` in ``_info.json``)."""
        return ClassMap.from_dict(self._info())

    @property
    def num_classes(self) -> int:
        return len(self.class_map)

    def train_dataloader(self):
        info = self._info()
        num_samples = info["splits"][self.train_split]["num_samples"]
        steps = self.epoch_steps(num_samples, self.batch_size, f"{self.batch_size} samples")
        split = SplitTransform(self.augment.build(train=True))
        decode = AugmentGroup(self.augment.channels, split, self.repeated_augmentation, draft=self.draft_decode)
        stream = ImageStream(
            split_urls(self.root, info, self.train_split),
            self.batch_size,
            self.shuffle_buffer,
            self.repeated_augmentation,
            decode,
            self.skipped,
            uint8=self.normalize_on_device,
        )
        return self.resumable_loader(stream, steps)

    def on_after_batch_transfer(self, batch, dataloader_idx: int):
        """On the device: a uint8 batch converted, normalised (the transform's mean and std) and
        erased (:func:`mmlight.data.on_device.normalized_batch`), then cast as the trainer's
        precision casts inputs (e.g. ``bf16-true``; Lightning does that before the transfer, when
        the images were still uint8); a float32 batch as it is."""
        batch = normalized_batch(batch, self.augment.mean, self.augment.std)
        return batch if self.trainer is None else self.trainer.precision_plugin.convert_input(batch)

    def _eval_loader(self, split: str):
        transform = SplitTransform(self.augment.build(train=False))
        decode = AugmentGroup(self.augment.channels, transform, copies=1, draft=False)
        batches = Uint8Batches if self.normalize_on_device else NormalizedBatches
        dataset = wds.DataPipeline(
            *self.eval_stages(split_urls(self.root, self._info(), split)),
            wds.map(Skipping(decode, self.skipped)),
            wds.select(is_kept),
            flatten,
            batches(self.batch_size, transform, partial=True),
        )
        return wds.WebLoader(dataset, batch_size=None, num_workers=self.num_workers)
