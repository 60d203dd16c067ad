"""Image-folder preparation from a tiny tree written here in several formats: RGB and greyscale
JPEG (kept as they are), a CMYK JPEG, an animated GIF, an RGBA PNG and a BMP (converted to RGB
PNGs), and a text file and a truncated JPEG (skipped with their reasons)."""

import logging

import numpy as np
import pytest
from PIL import Image

from mmlight.data.prepare import prepare
from tests.data.shard_contents import encoded, image_bytes, pixels, split_samples


def rgb(seed, size=(8, 10)):
    return np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)


def gif(path):
    frames = [Image.fromarray(rgb(s)).convert("P") for s in (20, 21)]
    frames[0].save(path, save_all=True, append_images=frames[1:])
    return np.asarray(Image.open(path).convert("RGB"))  # the first frame


def write_tree(root):
    """Returns {split: [(relative path, class, expected stored bytes or pixels, kind)]}."""
    for d in ("train/cat", "train/dog", "val/cat", "val/dog"):
        (root / d).mkdir(parents=True)
    cases = {}
    kept_jpeg = encoded(rgb(1), "JPEG")
    grey_jpeg = encoded(rgb(2)[..., 0], "JPEG", mode="L")
    (root / "train/cat/a.jpg").write_bytes(kept_jpeg)
    (root / "train/cat/grey.jpeg").write_bytes(grey_jpeg)
    Image.fromarray(rgb(3)).convert("CMYK").save(root / "train/dog/cmyk.jpg", format="JPEG")
    cmyk = np.asarray(Image.open(root / "train/dog/cmyk.jpg").convert("RGB"))
    anim = gif(root / "train/dog/anim.gif")
    rgba = np.concatenate([rgb(4), np.full((8, 10, 1), 255, np.uint8)], axis=-1)
    rgba[0, 0, 3] = 0  # one transparent pixel: white after compositing
    (root / "val/cat/alpha.png").write_bytes(encoded(rgba, "PNG", mode="RGBA"))
    Image.fromarray(rgb(5)).save(root / "val/dog/b.bmp")
    (root / "val/dog/notes.txt").write_text("not an image")
    (root / "train/cat/cut.jpg").write_bytes(encoded(rgb(6, (64, 64)), "JPEG")[:200])
    want_alpha = rgba[..., :3].copy()
    want_alpha[0, 0] = 255
    cases["train"] = [(kept_jpeg, 0, "bytes"), (grey_jpeg, 0, "bytes"), (cmyk, 1, "pixels"), (anim, 1, "pixels")]
    cases["val"] = [(want_alpha, 0, "pixels"), (rgb(5), 1, "pixels")]
    return cases


def test_formats_are_kept_converted_or_skipped_with_reasons(tmp_path, caplog):
    cases = write_tree(tmp_path / "raw")
    with caplog.at_level(logging.INFO):
        info = prepare("imagefolder", tmp_path / "raw", tmp_path / "out")
    assert info["classes"] == ["cat", "dog"]
    assert {s: info["splits"][s]["num_samples"] for s in info["splits"]} == {"train": 4, "val": 2}
    skipped = {
        s["path"].split("raw/")[1]: s["reason"] for split in ("train", "val") for s in info["splits"][split]["skipped"]
    }
    assert set(skipped) == {"train/cat/cut.jpg", "val/dog/notes.txt"}
    assert all(reason.startswith("not a readable image") for reason in skipped.values())
    for split, want in cases.items():
        samples = list(split_samples(tmp_path / "out", split).values())
        for expected, label, kind in want:
            if kind == "bytes":
                match = [s for s in samples if image_bytes(s) == expected]
            else:
                match = [s for s in samples if "png" in s and np.array_equal(pixels(s["png"]), expected)]
            assert len(match) == 1 and int(match[0]["cls"]) == label
    converted = [r.getMessage() for r in caplog.records if r.getMessage().startswith("converted")]
    assert len(converted) == 4
    assert any("cmyk.jpg (JPEG CMYK)" in m for m in converted) and any("anim.gif (GIF P)" in m for m in converted)


def test_val_class_unknown_to_train_is_an_error(tmp_path):
    (tmp_path / "raw/train/cat").mkdir(parents=True)
    (tmp_path / "raw/train/cat/a.jpg").write_bytes(encoded(rgb(1), "JPEG"))
    (tmp_path / "raw/val/cow").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"val/ has class folders not in train/: \['cow'\]"):
        prepare("imagefolder", tmp_path / "raw", tmp_path / "out")


def test_missing_val_is_named(tmp_path):
    (tmp_path / "raw/train/cat").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match=r"expected the validation images \(val/<class>/\*\)"):
        prepare("imagefolder", tmp_path / "raw", tmp_path / "out")
