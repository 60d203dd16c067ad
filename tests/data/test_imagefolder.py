"""Image-folder preparation from a tiny tree written here in several formats: RGB and greyscale
JPEG (kept as they are), a CMYK JPEG, an animated GIF, an RGBA PNG and a BMP (converted to RGB
PNGs), and a text file and a truncated JPEG (skipped with their reasons)."""

import json
import logging
import tarfile

import numpy as np
import pytest
from PIL import Image

from mmlight.data.prepare import prepare
from tests.helpers.shard_contents import encoded, image_bytes, pixels, split_samples


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
    assert skipped["val/dog/notes.txt"].startswith("not a readable image (UnidentifiedImageError: cannot identify")
    assert skipped["train/cat/cut.jpg"].startswith("not a readable image (OSError: ")
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
    """No val/ folder, or a file named val (the test split beside it is not read alone): an error naming it."""
    (tmp_path / "raw/train/cat").mkdir(parents=True)
    message = f"expected the validation images (val/<class>/*) in the folder {tmp_path / 'raw' / 'val'}"
    with pytest.raises(FileNotFoundError) as err:
        prepare("imagefolder", tmp_path / "raw", tmp_path / "out")
    assert str(err.value) == message
    (tmp_path / "raw/test/cat").mkdir(parents=True)
    (tmp_path / "raw/val").write_text("not a folder")
    with pytest.raises(FileNotFoundError) as err:
        prepare("imagefolder", tmp_path / "raw", tmp_path / "out")
    assert str(err.value) == message


def composited_on_white(rgb_values: np.ndarray, alpha: np.ndarray) -> np.ndarray:
    """The reference: ``c * a / 255 + 255 * (1 - a / 255)`` per channel, in float64."""
    a = alpha.astype(np.float64)[..., None] / 255
    return rgb_values.astype(np.float64) * a + 255 * (1 - a)


@pytest.mark.parametrize("mode", ["RGBA", "LA", "PA"])
def test_as_rgb_composites_every_transparent_mode_on_white(mode):
    """Each mode with an alpha band: the colour weighted by its alpha over white (a plain ``convert("RGB")``
    would drop the alpha and keep the hidden colour)."""
    from mmlight.data.prepare.image_files import as_rgb

    colour = rgb(7, (4, 5))
    alpha = np.array([0, 64, 128, 200, 255] * 4, np.uint8).reshape(4, 5)
    if mode == "RGBA":
        image = Image.fromarray(np.dstack([colour, alpha]), mode="RGBA")
        want_rgb = colour
    elif mode == "LA":
        image = Image.fromarray(np.dstack([colour[..., 0], alpha]), mode="LA")
        want_rgb = np.repeat(colour[..., :1], 3, axis=-1)
    else:  # a palette of 4 colours, each pixel's index and its own alpha
        palette = rgb(8, (4, 1)).reshape(4, 3)
        indices = (np.arange(20) % 4).astype(np.uint8).reshape(4, 5)
        image = Image.merge("PA", (Image.fromarray(indices, mode="L"), Image.fromarray(alpha, mode="L")))
        image.putpalette(palette.flatten().tolist())
        want_rgb = palette[indices]
    got = as_rgb(image)
    assert got.mode == "RGB" and got.size == image.size
    np.testing.assert_allclose(np.asarray(got), composited_on_white(want_rgb, alpha), atol=1)


def test_as_rgb_turns_a_palette_image_transparent_colour_white_and_keeps_opaque_images():
    """A palette PNG with a transparent index (``transparency`` in its info, mode ``P``): that index becomes
    white. Images without transparency are converted as they are."""
    from io import BytesIO

    from mmlight.data.prepare.image_files import as_rgb

    palette = np.array([[10, 20, 30], [200, 100, 50], [0, 255, 0]], np.uint8)
    indices = np.array([[0, 1, 2], [2, 1, 0]], np.uint8)
    image = Image.fromarray(indices, mode="L").convert("P")
    image.putpalette(palette.flatten().tolist())
    buf = BytesIO()
    image.save(buf, format="PNG", transparency=2)  # index 2 (green) is transparent
    with Image.open(BytesIO(buf.getvalue())) as png:
        assert png.mode == "P" and "transparency" in png.info
        got = np.asarray(as_rgb(png))
    want = palette[indices].copy()
    want[indices == 2] = 255
    np.testing.assert_array_equal(got, want)
    # opaque: the colour unchanged (no white blending), from greyscale, palette and CMYK alike
    grey = rgb(9, (3, 4))[..., 0]
    np.testing.assert_array_equal(np.asarray(as_rgb(Image.fromarray(grey, mode="L"))), np.dstack([grey] * 3))
    opaque = Image.fromarray(indices, mode="L").convert("P")
    opaque.putpalette(palette.flatten().tolist())
    assert "transparency" not in opaque.info
    np.testing.assert_array_equal(np.asarray(as_rgb(opaque)), palette[indices])
    cmyk = Image.new("CMYK", (2, 2), (0, 0, 0, 255))  # full black ink
    np.testing.assert_array_equal(np.asarray(as_rgb(cmyk)), np.zeros((2, 2, 3), np.uint8))


