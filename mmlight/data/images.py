"""Streaming image classification data from webdataset shards (``{jpg|png}`` image bytes + ``cls``)."""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Literal

import torch
import webdataset as wds
from PIL import Image, ImageOps
from timm.data import auto_augment as timm_auto_augment
from timm.data import create_transform

from mmlight.data.shards import MemberReader, split_urls
from mmlight.data.skips import SkipCounter, Skipping, is_kept
from mmlight.data.streaming import RankRandom, ShardDataModule, StreamSource, batched, resampled_samples, shuffled

IMAGE_KEYS = ("jpg", "jpeg", "png")


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
        common = dict(input_size=(self.channels, self.image_size, self.image_size),
                      interpolation=self.interpolation, mean=self.mean, std=self.std)
        if not train:
            return create_transform(is_training=False, crop_pct=self.crop_pct, **common)
        return create_transform(
            is_training=True, scale=self.scale, hflip=self.hflip, auto_augment=self.auto_augment,
            color_jitter=self.color_jitter or 0.0, re_prob=self.re_prob, **common,
        )


class DecodeImage:
    """Sample dict (image bytes under ``jpg``/``jpeg``/``png``, label under ``cls``) -> ``(image
    tensor, label tensor)``, transformed. A class so that it pickles into worker processes.

    Args:
        channels: 3 decodes to RGB, 1 to grayscale.
        transform: the timm transform applied to the PIL image.
    """

    def __init__(self, channels: int, transform):
        self.mode = "RGB" if channels == 3 else "L"
        self.transform = transform

    def __call__(self, sample: dict) -> tuple[torch.Tensor, torch.Tensor]:
        key = next((k for k in IMAGE_KEYS if k in sample), None)
        if key is None:
            raise ValueError(f"sample {sample.get('__key__')} has no image ({'/'.join(IMAGE_KEYS)})")
        image = Image.open(io.BytesIO(sample[key])).convert(self.mode)
        return self.transform(image), torch.tensor(int(sample["cls"]))


class RepeatEach:
    """Pipeline stage: yield every sample ``times`` times in a row (repeated augmentation).

    Args:
        times: copies per sample.
    """

    def __init__(self, times: int):
        self.times = times

    def __call__(self, samples):
        for sample in samples:
            for _ in range(self.times):
                yield sample


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


class ImageStream(StreamSource):
    """Training batches of an image shard set: resampled shards, each image ``repeats`` times, a
    shuffle buffer, batches of ``batch_size`` references; a batch is read and decoded only when
    materialised. A sample that fails to read or decode is logged, counted, and its place in the
    batch taken by a copy of another sample of the batch, so batches keep their size (mixup needs
    an even one) and later batches are unaffected.

    Args:
        urls: training shards.
        batch_size: samples per batch.
        shuffle_buffer: samples held in the shuffle buffer.
        repeats: copies of each sample (repeated augmentation).
        decode: sample dict -> ``(image, label)`` tensors.
        counter: where skipped samples are counted.
    """

    def __init__(self, urls: list[str], batch_size: int, shuffle_buffer: int, repeats: int, decode,
                 counter: SkipCounter):
        self.urls, self.batch_size, self.shuffle_buffer, self.repeats = urls, batch_size, shuffle_buffer, repeats
        self.counter = counter
        self.load = Skipping(ReadSample(decode), counter)

    def units(self, rand: RankRandom, count_skips: bool):
        refs = resampled_samples(self.urls, rand.python("shards"), self.counter if count_skips else None)
        if self.repeats > 1:  # copies share one reference until decoded, each with its own augmentation
            refs = RepeatEach(self.repeats)(refs)
        return batched(shuffled(refs, self.shuffle_buffer, rand.python("shuffle")), self.batch_size)

    def materialise(self, unit: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
        loaded = [self.load(ref) for ref in unit]
        kept = [item for item in loaded if is_kept(item)]
        if not kept:
            raise RuntimeError(f"no sample of a training batch could be read, e.g. {unit[0]['__key__']} "
                               f"in {unit[0]['__url__']}")
        filled = [item if is_kept(item) else kept[i % len(kept)] for i, item in enumerate(loaded)]
        images, labels = zip(*filled)
        return torch.stack(images), torch.stack(labels)


class ImageShardDataModule(ShardDataModule):
    """Streams an image shard set: for training resampled shards with a fixed epoch length (every
    rank runs the same number of steps) in an order fixed by the seed, resumable at any batch
    (:class:`ImageStream`); for validation each shard read once.

    Args:
        root: folder holding the shards and ``_info.json``.
        batch_size: per-device batch size.
        num_workers: DataLoader worker processes per device.
        augment: the image transforms.
        shuffle_buffer: samples held in the training shuffle buffer.
        train_split: name of the training split in ``_info.json``.
        val_split: name of the validation split.
        test_split: name of the split that ``test`` and ``predict`` read.
        repeated_augmentation: training copies of each image, each augmented independently and
            spread by the shuffle buffer (DeiT uses 3). The epoch length stays one pass's worth of
            samples, so an epoch sees ``1/repeats`` of the distinct images, as with DeiT's sampler.
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
    ):
        super().__init__(root, num_workers, val_split, test_split)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if repeated_augmentation < 1:
            raise ValueError(f"repeated_augmentation must be >= 1, got {repeated_augmentation}")
        self.repeated_augmentation = repeated_augmentation
        self.batch_size = batch_size
        self.augment = augment
        self.shuffle_buffer = shuffle_buffer
        self.train_split = train_split

    @property
    def num_classes(self) -> int:
        return len(self._info()["classes"])

    def train_dataloader(self):
        info = self._info()
        num_samples = info["splits"][self.train_split]["num_samples"]
        steps = self.epoch_steps(num_samples, self.batch_size, f"{self.batch_size} samples")
        decode = DecodeImage(self.augment.channels, self.augment.build(train=True))
        stream = ImageStream(split_urls(self.root, info, self.train_split), self.batch_size, self.shuffle_buffer,
                             self.repeated_augmentation, decode, self.skipped)
        return self.resumable_loader(stream, steps)

    def _eval_loader(self, split: str):
        decode = DecodeImage(self.augment.channels, self.augment.build(train=False))
        dataset = wds.DataPipeline(*self.eval_stages(split_urls(self.root, self._info(), split)),
                                   wds.map(Skipping(decode, self.skipped)), wds.select(is_kept),
                                   wds.batched(self.batch_size, partial=True))
        return wds.WebLoader(dataset, batch_size=None, num_workers=self.num_workers)
