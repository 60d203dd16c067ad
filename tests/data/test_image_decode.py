"""mmlight.data.image_decode against timm's own transform: same random draws, same pixels at full
size, close pixels at reduced size, one decode per repeated-augmentation group."""

import dataclasses
import io
import random

import numpy as np
import pytest
import torch
from PIL import Image

from mmlight.data import ImageAugment, image_decode
from mmlight.data.image_decode import (
    AugmentGroup,
    NormalizedBatches,
    SplitTransform,
    Uint8Batches,
    crop_box,
    draft_scale,
)
from tests.helpers.image_fixtures import AWKWARD, check_formats, rgb_to_grey
from tests.helpers.images import DEIT_16, seeded, smooth_jpeg


def test_draft_scale_is_the_largest_reduction_keeping_every_crop_at_output_size():
    rng = np.random.default_rng(0)
    for _ in range(300):
        boxes = [(0, 0, int(w), int(h)) for w, h in rng.integers(20, 2000, (int(rng.integers(1, 4)), 2))]
        fits = [s for s in (1, 2, 4, 8) if all(w / s >= 224 and h / s >= 200 for _, _, w, h in boxes)]
        assert draft_scale(boxes, (224, 200)) == max(fits, default=1)


def test_crop_draws_are_timms_and_full_size_pixels_are_timms_exactly():
    """Same seed: the header-only crop draw equals timm's on the decoded image, and the whole path
    (decode, crop, flip, RandAugment, normalise into a batch row, erase) equals timm's transform."""
    data = smooth_jpeg(61, 47)
    transform = DEIT_16.build(train=True)
    split = SplitTransform(transform)
    image = Image.open(io.BytesIO(data)).convert("RGB")
    for seed in range(40):
        seeded(seed)
        expected_box = split.crop.get_params(image, split.crop.scale, split.crop.ratio)
        seeded(seed)
        (left, top, right, bottom), _ = crop_box(split.crop, Image.open(io.BytesIO(data)))
        assert (top, left, bottom - top, right - left) == expected_box
        seeded(seed)
        expected = transform(image)  # (3, 16, 16)
        seeded(seed)
        group = AugmentGroup(3, split, copies=1, draft=False)
        row, labels = NormalizedBatches(1, split, partial=True).collate(group({"jpg": data, "cls": "2"}))
        assert labels.tolist() == [2]
        torch.testing.assert_close(row[0], expected, atol=1e-5, rtol=1e-5)


def test_reduced_decode_draws_the_same_crops_and_gives_close_pixels(monkeypatch):
    """A 1600 x 1200 image with crops of at least half its area: the crop boxes and the random state
    after them do not depend on draft; the reduced decode is used, and its crops differ from the
    full-size ones by resampling only (mean absolute difference under 2 of 255)."""
    data = smooth_jpeg(1600, 1200)
    augment = ImageAugment(image_size=224, scale=(0.5, 1.0), hflip=0.0, color_jitter=None)
    split = SplitTransform(augment.build(train=True))
    decoded = []
    monkeypatch.setattr(image_decode, "open_image", lambda *a: decoded.append(a[2]) or _open(*a))
    for seed in range(5):
        outputs, states = {}, {}
        for draft in (True, False):
            seeded(seed)
            group = AugmentGroup(3, split, copies=3, draft=draft)
            outputs[draft] = [np.asarray(image, np.float32) for image, _ in group({"jpg": data, "cls": "0"})]
            states[draft] = random.getstate()
        assert states[True] == states[False]
        for reduced, full in zip(outputs[True], outputs[False]):
            assert reduced.shape == full.shape == (224, 224, 3)
            assert np.abs(reduced - full).mean() < 2.0
    assert all(s >= 2 for s in decoded[0::2]) and decoded[1::2] == [1] * 5  # crops >= 848 px: room for >= 2


_open = image_decode.open_image


def test_repeated_augmentation_decodes_once_per_group(monkeypatch):
    data = smooth_jpeg(64, 48)
    calls = []
    monkeypatch.setattr(image_decode, "open_image", lambda *a: calls.append(a) or _open(*a))
    split = SplitTransform(DEIT_16.build(train=True))
    copies = AugmentGroup(3, split, copies=3)({"jpg": data, "cls": "7"})
    assert len(calls) == 1 and [label for _, label in copies] == [7, 7, 7]
    first, second, third = (np.asarray(image) for image, _ in copies)
    assert not (np.array_equal(first, second) and np.array_equal(second, third))  # augmented independently


