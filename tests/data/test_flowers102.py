"""Flowers-102 preparation from a tiny release written here: jpg/image_%05d.jpg, imagelabels.mat
and setid.mat (scipy.io.savemat, as MATLAB's 1 x N double arrays)."""

import numpy as np
import pytest
from scipy.io import savemat

from mmlight.commands.prepare import main
from mmlight.data.prepare import prepare
from tests.helpers.shard_contents import encoded, image_bytes, split_samples

LABELS = [3, 1, 2, 3, 1, 2, 2, 3, 1, 1]  # 1-based classes of images 1..10
SETID = {"trnid": [2, 5, 9], "valid": [1, 6, 7], "tstid": [3, 4, 8, 10]}


def write_release(root):
    (root / "jpg").mkdir(parents=True)
    files = {}
    for i in range(1, len(LABELS) + 1):
        pixels = np.random.default_rng(i).integers(0, 256, (12, 10, 3), dtype=np.uint8)
        files[i] = encoded(pixels, "JPEG")
        (root / "jpg" / f"image_{i:05d}.jpg").write_bytes(files[i])
    savemat(str(root / "imagelabels.mat"), {"labels": np.array([LABELS], dtype=np.float64)})
    savemat(str(root / "setid.mat"), {k: np.array([v], dtype=np.float64) for k, v in SETID.items()})
    return files


def test_splits_and_labels_follow_the_mat_files(tmp_path, capsys):
    files = write_release(tmp_path / "raw")
    main(["flowers102", "--src", str(tmp_path / "raw"), "--out", str(tmp_path / "out"), "--workers", "2"])
    assert (
        "train 3 samples (0 skipped), val 3 samples (0 skipped), test 4 samples (0 skipped)" in capsys.readouterr().out
    )
    for split, key in (("train", "trnid"), ("val", "valid"), ("test", "tstid")):
        got = sorted((image_bytes(s), int(s["cls"])) for s in split_samples(tmp_path / "out", split).values())
        assert got == sorted((files[i], LABELS[i - 1] - 1) for i in SETID[key])


def test_classes_are_named_by_their_number(tmp_path):
    write_release(tmp_path / "raw")
    assert prepare("flowers102", tmp_path / "raw", tmp_path / "out")["classes"] == ["1", "2", "3"]


def test_a_missing_image_is_skipped_and_counted(tmp_path):
    write_release(tmp_path / "raw")
    (tmp_path / "raw" / "jpg" / "image_00004.jpg").unlink()
    info = prepare("flowers102", tmp_path / "raw", tmp_path / "out")
    assert info["splits"]["test"]["num_samples"] == 3
    assert [(s["path"].split("/")[-1], s["reason"]) for s in info["splits"]["test"]["skipped"]] == [
        ("image_00004.jpg", "listed but missing")
    ]


def test_missing_label_file_is_named(tmp_path):
    write_release(tmp_path / "raw")
    (tmp_path / "raw" / "setid.mat").unlink()
    with pytest.raises(FileNotFoundError, match=r"expected the splits \(setid.mat\)"):
        prepare("flowers102", tmp_path / "raw", tmp_path / "out")


def test_image_numbers_outside_the_labels_are_refused_and_each_missing_part_is_named(tmp_path):
    raw = tmp_path / "raw"
    write_release(raw)
    assert prepare("flowers102", raw, tmp_path / "out")["dataset"] == "flowers102"
    for key, ids in (("tstid", [3, 11]), ("valid", [0, 4])):  # 10 images: 1..10 are valid
        savemat(str(raw / "setid.mat"), {k: np.array([ids if k == key else v], float) for k, v in SETID.items()})
        with pytest.raises(ValueError) as err:
            prepare("flowers102", raw, tmp_path / "out2")
        assert str(err.value) == f"setid.mat {key} lists images outside 1..10 (imagelabels.mat)"
    savemat(str(raw / "setid.mat"), {k: np.array([[10, 1] if k == "trnid" else v], float) for k, v in SETID.items()})
    assert prepare("flowers102", raw, tmp_path / "out2")["splits"]["train"]["num_samples"] == 2  # both ends kept
    savemat(str(raw / "setid.mat"), {k: np.array([v], float) for k, v in SETID.items()})
    (raw / "jpg").rename(raw / "images")
    with pytest.raises(FileNotFoundError) as err:
        prepare("flowers102", raw, tmp_path / "out2")
    assert str(err.value) == f"expected the images (jpg/image_00001.jpg ...) at {raw / 'jpg'}"
    (raw / "imagelabels.mat").unlink()
    with pytest.raises(FileNotFoundError) as err:
        prepare("flowers102", raw, tmp_path / "out2")
    assert str(err.value) == f"expected the labels (imagelabels.mat) at {raw / 'imagelabels.mat'}"


def test_a_single_image_split_and_the_classes_up_to_the_largest_label(tmp_path):
    """MATLAB saves a one-element list as a scalar (``squeeze_me``): still a split of one image. The classes run
    up to the largest label, even when some class has no image."""
    raw = tmp_path / "raw"
    files = write_release(raw)
    labels = [5 if label == 3 else label for label in LABELS]  # classes 3 and 4 unused
    savemat(str(raw / "imagelabels.mat"), {"labels": np.array([labels], dtype=np.float64)})
    setid = dict(SETID, trnid=[9])
    savemat(str(raw / "setid.mat"), {k: np.array([v], dtype=np.float64) for k, v in setid.items()})
    info = prepare("flowers102", raw, tmp_path / "out")
    assert info["classes"] == ["1", "2", "3", "4", "5"]
    for split, key in (("train", "trnid"), ("val", "valid"), ("test", "tstid")):
        got = sorted((image_bytes(s), int(s["cls"])) for s in split_samples(tmp_path / "out", split).values())
        assert got == sorted((files[i], labels[i - 1] - 1) for i in setid[key])
