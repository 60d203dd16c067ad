"""mmlight.data.images outside the loaders: ``eval_images`` (what ``classify`` feeds the network) against
timm's own evaluation transform, for PIL images of either mode and for image files."""

import io

import numpy as np
import pytest
import torch
from PIL import Image

from mmlight.data import ImageAugment
from mmlight.data.images import eval_images
from tests.data.image_fixtures import AWKWARD


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