def test_eval_rows_are_timms_eval_transform():
    data = smooth_jpeg(40, 30)
    augment = ImageAugment(image_size=16, crop_pct=0.875)
    transform = augment.build(train=False)
    split = SplitTransform(transform)
    rows, _ = NormalizedBatches(2, split, partial=True).collate(AugmentGroup(3, split)({"jpg": data, "cls": "0"}))
    expected = transform(Image.open(io.BytesIO(data)).convert("RGB"))
    torch.testing.assert_close(rows[0], expected, atol=1e-5, rtol=1e-5)


def test_a_transform_without_normalize_is_refused():
    from torchvision import transforms as tv

    with pytest.raises(ValueError, match="Normalize"):
        SplitTransform(tv.Compose([tv.CenterCrop(4), tv.ToTensor()]))


def test_pillow_build_names_the_distribution_that_provides_pil(monkeypatch):
    """Pillow-SIMD only when its distribution's version is the imported PIL's; otherwise stock Pillow."""
    import importlib.metadata

    import PIL

    def installed(versions):
        def version(name):
            if name not in versions:
                raise importlib.metadata.PackageNotFoundError(name)
            return versions[name]

        return version

    monkeypatch.setattr(PIL, "__version__", "12.1.1.post0")
    monkeypatch.setattr(importlib.metadata, "version", installed({"pillow-simd": "12.1.1.post0"}))
    assert image_decode.pillow_build() == "Pillow-SIMD 12.1.1.post0"
    monkeypatch.setattr(importlib.metadata, "version", installed({}))
    assert image_decode.pillow_build() == "Pillow 12.1.1.post0"
    # a stale pillow-simd record beside a stock Pillow that was installed over it
    monkeypatch.setattr(PIL, "__version__", "13.0.0")
    monkeypatch.setattr(importlib.metadata, "version", installed({"pillow-simd": "12.1.1.post0", "pillow": "13.0.0"}))
    assert image_decode.pillow_build() == "Pillow 13.0.0"


# ---------------------------------------------------------------------------- the awkward real formats

PLAIN_TRAIN = ImageAugment(image_size=8, scale=(0.5, 1.0), hflip=0.0, color_jitter=None)  # no colour change


def expected_pixel(name: str, channels: int) -> tuple[list[float], int]:
    """The colour a decode of fixture ``name`` to ``channels`` must give, and the tolerance."""
    _, rgb, tolerance = AWKWARD[name]
    return (list(rgb) if channels == 3 else [rgb_to_grey(rgb)]), tolerance + 1  # + 1: rounding, resampling


def test_the_awkward_fixtures_are_what_they_claim():
    check_formats()


@pytest.mark.parametrize("channels", [3, 1])
@pytest.mark.parametrize("path", ["eval", "train, reduced decode", "train, full decode"])
def test_every_real_format_decodes_to_its_colour_in_the_requested_mode(path, channels, monkeypatch):
    """Greyscale, CMYK and progressive JPEGs and a PNG and a GIF named .JPEG, in one batch: each row
    has ``channels`` channels holding the colour the file was made from (converted by the published
    formulas), on the evaluation path and on both training paths. The reduced decode is really used."""
    augment = dataclasses.replace(
        PLAIN_TRAIN, channels=channels, crop_pct=1.0, mean=(0.5,) * channels, std=(0.5,) * channels
    )
    split = SplitTransform(augment.build(train=path != "eval"))
    scales = []
    monkeypatch.setattr(image_decode, "open_image", lambda *a: scales.append(a[2:]) or _open(*a))
    group = AugmentGroup(channels, split, copies=2, draft=path == "train, reduced decode")
    pairs = [
        pair for label, (data, _, _) in enumerate(AWKWARD.values()) for pair in group({"jpg": data, "cls": str(label)})
    ]
    images, labels = Uint8Batches(len(pairs), split, partial=True).collate(pairs)
    assert images.shape == (2 * len(AWKWARD), 8, 8, channels) and images.dtype == torch.uint8
    assert labels.tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    for row, name in zip(images, [name for name in AWKWARD for _ in range(2)]):
        colour, tolerance = expected_pixel(name, channels)
        error = (row.float() - torch.tensor(colour)).abs().max().item()
        assert error <= tolerance, f"{name}: {row.float().mean((0, 1)).tolist()} vs {colour}"
    jpegs = [s for s, name in zip(scales, AWKWARD) if "JPEG" in name and "named" not in name]
    if path == "train, reduced decode":
        assert all(scale >= (2,) for scale in jpegs) and len(jpegs) == 3
    elif path == "train, full decode":
        assert scales == [(1,)] * len(AWKWARD)


