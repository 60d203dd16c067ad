"""The shard writer (mmlight.data.shard_writer): how plan_shards cuts a split, what write_shards logs
and shows on its progress bar, where make_sample runs (this process or the worker pool), and how a
rerun tells a finished shard from one that must be written again (also through ``mmlight prepare`` of each
preparer family). Shards are read back with tarfile."""

import hashlib
import json
import logging
import os
import re
import tarfile
from concurrent.futures import ProcessPoolExecutor

import pytest

from mmlight.data import shard_writer
from mmlight.data.prepare import prepare
from mmlight.data.shard_writer import ShardJob, Skipped, plan_shards, write_shards
from mmlight.data.toy_translation import write_toy_corpus

LOGGER = "mmlight.data.shard_writer"


def negative_items_are_bad(item: int):
    """A make_sample (module level, so worker processes can pickle it): negative items are skipped."""
    if item < 0:
        return Skipped(f"raw/{-item}.bin", "unreadable")
    return {"__key__": f"{item:03d}", "cls": str(item)}


def sample_with_pid(item: int):
    """A make_sample that records which process made the sample."""
    return {"__key__": f"{item:03d}", "pid": str(os.getpid())}


def members(path):
    """(name, bytes) of every regular member of a tar file."""
    with tarfile.open(path) as tar:
        return [(m.name, tar.extractfile(m).read()) for m in tar.getmembers() if m.isreg()]


def messages(caplog):
    return [(r.levelname, r.getMessage()) for r in caplog.records if r.name == LOGGER]


def test_plan_shards_cuts_consecutive_runs_even_of_one_item():
    jobs = plan_shards("val", ["a", "b", "c", "d", "e"], 2)
    assert [(j.name, j.items) for j in jobs] == [
        ("val-000000.tar", ["a", "b"]),
        ("val-000001.tar", ["c", "d"]),
        ("val-000002.tar", ["e"]),
    ]
    jobs = plan_shards("train", ["a", "b"], 1)  # one sample per shard is allowed
    assert [(j.name, j.items) for j in jobs] == [("train-000000.tar", ["a"]), ("train-000001.tar", ["b"])]


def test_plan_shards_rejects_fewer_than_one_item_per_shard():
    with pytest.raises(ValueError) as error:
        plan_shards("train", ["a"], 0)
    assert str(error.value) == "samples per shard must be >= 1, got 0"


def test_serial_run_logs_shards_written_then_verified_with_the_default_label(tmp_path, caplog):
    """Default workers and desc: the first run writes 3 shards, the rerun verifies and keeps all 3."""
    jobs = plan_shards("train", [1, -2, 3, 4, -5], 2)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        entry = write_shards(jobs, tmp_path, negative_items_are_bad)
    skips = [("WARNING", "skipped raw/2.bin: unreadable"), ("WARNING", "skipped raw/5.bin: unreadable")]
    assert messages(caplog) == [*skips, ("INFO", "shards: 3 shards written, 0 verified and kept, 2 items skipped")]
    assert (entry["num_samples"], entry["num_skipped"]) == (3, 2)

    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        again = write_shards(jobs, tmp_path, negative_items_are_bad)
    assert messages(caplog) == [*skips, ("INFO", "shards: 0 shards written, 3 verified and kept, 2 items skipped")]
    assert again == entry


def test_parallel_run_logs_shards_written_then_verified(tmp_path, caplog):
    jobs = plan_shards("train", [1, 2, 3, -4, 5, 6], 2)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        entry = write_shards(jobs, tmp_path, negative_items_are_bad, workers=2, desc="train")
    skip = ("WARNING", "skipped raw/4.bin: unreadable")
    assert messages(caplog) == [skip, ("INFO", "train: 3 shards written, 0 verified and kept, 1 items skipped")]
    assert entry["num_samples"] == 5

    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        write_shards(jobs, tmp_path, negative_items_are_bad, workers=2, desc="train")
    assert messages(caplog) == [skip, ("INFO", "train: 0 shards written, 3 verified and kept, 1 items skipped")]


def test_members_carry_a_fixed_zero_mtime(tmp_path):
    write_shards([ShardJob("s.tar", [1, 2])], tmp_path, negative_items_are_bad)
    with tarfile.open(tmp_path / "s.tar") as tar:
        stamps = [(m.name, m.mtime) for m in tar.getmembers()]
    assert stamps == [("001.cls", 0), ("002.cls", 0)]


def test_a_shard_whose_job_gained_items_is_written_again(tmp_path, caplog):
    """The file and its checksum still match the record, but the record counts 2 items, not 3."""
    write_shards([ShardJob("s.tar", [1, 2])], tmp_path, negative_items_are_bad)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        entry = write_shards([ShardJob("s.tar", [1, 2, 3])], tmp_path, negative_items_are_bad)
    assert messages(caplog) == [("INFO", "shards: 1 shards written, 0 verified and kept, 0 items skipped")]
    assert entry["num_samples"] == 3
    assert members(tmp_path / "s.tar") == [("001.cls", b"1"), ("002.cls", b"2"), ("003.cls", b"3")]


def test_a_shard_whose_items_changed_but_not_their_count_is_written_again(tmp_path, caplog):
    """Two items in, two items still, but other ones (re-prepared raw data): the shard, its size and its
    checksum still match the record, and only the record's digest of the items tells them apart."""
    write_shards([ShardJob("s.tar", [1, 2])], tmp_path, negative_items_are_bad)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        entry = write_shards([ShardJob("s.tar", [1, 3])], tmp_path, negative_items_are_bad)
    assert messages(caplog) == [
        ("INFO", f"shard {tmp_path / 's.tar'} was written from other items; writing it again"),
        ("INFO", "shards: 1 shards written, 0 verified and kept, 0 items skipped"),
    ]
    assert entry["num_samples"] == 2
    assert members(tmp_path / "s.tar") == [("001.cls", b"1"), ("003.cls", b"3")]
    record = json.loads((tmp_path / "s.tar.done.json").read_text())
    assert record["items_sha256"] == hashlib.sha256(b"[1, 3]").hexdigest()


