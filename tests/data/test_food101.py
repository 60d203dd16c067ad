"""Food-101 preparation from a tiny release written here: images/<class>/<id>.jpg, meta/classes.txt,
meta/train.txt and meta/test.txt, inside a food-101/ folder as the archive extracts."""

import numpy as np
import pytest

from mmlight.data.prepare import prepare
from tests.helpers.shard_contents import encoded, image_bytes, split_samples

CLASSES = ["apple_pie", "baby_back_ribs", "baklava"]
LISTS = {
    "train": ["apple_pie/101", "apple_pie/102", "baklava/301", "baby_back_ribs/201"],
    "test": ["baklava/302", "apple_pie/103"],
}


def write_release(root):
    files = {}
    for n, line in enumerate(LISTS["train"] + LISTS["test"]):
        path = root / "images" / f"{line}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        files[line] = encoded(np.random.default_rng(n).integers(0, 256, (9, 11, 3), dtype=np.uint8), "JPEG")
        path.write_bytes(files[line])
    (root / "meta").mkdir()
    (root / "meta" / "classes.txt").write_text("\n".join(CLASSES) + "\n")
    for split, lines in LISTS.items():
        (root / "meta" / f"{split}.txt").write_text("\n".join(lines) + "\n")
    return files


def test_lists_give_the_splits_and_classes(tmp_path):
    files = write_release(tmp_path / "download" / "food-101")
    info = prepare("food101", tmp_path / "download", tmp_path / "out")
    assert info["classes"] == CLASSES
    for split, lines in LISTS.items():
        got = sorted((image_bytes(s), int(s["cls"])) for s in split_samples(tmp_path / "out", split).values())
        assert got == sorted((files[line], CLASSES.index(line.split("/")[0])) for line in lines)


def test_unlisted_class_is_an_error(tmp_path):
    write_release(tmp_path / "raw")
    (tmp_path / "raw" / "meta" / "classes.txt").write_text("apple_pie\nbaklava\n")
    with pytest.raises(ValueError, match="names class 'baby_back_ribs', which meta/classes.txt does not list"):
        prepare("food101", tmp_path / "raw", tmp_path / "out")


def test_info_names_the_dataset_and_each_missing_part_is_named(tmp_path):
    raw = tmp_path / "raw"
    write_release(raw)
    assert prepare("food101", raw, tmp_path / "out")["dataset"] == "food101"
    (raw / "meta" / "test.txt").unlink()
    with pytest.raises(FileNotFoundError) as err:
        prepare("food101", raw, tmp_path / "out2")
    assert str(err.value) == f"expected the test list (meta/test.txt) at {raw / 'meta' / 'test.txt'}"
    (raw / "images").rename(raw / "images.moved")
    with pytest.raises(FileNotFoundError) as err:
        prepare("food101", raw, tmp_path / "out2")
    assert str(err.value) == f"expected the images (images/<class>/<id>.jpg) at {raw / 'images'}"
    (raw / "meta" / "classes.txt").unlink()
    with pytest.raises(FileNotFoundError) as err:
        prepare("food101", raw, tmp_path / "out2")
    assert str(err.value) == f"expected the class list (meta/classes.txt) at {raw / 'meta' / 'classes.txt'}"
