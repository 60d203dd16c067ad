"""CIFAR-10/100 preparation from pickles written here in the official python format (Python 2
style byte-string keys, row-major R, G, B planes), as a folder and as the .tar.gz archive."""

import pickle
import tarfile

import numpy as np
import pytest
import torch

from mmlight.commands.prepare import main
from mmlight.data import ImageAugment, ImageShardDataModule
from mmlight.data.prepare import prepare
from tests.helpers import py2_pickle
from tests.helpers.shard_contents import pixels, split_samples

PER_BATCH = 4


def batch(seed: int, n: int, labels_key: bytes, num_classes: int) -> dict:
    rng = np.random.default_rng(seed)
    labels = [int(x) for x in rng.integers(0, num_classes, n)]
    data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
    return {
        b"batch_label": b"batch",
        labels_key: labels,
        b"data": data,
        b"filenames": [f"img_{seed}_{i}.png".encode() for i in range(n)],
    }


def write_cifar10(folder):
    folder.mkdir(parents=True)
    batches = {f"data_batch_{i}": batch(i, PER_BATCH, b"labels", 10) for i in range(1, 6)}
    batches["test_batch"] = batch(9, 3, b"labels", 10)
    batches["batches.meta"] = {b"label_names": [f"class{i}".encode() for i in range(10)], b"num_vis": 3072}
    for name, content in batches.items():
        (folder / name).write_bytes(pickle.dumps(content, protocol=2))
    return batches


