"""The shard reader: the fast tar reader against Python's tarfile and webdataset's own reader."""

import hashlib
import io
import os
import pickle
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
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


def test_keys_split_at_the_last_slash_and_the_first_dot_after_it(tmp_path):
    """Keys in dotted folders, extensions with dots: grouped as webdataset groups them."""
    samples = [
        {"__key__": "d.v1/sub.x/k0", "seg.png": b"s0", "cls": b"0"},
        {"__key__": "d.v1/sub.x/k1", "seg.png": b"s1", "cls": b"1"},
        {"__key__": "e.v2/k0", "seg.png": b"s2", "cls": b"2"},
    ]
    write_shard(tmp_path / "s.tar", samples)
    url = str(tmp_path / "s.tar")
    strip = lambda s: {k: v for k, v in s.items() if k != "__local_path__"}  # noqa: E731
    want = [strip(s) for s in wds.WebDataset(url, shardshuffle=False)]
    got = list(TarSamples()([url]))
    assert got == want
    assert got == [{"__key__": s["__key__"], "__url__": url, "cls": s["cls"], "seg.png": s["seg.png"]} for s in samples]


def npy_bytes(array, version=None) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, array, version=version, allow_pickle=True)
    return buf.getvalue()


def test_npy_header_reads_both_header_versions_at_an_offset(tmp_path):
    """A version-1.0 and a version-2.0 ``.npy`` (4-byte header length) inside a file: dtype, shape and
    where the data starts, against the array's own bytes."""
    from mmlight.data.shards import MemberReader, npy_header

    array = np.arange(12, dtype="<i4").reshape(3, 4)
    v1, v2 = npy_bytes(array, (1, 0)), npy_bytes(array, (2, 0))
    assert v2[6:8] == b"\x02\x00"
    path = tmp_path / "f.bin"
    path.write_bytes(b"?" * 37 + v1 + v2)
    reader = MemberReader()
    for offset, member in ((37, v1), (37 + len(v1), v2)):
        dtype, shape, data_offset = npy_header(reader, str(path), offset, len(member))
        assert (dtype, shape) == (np.dtype("<i4"), (3, 4))
        assert data_offset == offset + len(member) - 48  # the 12 int32s end the member
        assert path.read_bytes()[data_offset : data_offset + 48] == array.tobytes()


@pytest.mark.parametrize("array", [np.asfortranarray(np.ones((2, 3))), np.array([1, "a"], dtype=object)])
def test_npy_header_refuses_an_array_that_is_not_plain_c_ordered(tmp_path, array):
    from mmlight.data.shards import MemberReader, npy_header

    path = tmp_path / "f.bin"
    member = npy_bytes(array)
    path.write_bytes(b"\0" * 10 + member)
    with pytest.raises(ValueError) as err:
        npy_header(MemberReader(), str(path), 10, len(member))
    assert str(err.value) == f"{path}: .npy member at 10 is not a plain C-ordered array"


@pytest.mark.parametrize("missing", [1, 200])
def test_npy_header_refuses_a_member_shorter_than_its_header_says(tmp_path, missing):
    """100 float32s: a member short of 1 or 200 of its 400 data bytes."""
    from mmlight.data.shards import MemberReader, npy_header

    path = tmp_path / "f.bin"
    member = npy_bytes(np.zeros(100, dtype=np.float32))
    path.write_bytes(b"\0" * 5 + member)
    with pytest.raises(ValueError) as err:
        npy_header(MemberReader(), str(path), 5, len(member) - missing)
    assert str(err.value) == f"{path}: .npy member at 5 is shorter than its header says"


def test_sha256_of_a_file_over_several_blocks(tmp_path):
    from mmlight.data.shards import sha256

    data = np.random.default_rng(0).integers(0, 256, 3 * (1 << 20) + 5, dtype=np.uint8).tobytes()
    (tmp_path / "f").write_bytes(data)
    assert sha256(tmp_path / "f") == hashlib.sha256(data).hexdigest()
    (tmp_path / "empty").write_bytes(b"")
    assert sha256(tmp_path / "empty") == hashlib.sha256(b"").hexdigest()


def test_split_urls_names_an_unknown_split_and_the_first_missing_shards(tmp_path):
    from mmlight.data.shards import split_urls

    names = [f"train-{i:06d}.tar" for i in range(5)]
    (tmp_path / names[2]).write_bytes(b"")
    info = {"splits": {"val": {"shards": []}, "train": {"shards": [{"name": n} for n in names]}}}
    with pytest.raises(KeyError) as err:
        split_urls(tmp_path, info, "test")
    assert err.value.args == (f"shard set {tmp_path} has no split 'test'; it has ['train', 'val']",)
    with pytest.raises(FileNotFoundError) as err:
        split_urls(tmp_path, info, "train")
    missing = [str(tmp_path / names[i]) for i in (0, 1, 3)]  # the first three of the four
    assert str(err.value) == f"shard set {tmp_path} lists shards that are missing: {missing}"
    for name in names:
        (tmp_path / name).write_bytes(b"")
    assert split_urls(tmp_path, info, "train") == [str(tmp_path / n) for n in names]


