"""ImageNet preparation and streaming on a tiny raw set written here in the ILSVRC-2012 layout,
with a truncated JPEG and a zero-byte file among the images."""

import io
import json
import logging
import random
import tarfile

import numpy as np
import pytest
import torch
import webdataset as wds
from PIL import Image

from mmlight.cli import main
from mmlight.data import ImageAugment, ImageShardDataModule
from mmlight.data.prepare import imagenet, prepare
from mmlight.data.shards import read_info

WNIDS = ["n01440764", "n01443537", "n01484850"]
SMALL = ImageAugment(image_size=16, channels=3, scale=(0.5, 1.0), color_jitter=None, crop_pct=1.0)


def jpeg(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (20, 24, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG")
    return buf.getvalue()


def write_raw(root, val_layout="flat"):
    """3 classes x 4 train images (+ one truncated, one empty), 2 val images per class."""
    for c, wnid in enumerate(WNIDS):
        folder = root / "train" / wnid
        folder.mkdir(parents=True)
        for i in range(4):
            (folder / f"{wnid}_{i}.JPEG").write_bytes(jpeg(10 * c + i))
    (root / "train" / WNIDS[0] / f"{WNIDS[0]}_truncated.JPEG").write_bytes(jpeg(99)[:300])
    (root / "train" / WNIDS[1] / f"{WNIDS[1]}_empty.JPEG").write_bytes(b"")
    val = root / "val"
    val.mkdir()
    labels = {}
    for n in range(6):
        name = f"ILSVRC2012_val_{n + 1:08d}"
        labels[name] = WNIDS[n % 3]
        target = val / labels[name] if val_layout == "folders" else val
        target.mkdir(exist_ok=True)
        (target / f"{name}.JPEG").write_bytes(jpeg(100 + n))
    if val_layout == "flat":
        rows = ["ImageId,PredictionString"] + [f"{k},{w} 1 2 3 4" for k, w in labels.items()]
        (root / "LOC_val_solution.csv").write_text("\n".join(rows) + "\n")
    if val_layout == "devkit":
        from scipy.io import savemat

        ids = {w: i + 1 for i, w in enumerate(reversed(WNIDS))}  # devkit ids are not the sorted order
        synsets = np.array([(i, w) for w, i in ids.items()], dtype=[("ILSVRC2012_ID", "O"), ("WNID", "O")])
        savemat(str(root / "meta.mat"), {"synsets": synsets})
        (root / "ILSVRC2012_validation_ground_truth.txt").write_text("\n".join(str(ids[w]) for w in labels.values()))
    return labels


def read_shards(out, split):
    info = read_info(out)
    samples = []
    for shard in info["splits"][split]["shards"]:
        with tarfile.open(out / shard["name"]) as tar:
            members = sorted(tar.getmembers(), key=lambda m: m.name)
            samples += [(m.name, tar.extractfile(m).read()) for m in members]
    return samples


@pytest.fixture
def small_shards(monkeypatch):
    monkeypatch.setattr(imagenet, "SAMPLES_PER_SHARD", 4)


@pytest.mark.parametrize("layout", ["flat", "folders", "devkit"])
def test_prepare_counts_labels_and_skips(tmp_path, small_shards, layout, caplog):
    labels = write_raw(tmp_path / "raw", layout)
    with caplog.at_level(logging.WARNING):
        info = prepare("imagenet", tmp_path / "raw", tmp_path / "out", workers=1)
    assert info["classes"] == WNIDS
    train, val = info["splits"]["train"], info["splits"]["val"]
    assert (train["num_samples"], train["num_skipped"], val["num_samples"], val["num_skipped"]) == (12, 2, 6, 0)
    assert len(train["shards"]) == 4 and sum(s["num_samples"] for s in train["shards"]) == 12  # 14 items, 4 per shard
    reasons = {s["path"].rsplit("/", 1)[-1]: s["reason"] for s in train["skipped"]}
    assert (
        set(reasons) == {f"{WNIDS[0]}_truncated.JPEG", f"{WNIDS[1]}_empty.JPEG"}
        and reasons[f"{WNIDS[1]}_empty.JPEG"] == "empty file"
    )
    assert f"{WNIDS[0]}_truncated.JPEG" in caplog.text  # logged with its path
    # bytes stored as they were, labels from the label file / folders
    val_samples = dict(read_shards(tmp_path / "out", "val"))
    for n, (name, wnid) in enumerate(labels.items()):
        assert val_samples[f"{name}.jpg"] == jpeg(100 + n)
        assert val_samples[f"{name}.cls"] == str(WNIDS.index(wnid)).encode()


def test_rerun_verifies_and_rewrites_nothing_and_a_killed_run_resumes(tmp_path, small_shards):
    write_raw(tmp_path / "raw")
    first = prepare("imagenet", tmp_path / "raw", tmp_path / "out", workers=2)
    shards = sorted((tmp_path / "out").glob("*.tar"))
    mtimes = {p: p.stat().st_mtime_ns for p in shards}
    assert prepare("imagenet", tmp_path / "raw", tmp_path / "out", workers=2) == first
    assert {p: p.stat().st_mtime_ns for p in shards} == mtimes
    # a run killed mid-way: one shard without its record, one half-written temp file, one corrupted
    (tmp_path / "out" / "train-000001.tar.done.json").unlink()
    (tmp_path / "out" / "train-000002.tar.tmp").write_bytes(b"partial")
    (tmp_path / "out" / "val-000000.tar").write_bytes(b"garbage")
    assert prepare("imagenet", tmp_path / "raw", tmp_path / "out", workers=1) == first
    untouched = [p for p in shards if p.name not in ("train-000001.tar", "val-000000.tar")]
    assert all(p.stat().st_mtime_ns == mtimes[p] for p in untouched)


def test_missing_layout_names_what_was_expected(tmp_path, capsys):
    (tmp_path / "raw" / "train" / WNIDS[0]).mkdir(parents=True)
    (tmp_path / "raw" / "val").mkdir()
    (tmp_path / "raw" / "val" / "ILSVRC2012_val_00000001.JPEG").write_bytes(jpeg(0))
    with pytest.raises(SystemExit):
        main(["prepare", "imagenet", "--src", str(tmp_path / "raw"), "--out", str(tmp_path / "out")])
    assert "LOC_val_solution.csv" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="train"):
        prepare("imagenet", tmp_path, tmp_path / "out2")


def test_stream_val_once_and_train_fixed_length(tmp_path, small_shards):
    write_raw(tmp_path / "raw")
    prepare("imagenet", tmp_path / "raw", tmp_path / "out", workers=1)
    dm = ImageShardDataModule(str(tmp_path / "out"), batch_size=5, num_workers=0, augment=SMALL)
    labels = torch.cat([y for _, y in dm.val_dataloader()])
    assert sorted(labels.tolist()) == [0, 0, 1, 1, 2, 2]
    train = dm.train_dataloader()
    batches = list(train)
    assert len(batches) == len(train) == 12 // 5
    images, labels = batches[0]  # uint8 (normalised on the device, tests/data/test_on_device.py)
    assert images.shape == (5, 16, 16, 3) and images.dtype == torch.uint8 and labels.dtype == torch.int64


def test_corrupt_sample_in_a_shard_is_skipped_counted_and_logged(tmp_path, caplog):
    out = tmp_path / "shards"
    out.mkdir()
    with wds.TarWriter(str(out / "val-000000.tar")) as writer:
        writer.write({"__key__": "good0", "jpg": jpeg(1), "cls": "0"})
        writer.write({"__key__": "broken", "jpg": b"\xff\xd8 not really a jpeg", "cls": "1"})
        writer.write({"__key__": "good1", "jpg": jpeg(2), "cls": "1"})
    info = {"classes": ["a", "b"], "splits": {"val": {"num_samples": 3, "shards": [{"name": "val-000000.tar"}]}}}
    (out / "_info.json").write_text(json.dumps(info))
    dm = ImageShardDataModule(str(out), batch_size=2, num_workers=0, augment=SMALL)
    with caplog.at_level(logging.WARNING):
        labels = torch.cat([y for _, y in dm.val_dataloader()])
    assert labels.tolist() == [0, 1] and dm.skipped.value == 1
    assert "broken" in caplog.text


def test_repeated_augmentation_decodes_each_image_once_and_batches_arrive_in_shared_memory(tmp_path, monkeypatch):
    """3 copies per image from one decode each, in the same batch (12 rows: 4 decodes; per-copy
    decoding would need 12), each copy augmented on its own; with a worker, batches reach the main
    process in shared memory (allocated there by the worker, so nothing was copied to send them)."""
    from mmlight.data import image_decode

    write_raw(tmp_path / "raw")
    prepare("imagenet", tmp_path / "raw", tmp_path / "out", workers=1)
    decodes = []
    opened = image_decode.open_image
    monkeypatch.setattr(image_decode, "open_image", lambda *a: decodes.append(a) or opened(*a))
    dm = ImageShardDataModule(
        str(tmp_path / "out"), batch_size=6, num_workers=0, augment=SMALL, shuffle_buffer=1, repeated_augmentation=3
    )
    batches = list(dm.train_dataloader())  # 12 // 6 = 2 batches of 2 images x 3 copies
    assert len(batches) == 2 and len(decodes) == 12 // 3
    for _, labels in batches:
        assert all(count % 3 == 0 for count in torch.bincount(labels).tolist())  # whole groups
    images = torch.cat([x for x, _ in batches])
    assert not any(torch.equal(images[i], images[j]) for i in range(12) for j in range(i))  # each copy augmented
    dm_worker = ImageShardDataModule(
        str(tmp_path / "out"), batch_size=6, num_workers=1, augment=SMALL, repeated_augmentation=3
    )
    images, labels = next(iter(dm_worker.train_dataloader()))
    assert images.is_shared() and images.shape == (6, 16, 16, 3) and images.dtype == torch.uint8
    dm_worker.normalize_on_device = False
    images, labels = next(iter(dm_worker.train_dataloader()))
    assert images.is_shared() and images.shape == (6, 3, 16, 16) and images.dtype == torch.float32


def test_randaugment_posterize_at_full_magnitude_does_not_crash():
    """timm's RandAugment reaches posterize with 0 bits at magnitude 10; Pillow 13 refuses 0 bits.
    The DeiT transform must keep working and give the black image older Pillow gave."""
    from timm.data.auto_augment import rand_augment_transform

    image = Image.fromarray(np.full((16, 16, 3), 200, dtype=np.uint8))
    op = rand_augment_transform("rand-n1-m10-inc1", {}).ops
    posterize = next(o for o in op if o.name == "PosterizeIncreasing")
    posterize.prob = 1.0
    assert np.asarray(posterize(image)).max() == 0
    transform = ImageAugment(image_size=16, auto_augment="rand-m9-mstd0.5-inc1", color_jitter=0.3).build(train=True)
    for _ in range(200):
        transform(image)


def test_copy_groups_cover_every_row_once_and_split_a_straddling_image():
    """Batches of 4 rows from images of 3 copies: every row of a batch filled exactly once, every
    image's 3 copies present (image b straddles batches 0 and 1, as 2 + 1 copies), rows drawn at random."""
    from mmlight.data.images import copy_groups

    refs = [{"__key__": k} for k in "abcd"]
    batches = list(copy_groups(refs, 3, 4, random.Random(0)))
    assert len(batches) == 3  # 12 rows
    for groups in batches:
        assert sorted(row for g in groups for row in g["__rows__"]) == [0, 1, 2, 3]
        assert all(g["__copies__"] == len(g["__rows__"]) for g in groups)
    copies = [(g["__key__"], g["__copies__"]) for groups in batches for g in groups]
    assert copies == [("a", 3), ("b", 1), ("b", 2), ("c", 2), ("c", 1), ("d", 3)]
    assert {tuple(g["__rows__"]) for groups in batches for g in groups} != {
        (0, 1, 2),
        (3,),
        (0, 1),
        (2, 3),
        (0,),
        (1, 2, 3),
    }


def test_the_awkward_real_formats_are_kept_as_they_are_and_stream_in_their_colours(tmp_path):
    """ImageNet's greyscale, CMYK and progressive JPEGs and its PNG and GIF named .JPEG: all kept (none
    skipped), stored byte for byte, labelled by their folder, and streamed as RGB rows of their colour."""
    from tests.helpers.image_fixtures import AWKWARD

    names = list(AWKWARD)
    wnids = [f"n0000000{i}" for i in range(len(names))]
    for split in ("train", "val"):
        for wnid, (data, _, _) in zip(wnids, AWKWARD.values()):
            (tmp_path / "raw" / split / wnid).mkdir(parents=True)
            (tmp_path / "raw" / split / wnid / f"{wnid}_{split}.JPEG").write_bytes(data)
    info = prepare("imagenet", tmp_path / "raw", tmp_path / "out", workers=1)
    for split in ("train", "val"):
        entry = info["splits"][split]
        assert (entry["num_samples"], entry["num_skipped"]) == (len(names), 0)
    stored = dict(read_shards(tmp_path / "out", "val"))
    for label, (wnid, (data, _, _)) in enumerate(zip(wnids, AWKWARD.values())):
        assert stored[f"{wnid}_val.jpg"] == data and stored[f"{wnid}_val.cls"] == str(label).encode()
    dm = ImageShardDataModule(str(tmp_path / "out"), batch_size=len(names), num_workers=0, augment=SMALL)
    [(images, labels)] = list(dm.val_dataloader())
    assert images.shape == (len(names), 16, 16, 3) and dm.skipped.value == 0
    for row, label in zip(images, labels.tolist()):
        _, rgb, tolerance = AWKWARD[names[label]]
        assert (row.float() - torch.tensor(rgb)).abs().max().item() <= tolerance + 1, names[label]


def test_a_jpeg_cut_inside_its_image_data_is_skipped_though_its_header_reads(tmp_path):
    """Cut 200 bytes before the end: the header still parses (so a header check or ``verify`` would
    keep it), only a full decode finds the missing data."""
    data = np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(data).save(buf, format="JPEG")
    whole, cut = tmp_path / "whole.JPEG", tmp_path / "cut.JPEG"
    whole.write_bytes(buf.getvalue())
    cut.write_bytes(buf.getvalue()[:-200])
    with Image.open(cut) as header:
        assert header.size == (64, 64)  # the header alone is intact
    assert imagenet.make_sample((str(whole), 4)) == {"__key__": "whole", "jpg": buf.getvalue(), "cls": "4"}
    skipped = imagenet.make_sample((str(cut), 4))
    assert skipped.path == str(cut) and skipped.reason.startswith("OSError: image file is truncated")


def test_only_image_files_in_class_folders_are_read_and_every_layout_error_is_named(tmp_path):
    """``*.JPEG``/``*.jpg``/``*.png`` in any case are images; other files, sub-folders and loose files beside
    the class folders are not items. Each layout mistake stops with a message naming it."""
    raw = tmp_path / "raw"
    write_raw(raw, "folders")
    extra = raw / "train" / WNIDS[2]
    (extra / "upper.JPG").write_bytes(jpeg(50))
    (extra / "lower.png").write_bytes(jpeg(51))  # a JPEG named .png still decodes
    (extra / "readme.txt").write_text("not an image")
    (extra / "nested.JPEG").mkdir()
    (raw / "train" / "loose.JPEG").write_bytes(jpeg(52))
    assert [p.name for p in imagenet._images(extra)] == sorted(
        [f"{WNIDS[2]}_{i}.JPEG" for i in range(4)] + ["lower.png", "upper.JPG"]
    )
    assert list(imagenet.class_folders(raw / "train")) == WNIDS
    info = prepare("imagenet", raw, tmp_path / "out", workers=1)
    assert (info["splits"]["train"]["num_samples"], info["splits"]["train"]["num_skipped"]) == (14, 2)
    # errors
    assert info["dataset"] == "imagenet"
    for k in range(6):
        (raw / "val" / f"n0999999{k}").mkdir()
    with pytest.raises(ValueError) as err:  # the first five named
        prepare("imagenet", raw, tmp_path / "out2")
    assert str(err.value) == f"val/ has class folders not in train/: {[f'n0999999{k}' for k in range(5)]}"
    flat = tmp_path / "flat"
    write_raw(flat, "flat")
    (flat / "val" / "ILSVRC2012_val_00000099.JPEG").write_bytes(jpeg(7))
    with pytest.raises(ValueError) as err:
        prepare("imagenet", flat, tmp_path / "out3")
    unlabelled = flat / "val" / "ILSVRC2012_val_00000099.JPEG"
    assert str(err.value) == f"no label for {unlabelled} in the validation label file"
    (flat / "LOC_val_solution.csv").unlink()
    with pytest.raises(FileNotFoundError) as err:
        prepare("imagenet", flat, tmp_path / "out3")
    assert str(err.value) == (
        f"val/ in {flat} holds images directly, so a label file is needed: expected {flat / 'LOC_val_solution.csv'}, "
        f"or {flat / 'ILSVRC2012_validation_ground_truth.txt'} with {flat / 'meta.mat'}"
    )
    (flat / "ILSVRC2012_validation_ground_truth.txt").write_text("1\n")  # without meta.mat: still no label file
    with pytest.raises(FileNotFoundError, match="holds images directly"):
        prepare("imagenet", flat, tmp_path / "out3")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError) as err:
        prepare("imagenet", empty, tmp_path / "out4")
    assert str(err.value) == f"expected the training images (train/<wnid>/*.JPEG) at {empty / 'train'}"
    (empty / "train").mkdir()
    with pytest.raises(FileNotFoundError) as err:
        prepare("imagenet", empty, tmp_path / "out4")
    assert str(err.value) == f"expected class folders train/<wnid>/ in {empty / 'train'}"
    (empty / "train" / WNIDS[0]).mkdir()
    with pytest.raises(FileNotFoundError) as err:
        prepare("imagenet", empty, tmp_path / "out4")
    assert str(err.value) == f"expected the validation images (val/) at {empty / 'val'}"


def test_training_shards_mix_the_classes_in_a_fixed_order(tmp_path, small_shards):
    """Training items are shuffled once with a fixed seed: shards mix classes, and a second preparation writes
    the same shards."""
    write_raw(tmp_path / "raw", "folders")
    for out in ("a", "b"):
        prepare("imagenet", tmp_path / "raw", tmp_path / out, workers=1)
    orders = [[name for name, _ in read_shards(tmp_path / out, "train") if name.endswith(".cls")] for out in "ab"]
    assert orders[0] == orders[1]
    train_shards = read_info(tmp_path / "a")["splits"]["train"]["shards"]
    labels_per_shard = []
    for shard in train_shards:
        with tarfile.open(tmp_path / "a" / shard["name"]) as tar:
            labels_per_shard.append({tar.extractfile(m).read() for m in tar.getmembers() if m.name.endswith(".cls")})
    assert sum(len(labels) > 1 for labels in labels_per_shard) >= 2  # class-sorted shards would hold one each
