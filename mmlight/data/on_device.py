"""The last, per-pixel steps of an image batch, done on the accelerator after the transfer.

A loader worker that writes float32 batches spends about a fifth of its time on them (BENCHMARKS.md,
"Image loader"): converting each augmented image to float, normalising it into a fresh 600 KB row
(first-touch page faults), and timm's ``RandomErasing`` filling boxes with noise. With
``ImageShardDataModule(normalize_on_device=True)`` the worker instead copies the augmented pixels
into a uint8 batch ``(B, H, W, C)`` (a quarter of the bytes to send and to copy to the device) and
draws only the erasing boxes, with exactly timm's random calls (:func:`draw_boxes`). After the
transfer, :func:`normalized_batch` converts, normalises and fills the boxes on the device in a few
vectorised ops.

The fill values come from a device generator seeded per batch in the worker (from the torch
generator that :func:`mmlight.data.streaming.seeded_rngs` seeds per batch), so a batch's noise is a
function of ``(seed, epoch, rank, batch index)`` like everything else in it. They are N(0, 1) as in
timm's modes, but not the numbers timm's CPU generator would have drawn.
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass

import torch
from timm.data.random_erasing import RandomErasing


@dataclass
class ErasingBoxes:
    """The random-erasing boxes of one uint8 batch, drawn in the worker, filled on the device.

    Args:
        boxes: ``(B, K, 4)`` int64 rows ``(top, left, height, width)``, up to ``K`` (timm's
            ``max_count``) boxes per image, in timm's order (a later box paints over an earlier
            one); an unused slot has height and width 0.
        mode: timm's fill: ``pixel`` (N(0, 1) per pixel and channel), ``rand`` (N(0, 1) per box
            and channel) or ``const`` (0, the normalised mean).
        seed: seed of the device generator that draws the fill of this batch.
    """

    boxes: torch.Tensor
    mode: str
    seed: int


def draw_boxes(erasing: RandomErasing, height: int, width: int) -> list[tuple[int, int, int, int]]:
    """The boxes timm's ``RandomErasing`` erases on one ``height x width`` image, as
    ``(top, left, height, width)``: the same calls to Python's ``random``, in the same order, as its
    ``_erase`` (whose fill draws from torch and leaves ``random`` alone), so under one seed the boxes
    are timm's."""
    if random.random() > erasing.probability:
        return []
    area = height * width
    count = (
        erasing.min_count
        if erasing.min_count == erasing.max_count
        else random.randint(erasing.min_count, erasing.max_count)
    )
    boxes = []
    for _ in range(count):
        for _attempt in range(10):
            target_area = random.uniform(erasing.min_area, erasing.max_area) * area / count
            aspect_ratio = math.exp(random.uniform(*erasing.log_aspect_ratio))
            box_h = int(round(math.sqrt(target_area * aspect_ratio)))
            box_w = int(round(math.sqrt(target_area / aspect_ratio)))
            if box_w < width and box_h < height:
                top = random.randint(0, height - box_h)
                left = random.randint(0, width - box_w)
                boxes.append((top, left, box_h, box_w))
                break
    return boxes


def draw_erasing(erasing: RandomErasing, batch: int, height: int, width: int) -> ErasingBoxes:
    """The boxes of ``batch`` images, row after row (timm's order when it erases the rows of a batch
    one by one), and a fill seed drawn from torch's CPU generator (seeded per batch in a stream)."""
    boxes = torch.zeros(batch, erasing.max_count, 4, dtype=torch.int64)  # (B, K, 4)
    for row in range(batch):
        for slot, box in enumerate(draw_boxes(erasing, height, width)):
            boxes[row, slot] = torch.tensor(box)
    seed = int(torch.randint(2**62, ()))
    return ErasingBoxes(boxes, erasing.mode, seed)


@functools.lru_cache(maxsize=16)
def _constants(mean: tuple[float, ...], std: tuple[float, ...], device: torch.device):
    """``(255 mean, 1 / (255 std))`` as ``(1, C, 1, 1)`` float32 on ``device``, made once: a copy from
    pageable host memory in every step would make the host wait for the device."""
    mean255 = (torch.tensor(mean, dtype=torch.float32) * 255).view(1, -1, 1, 1)
    inv_std255 = (1 / (torch.tensor(std, dtype=torch.float32) * 255)).view(1, -1, 1, 1)
    return mean255.to(device), inv_std255.to(device)


def normalized(images: torch.Tensor, mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    """``(B, H, W, C)`` uint8 -> ``(B, C, H, W)`` float32 ``(pixels - 255 mean) / (255 std)``, on the
    images' device: the arithmetic (float32, in this order) of the worker-side path
    (:class:`mmlight.data.image_decode.NormalizedBatches`), so the two agree to rounding."""
    mean255, inv_std255 = _constants(tuple(mean), tuple(std), images.device)
    batch, height, width, channels = images.shape
    out = torch.empty(batch, channels, height, width, dtype=torch.float32, device=images.device)
    torch.sub(images.permute(0, 3, 1, 2), mean255, out=out)  # convert and transpose in one pass
    return out.mul_(inv_std255)


def erased(images: torch.Tensor, erasing: ErasingBoxes) -> torch.Tensor:
    """``images (B, C, H, W)`` with each box filled as timm's mode fills it, vectorised over the
    batch: one mask per box slot from broadcast comparisons, no loop over samples."""
    batch, channels, height, width = images.shape
    boxes = erasing.boxes.to(images.device)
    top, left, box_h, box_w = (t[..., None, None] for t in boxes.unbind(-1))  # each (B, K, 1, 1)
    rows = torch.arange(height, device=images.device).view(1, 1, height, 1)
    cols = torch.arange(width, device=images.device).view(1, 1, 1, width)
    inside = (rows >= top) & (rows < top + box_h) & (cols >= left) & (cols < left + box_w)  # (B, K, H, W)
    generator = torch.Generator(device=images.device).manual_seed(erasing.seed)
    if erasing.mode == "pixel":  # one draw serves every slot: each pixel's values are N(0, 1) either way
        fill = torch.randn(images.shape, generator=generator, device=images.device, dtype=images.dtype)
    elif erasing.mode == "rand":
        colours = torch.randn(
            batch, boxes.shape[1], channels, generator=generator, device=images.device, dtype=images.dtype
        )  # (B, K, C)
    for slot in range(boxes.shape[1]):  # timm's max_count: 1 for DeiT
        if erasing.mode == "rand":
            fill = colours[:, slot, :, None, None]  # (B, C, 1, 1)
        elif erasing.mode != "pixel":
            fill = images.new_zeros(())
        images = torch.where(inside[:, slot, None], fill, images)
    return images


def normalized_batch(batch, mean: tuple[float, ...], std: tuple[float, ...]):
    """A transferred batch ``(uint8 images (B, H, W, C), labels[, ErasingBoxes])`` ->
    ``(normalised float32 images (B, C, H, W), labels)``; any other batch is returned as it is."""
    if not isinstance(batch, (tuple, list)) or not torch.is_tensor(batch[0]) or batch[0].dtype != torch.uint8:
        return batch
    images, labels, *rest = batch
    images = normalized(images, mean, std)
    for erasing in rest:
        images = erased(images, erasing)
    return images, labels
