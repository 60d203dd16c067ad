"""The shard reader: the fast tar reader against Python's tarfile and webdataset's own reader."""

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
    {"__key__": "c" * 150, "txt": "long key: a GNU long name".encode(), "cls": "7"},
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
