"""The shard reader: the fast tar reader against Python's tarfile and webdataset's own reader."""

import io
import tarfile

import pytest
import webdataset as wds

from mmlight.data.shards import TarSamples, iter_tar
from mmlight.data.skips import SkipCounter


def write_shard(path, samples):
    with wds.TarWriter(str(path)) as writer:
        for sample in samples:
            writer.write(sample)


SAMPLES = [
    {"__key__": "a0", "jpg": b"x" * 700, "cls": "3"},
    {"__key__": "dir/b1", "jpg": b"", "cls": "1"},  # an empty member and a key with a folder
    {"__key__": "c" * 150, "txt": b"long key: a GNU long name", "cls": "7"},
]


def test_iter_tar_matches_tarfile(tmp_path):
    write_shard(tmp_path / "s.tar", SAMPLES)
    with tarfile.open(tmp_path / "s.tar") as tar:
        want = [(m.name, tar.extractfile(m).read()) for m in tar.getmembers() if m.isreg()]
    assert list(iter_tar(tmp_path / "s.tar")) == want


def test_tar_samples_match_webdataset(tmp_path):
    write_shard(tmp_path / "s.tar", SAMPLES)
    strip = lambda s: {k: v for k, v in s.items() if k != "__local_path__"}  # noqa: E731
    want = [strip(s) for s in wds.WebDataset(str(tmp_path / "s.tar"), shardshuffle=False)]
    got = list(TarSamples()([str(tmp_path / "s.tar")]))
    assert got == want and len(got) == 3


def test_truncated_shard_is_counted_and_the_stream_goes_on(tmp_path, caplog):
    write_shard(tmp_path / "good.tar", SAMPLES[:1])
    write_shard(tmp_path / "bad.tar", SAMPLES)
    data = (tmp_path / "bad.tar").read_bytes()
    (tmp_path / "bad.tar").write_bytes(data[:1100])  # cut inside the second member
    counter = SkipCounter()
    got = list(TarSamples(counter)([{"url": str(tmp_path / "bad.tar")}, str(tmp_path / "good.tar")]))
    # the bad shard's first sample is incomplete (its jpg was cut), so only the good shard's remains
    assert [s["__key__"] for s in got] == ["a0"] and counter.value == 1
    assert "bad.tar" in caplog.text
    with pytest.raises(EOFError, match="truncated"):
        list(iter_tar(tmp_path / "bad.tar"))


def odd_items_are_bad(item: int):
    """A make_sample for write_shards (module level, so worker processes can pickle it)."""
    from mmlight.data.shard_writer import Skipped

    if item % 2:
        return Skipped(f"raw/{item}.jpg", "not an image")
    return {"__key__": f"{item:03d}", "cls": str(item)}


@pytest.mark.parametrize("workers", [1, 2])
def test_the_writer_records_every_skip_even_one_that_opens_a_shard(tmp_path, workers):
    """Items 1..5, two per shard, the odd ones bad: every shard opens with a skip and the last holds
    nothing else. Counts, the skips in order, and each shard's members, read back with tarfile."""
    from mmlight.data.shard_writer import plan_shards, write_shards

    entry = write_shards(plan_shards("train", [1, 2, 3, 4, 5], 2), tmp_path, odd_items_are_bad, workers=workers)
    assert (entry["num_samples"], entry["num_skipped"]) == (2, 3)
    assert entry["skipped"] == [{"path": f"raw/{i}.jpg", "reason": "not an image"} for i in (1, 3, 5)]
    assert [(s["name"], s["num_samples"]) for s in entry["shards"]] == [
        ("train-000000.tar", 1),
        ("train-000001.tar", 1),
        ("train-000002.tar", 0),
    ]
    contents = []
    for shard in entry["shards"]:
        with tarfile.open(tmp_path / shard["name"]) as tar:
            contents.append([(m.name, tar.extractfile(m).read()) for m in tar.getmembers()])
    assert contents == [[("002.cls", b"2")], [("004.cls", b"4")], []]