# ---------------------------------------------------------------------------- non-square inputs, the decode itself


def wide_transform(channels: int):
    """timm's training transform to a 10 x 14 (H x W) input with RandAugment, 'random' interpolation
    (a filter drawn per crop) and per-pixel random erasing: no two of H, W and C are equal."""
    from timm.data import create_transform

    mean, std = (0.41, 0.52, 0.33)[:channels], (0.27, 0.21, 0.19)[:channels]
    return create_transform(
        input_size=(channels, 10, 14),
        is_training=True,
        auto_augment="rand-m9-mstd0.5-inc1",
        re_prob=0.5,
        re_mode="pixel",
        interpolation="random",
        mean=mean,
        std=std,
    )


@pytest.mark.parametrize("channels", [3, 1])
def test_a_non_square_input_is_timms_on_both_batch_paths(channels):
    """Same seed: the float32 row is timm's transform of the converted image (to float rounding); the uint8
    row, normalised on the device, equals it outside the erasing box, and timm's noise fills exactly that
    box on both paths (C x H x W = channels x 10 x 14)."""
    from mmlight.data.on_device import normalized, normalized_batch
    from tests.helpers.images import box_mask

    data = smooth_jpeg(61, 47)
    transform = wide_transform(channels)
    split = SplitTransform(transform)
    mean, std = tuple(split.mean.tolist()), tuple(split.std.tolist())
    image = Image.open(io.BytesIO(data)).convert("RGB" if channels == 3 else "L")
    group = AugmentGroup(channels, split, copies=1, draft=False)
    erased_rows = 0
    for seed in range(12):
        seeded(seed)
        expected = transform(image)  # (C, 10, 14)
        seeded(seed)
        rows, _ = NormalizedBatches(1, split, partial=True).collate(group({"jpg": data, "cls": "1"}))
        assert rows.shape == (1, channels, 10, 14)
        torch.testing.assert_close(rows[0], expected, atol=1e-5, rtol=1e-5)
        seeded(seed)
        images, labels, erasing = Uint8Batches(1, split, partial=True).collate(group({"jpg": data, "cls": "1"}))
        assert images.shape == (1, 10, 14, channels) and labels.tolist() == [1]
        device, _ = normalized_batch((images, labels, erasing), mean, std)
        plain = normalized(images, mean, std)[0]
        mask = box_mask(erasing.boxes[0], 10, 14)
        torch.testing.assert_close(device[0][:, ~mask], expected[:, ~mask], atol=1e-5, rtol=1e-5)
        assert torch.equal((rows[0] != plain).all(0), mask) and torch.equal((device[0] != plain).all(0), mask)
        erased_rows += bool(mask.any())
    assert 0 < erased_rows < 12  # re_prob 0.5: both cases met


def test_draft_scale_at_the_exact_bounds():
    """A crop exactly ``s`` times the output on its tighter side allows reduction ``s``; a pixel less does not."""
    for s in (2, 4, 8):
        assert draft_scale([(5, 7, 5 + 224 * s, 7 + 200 * s)], (224, 200)) == s
        assert draft_scale([(5, 7, 5 + 224 * s - 1, 7 + 200 * s)], (224, 200)) == s // 2
        assert draft_scale([(5, 7, 5 + 224 * s, 7 + 200 * s - 1)], (224, 200)) == s // 2
    assert draft_scale([(0, 0, 100, 100)], (224, 200)) == 1  # a crop smaller than the output: full size


def noisy_jpeg(width: int, height: int) -> bytes:
    """A JPEG of random colours: its chroma varies from pixel to pixel, so a grey decode shows how it was made."""
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(1).integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


