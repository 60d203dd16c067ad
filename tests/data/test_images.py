"""mmlight.data.images outside the loaders: ``eval_images`` (what ``classify`` feeds the network) against
timm's own evaluation transform, for PIL images of either mode and for image files."""

import io
import random
import re

import numpy as np
import pytest
import torch
from PIL import Image

from mmlight.data import ImageAugment
from mmlight.data.images import eval_images
from tests.helpers.image_fixtures import AWKWARD


def photo(mode: str, seed: int, size=(13, 11)) -> Image.Image:
    """A random image of ``mode`` (RGB or L): every pixel differs, so a wrong crop or conversion shows."""
    channels = 3 if mode == "RGB" else 1
    array = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], channels), dtype=np.uint8)
    return Image.fromarray(array.squeeze(-1) if channels == 1 else array, mode)


@pytest.mark.parametrize("channels", [3, 1])
def test_eval_images_are_timms_eval_transform_of_the_converted_images(channels, tmp_path):
    """PIL images of both modes and a CMYK JPEG file, in one batch: each row is timm's evaluation
    transform (resize, centre crop, ToTensor, Normalize) of the image converted by Pillow to the config's
    mode, the file read as Pillow reads it."""
    mean, std = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)) if channels == 3 else ((0.3,), (0.2,))
    augment = ImageAugment(image_size=8, channels=channels, crop_pct=0.875, mean=mean, std=std)
    mode = "RGB" if channels == 3 else "L"
    cmyk = tmp_path / "cmyk.JPEG"
    cmyk.write_bytes(AWKWARD["CMYK JPEG"][0])
    images = [photo("RGB", 0), photo("L", 1), photo(mode, 2), str(cmyk), cmyk]
    rows = eval_images(images, augment)
    transform = augment.build(train=False)
    opened = [Image.open(image) if not isinstance(image, Image.Image) else image for image in images]
    expected = torch.stack([transform(image.convert(mode)) for image in opened])
    assert rows.dtype == torch.float32 and rows.shape == (5, channels, 8, 8)
    torch.testing.assert_close(rows, expected, atol=1e-5, rtol=1e-5)


def test_eval_images_of_a_png_file_and_its_image_agree(tmp_path):
    """A path is decoded to the same pixels as the PIL image it was saved from (PNG: lossless)."""
    image = photo("RGB", 3)
    path = tmp_path / "image.png"
    image.save(path)
    augment = ImageAugment(image_size=8, crop_pct=1.0)
    assert torch.equal(eval_images([path], augment), eval_images([image], augment))


def test_eval_images_names_an_item_that_is_not_an_image():
    with pytest.raises(TypeError, match=r"^image 1 is a bytes; give PIL images or paths of image files$"):
        eval_images([photo("RGB", 0), io.BytesIO(b"x").getvalue()], ImageAugment(image_size=8))


def test_every_augment_field_reaches_timms_transform():
    """Each field of ImageAugment shows in the transform timm builds from it (read from timm's ops)."""
    from timm.data.random_erasing import RandomErasing
    from timm.data.transforms import RandomResizedCropAndInterpolation
    from torchvision import transforms as tv

    augment = ImageAugment(
        image_size=12,
        scale=(0.3, 0.9),
        hflip=0.25,
        color_jitter=0.2,
        re_prob=0.3,
        interpolation="bilinear",
        crop_pct=0.75,
        mean=(0.1, 0.2, 0.3),
        std=(0.4, 0.5, 0.6),
    )
    crop, flip, jitter, _, normalize, erasing = augment.build(train=True).transforms
    assert isinstance(crop, RandomResizedCropAndInterpolation) and crop.size == (12, 12) and crop.scale == (0.3, 0.9)
    assert crop.interpolation == tv.InterpolationMode.BILINEAR
    assert isinstance(flip, tv.RandomHorizontalFlip) and flip.p == 0.25
    assert isinstance(jitter, tv.ColorJitter) and jitter.brightness == (0.8, 1.2)
    assert torch.allclose(normalize.mean, torch.tensor([0.1, 0.2, 0.3])) and torch.allclose(
        normalize.std, torch.tensor([0.4, 0.5, 0.6])
    )
    assert isinstance(erasing, RandomErasing) and erasing.probability == 0.3
    resize, centre, _, normalize = augment.build(train=False).transforms
    assert resize.size == 16 and centre.size == (12, 12)  # 12 / 0.75: the centre crop keeps 75% of the side
    assert resize.interpolation == tv.InterpolationMode.BILINEAR and normalize.mean.tolist() == pytest.approx(
        [0.1, 0.2, 0.3]
    )
    plain = ImageAugment(image_size=12, color_jitter=None, channels=1, mean=(0.5,), std=(0.5,)).build(train=True)
    names = [type(op).__name__ for op in plain.transforms]
    assert names == [
        "RandomResizedCropAndInterpolation",
        "RandomHorizontalFlip",
        "ColorJitter",
        "MaybeToTensor",
        "Normalize",
    ]
    jitter = plain.transforms[2]  # None is passed on as 0: a jitter that changes nothing, and no erasing
    assert (jitter.brightness, jitter.contrast, jitter.saturation, jitter.hue) == (None, None, None, None)
    policy = ImageAugment(image_size=12, auto_augment="rand-m9-mstd0.5-inc1").build(train=True)
    assert "RandAugment" in [type(op).__name__ for op in policy.transforms]