def test_missing_or_empty_train_is_named_and_at_most_five_unknown_classes_are_listed(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    with pytest.raises(FileNotFoundError) as err:
        prepare("imagefolder", raw, tmp_path / "out")
    assert str(err.value) == f"expected the training images (train/<class>/*) at {raw / 'train'}"
    (raw / "train").mkdir()
    (raw / "train" / "loose.jpg").write_bytes(encoded(rgb(1), "JPEG"))  # a file, not a class folder
    with pytest.raises(FileNotFoundError) as err:
        prepare("imagefolder", raw, tmp_path / "out")
    assert str(err.value) == f"expected class folders train/<class>/ in {raw / 'train'}"
    (raw / "train" / "cat").mkdir()
    for name in ("f", "b", "a", "e", "d", "c"):
        (raw / "val" / name).mkdir(parents=True)
    with pytest.raises(ValueError) as err:
        prepare("imagefolder", raw, tmp_path / "out")
    assert str(err.value) == "val/ has class folders not in train/: ['a', 'b', 'c', 'd', 'e']"


def test_info_names_the_dataset_and_a_test_split_is_read_when_present(tmp_path):
    raw = tmp_path / "raw"
    for split, name, seed in (("train", "cat", 1), ("train", "dog", 2), ("val", "dog", 3), ("test", "cat", 4)):
        (raw / split / name).mkdir(parents=True, exist_ok=True)
        (raw / split / name / f"{seed}.jpg").write_bytes(encoded(rgb(seed), "JPEG"))
    info = prepare("imagefolder", raw, tmp_path / "out")
    assert info["dataset"] == "imagefolder" and info["classes"] == ["cat", "dog"]
    got = {
        split: sorted((image_bytes(s), int(s["cls"])) for s in split_samples(tmp_path / "out", split).values())
        for split in ("train", "val", "test")
    }
    assert got == {
        "train": sorted([(encoded(rgb(1), "JPEG"), 0), (encoded(rgb(2), "JPEG"), 1)]),
        "val": [(encoded(rgb(3), "JPEG"), 1)],
        "test": [(encoded(rgb(4), "JPEG"), 0)],
    }


def test_image_sample_keeps_rgb_and_grey_pngs_and_skips_an_empty_file(tmp_path):
    """PNG in RGB or L is stored byte for byte under ``png`` (JPEG under ``jpg``); an empty file is skipped as
    such; the sample's key and class come from the item."""
    from mmlight.data.prepare.image_files import image_sample

    files = {
        "rgb.png": encoded(rgb(11), "PNG"),
        "grey.png": encoded(rgb(12)[..., 0], "PNG", mode="L"),
        "photo.jpg": encoded(rgb(13), "JPEG"),
        "empty.jpg": b"",
    }
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    assert image_sample(("k1", str(tmp_path / "rgb.png"), 3)) == {"__key__": "k1", "png": files["rgb.png"], "cls": "3"}
    assert image_sample(("k2", str(tmp_path / "grey.png"), 0)) == {
        "__key__": "k2",
        "png": files["grey.png"],
        "cls": "0",
    }
    assert image_sample(("k3", str(tmp_path / "photo.jpg"), 1)) == {
        "__key__": "k3",
        "jpg": files["photo.jpg"],
        "cls": "1",
    }
    empty = image_sample(("k4", str(tmp_path / "empty.jpg"), 1))
    assert (empty.path, empty.reason) == (str(tmp_path / "empty.jpg"), "empty file")
    missing = image_sample(("k5", str(tmp_path / "gone.jpg"), 1))
    assert (missing.path, missing.reason) == (str(tmp_path / "gone.jpg"), "listed but missing")


def test_write_image_splits_keys_items_in_order_and_shuffles_only_the_named_splits(tmp_path):
    """Keys are ``{split}{index:07d}`` in the list's order; ``train`` (the default ``shuffle``) is written in a
    fixed shuffled order across its shards (the same in a second folder), the other splits in their order,
    ``per_shard`` to a shard."""
    from mmlight.data.prepare.image_files import write_image_splits

    def sample(item):
        key, value, label = item
        return {"__key__": key, "txt": value, "cls": str(label)}

    def written_order(out, shards):
        order = []
        for shard in shards:
            with tarfile.open(out / shard["name"]) as tar:
                order += [m.name.split(".")[0] for m in tar.getmembers() if m.name.endswith(".txt")]
        return order

    items = [(f"item{i}", i % 3) for i in range(10)]
    splits = {"train": items, "val": items}
    info = write_image_splits(tmp_path, "toy", ["a", "b", "c"], splits, 1, per_shard=4, make_sample=sample)
    written = json.loads((tmp_path / "_info.json").read_text())
    assert (written["dataset"], written["classes"], written["splits"]) == ("toy", ["a", "b", "c"], info["splits"])
    for split in ("train", "val"):
        shards = info["splits"][split]["shards"]
        assert [s["num_samples"] for s in shards] == [4, 4, 2]
        samples = split_samples(tmp_path, split)
        assert {k: (s["txt"].decode(), int(s["cls"])) for k, s in samples.items()} == {
            f"{split}{i:07d}": item for i, item in enumerate(items)
        }
        keys = [f"{split}{i:07d}" for i in range(10)]
        order = written_order(tmp_path, shards)
        assert sorted(order) == keys and (order == keys) == (split == "val")
    again = write_image_splits(tmp_path / "again", "toy", ["a", "b", "c"], splits, 1, per_shard=4, make_sample=sample)
    assert written_order(tmp_path / "again", again["splits"]["train"]["shards"]) == written_order(
        tmp_path, info["splits"]["train"]["shards"]
    )
