"""Decode and augment JPEGs for training at a fraction of the usual CPU cost, with the same
augmentation distribution as timm's transform.

Where the time goes in a DeiT loader worker (``benchmarks/bench_loader.py``, BENCHMARKS.md): the full
size JPEG decode, the resize of the random crop, RandAugment, and then three passes over the
float32 output that the network never needed (``ToTensor``, ``Normalize``, the batch ``stack``)
plus a fourth when the batch is copied into shared memory for the main process. This module:

* draws the RandomResizedCrop box on the full-size geometry (the JPEG header is enough), through
  timm's own ``get_params`` (same random draws), then decodes the JPEG with libjpeg's DCT scaling
  (Pillow ``draft``) at the smallest size that keeps every crop at least as large as the network
  input, and crops and resizes in one Pillow call (as FFCV does);
* with repeated augmentation, decodes an image once for all of its copies;
* writes each augmented image straight into its row of the batch tensor, in shared memory when in
  a loader worker, so the batch reaches the main process without a copy: either as uint8 pixels
  with the random-erasing boxes, normalised and erased on the device after the transfer
  (:class:`Uint8Batches`, :mod:`mmlight.data.on_device`), or converted, normalised and erased here
  (:class:`NormalizedBatches`).
"""

from __future__ import annotations

import importlib.metadata
import io
import random
import warnings
from collections.abc import Iterable, Iterator

import numpy as np
import PIL
import torch
from PIL import Image
from timm.data.random_erasing import RandomErasing
from timm.data.transforms import MaybeToTensor, RandomResizedCropAndInterpolation
from torchvision import transforms as tv
from torchvision.transforms.functional import pil_modes_mapping

from mmlight.data.on_device import draw_erasing

IMAGE_KEYS = ("jpg", "jpeg", "png")
DCT_SCALES = (8, 4, 2, 1)  # the reductions libjpeg can decode at directly (Pillow ``draft``)


def pillow_build() -> str:
    """Which Pillow distribution provides ``PIL``: ``"Pillow-SIMD 12.1.1.post0"`` or ``"Pillow 13.0.0"``.

    Pillow-SIMD (a drop-in fork with vectorised resampling) is installed under its own distribution
    name; it is the one imported when that distribution's version is ``PIL.__version__``. It shortens the
    augmentation (1.60 to 1.09 ms per sample for the uint8 shards; BENCHMARKS.md, "Image loader"), so
    loader rates depend on it.
    """
    try:
        simd = importlib.metadata.version("pillow-simd")
    except importlib.metadata.PackageNotFoundError:
        simd = None
    return f"{'Pillow-SIMD' if simd == PIL.__version__ else 'Pillow'} {PIL.__version__}"


class SplitTransform:
    """A timm transform (``Compose``) cut where the PIL image becomes a tensor.

    Args:
        transform: ``timm.data.create_transform(...)``: PIL ops, ``ToTensor``, ``Normalize``, then
            in-place tensor ops (random erasing).

    Attributes:
        crop: the leading ``RandomResizedCropAndInterpolation`` (training), else None.
        pil_ops: the PIL ops after the crop (flip, RandAugment; resize and centre crop for eval).
        mean, std: per-channel normalisation.
        tensor_ops: ops applied to the normalised ``(C, H, W)`` tensor.
    """

    def __init__(self, transform: tv.Compose):
        ops = list(transform.transforms)
        at = next((k for k, op in enumerate(ops) if isinstance(op, (MaybeToTensor, tv.ToTensor))), None)
        if at is None or at + 1 >= len(ops) or not isinstance(ops[at + 1], tv.Normalize):
            raise ValueError(f"expected PIL ops, ToTensor, Normalize, tensor ops; got {transform}")
        self.crop = ops[0] if isinstance(ops[0], RandomResizedCropAndInterpolation) else None
        self.pil_ops = tv.Compose(ops[1 if self.crop else 0 : at])
        self.mean = torch.as_tensor(ops[at + 1].mean, dtype=torch.float32)
        self.std = torch.as_tensor(ops[at + 1].std, dtype=torch.float32)
        self.tensor_ops = ops[at + 2 :]


def crop_box(crop: RandomResizedCropAndInterpolation, image: Image.Image):
    """One RandomResizedCrop draw on ``image`` (only its size is read, so it may be a JPEG whose
    header alone was parsed), through timm's ``get_params`` (so the same random numbers are drawn as
    by timm's transform): ``((left, top, right, bottom), PIL resample filter)``."""
    top, left, height, width = crop.get_params(image, crop.scale, crop.ratio)
    interpolation = crop.interpolation
    if isinstance(interpolation, (tuple, list)):  # timm's "random" interpolation
        interpolation = random.choice(interpolation)
    return (left, top, left + width, top + height), pil_modes_mapping[interpolation]