def test_mean_and_std_need_one_value_per_channel():
    for mean, std in (((0.5,), (0.5, 0.5, 0.5)), ((0.5, 0.5, 0.5), (0.5,))):
        for train in (True, False):
            with pytest.raises(ValueError, match=r"^mean/std need 3 values, got "):
                ImageAugment(mean=mean, std=std).build(train)


@pytest.mark.parametrize("bits", range(0, 10))
def test_posterize_keeps_the_high_bits(bits):
    """timm's posterize op as patched here: ``bits`` high bits of each value kept (all 8 and more: the
    image unchanged; 0 and less: black), by a bit mask computed with NumPy."""
    from mmlight.data.images import _posterize

    values = np.arange(256, dtype=np.uint8).reshape(16, 16)
    kept = min(max(bits, 0), 8)
    mask = (0xFF << (8 - kept)) & 0xFF
    for mode in ("L", "RGB"):
        image = Image.fromarray(values).convert(mode)
        out = np.asarray(_posterize(image, bits))
        assert out.shape == np.asarray(image).shape and np.array_equal(out, np.asarray(image) & mask)
    assert np.asarray(_posterize(Image.fromarray(values), -1)).max() == 0


# ---------------------------------------------------------------------------- ImageStream's units and batches


def stream(root, shuffle_buffer: int, repeats: int, decode=None, counter=None, **kwargs):
    from mmlight.data.images import ImageStream
    from mmlight.data.skips import SkipCounter

    urls = sorted(str(p) for p in root.glob("train-*.tar"))
    return ImageStream(urls, 4, shuffle_buffer, repeats, decode, counter or SkipCounter(), **kwargs)


@pytest.fixture(scope="module")
def image_set(tmp_path_factory):
    from tests.helpers.images import write_image_shards

    return write_image_shards(tmp_path_factory.mktemp("images"), n=21, per_shard=7, corrupt=(2, 9, 16))