def ycbcr_luma(data: bytes, scale: int) -> np.ndarray:
    """libjpeg's luma plane at ``1/scale`` (a YCbCr decode's first band): the grey values the encoder stored."""
    image = Image.open(io.BytesIO(data))
    image.draft("YCbCr", (image.width // scale, image.height // scale))
    return np.asarray(image.convert("YCbCr"))[..., 0]


@pytest.mark.parametrize("scale", [1, 2, 4, 8])
def test_open_image_decodes_at_the_scale_and_mode_asked(scale):
    """A 61 x 47 colour JPEG of noise: libjpeg's sizes ``ceil(61 / s) x ceil(47 / s)``; RGB at full size is Pillow's
    plain decode; greyscale at a reduced size is libjpeg's luma plane (no colour decode, no conversion),
    at full size Pillow's ``convert("L")`` of the colour decode (what timm's loader gives)."""
    data = noisy_jpeg(61, 47)
    rgb = image_decode.open_image(data, "RGB", scale)
    grey = image_decode.open_image(data, "L", scale)
    size = (-(-61 // scale), -(-47 // scale))
    assert (rgb.mode, rgb.size) == ("RGB", size) and (grey.mode, grey.size) == ("L", size)
    if scale == 1:
        full = Image.open(io.BytesIO(data))
        assert np.array_equal(np.asarray(rgb), np.asarray(full.convert("RGB")))
        assert np.array_equal(np.asarray(grey), np.asarray(full.convert("L")))
    else:
        assert np.array_equal(np.asarray(grey), ycbcr_luma(data, scale))
        if scale == 2:  # the check tells the two greys apart: converting the colour decode gives other values
            assert not np.array_equal(np.asarray(grey), np.asarray(rgb.convert("L")))


def test_open_image_decodes_before_it_returns():
    """A JPEG cut inside its data fails in open_image (where the caller counts it as a skipped sample), even
    when no conversion is needed, and a decoded image no longer needs its bytes."""
    data = smooth_jpeg(64, 48)
    with pytest.raises(OSError, match="truncated"):
        image_decode.open_image(data[:-300], "RGB")
    image = image_decode.open_image(data, "RGB")
    assert image.im is not None and image.mode == "RGB"


def test_batches_drop_or_keep_the_last_partial_batch():
    split = SplitTransform(ImageAugment(image_size=4, crop_pct=1.0).build(train=False))
    samples = [(Image.new("RGB", (4, 4), (i, 0, 0)), i) for i in range(5)]
    for partial, sizes in ((False, [2, 2]), (True, [2, 2, 1])):
        batches = list(NormalizedBatches(2, split, partial)(iter(samples)))
        assert [len(labels) for _, labels in batches] == sizes
        assert torch.cat([labels for _, labels in batches]).tolist() == list(range(sum(sizes)))
    batches = list(Uint8Batches(2, split, partial=True)(iter(samples)))
    assert [images[:, 0, 0, 0].tolist() for images, _ in batches] == [[0, 1], [2, 3], [4]]


def test_a_tensor_op_returning_a_new_tensor_is_written_into_the_row():
    """timm's erasing works in place; an op that returns a new tensor has its result copied into the row."""
    from torchvision import transforms as tv

    split = SplitTransform(tv.Compose([tv.ToTensor(), tv.Normalize((0.5,), (0.25,)), tv.Lambda(lambda t: t * 2 + 1)]))
    rows, _ = NormalizedBatches(1, split, partial=True).collate([(Image.new("L", (3, 2), 255), 0)])
    assert torch.equal(rows, torch.full((1, 1, 2, 3), 5.0))  # ((1 - 0.5) / 0.25) * 2 + 1


def test_uint8_batches_take_one_random_erasing_only():
    from timm.data.random_erasing import RandomErasing
    from torchvision import transforms as tv

    erasing = RandomErasing(probability=1.0, device="cpu")
    head = [tv.ToTensor(), tv.Normalize((0.5,), (0.5,))]
    assert Uint8Batches(2, SplitTransform(tv.Compose([*head, erasing])), partial=True).erasing is erasing
    assert Uint8Batches(2, SplitTransform(tv.Compose(head)), partial=True).erasing is None
    with pytest.raises(ValueError, match="normalize_on_device=False"):
        Uint8Batches(2, SplitTransform(tv.Compose([*head, erasing, erasing])), partial=True)


def test_a_reduced_decode_resizes_with_the_drawn_filter(monkeypatch):
    """Nearest-neighbour interpolation on the reduced decode: every output pixel is a pixel of the decoded
    image (a smoothing filter such as Pillow's default bicubic would blend new colours)."""
    augment = ImageAugment(image_size=16, scale=(0.5, 1.0), hflip=0.0, color_jitter=None, interpolation="nearest")
    split = SplitTransform(augment.build(train=True))
    decoded = []
    monkeypatch.setattr(image_decode, "open_image", lambda *a: decoded.append((a[2], _open(*a))) or decoded[-1][1])
    seeded(0)
    copies = AugmentGroup(3, split, copies=4)({"jpg": noisy_jpeg(200, 160), "cls": "0"})
    [(scale, source)] = decoded
    colours = {tuple(p) for p in np.asarray(source).reshape(-1, 3).tolist()}
    assert scale >= 4 and len(colours) > 1000  # reduced, and many colours to tell filters apart
    for image, _ in copies:
        assert all(tuple(p) in colours for p in np.asarray(image).reshape(-1, 3).tolist())


def test_open_image_at_a_scale_larger_than_the_image_keeps_one_pixel():
    """libjpeg reduces an 8 x 16 image by 8 to 1 x 2 (and 16 x 8 to 2 x 1): the requested size is never
    rounded up past the reduction asked for."""
    for width, height in ((8, 16), (16, 8)):
        data = smooth_jpeg(width, height)
        assert image_decode.open_image(data, "RGB", 8).size == (width // 8, height // 8)


def test_open_image_returns_the_decoded_image_when_the_mode_matches():
    """No conversion (which would copy) when the JPEG decodes to the mode asked; a conversion otherwise."""
    from PIL import JpegImagePlugin

    data = smooth_jpeg(16, 12)
    assert isinstance(image_decode.open_image(data, "RGB"), JpegImagePlugin.JpegImageFile)
    assert not isinstance(image_decode.open_image(data, "L"), JpegImagePlugin.JpegImageFile)


def test_a_group_has_the_copies_its_sample_names_and_a_sample_without_image_is_named():
    split = SplitTransform(PLAIN_TRAIN.build(train=True))
    data = smooth_jpeg(64, 48)
    assert len(AugmentGroup(3, split)({"jpg": data, "cls": "1"})) == 1  # one copy by default
    assert len(AugmentGroup(3, split, copies=3)({"jpg": data, "cls": "1", "__copies__": 2})) == 2
    with pytest.raises(ValueError, match=r"^sample k7 has no image \(jpg/jpeg/png\)$"):
        AugmentGroup(3, split)({"__key__": "k7", "txt": b"x", "cls": "1"})


def test_a_group_decodes_reduced_by_default(monkeypatch):
    scales = []
    monkeypatch.setattr(image_decode, "open_image", lambda *a: scales.append(a[2]) or _open(*a))
    AugmentGroup(3, SplitTransform(PLAIN_TRAIN.build(train=True)))({"jpg": smooth_jpeg(64, 48), "cls": "0"})
    assert scales[0] >= 2  # crops of >= 22 pixels for an 8-pixel input


def test_a_transform_without_to_tensor_is_refused():
    from torchvision import transforms as tv

    with pytest.raises(ValueError, match="expected PIL ops, ToTensor, Normalize"):
        SplitTransform(tv.Compose([tv.CenterCrop(4)]))


def test_split_mean_and_std_are_float32_under_a_float64_default():
    """The normalisation constants stay float32 when the default dtype is float64 (Lightning's ``64-true``
    sets it), so the worker rows keep the float32 arithmetic of the device path."""
    from torchvision import transforms as tv

    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        split = SplitTransform(tv.Compose([tv.ToTensor(), tv.Normalize((0.3, 0.4), (0.2, 0.1))]))
    finally:
        torch.set_default_dtype(default)
    assert split.mean.dtype == split.std.dtype == torch.float32
    assert split.mean.tolist() == pytest.approx([0.3, 0.4]) and split.std.tolist() == pytest.approx([0.2, 0.1])