def draft_scale(boxes: Iterable[tuple[int, int, int, int]], out_size: tuple[int, int]) -> int:
    """The largest libjpeg reduction (8, 4, 2 or 1) that leaves every crop box at least
    ``out_size = (W, H)`` pixels on both sides, so no crop is upsampled because of the reduction."""
    room = min(min((right - left) / out_size[0], (bottom - top) / out_size[1]) for left, top, right, bottom in boxes)
    return next(s for s in DCT_SCALES if s <= room or s == 1)


def open_image(data: bytes, mode: str, scale: int = 1) -> Image.Image:
    """Decode image bytes to ``mode``, a JPEG at ``1/scale`` of its size (libjpeg DCT scaling; other
    formats ignore ``scale``). ``convert`` is skipped when the mode already matches (it would copy)."""
    image = Image.open(io.BytesIO(data))
    if scale > 1:
        width, height = image.size
        image.draft(mode, (max(width // scale, 1), max(height // scale, 1)))
    image.load()
    return image if image.mode == mode else image.convert(mode)


def resized_crop(image: Image.Image, box, scale: int, out_size: tuple[int, int], resample) -> Image.Image:
    """Crop ``box`` (full-size pixels) out of ``image`` decoded at ``1/scale`` and resize it to
    ``out_size`` in one Pillow call. Full-size ``x`` is ``x / scale`` in the reduced image (what
    Pillow's ``draft`` reports), a fractional pixel that Pillow's resample honours."""
    left, top, right, bottom = box
    scaled = (left / scale, top / scale, min(right / scale, image.width), min(bottom / scale, image.height))
    return image.resize(out_size, resample, box=scaled)


class AugmentGroup:
    """Sample dict (image bytes under ``jpg``/``jpeg``/``png``, label under ``cls``, optionally the
    number of copies under ``__copies__``) -> a list of that many ``(PIL image, label)`` pairs, each
    augmented independently from one decode. A class so that it pickles into worker processes.

    Args:
        channels: 3 decodes to RGB, 1 to grayscale.
        split: the transform, cut by :class:`SplitTransform`.
        copies: augmented copies per image when the sample names none (repeated augmentation; 1 for none).
        draft: decode JPEGs at reduced size when every crop of the group allows it. False decodes
            at full size, giving timm's own crop-then-resize pixels exactly.
    """

    def __init__(self, channels: int, split: SplitTransform, copies: int = 1, draft: bool = True):
        self.mode = "RGB" if channels == 3 else "L"
        self.split = split
        self.copies = copies
        self.draft = draft

    def __call__(self, sample: dict) -> list[tuple[Image.Image, int]]:
        key = next((k for k in IMAGE_KEYS if k in sample), None)
        if key is None:
            raise ValueError(f"sample {sample.get('__key__')} has no image ({'/'.join(IMAGE_KEYS)})")
        label = int(sample["cls"])
        copies = int(sample.get("__copies__", self.copies))
        if self.split.crop is None:  # evaluation: the whole image through the PIL ops
            image = open_image(sample[key], self.mode)
            return [(self.split.pil_ops(image), label) for _ in range(copies)]
        draws, scale = self.draw(sample[key], copies)
        image = open_image(sample[key], self.mode, scale)
        return [(image, label) for image in self.augment(image, draws, scale)]

    def draw(self, data: bytes, copies: int):
        """The crop boxes of ``copies`` copies, drawn on the full-size geometry read from the header,
        and the decode reduction they allow: ``([(box, resample)] * copies, scale)``."""
        with Image.open(io.BytesIO(data)) as header:  # parses the header only
            draws = [crop_box(self.split.crop, header) for _ in range(copies)]
        scale = draft_scale([box for box, _ in draws], self.out_size) if self.draft else 1
        return draws, scale

    @property
    def out_size(self) -> tuple[int, int]:
        height, width = self.split.crop.size  # timm keeps (H, W)
        return width, height

    def augment(self, image: Image.Image, draws, scale: int) -> list[Image.Image]:
        """Each copy: its crop of ``image`` (decoded at ``1/scale``), resized, then the PIL ops."""
        if scale == 1:  # timm's own pixels: crop, then resize (never read past the box)
            crops = [image.crop(box).resize(self.out_size, resample) for box, resample in draws]
        else:
            crops = [resized_crop(image, box, scale, self.out_size, resample) for box, resample in draws]
        return [self.split.pil_ops(crop) for crop in crops]


def flatten(groups: Iterable[list]) -> Iterator:
    """Pipeline stage: lists of samples -> samples."""
    for group in groups:
        yield from group


def _batch_tensor(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialised tensor, in shared memory inside a DataLoader worker, so that sending the
    batch to the main process passes a handle instead of copying it (what ``default_collate`` does
    for the batches it stacks)."""
    if torch.utils.data.get_worker_info() is None:
        return torch.empty(shape, dtype=dtype)
    numel = int(np.prod(shape))
    storage = torch.empty(0, dtype=dtype)._typed_storage()._new_shared(numel, device="cpu")
    return torch.empty(0, dtype=dtype).new(storage).view(shape)


def pixels(image: Image.Image) -> torch.Tensor:
    """The image's pixels as an ``(H, W, C)`` uint8 tensor (one copy, Pillow's ``tobytes``)."""
    with warnings.catch_warnings():  # Pillow's array is read-only; it is only read
        warnings.simplefilter("ignore", UserWarning)
        array = torch.from_numpy(np.asarray(image))  # (H, W) or (H, W, C) uint8
    return array.view(image.height, image.width, -1)


class Batches:
    """Pipeline stage: ``(PIL image, label)`` pairs -> batches of ``batch_size`` (:meth:`collate`).

    Args:
        batch_size: images per batch.
        partial: yield a last, smaller batch.
    """

    def __init__(self, batch_size: int, partial: bool):
        self.batch_size = batch_size
        self.partial = partial

    def __call__(self, samples: Iterable[tuple[Image.Image, int]]):
        pending = []
        for sample in samples:
            pending.append(sample)
            if len(pending) == self.batch_size:
                yield self.collate(pending)
                pending = []
        if pending and self.partial:
            yield self.collate(pending)

    def collate(self, samples: list[tuple[Image.Image, int]]) -> tuple:
        raise NotImplementedError


class NormalizedBatches(Batches):
    """Pipeline stage: ``(PIL image, label)`` pairs -> ``(images (B, C, H, W) float32, labels (B,))``.
    Each image is converted and normalised straight into its row of the batch, then the tensor ops
    (random erasing) run on that row in place.

    Args:
        batch_size: images per batch.
        split: supplies ``mean``, ``std`` and ``tensor_ops``.
        partial: yield a last, smaller batch.
    """

    def __init__(self, batch_size: int, split: SplitTransform, partial: bool):
        super().__init__(batch_size, partial)
        self.mean255 = (split.mean * 255).view(-1, 1, 1)  # ToTensor's /255 folded into Normalize
        self.inv_std255 = (1 / (split.std * 255)).view(-1, 1, 1)
        self.tensor_ops = split.tensor_ops

    def collate(self, samples: list[tuple[Image.Image, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        first = samples[0][0]
        images = _batch_tensor((len(samples), len(first.getbands()), first.height, first.width))
        for row, (image, _) in zip(images, samples):
            self.write_row(row, image)
        return images, torch.tensor([label for _, label in samples])

    def write_row(self, row: torch.Tensor, image: Image.Image) -> None:
        """``row (C, H, W) = (pixels - 255 mean) / (255 std)``, then the tensor ops in place."""
        torch.sub(pixels(image).permute(2, 0, 1), self.mean255, out=row)  # uint8 -> float32 and transpose
        row.mul_(self.inv_std255)
        for op in self.tensor_ops:
            result = op(row)
            if result is not row:
                row.copy_(result)


class Uint8Batches(Batches):
    """Pipeline stage: ``(PIL image, label)`` pairs -> ``(images (B, H, W, C) uint8, labels (B,))``,
    plus, when the transform erases, the batch's :class:`~mmlight.data.on_device.ErasingBoxes`
    (timm's boxes, drawn here; filled on the device). Each row is a plain copy of the image's
    pixels; :func:`mmlight.data.on_device.normalized_batch` finishes the batch after the transfer.

    Args:
        batch_size: images per batch.
        split: its ``tensor_ops`` may hold timm's ``RandomErasing`` and nothing else.
        partial: yield a last, smaller batch.
    """

    def __init__(self, batch_size: int, split: SplitTransform, partial: bool):
        super().__init__(batch_size, partial)
        others = [op for op in split.tensor_ops if not isinstance(op, RandomErasing)]
        if others or len(split.tensor_ops) > 1:
            raise ValueError(
                f"uint8 batches finish on the device only timm's RandomErasing; the transform "
                f"also has {split.tensor_ops}: use normalize_on_device=False"
            )
        self.erasing = split.tensor_ops[0] if split.tensor_ops else None

    def collate(self, samples: list[tuple[Image.Image, int]]) -> tuple:
        first = samples[0][0]
        height, width = first.height, first.width
        images = _batch_tensor((len(samples), height, width, len(first.getbands())), torch.uint8)
        for row, (image, _) in zip(images, samples):
            row.copy_(pixels(image))
        labels = torch.tensor([label for _, label in samples])
        if self.erasing is None:
            return images, labels
        return images, labels, draw_erasing(self.erasing, len(samples), height, width)
