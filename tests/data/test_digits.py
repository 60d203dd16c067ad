"""The digits shard set: written once, streamed through the same path as ImageNet."""

import io
import json
import logging
import threading

import numpy as np
import pytest
import torch
import webdataset as wds
from sklearn.datasets import load_digits

from mmlight.data import DigitsDataModule, read_info, write_digits_shards
from mmlight.data.shards import preparing, sha256


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    out = tmp_path_factory.mktemp("digits")
    write_digits_shards(out, val_fraction=0.2, seed=0)
    return out


def test_info_counts_and_checksums(shards):
    info = read_info(shards)
    assert info["classes"] == [str(i) for i in range(10)]
    assert info["splits"]["train"]["num_samples"] == 1438 and info["splits"]["val"]["num_samples"] == 359
    for split in info["splits"].values():
        assert sum(s["num_samples"] for s in split["shards"]) == split["num_samples"]
        for s in split["shards"]:
            assert sha256(shards / s["name"]) == s["sha256"]


def test_shards_hold_the_real_images(shards):
    digits = load_digits()
    seen = {}
    for sample in wds.WebDataset(str(shards / "val-000000.tar"), shardshuffle=False).decode("l8"):
        seen[int(sample["__key__"][5:])] = (sample["png"], int(sample["cls"]))
    for i, (image, label) in list(seen.items())[:20]:
        assert label == digits.target[i]
        np.testing.assert_array_equal(image, np.clip(digits.images[i] * 16, 0, 255).astype(np.uint8))


def test_stream_a_batch_and_a_full_validation_pass(shards):
    dm = DigitsDataModule(cache_dir=str(shards), batch_size=16, num_workers=0)
    dm.prepare_data()  # already there: nothing rewritten
    images, labels = next(iter(dm.train_dataloader()))
    assert images.shape == (16, 1, 8, 8) and images.dtype == torch.float32
    assert labels.shape == (16,) and labels.dtype == torch.int64 and labels.max() < 10
    assert len(dm.train_dataloader()) == 1438 // 16
    val = list(dm.val_dataloader())
    assert sum(len(y) for _, y in val) == 359  # every validation sample exactly once


def test_missing_shard_set_names_the_file(tmp_path):
    dm = DigitsDataModule(cache_dir=str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="_info.json"):
        dm.train_dataloader()


def test_prepare_writes_once(tmp_path):
    dm = DigitsDataModule(cache_dir=str(tmp_path))
    dm.prepare_data()
    stamp = (tmp_path / "_info.json").stat().st_mtime_ns
    dm.prepare_data()
    assert (tmp_path / "_info.json").stat().st_mtime_ns == stamp
    assert json.loads((tmp_path / "_info.json").read_text())["dataset"] == "sklearn-digits"


def test_a_run_waits_while_another_prepares_the_same_folder(tmp_path, shards):
    """While another process holds the cache folder's lock, ``prepare_data`` writes nothing; after, it
    writes the same shard set as an unshared preparation."""
    folder = tmp_path / "shared"
    with preparing(folder):
        waiting = threading.Thread(target=DigitsDataModule(cache_dir=str(folder)).prepare_data)
        waiting.start()
        waiting.join(timeout=1.0)
        assert waiting.is_alive() and not folder.exists()
    waiting.join(timeout=120)
    assert not waiting.is_alive()
    assert read_info(folder)["splits"] == read_info(shards)["splits"]


def test_cache_written_with_another_split_is_refused(tmp_path):
    DigitsDataModule(cache_dir=str(tmp_path)).prepare_data()
    with pytest.raises(ValueError, match="val_fraction=0.2, seed=0, not 0.3, 0"):
        DigitsDataModule(cache_dir=str(tmp_path), val_fraction=0.3).prepare_data()


def test_prepare_digits_command_writes_the_same_shard_set(tmp_path, shards, capsys):
    from mmlight.cli import main

    main(["prepare", "digits", "--out", str(tmp_path / "digits"), "--workers", "1"])
    assert "val 359 samples (0 skipped), train 1438 samples (0 skipped)" in capsys.readouterr().out
    assert read_info(tmp_path / "digits")["splits"] == read_info(shards)["splits"]  # byte-identical shards


def test_a_subset_of_digits_is_relabelled_in_list_order(tmp_path):
    """digits=[7, 2]: only sevens and twos, labelled 0 and 1, split as in the full set."""
    from sklearn.datasets import load_digits

    full = write_digits_shards(tmp_path / "all")
    info = write_digits_shards(tmp_path / "sub", digits=[7, 2])
    target = load_digits().target
    assert info["classes"] == ["7", "2"] and info["digits"] == [7, 2]
    for split in ("train", "val"):
        assert info["splits"][split]["num_samples"] == sum(
            1 for key in split_keys(tmp_path / "all", split) if target[int(key[5:])] in (7, 2)
        )
        for key, label in split_labels(tmp_path / "sub", split).items():
            assert [7, 2][label] == target[int(key[5:])]
    assert full["splits"]["train"]["num_samples"] + full["splits"]["val"]["num_samples"] == len(target)
    dm = DigitsDataModule(cache_dir=str(tmp_path / "sub"), digits=[7, 2])
    assert dm.num_classes == 2
    dm.prepare_data()
    with pytest.raises(ValueError, match=r"of digits \[7, 2\], not \[2, 7\]"):
        DigitsDataModule(cache_dir=str(tmp_path / "sub"), digits=[2, 7]).prepare_data()
    with pytest.raises(ValueError, match="digits must be distinct values in 0..9"):
        DigitsDataModule(cache_dir=str(tmp_path / "bad"), digits=[3, 3])