@pytest.mark.parametrize("shuffle_buffer, repeats", [(7, 3), (10, 3), (2, 3), (4, 1)])
def test_stream_units_hold_shuffle_buffer_over_repeats_images(image_set, shuffle_buffer, repeats):
    """The units are the resampled shards' samples through a buffer of ``shuffle_buffer // repeats``
    images (at least 1: the draw order kept), each image's copies consecutive, in the rank's streams of
    purposes shards, shuffle and order; no decoder: nothing to collate (a stream that is only replayed)."""
    from itertools import islice

    from mmlight.data.images import copy_groups
    from mmlight.data.streaming import RankRandom, resampled_samples, shuffled

    source = stream(image_set, shuffle_buffer, repeats)
    assert source.collate is None
    rand = RankRandom(3, 1, 0)
    refs = resampled_samples(source.urls, rand.python("shards"), None)
    images = shuffled(refs, max(shuffle_buffer // repeats, 1), rand.python("shuffle"))
    expected = list(islice(copy_groups(images, repeats, 4, rand.python("order")), 12))
    assert list(islice(source.units(RankRandom(3, 1, 0), count_skips=False), 12)) == expected


def test_stream_counts_unreadable_shards_only_when_asked(image_set, tmp_path):
    """A listed shard that cannot be read is counted at each draw by the stream that counts skips (loader
    worker 0), not by the others."""
    from itertools import islice

    from mmlight.data.images import ImageStream
    from mmlight.data.skips import SkipCounter
    from mmlight.data.streaming import RankRandom

    urls = sorted(str(p) for p in image_set.glob("train-*.tar")) + [str(tmp_path / "missing.tar")]
    for count_skips in (True, False):
        counter = SkipCounter()
        source = ImageStream(urls, 4, 4, 1, None, counter)
        list(islice(source.units(RankRandom(0, 0, 0), count_skips), 20))
        assert (counter.value > 0) == count_skips


def test_stream_batches_are_float_unless_uint8_and_a_batch_of_no_readable_image_is_named(image_set):
    """By default the stream yields normalised float32 batches; uint8 ones when asked. A batch whose every
    image fails to decode stops with the first group's key and shard (img0002, img0009, img0016 are not JPEGs)."""
    from mmlight.data.image_decode import AugmentGroup, NormalizedBatches, SplitTransform, Uint8Batches
    from mmlight.data.streaming import resampled_samples

    split = SplitTransform(ImageAugment(image_size=8, scale=(0.5, 1.0)).build(train=True))
    decode = AugmentGroup(3, split, copies=2)
    assert isinstance(stream(image_set, 4, 2, decode).collate, NormalizedBatches)
    assert isinstance(stream(image_set, 4, 2, decode, uint8=True).collate, Uint8Batches)
    urls = sorted(str(p) for p in image_set.glob("train-*.tar"))
    refs = {}
    for ref in resampled_samples(urls, random.Random(0), None):  # references as the stream makes them
        refs[ref["__key__"]] = ref
        if {"img0001", "img0003", "img0009", "img0016"} <= refs.keys():
            break
    unit = [
        {**refs["img0009"], "__copies__": 2, "__rows__": [3, 0]},
        {**refs["img0016"], "__copies__": 2, "__rows__": [1, 2]},
    ]
    source = stream(image_set, 4, 2, decode)
    with pytest.raises(
        RuntimeError, match=rf"^no sample of a training batch could be read, e\.g\. img0009 in {re.escape(urls[1])}$"
    ):
        source.materialise(unit)
    assert source.counter.value == 2
    unit[1] = {**refs["img0003"], "__copies__": 2, "__rows__": [1, 2]}
    images, labels = source.materialise(unit)
    assert images.shape == (4, 3, 8, 8) and labels.tolist() == [0, 0, 0, 0]  # img0003 fills the rows of img0009
    # a skipped row takes a copy of a kept row; the kept rows stay where they were drawn
    unit = [
        {**refs["img0009"], "__copies__": 1, "__rows__": [0]},
        {**refs["img0003"], "__copies__": 1, "__rows__": [1]},
        {**refs["img0016"], "__copies__": 1, "__rows__": [2]},
        {**refs["img0001"], "__copies__": 1, "__rows__": [3]},
    ]
    images, labels = source.materialise(unit)
    assert labels.tolist() == [0, 0, 0, 1]  # rows 0 and 2 (unreadable) take copies of kept rows i % 2 = 0
    assert torch.equal(images[0], images[1]) and torch.equal(images[2], images[1])


# ---------------------------------------------------------------------------- ImageShardDataModule's loaders


def test_datamodule_options_reach_its_loaders(image_set, monkeypatch):
    """``draft_decode=False`` decodes training JPEGs at full size (True: reduced where the crops allow);
    training skips are counted in the module's counter; the evaluation loader runs ``num_workers`` workers;
    too small a training split names the per-device batch."""
    from mmlight.data import ImageShardDataModule, image_decode

    big = ImageAugment(image_size=4, scale=(0.9, 1.0))  # 20 x 24 images, 4-pixel crops: room for 1/4
    scales = []
    opened = image_decode.open_image
    monkeypatch.setattr(image_decode, "open_image", lambda *a: scales.append(a[2:]) or opened(*a))
    for draft in (False, True):
        scales.clear()
        dm = ImageShardDataModule(str(image_set), batch_size=4, num_workers=0, augment=big, draft_decode=draft)
        next(iter(dm.train_dataloader()))
        assert scales and all(scale == (1,) for scale in scales) == (not draft)
    dm = ImageShardDataModule(str(image_set), batch_size=4, num_workers=0, augment=big, shuffle_buffer=1)
    for _ in dm.train_dataloader():
        pass
    assert dm.skipped.value > 0  # img0002, img0009, img0016 are not JPEGs
    val = ImageShardDataModule(str(image_set), num_workers=3, val_split="train").val_dataloader()
    assert val.pipeline[0].num_workers == 3  # webdataset's WebLoader: a DataLoader at the head of its pipeline
    with pytest.raises(ValueError, match=r"is smaller than one global batch \(40 samples x 1 devices\)"):
        ImageShardDataModule(str(image_set), batch_size=40, num_workers=0).train_dataloader()


def test_batch_tensors_are_shared_only_in_a_loader_worker(monkeypatch):
    """In the main process a batch is ordinary memory; in a loader worker, shared memory of the shape and
    dtype asked (so sending it passes a handle)."""
    from mmlight.data import image_decode

    plain = image_decode._batch_tensor((2, 3, 4), torch.uint8)
    assert not plain.is_shared() and plain.shape == (2, 3, 4) and plain.dtype == torch.uint8
    monkeypatch.setattr(torch.utils.data, "get_worker_info", lambda: object())
    shared = image_decode._batch_tensor((2, 3, 4))
    assert shared.is_shared() and shared.shape == (2, 3, 4) and shared.dtype == torch.float32
    shared.fill_(1.5)
    assert shared.sum().item() == 36.0


def test_datamodule_defaults(image_set):
    from mmlight.data import ImageShardDataModule

    dm = ImageShardDataModule(str(image_set))
    assert (dm.batch_size, dm.num_workers, dm.shuffle_buffer, dm.repeated_augmentation) == (64, 4, 5000, 1)
    assert dm.draft_decode and dm.normalize_on_device and dm.augment == ImageAugment()


def test_datamodule_refuses_empty_batches_and_no_copies(image_set):
    from mmlight.data import ImageShardDataModule

    assert ImageShardDataModule(str(image_set), batch_size=1).batch_size == 1
    assert ImageShardDataModule(str(image_set)).test_split == "val"
    with pytest.raises(ValueError, match=r"^batch_size must be >= 1, got 0$"):
        ImageShardDataModule(str(image_set), batch_size=0)
    with pytest.raises(ValueError, match=r"^repeated_augmentation must be >= 1, got 0$"):
        ImageShardDataModule(str(image_set), repeated_augmentation=0)