@pytest.mark.parametrize("fmt", ["webdataset (pax)", "GNU"])
def test_the_header_index_gives_each_members_name_offset_and_size(tmp_path, fmt):
    """tar_index reads headers only (GNU long-name and pax records included): the names tarfile reads,
    and each (offset, size) holds exactly the member's bytes."""
    from mmlight.data.shards import tar_index

    path = tmp_path / "s.tar"
    if fmt == "GNU":
        with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
            for name, data in (("a0.cls", b"3"), ("c" * 150 + ".tX", b"long name"), ("d1.jpg", b"y" * 600)):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    else:
        write_shard(path, SAMPLES)
    with tarfile.open(path) as tar:
        want = [(m.name, tar.extractfile(m).read()) for m in tar.getmembers() if m.isreg()]
    data = path.read_bytes()
    index = list(tar_index(path))
    assert [(name, data[offset : offset + size]) for name, offset, size in index] == want
    assert any(len(name) > 100 for name, _, _ in index)  # the long name came from its record


def test_a_tar_without_end_blocks_ending_with_a_whole_member_is_read(tmp_path):
    """Data that ends exactly at the end of the file (512 bytes, no padding, no end-of-archive blocks):
    not truncated, so both readers give every member."""
    from mmlight.data.shards import tar_index

    write_shard(tmp_path / "s.tar", [{"__key__": "a", "bin": b"x" * 512}])
    with tarfile.open(tmp_path / "s.tar") as tar:
        end = tar.getmember("a.bin").offset_data + 512
    (tmp_path / "cut.tar").write_bytes((tmp_path / "s.tar").read_bytes()[:end])
    assert list(iter_tar(tmp_path / "cut.tar")) == [("a.bin", b"x" * 512)]
    assert [(name, size) for name, _, size in tar_index(tmp_path / "cut.tar")] == [("a.bin", 512)]


def test_upgrade_info_turns_each_version_1_layout_into_the_current_one_and_refuses_newer():
    """Version-1 ``_info.json`` files (no ``version``; WikiText's ``vocab_file``/``special_ids``, IWSLT's
    ``dict_file`` and flat ``*_id`` keys), written out by hand, against the version-2 content by hand."""
    from mmlight.data.shards import INFO_VERSION, upgrade_info

    assert INFO_VERSION == 2
    splits = {"train": {"num_samples": 3, "shards": []}}
    wikitext_v1 = {
        "dataset": "wikitext103",
        "splits": splits,
        "vocab_file": "vocab.txt",
        "vocab_size": 40,
        "special_ids": {"pad": 0, "eos": 1},
    }
    assert upgrade_info(dict(wikitext_v1), "root") == {
        "version": 2,
        "dataset": "wikitext103",
        "splits": splits,
        "vocab": {
            "file": "vocab.txt",
            "format": "lines",
            "size": 40,
            "special_ids": {"pad": 0, "eos": 1},
            "tokenizer": {"moses": False},
        },
    }
    iwslt_v1 = {
        "dataset": "iwslt14",
        "splits": splits,
        "src_lang": "de",
        "tgt_lang": "en",
        "bpe_file": "code",
        "bpe_merges": 10000,
        "dict_file": "dict.txt",
        "vocab_size": 99,
        "specials": ["<s>", "<pad>", "</s>", "<unk>"],
        "bos_id": 0,
        "pad_id": 1,
        "eos_id": 2,
        "unk_id": 3,
    }
    assert upgrade_info(dict(iwslt_v1), "root") == {
        "version": 2,
        "dataset": "iwslt14",
        "splits": splits,
        "vocab": {
            "file": "dict.txt",
            "format": "dict",
            "size": 99,
            "special_ids": {"bos": 0, "pad": 1, "eos": 2, "unk": 3},
            "tokenizer": {"moses": True, "src_lang": "de", "tgt_lang": "en", "bpe_file": "code", "bpe_merges": 10000},
        },
    }
    images_v1 = {"dataset": "digits", "splits": splits}  # nothing to move: only the version is added
    assert upgrade_info(dict(images_v1), "root") == {"version": 2, **images_v1}
    assert upgrade_info({"version": 1, **images_v1}, "root") == {"version": 2, **images_v1}
    current = {"version": 2, "dataset": "x", "vocab_file": "kept as is"}
    assert upgrade_info(current, "root") is current
    for version in (3, "2", 2.0):
        with pytest.raises(ValueError) as err:
            upgrade_info({"version": version}, "root")
        assert str(err.value) == (
            f"root/_info.json has schema version {version!r}; this mmlight reads up to 2: update mmlight"
        )