def split_labels(root, split):
    from tests.helpers.shard_contents import split_samples

    return {key: int(sample["cls"]) for key, sample in split_samples(root, split).items()}


def split_keys(root, split):
    return list(split_labels(root, split))


def test_prepare_refuses_an_unknown_dataset_and_a_missing_or_non_folder_src(tmp_path, capsys):
    """``prepare``'s checks before any work, and the command's exit 2 with the message (digits alone needs no
    ``--src``)."""
    from mmlight.commands.prepare import main
    from mmlight.data.prepare import DATASETS, prepare

    with pytest.raises(ValueError) as err:
        prepare("mnist", tmp_path, tmp_path / "out")
    assert str(err.value) == f"unknown dataset 'mnist'; choose one of {sorted(DATASETS)}"
    with pytest.raises(ValueError) as err:
        prepare("wikitext103", None, tmp_path / "out")
    assert str(err.value) == "wikitext103 needs --src (the raw data folder)"
    (tmp_path / "a_file").write_text("x")
    for src in (tmp_path / "missing", tmp_path / "a_file"):
        with pytest.raises(FileNotFoundError) as err:
            prepare("food101", src, tmp_path / "out")
        assert str(err.value) == f"--src {src} is not a folder"
        with pytest.raises(FileNotFoundError):
            prepare("digits", src, tmp_path / "out")  # a --src given to digits is still checked
    assert not (tmp_path / "out").exists()
    with pytest.raises(SystemExit) as exit_info:
        main(["iwslt14", "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == "mmlight prepare: error: iwslt14 needs --src (the raw data folder)\n"


def test_prepare_passes_the_paths_workers_and_options_on_to_the_datasets_module(tmp_path, monkeypatch):
    """A list of sources (``text``), one folder (``food101``) and none (``python-docs``): each module's
    ``prepare`` gets the paths as ``Path``, the worker count and the module's own options."""
    from mmlight.data.prepare import dataset_module, prepare

    calls = []

    def recorder(name):
        return lambda *args, **options: calls.append((name, args, options))

    for name in ("text", "food101", "python-docs"):
        monkeypatch.setattr(dataset_module(name), "prepare", recorder(name))
    prepare("text", [str(tmp_path / "a.txt"), tmp_path / "b"], str(tmp_path / "out"), 3, vocab_size=300)
    prepare("food101", str(tmp_path), tmp_path / "out", 2, size=64)
    prepare("python-docs", None, tmp_path / "out", 4, valid_fraction=0.1)
    assert calls == [
        ("text", ([tmp_path / "a.txt", tmp_path / "b"], tmp_path / "out", 3), {"vocab_size": 300}),
        ("food101", (tmp_path, tmp_path / "out", 2), {"size": 64}),
        ("python-docs", (None, tmp_path / "out", 4), {"valid_fraction": 0.1}),
    ]


def test_prepare_command_line_options(tmp_path, capsys, monkeypatch):
    """``mmlight prepare --help`` names every dataset and option; ``--workers`` defaults to the cores, at most 8;
    ``--out`` is required."""
    import os

    from mmlight.commands import prepare as prepare_module

    with pytest.raises(SystemExit) as exit_info:
        prepare_module.main(["--help"])
    assert exit_info.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert help_text.startswith("usage: mmlight prepare [-h] [--src SRC] --out OUT [--workers WORKERS]")
    datasets = "cifar10,cifar100,digits,flowers102,food101,imagefolder,imagenet,iwslt14,python-docs,text,wikitext103"
    assert "{" + datasets + "}" in help_text
    assert "raw datasets to webdataset shards" in help_text
    assert (
        "--src SRC raw data folder (not needed for digits) --out OUT shard set folder to write (or verify) "
        "--workers WORKERS writer processes"
    ) in help_text
    with pytest.raises(SystemExit):
        prepare_module.main(["digits"])
    assert "the following arguments are required: --out" in capsys.readouterr().err
    seen = []
    splits = {"train": {"num_samples": 5}, "val": {"num_samples": 2, "num_skipped": 1}}  # no count: none skipped
    monkeypatch.setattr(prepare_module, "prepare", lambda *args: seen.append(args) or {"splits": splits})
    for cores, workers in ((2, 2), (32, 8), (None, 1)):
        monkeypatch.setattr(os, "cpu_count", lambda cores=cores: cores)
        prepare_module.main(["digits", "--out", str(tmp_path)])
        assert seen[-1] == ("digits", None, str(tmp_path), workers)
    prepare_module.main(["food101", "--src", "raw", "--out", "shards", "--workers", "3"])
    assert seen[-1] == ("food101", "raw", "shards", 3)
    assert capsys.readouterr().out.splitlines()[-1] == (
        "food101 shards in shards: train 5 samples (0 skipped), val 2 samples (1 skipped)"
    )


def test_prepare_command_logs_info_lines_with_level_and_logger(tmp_path, capsys, monkeypatch):
    """Without logging set up (a plain ``mmlight prepare`` process), the command shows INFO records on stderr as
    ``LEVEL logger: message``."""
    import logging

    from mmlight.commands import prepare as prepare_module

    monkeypatch.setattr(logging.root, "handlers", [])  # as in a fresh process (pytest installs its own)
    monkeypatch.setattr(logging.root, "level", logging.WARNING)

    def prepare(*args):
        logging.getLogger("mmlight.data.prepare.toy").info("wrote %d shards", 3)
        return {"splits": {}}

    monkeypatch.setattr(prepare_module, "prepare", prepare)
    prepare_module.main(["digits", "--out", str(tmp_path)])
    assert capsys.readouterr().err == "INFO mmlight.data.prepare.toy: wrote 3 shards\n"


def test_written_samples_are_greyscale_pngs_of_the_digits_in_shards_of_300(tmp_path, caplog):
    """Written here (not by the module fixture): each sample holds a ``png`` (PNG, mode L, the digit's 0..16
    values times 16, 16 giving 255 after the clip) and its ``cls``; shards hold 300 samples but the last;
    each split's summary line is labelled with it."""
    from PIL import Image

    from tests.helpers.shard_contents import split_samples

    with caplog.at_level(logging.INFO, logger="mmlight.data.shard_writer"):
        info = write_digits_shards(tmp_path)
    summaries = [r.getMessage() for r in caplog.records if "shards written" in r.getMessage()]
    assert [m.split(":")[0] for m in summaries] == ["digits val", "digits train"]
    digits = load_digits()
    assert (digits.images == 16).any()  # the clip is reached
    for split in ("train", "val"):
        counts = [s["num_samples"] for s in info["splits"][split]["shards"]]
        assert all(n == 300 for n in counts[:-1]) and 0 < counts[-1] <= 300
        for key, sample in list(split_samples(tmp_path, split).items())[:40]:
            assert set(sample) >= {"png", "cls"} and not set(sample) - {"png", "cls", "__key__", "__url__"}
            image = Image.open(io.BytesIO(sample["png"]))
            assert (image.format, image.mode) == ("PNG", "L")
            i = int(key[5:])
            expected = np.minimum(digits.images[i] * 16, 255).astype(np.uint8)
            np.testing.assert_array_equal(np.asarray(image), expected)
            assert int(sample["cls"]) == digits.target[i]


def test_digits_outside_0_to_9_or_none_are_refused(tmp_path):
    for digits in ([10], [], [9, 10], [-1]):
        with pytest.raises(ValueError, match=r"^digits must be distinct values in 0\.\.9, got "):
            DigitsDataModule(cache_dir=str(tmp_path), digits=digits)


def test_defaults_of_the_quick_start():
    import os

    dm = DigitsDataModule()
    assert dm.root == os.path.expanduser("~/.cache/mmlight/digits")
    assert (dm.batch_size, dm.num_workers, dm.shuffle_buffer, dm.normalize_on_device) == (64, 0, 2000, False)
    assert dm.digits == list(range(10)) and (dm.val_fraction, dm.seed) == (0.2, 0)


def test_prepare_writes_the_split_and_digits_asked(tmp_path):
    DigitsDataModule(cache_dir=str(tmp_path), seed=3, val_fraction=0.25, digits=[4, 1]).prepare_data()
    info = read_info(tmp_path)
    assert (info["seed"], info["val_fraction"], info["digits"], info["classes"]) == (3, 0.25, [4, 1], ["4", "1"])
    assert info["splits"]["val"]["num_samples"] == sum(
        1 for i in np.random.default_rng(3).permutation(1797)[:449] if load_digits().target[i] in (4, 1)
    )


def test_a_cache_written_before_digits_were_recorded_holds_all_ten(tmp_path):
    """An ``_info.json`` without ``digits`` (written before subsets existed) is all ten digits: accepted for
    all ten, refused for a subset, with the full message."""
    DigitsDataModule(cache_dir=str(tmp_path)).prepare_data()
    info = json.loads((tmp_path / "_info.json").read_text())
    del info["digits"]
    (tmp_path / "_info.json").write_text(json.dumps(info))
    DigitsDataModule(cache_dir=str(tmp_path)).prepare_data()
    message = (
        f"{tmp_path} holds digits shards split with val_fraction=0.2, seed=0, not 0.2, 0, or of digits "
        f"{list(range(10))}, not [1, 2]: choose another cache_dir or delete that folder"
    )
    with pytest.raises(ValueError) as error:
        DigitsDataModule(cache_dir=str(tmp_path), digits=[1, 2]).prepare_data()
    assert str(error.value) == message