def test_a_record_of_an_older_mmlight_without_the_items_digest_is_kept_by_its_count(tmp_path, caplog):
    """Shard sets prepared before the digest existed are verified as before (count, size, checksum),
    not all written again on the first rerun."""
    write_shards([ShardJob("s.tar", [1, 2])], tmp_path, negative_items_are_bad)
    record_path = tmp_path / "s.tar.done.json"
    record = json.loads(record_path.read_text())
    del record["items_sha256"]
    record_path.write_text(json.dumps(record))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        write_shards([ShardJob("s.tar", [1, 2])], tmp_path, negative_items_are_bad)
    assert messages(caplog) == [("INFO", "shards: 0 shards written, 1 verified and kept, 0 items skipped")]


def test_missing_parent_folders_are_created(tmp_path):
    out = tmp_path / "sets" / "digits"
    entry = write_shards([ShardJob("s.tar", [7])], out, negative_items_are_bad)
    assert entry["num_samples"] == 1
    assert members(out / "s.tar") == [("007.cls", b"7")]


def test_progress_bar_counts_shards_under_its_label(tmp_path, capsys):
    write_shards(plan_shards("val", [1, 2, 3], 1), tmp_path, negative_items_are_bad, desc="val")
    final = capsys.readouterr().err.split("\r")[-1]
    pattern = r"val: 100%\|[#█]{10}\| 3/3 \[\d\d:\d\d<\d\d:\d\d, (?:(?:[\d.]+|\?)shard/s|[\d.]+s/shard)\]\n"
    assert re.fullmatch(pattern, final), final


@pytest.mark.parametrize(
    "items, options",
    [([1, 2], {}), ([1, 2], {"workers": 1}), ([1], {"workers": 2})],
    ids=["default-workers", "one-worker", "one-shard"],
)
def test_make_sample_runs_in_this_process_with_one_worker_or_one_shard(tmp_path, items, options):
    """A closure (not picklable) that records its calls: it works, and sees every item, only when
    the shards are written in this process."""
    seen = []

    def make_sample(item):
        seen.append(item)
        return {"__key__": f"{item:03d}", "cls": str(item)}

    entry = write_shards(plan_shards("train", items, 1), tmp_path, make_sample, **options)
    assert seen == items
    assert entry["num_samples"] == len(items)


def test_two_workers_write_two_shards_in_a_pool_of_two(tmp_path, monkeypatch):
    sizes = []

    class RecordingPool(ProcessPoolExecutor):
        def __init__(self, max_workers=None, *args, **kwargs):
            sizes.append(max_workers)
            super().__init__(max_workers, *args, **kwargs)

    monkeypatch.setattr(shard_writer, "ProcessPoolExecutor", RecordingPool)
    entry = write_shards(plan_shards("train", [1, 2], 1), tmp_path, sample_with_pid, workers=2)
    assert sizes == [2]
    assert entry["num_samples"] == 2
    pids = {int(data) for shard in entry["shards"] for _, data in members(tmp_path / shard["name"])}
    assert pids and os.getpid() not in pids


def write_wikitext(src):
    """A small raw WikiText-103: the three token files, a few lines each."""
    src.mkdir(parents=True)
    for split, n in (("train", 30), ("valid", 6), ("test", 6)):
        lines = "".join(f" = Heading {i} = \n the game is fun , and {split} line {i} . \n" for i in range(n))
        (src / f"wiki.{split}.tokens").write_text(lines, encoding="utf-8")
    return src


@pytest.mark.parametrize(
    "dataset, write_raw",
    [
        ("digits", None),
        ("wikitext103", write_wikitext),
        ("iwslt14", lambda src: write_toy_corpus(src, train_size=40, valid_size=4, test_size=4)),
    ],
    ids=["images", "text", "translation"],
)
def test_a_finished_shard_changed_in_place_is_found_by_its_checksum_and_written_again(
    tmp_path, caplog, dataset, write_raw
):
    """One byte of a finished shard flipped (its size and record unchanged: a bad disk block): the rerun of
    ``mmlight prepare`` finds it by its SHA-256, says so naming it, writes it again byte for byte, and keeps
    every other shard as it is."""
    src = None if write_raw is None else str(write_raw(tmp_path / "raw"))
    out = tmp_path / "out"
    info = prepare(dataset, src, out)
    shard = out / info["splits"]["train"]["shards"][0]["name"]
    original = shard.read_bytes()
    damaged = bytearray(original)
    damaged[len(damaged) // 2] ^= 0xFF
    shard.write_bytes(bytes(damaged))
    record = json.loads((out / (shard.name + shard_writer.DONE_SUFFIX)).read_text())
    assert record["bytes"] == shard.stat().st_size and record["num_items"] > 0  # the record says it is finished
    kept = {p.name: p.stat().st_mtime_ns for p in out.glob("*.tar") if p != shard}
    assert kept
    with caplog.at_level(logging.INFO, logger=LOGGER):
        again = prepare(dataset, src, out)
    assert ("WARNING", f"shard {shard} does not match its checksum; writing it again") in messages(caplog)
    assert shard.read_bytes() == original and again == info
    assert {name: (out / name).stat().st_mtime_ns for name in kept} == kept