def write_cifar100(folder):
    folder.mkdir(parents=True)
    batches = {"train": batch(1, 7, b"fine_labels", 100), "test": batch(2, 5, b"fine_labels", 100)}
    for content in batches.values():
        content[b"coarse_labels"] = [label // 5 for label in content[b"fine_labels"]]
    batches["meta"] = {
        b"fine_label_names": [f"fine{i}".encode() for i in range(100)],
        b"coarse_label_names": [f"coarse{i}".encode() for i in range(20)],
    }
    for name, content in batches.items():
        (folder / name).write_bytes(pickle.dumps(content, protocol=2))
    return batches


def raw_images(batches, names, labels_key):
    """(pixels (32, 32, 3), label) of every image of the named pickles, in file order."""
    return [
        (row.reshape(3, 32, 32).transpose(1, 2, 0), label)
        for name in names
        for row, label in zip(batches[name][b"data"], batches[name][labels_key])
    ]


def check_split(out, split, want):
    samples = split_samples(out, split)
    assert len(samples) == len(want)
    got = sorted((pixels(s["png"]).tobytes(), int(s["cls"])) for s in samples.values())
    assert got == sorted((p.tobytes(), label) for p, label in want)


def test_cifar10_from_the_extracted_folder(tmp_path):
    batches = write_cifar10(tmp_path / "raw" / "cifar-10-batches-py")
    info = prepare("cifar10", tmp_path / "raw", tmp_path / "out")
    assert info["classes"] == [f"class{i}" for i in range(10)]
    assert {s: info["splits"][s]["num_samples"] for s in info["splits"]} == {"train": 5 * PER_BATCH, "test": 3}
    check_split(tmp_path / "out", "train", raw_images(batches, [f"data_batch_{i}" for i in range(1, 6)], b"labels"))
    check_split(tmp_path / "out", "test", raw_images(batches, ["test_batch"], b"labels"))


def test_cifar100_from_the_archive_with_fine_labels(tmp_path, capsys):
    batches = write_cifar100(tmp_path / "extract" / "cifar-100-python")
    (tmp_path / "download").mkdir()
    with tarfile.open(tmp_path / "download" / "cifar-100-python.tar.gz", "w:gz") as tar:
        tar.add(tmp_path / "extract" / "cifar-100-python", arcname="cifar-100-python")
    main(["cifar100", "--src", str(tmp_path / "download"), "--out", str(tmp_path / "out"), "--workers", "1"])
    assert "train 7 samples (0 skipped), test 5 samples (0 skipped)" in capsys.readouterr().out
    check_split(tmp_path / "out", "train", raw_images(batches, ["train"], b"fine_labels"))
    check_split(tmp_path / "out", "test", raw_images(batches, ["test"], b"fine_labels"))


def test_cifar_shards_stream_with_the_test_split_as_validation(tmp_path):
    batches = write_cifar10(tmp_path / "raw")
    prepare("cifar10", tmp_path / "raw", tmp_path / "out")
    augment = ImageAugment(
        image_size=32,
        channels=3,
        scale=(1.0, 1.0),
        hflip=0.0,
        color_jitter=None,
        crop_pct=1.0,
        mean=(0.0, 0.0, 0.0),
        std=(1.0, 1.0, 1.0),
    )
    dm = ImageShardDataModule(
        str(tmp_path / "out"),
        batch_size=3,
        augment=augment,
        val_split="test",
        test_split="test",
        normalize_on_device=False,
    )
    assert dm.num_classes == 10
    images, labels = next(iter(dm.val_dataloader()))
    want = sorted((p.tobytes(), label) for p, label in raw_images(batches, ["test_batch"], b"labels"))
    got = sorted(
        ((img * 255).round().to(torch.uint8).permute(1, 2, 0).numpy().tobytes(), int(label))
        for img, label in zip(images, labels)
    )
    assert got == want


def test_missing_pickles_are_named(tmp_path):
    (tmp_path / "raw").mkdir()
    with pytest.raises(FileNotFoundError, match="expected the cifar10 pickles .*cifar-10-python.tar.gz"):
        prepare("cifar10", tmp_path / "raw", tmp_path / "out")


def test_names_as_str_a_wrong_data_shape_and_the_missing_files_message(tmp_path):
    """Class names pickled as ``str`` (a Python 3 re-pickle) are read as they are; a data array that is not
    N x 3072 for its N labels is refused, naming the file; each release's info names its dataset."""
    folder = tmp_path / "raw"
    batches = write_cifar10(folder)
    meta = {b"label_names": [f"name{i}" for i in range(10)]}
    (folder / "batches.meta").write_bytes(pickle.dumps(meta, protocol=2))
    info = prepare("cifar10", folder, tmp_path / "out")
    assert info["dataset"] == "cifar10" and info["classes"] == [f"name{i}" for i in range(10)]
    bad = {**batches["data_batch_3"], b"data": batches["data_batch_3"][b"data"][:, :3000]}
    (folder / "data_batch_3").write_bytes(pickle.dumps(bad, protocol=2))
    with pytest.raises(ValueError) as err:
        prepare("cifar10", folder, tmp_path / "out2")
    assert str(err.value) == f"cifar10 data_batch_3: data has shape ({PER_BATCH}, 3000), expected ({PER_BATCH}, 3072)"
    write_cifar100(tmp_path / "raw100")
    assert prepare("cifar100", tmp_path / "raw100", tmp_path / "out100")["dataset"] == "cifar100"
    with pytest.raises(FileNotFoundError) as err:
        prepare("cifar100", tmp_path / "out", tmp_path / "out3")
    src = tmp_path / "out"
    assert str(err.value) == (
        f"expected the cifar100 pickles (meta, ...) in {src} or {src / 'cifar-100-python'}, "
        f"or the archive {src / 'cifar-100-python.tar.gz'}"
    )


def test_python2_pickles_and_shards_of_at_most_5000_images(tmp_path):
    """The official pickles hold Python 2 strings (read as bytes, then decoded); a split of 1,001 images is one
    shard (5,000 images to a shard)."""
    folder = tmp_path / "raw"
    batches = write_cifar10(folder)
    batches["data_batch_2"] = batch(2, 1001 - 4 * PER_BATCH, b"labels", 10)
    for name, content in batches.items():
        (folder / name).write_bytes(py2_pickle.dumps(content))
    raw = (folder / "data_batch_1").read_bytes()  # Python 2 strings: bytes on request; the pixels are not ASCII
    assert b"labels" in pickle.loads(raw, encoding="bytes")
    with pytest.raises(UnicodeDecodeError):
        pickle.loads(raw)
    info = prepare("cifar10", folder, tmp_path / "out")
    assert info["classes"] == [f"class{i}" for i in range(10)]
    assert [s["num_samples"] for s in info["splits"]["train"]["shards"]] == [1001]
    check_split(tmp_path / "out", "train", raw_images(batches, [f"data_batch_{i}" for i in range(1, 6)], b"labels"))


def python3_repickle(content: dict) -> dict:
    """What ``pickle.dump`` under Python 3 writes after ``pickle.load(f, encoding="latin1")`` of an official
    file: every key and every name a ``str``, the arrays as they were."""

    def text(value):
        return value.decode("latin1") if isinstance(value, bytes) else value

    return {text(k): [text(v) for v in v_] if isinstance(v_, list) else text(v_) for k, v_ in content.items()}


@pytest.mark.parametrize("protocol", [2, pickle.HIGHEST_PROTOCOL])
def test_archives_re_pickled_under_python_3_with_str_keys(tmp_path, protocol):
    """The same images and labels as from the official (bytes-keyed) pickles, for CIFAR-10 from the folder
    and CIFAR-100 from the archive; the class names are the str ones."""
    batches10 = write_cifar10(tmp_path / "raw10")
    batches100 = write_cifar100(tmp_path / "extract" / "cifar-100-python")
    for folder, batches in ((tmp_path / "raw10", batches10), (tmp_path / "extract" / "cifar-100-python", batches100)):
        for name, content in batches.items():
            repickled = python3_repickle(content)
            assert all(isinstance(key, str) for key in repickled)
            (folder / name).write_bytes(pickle.dumps(repickled, protocol=protocol))
    info = prepare("cifar10", tmp_path / "raw10", tmp_path / "out10")
    assert info["classes"] == [f"class{i}" for i in range(10)]
    check_split(tmp_path / "out10", "train", raw_images(batches10, [f"data_batch_{i}" for i in range(1, 6)], b"labels"))
    check_split(tmp_path / "out10", "test", raw_images(batches10, ["test_batch"], b"labels"))
    (tmp_path / "download").mkdir()
    with tarfile.open(tmp_path / "download" / "cifar-100-python.tar.gz", "w:gz") as tar:
        tar.add(tmp_path / "extract" / "cifar-100-python", arcname="cifar-100-python")
    info = prepare("cifar100", tmp_path / "download", tmp_path / "out100")
    assert info["classes"] == [f"fine{i}" for i in range(100)]
    check_split(tmp_path / "out100", "train", raw_images(batches100, ["train"], b"fine_labels"))
    check_split(tmp_path / "out100", "test", raw_images(batches100, ["test"], b"fine_labels"))


def test_a_pickle_that_is_not_a_dict_or_holds_code_is_named_by_its_file_and_archive_member(tmp_path):
    """The error names the file (extracted folder) or ``archive:member`` (the .tar.gz) it came from."""
    import os

    from mmlight.safe_load import RefusedFile

    folder = tmp_path / "raw" / "cifar-10-batches-py"
    write_cifar10(folder)
    (folder / "data_batch_2").write_bytes(pickle.dumps([1, 2], protocol=2))
    with pytest.raises(ValueError) as error:
        prepare("cifar10", tmp_path / "raw", tmp_path / "out")
    assert str(error.value) == f"{folder / 'data_batch_2'} holds a list, not the dict of a CIFAR pickle"

    (folder / "data_batch_2").write_bytes(pickle.dumps({b"data": os.system}, protocol=2))
    (tmp_path / "download").mkdir()
    archive = tmp_path / "download" / "cifar-10-python.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(folder, arcname="cifar-10-batches-py")
    with pytest.raises(RefusedFile) as refused:
        prepare("cifar10", tmp_path / "download", tmp_path / "out2")
    assert str(refused.value).startswith(
        f"{archive}:cifar-10-batches-py/data_batch_2 holds objects mmlight does not load: posix.system. "
    )


def test_pixels_held_as_a_wider_integer_array_become_the_same_bytes(tmp_path):
    """A batch whose pixels a re-pickling tool widened (an int64 array of 0-255, or a list of lists) gives
    the images of the uint8 original."""
    folder = tmp_path / "raw"
    batches = write_cifar10(folder)
    wide = {**batches["data_batch_1"], b"data": batches["data_batch_1"][b"data"].astype(np.int64)}
    listed = {**batches["data_batch_2"], b"data": batches["data_batch_2"][b"data"].tolist()}
    (folder / "data_batch_1").write_bytes(pickle.dumps(wide, protocol=2))
    (folder / "data_batch_2").write_bytes(pickle.dumps(listed, protocol=2))
    prepare("cifar10", folder, tmp_path / "out")
    check_split(tmp_path / "out", "train", raw_images(batches, [f"data_batch_{i}" for i in range(1, 6)], b"labels"))