def test_tar_index_reads_the_headers_and_seeks_over_the_data(tmp_path, monkeypatch):
    """Every read the index makes, counted: two member headers and the first end block, no data."""
    from mmlight.data import shards

    path = tmp_path / "s.tar"
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:  # no pax headers: one header a member
        for name, data in (("a.bin", b"x" * 100_000), ("b.bin", b"y" * 50_000)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    reads = []
    real_open = open

    class Counted:
        def __init__(self, f):
            self.f = f

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def read(self, n=-1):
            data = self.f.read(n)
            reads.append(len(data))
            return data

    monkeypatch.setattr(shards, "open", lambda *args, **kwargs: Counted(real_open(*args, **kwargs)), raising=False)
    with tarfile.open(path) as tar:
        want = [(m.name, m.offset_data, m.size) for m in tar.getmembers()]
    assert list(shards.tar_index(path)) == want
    assert reads == [512, 512, 512]


def test_upgrade_info_of_an_iwslt_file_without_a_specials_list():
    """Some version-1 IWSLT files have no ``specials`` list (only the ``*_id`` keys): upgraded all the same."""
    from mmlight.data.shards import upgrade_info

    v1 = {
        "dataset": "iwslt14",
        "src_lang": "de",
        "tgt_lang": "en",
        "bpe_file": "code",
        "bpe_merges": 10,
        "dict_file": "dict.txt",
        "vocab_size": 9,
        "bos_id": 0,
        "pad_id": 1,
        "eos_id": 2,
        "unk_id": 3,
    }
    assert upgrade_info(v1, "root") == {
        "version": 2,
        "dataset": "iwslt14",
        "vocab": {
            "file": "dict.txt",
            "format": "dict",
            "size": 9,
            "special_ids": {"bos": 0, "pad": 1, "eos": 2, "unk": 3},
            "tokenizer": {"moses": True, "src_lang": "de", "tgt_lang": "en", "bpe_file": "code", "bpe_merges": 10},
        },
    }


def test_write_info_writes_json_indented_by_two(tmp_path):
    from mmlight.data.shards import write_info

    assert write_info(tmp_path, {"classes": ["a"]}) == {"version": 2, "classes": ["a"]}
    assert (tmp_path / "_info.json").read_bytes() == b'{\n  "version": 2,\n  "classes": [\n    "a"\n  ]\n}'


def test_write_text_atomic_writes_utf8_whatever_the_locale(tmp_path):
    """In a process whose locale encoding is ASCII (C locale, no UTF-8 mode), non-ASCII text is written as
    UTF-8, its newlines as given. The module is loaded from its file alone (not the package: fast)."""
    from mmlight.data import shards

    code = (
        "import importlib.util, pathlib, sys; "
        "spec = importlib.util.spec_from_file_location('shards', sys.argv[1]); "
        "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module); "
        "module.write_text_atomic(pathlib.Path(sys.argv[2]), '\\xe9\\r\\n\\xfc\\n')"  # ASCII source: é, ü
    )
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}
    subprocess.run([sys.executable, "-c", code, shards.__file__, str(tmp_path / "t.txt")], env=env, check=True)
    assert (tmp_path / "t.txt").read_bytes() == "\xe9\r\n\xfc\n".encode()
    assert not (tmp_path / "t.txt.tmp").exists()


def test_member_reader_keeps_the_last_eight_files_open(tmp_path):
    """The default reader keeps 8 files open, dropping the least recently used: after reading 9 files and
    deleting them all, the first one is gone and the other 8 still read (from their open handles)."""
    from mmlight.data.shards import MemberReader

    paths = [tmp_path / f"{i}.bin" for i in range(9)]
    for i, path in enumerate(paths):
        path.write_bytes(bytes([i]) * 10 + b"tail")
    reader = MemberReader()
    assert [reader.read(str(p), 8, 3) for p in paths] == [bytes([i, i]) + b"t" for i in range(9)]
    for path in paths:
        path.unlink()
    with pytest.raises(FileNotFoundError):
        reader.read(str(paths[0]), 0, 1)
    assert [reader.read(str(p), 10, 4) for p in paths[1:]] == [b"tail"] * 8


def test_member_reader_drops_the_least_recently_used_file(tmp_path):
    from mmlight.data.shards import MemberReader

    a, b, c = (str(tmp_path / n) for n in "abc")
    for n in (a, b, c):
        Path(n).write_bytes(n.encode())
    reader = MemberReader(max_open=2)
    for n in (a, b, a, c):  # a read again after b: b is the least recently used when c comes
        assert reader.read(n, 0, len(n)) == n.encode()
    for n in (a, b, c):
        Path(n).unlink()
    assert reader.read(a, 0, 3) == a.encode()[:3] and reader.read(c, 0, 3) == c.encode()[:3]
    with pytest.raises(FileNotFoundError):
        reader.read(b, 0, 1)


def test_member_reader_names_a_short_read(tmp_path):
    from mmlight.data.shards import MemberReader

    (tmp_path / "f").write_bytes(b"x" * 10)
    with pytest.raises(EOFError) as err:
        MemberReader().read(str(tmp_path / "f"), 6, 8)
    assert str(err.value) == f"{tmp_path / 'f'}: 4 of 8 bytes at offset 6"


def test_a_pickled_member_reader_keeps_its_limit_and_no_open_file(tmp_path):
    """Sent to a worker process: the limit travels, the open files stay behind."""
    from mmlight.data.shards import MemberReader

    (tmp_path / "f").write_bytes(b"0123456789")
    reader = MemberReader(max_open=3)
    assert reader.read(str(tmp_path / "f"), 2, 3) == b"234"
    copy = pickle.loads(pickle.dumps(reader))
    assert vars(copy) == {"max_open": 3, "_files": {}}
    assert copy.read(str(tmp_path / "f"), 7, 3) == b"789"
