"""Shards malformed in each way a tar can be (truncated, a garbage header, a header with a bad
checksum, an empty member, an empty file), read by every path that reads shards: the tar reader,
the evaluation stage (``TarSamples``), the training stream's header index (``resampled_samples``)
and an image DataModule. Each is checked against the samples, labels, skip counts and reasons that
the damage must give."""

import io
import logging
import random
import tarfile

import numpy as np
import pytest
import torch
import webdataset as wds
from PIL import Image

from mmlight.data import ImageAugment, ImageShardDataModule
from mmlight.data.shards import TarSamples, iter_tar, tar_index, write_info
from mmlight.data.skips import SkipCounter
from mmlight.data.streaming import resampled_samples

SMALL = ImageAugment(image_size=8, channels=3, scale=(0.5, 1.0), color_jitter=None, crop_pct=1.0)
KEYS = [f"s{i}" for i in range(4)]
BROKEN = "s2"  # the sample whose member is damaged
MEMBERS_BEFORE = ["s0.cls", "s0.jpg", "s1.cls", "s1.jpg", "s2.cls"]  # webdataset writes a sample's files sorted


def jpeg(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (12, 10, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG")
    return buf.getvalue()


def write_shard(path, empty_key: str | None = None, labels=(0, 1, 2, 3)) -> None:
    with wds.TarWriter(str(path)) as writer:
        for i, key in enumerate(KEYS):
            writer.write({"__key__": key, "jpg": b"" if key == empty_key else jpeg(i), "cls": str(labels[i])})


def header_at(path, member: str) -> int:
    """Byte offset of ``member``'s own ustar header (after any pax header before it), from tarfile."""
    with tarfile.open(path) as tar:
        return tar.getmember(member).offset_data - 512


def damage(path, kind: str) -> None:
    """Damage the shard at ``path`` at ``s2.jpg`` in the way ``kind`` names."""
    data = bytearray(path.read_bytes())
    at = header_at(path, f"{BROKEN}.jpg")
    if kind == "truncated":  # cut inside the member's data
        del data[at + 512 + 100 :]
    elif kind == "garbage header":  # e.g. a disk block of something else
        data[at : at + 512] = np.random.default_rng(0).integers(0, 256, 512, dtype=np.uint8).tobytes()
    elif kind == "bad checksum":  # one flipped bit in the name: s2.jpg would read as s3.jpg
        assert data[at + 1] == ord("2")
        data[at + 1] ^= 0x01
    elif kind == "empty file":
        data = bytearray()
    else:
        raise AssertionError(kind)
    path.write_bytes(bytes(data))


ERRORS = {"truncated": EOFError, "garbage header": ValueError, "bad checksum": ValueError, "empty file": EOFError}
MESSAGES = {
    "truncated": "truncated member",
    "garbage header": "not a tar header",
    "bad checksum": "not a tar header",
    "empty file": "empty file",
}


@pytest.mark.parametrize("kind", list(ERRORS))
def test_the_reader_gives_the_members_before_the_damage_then_a_named_error(tmp_path, kind):
    path = tmp_path / "s.tar"
    write_shard(path)
    write_shard(tmp_path / "whole.tar")
    damage(path, kind)
    read = []
    with pytest.raises(ERRORS[kind], match=MESSAGES[kind]) as err:
        for name, _ in iter_tar(path):
            read.append(name)
    assert str(path) in str(err.value)
    if kind == "truncated":  # 100 bytes of s2.jpg's data are left
        assert f"truncated member (100 of {len(jpeg(2))} bytes)" in str(err.value)
    if ERRORS[kind] is ValueError:  # where the bad header starts
        assert f"at byte {header_at(tmp_path / 'whole.tar', 's2.jpg')} " in str(err.value)
    assert read == ([] if kind == "empty file" else MEMBERS_BEFORE)
    indexed = []
    with pytest.raises(ERRORS[kind], match=MESSAGES[kind]):
        for name, _, _ in tar_index(path):
            indexed.append(name)
    assert indexed == read


def test_a_header_written_with_a_signed_checksum_is_read(tmp_path):
    """Old tars summed the header's bytes as signed chars; a header with bytes over 127 (a UTF-8
    name; 0x80 is the first byte read as negative, 0x7f the last positive one) then holds another
    checksum, which tarfile accepts too, and so must the reader."""
    path = tmp_path / "s.tar"
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        info = tarfile.TarInfo("\x7fĀä0.cls")  # bytes 0x7f (counted positive) and 0x80 (negative)
        info.size = 1
        tar.addfile(info, io.BytesIO(b"5"))
    data = bytearray(path.read_bytes())
    header = data[:512]
    signed = 256 + sum(b - 256 if b > 127 else b for b in header[:148] + header[156:])
    assert signed != 256 + sum(header[:148]) + sum(header[156:])  # the name has bytes over 127
    data[148:156] = b"%06o\0 " % signed
    path.write_bytes(bytes(data))
    with tarfile.open(path) as tar:
        assert tar.getnames() == ["\x7fĀä0.cls"]  # the reference accepts it
    assert list(iter_tar(path)) == [("\x7fĀä0.cls", b"5")]


@pytest.mark.parametrize("kind", list(ERRORS))
def test_evaluation_keeps_the_whole_samples_before_the_damage_and_counts_the_shard_once(tmp_path, kind, caplog):
    bad, good = tmp_path / "bad.tar", tmp_path / "good.tar"
    write_shard(bad)
    write_shard(good, labels=(4, 5, 6, 7))
    damage(bad, kind)
    counter = SkipCounter()
    with caplog.at_level(logging.WARNING):
        samples = list(TarSamples(counter)([str(bad), {"url": str(good)}]))
    kept = [] if kind == "empty file" else ["s0", "s1"]  # s2 lost its jpg (or may have): dropped whole
    expected = [(str(bad), k) for k in kept] + [(str(good), k) for k in KEYS]
    assert [(s["__url__"], s["__key__"]) for s in samples] == expected
    assert [s["cls"] for s in samples] == [str(i).encode() for i in range(len(kept))] + [b"4", b"5", b"6", b"7"]
    assert counter.value == 1
    [record] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert str(bad) in record.getMessage() and ERRORS[kind].__name__ in record.getMessage()


class Draws(random.Random):
    """A generator whose ``randrange`` returns the scripted shard indices (then fails)."""

    def __init__(self, picks):
        super().__init__(0)
        self.picks = iter(picks)

    def randrange(self, *args):
        return next(self.picks)


@pytest.mark.parametrize("kind", list(ERRORS))
def test_the_training_index_drops_the_broken_sample_and_counts_each_draw_of_the_shard(tmp_path, kind, caplog):
    bad, good = tmp_path / "bad.tar", tmp_path / "good.tar"
    write_shard(bad)
    write_shard(good)
    damage(bad, kind)
    counter = SkipCounter()
    stream = resampled_samples([str(bad), str(good)], Draws([0, 1, 0]), counter)
    with caplog.at_level(logging.WARNING):
        refs = [next(stream) for _ in range(4 + (0 if kind == "empty file" else 4))]
    kept = [] if kind == "empty file" else ["s0", "s1"]
    expected = [(str(bad), k) for k in kept] + [(str(good), k) for k in KEYS] + [(str(bad), k) for k in kept]
    assert [(r["__url__"], r["__key__"]) for r in refs] == expected
    assert all(set(r) == {"__key__", "__url__", "cls", "jpg"} for r in refs)  # every kept sample is whole
    assert counter.value == (1 if kind == "empty file" else 2)  # the third draw was not reached
    assert all(str(bad) in r.getMessage() and ERRORS[kind].__name__ in r.getMessage() for r in caplog.records)


def test_a_training_stream_of_only_broken_shards_stops_naming_them(tmp_path):
    """An empty file, and a shard cut inside its first sample (whose ``cls`` alone was read: no whole
    sample), give no sample at all: a stream of just those stops with an error naming them."""
    empty, cut = tmp_path / "a.tar", tmp_path / "b.tar"
    for path in (empty, cut):
        write_shard(path)
    damage(empty, "empty file")
    cut.write_bytes(cut.read_bytes()[: header_at(cut, "s0.jpg") + 600])
    counter = SkipCounter()
    with pytest.raises(RuntimeError, match="no readable sample in any of the 2 training shards.*a.tar.*b.tar"):
        next(resampled_samples([str(empty), str(cut)], Draws([0, 1, 0]), counter))
    assert counter.value == 2


def test_ustar_headers_with_path_prefixes_and_six_digit_checksums_are_read(tmp_path):
    """Members whose 232-byte UTF-8 paths are split into ustar's prefix and name fields (the prefix,
    a folder, ending in X; the name too): their bytes sum past 0o77777, so the checksum field's first
    digit is not 0 (all of it is read), and each prefix is joined to its name, in the first member and
    the ones after it, although no long-name record came before. A directory entry and an old-style
    regular file (type flag NUL) in between: the directory is no sample, the file is one."""
    path = tmp_path / "s.tar"
    names = ["ÿ" * 76 + "X/" + "ÿ" * 38 + ".clsX", "ÿ" * 76 + "X/" + "ÿ" * 38 + ".txtX"]
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data, kind in (
            (names[0], b"7", tarfile.REGTYPE),
            ("folder", b"", tarfile.DIRTYPE),
            ("old.cls", b"8", tarfile.AREGTYPE),
            (names[1], b"9", tarfile.REGTYPE),
        ):
            info = tarfile.TarInfo(name)
            info.size, info.type, info.uname, info.gname = len(data), kind, "ÿ" * 16, "ÿ" * 16
            tar.addfile(info, io.BytesIO(data))
    header = path.read_bytes()[:512]
    assert header[345:500].rstrip(b"\0") and header[148:149] != b"0"  # a prefix, a six-digit sum
    assert list(iter_tar(path)) == [(names[0], b"7"), ("old.cls", b"8"), (names[1], b"9")]


def test_an_empty_size_field_is_a_member_of_no_bytes(tmp_path):
    """tarfile reads a size field of NULs as 0 (``nti`` of an empty field); so must the reader."""
    path = tmp_path / "s.tar"
    write_shard(path, empty_key="s0")
    data = bytearray(path.read_bytes())
    at = header_at(path, "s0.jpg")
    data[at + 124 : at + 136] = b"\0" * 12
    data[at + 148 : at + 156] = b"%06o\0 " % (256 + sum(data[at : at + 148]) + sum(data[at + 156 : at + 512]))
    path.write_bytes(bytes(data))
    with tarfile.open(path) as tar:
        assert tar.getmember("s0.jpg").size == 0  # the reference
    assert [(name, value) for name, value in iter_tar(path)][:2] == [("s0.cls", b"0"), ("s0.jpg", b"")]


def test_a_checksum_field_that_is_not_octal_is_named_as_such(tmp_path):
    path = tmp_path / "s.tar"
    write_shard(path)
    data = bytearray(path.read_bytes())
    data[148:156] = b"0008888\0"[:8]
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"not a tar header at byte 0 \(checksum field b'0008888\\x00'"):
        list(iter_tar(path))


def image_shard_set(root, kind: str):
    """Two validation shards: ``val-000000.tar`` damaged as ``kind`` (or with an empty ``s2.jpg``),
    ``val-000001.tar`` whole with labels 4..7."""
    root.mkdir()
    bad, good = root / "val-000000.tar", root / "val-000001.tar"
    write_shard(bad, empty_key=BROKEN if kind == "empty member" else None)
    write_shard(good, labels=(4, 5, 6, 7))
    if kind != "empty member":
        damage(bad, kind)
    shards = [{"name": p.name, "num_samples": 4} for p in (bad, good)]
    write_info(root, {"classes": [str(i) for i in range(8)], "splits": {"val": {"num_samples": 8, "shards": shards}}})


@pytest.mark.parametrize(
    "kind, labels, reason",
    [
        ("truncated", [0, 1, 4, 5, 6, 7], "EOFError"),
        ("garbage header", [0, 1, 4, 5, 6, 7], "ValueError"),
        ("bad checksum", [0, 1, 4, 5, 6, 7], "ValueError"),
        ("empty file", [4, 5, 6, 7], "EOFError"),
        ("empty member", [0, 1, 3, 4, 5, 6, 7], "skipped corrupt sample s2"),  # s2's jpg has 0 bytes: not an image
    ],
)
def test_image_validation_labels_skips_and_reasons(tmp_path, kind, labels, reason, caplog):
    image_shard_set(tmp_path / "set", kind)
    dm = ImageShardDataModule(str(tmp_path / "set"), batch_size=3, num_workers=0, augment=SMALL)
    with caplog.at_level(logging.WARNING):
        batches = list(dm.val_dataloader())
    images = torch.cat([x for x, *_ in batches])
    assert torch.cat([y for _, y, *_ in batches]).tolist() == labels
    assert images.shape == (len(labels), 8, 8, 3)
    assert dm.skipped.value == 1
    [record] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert reason in record.getMessage() and "val-000000.tar" in record.getMessage()


def test_byte_sum_is_the_sum_of_the_bytes():
    """The header checksum's fast byte sum against Python's sum, up to the largest sums a 512-byte
    header can have (all bytes 255) and at every length up to one header."""
    from mmlight.data.shards import byte_sum

    rng = np.random.default_rng(0)
    cases = [bytes(rng.integers(0, 256, n, dtype=np.uint8)) for n in range(0, 513, 7)]
    cases += [b"\xff" * n for n in (1, 255, 256, 257, 356, 512)] + [b"\0" * 512]
    for data in cases:
        assert byte_sum(data) == sum(data), len(data)


def valid_header() -> bytearray:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        info = tarfile.TarInfo("0.cls")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"5"))
    return bytearray(buffer.getvalue()[:512])


def test_the_signed_checksum_counts_every_byte_over_127_the_type_flag_too():
    """A signed-char checksum counts each byte over 127 as negative wherever it stands, byte 156 (the
    type flag) included; an unknown type is the walker's business, not the checksum's."""
    from mmlight.data.shards import _check_header

    header = valid_header()
    header[156] = 0xC8
    signed = 256 + sum(b - 256 if b > 127 else b for b in header[:148] + header[156:])
    header[148:156] = b"%06o\0 " % signed
    _check_header(bytes(header), "s.tar", 0)  # accepted: no error


def test_a_checksum_field_with_a_stray_character_is_not_a_header():
    """The checksum field must be octal digits padded with NUL or space: a right sum followed by any
    other character is garbage, not a header."""
    from mmlight.data.shards import _check_header

    header = valid_header()
    header[148:156] = header[148:154] + b"X\0"
    with pytest.raises(ValueError, match="not a tar header at byte 1024"):
        _check_header(bytes(header), "s.tar", 1024)


def padded(data: bytes) -> bytes:
    return data + b"\0" * (-len(data) % 512)


def pax_record(key: str, value: str) -> bytes:
    """One pax record ``"<len> key=value\\n"``, ``len`` counting its own digits."""
    body = f" {key}={value}\n".encode()
    length = len(body) + 1
    while len(str(length)) + len(body) != length:
        length += 1
    return str(length).encode() + body


def ustar_header(name: str, size: int, kind: bytes = tarfile.REGTYPE) -> bytearray:
    info = tarfile.TarInfo(name)
    info.size, info.type = size, kind
    return bytearray(info.tobuf(tarfile.USTAR_FORMAT))


def rechecksum(header: bytearray) -> bytes:
    """``header`` with its checksum recomputed (the field counted as 8 spaces), as tar writes it."""
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\0 " % sum(header)
    return bytes(header)


def pax_member(records: bytes, size: int | None = None) -> bytes:
    """A pax extended header whose data is ``records`` (its size field ``size``, if given)."""
    header = ustar_header("././@PaxHeader", len(records), tarfile.XHDTYPE)
    if size is not None:
        header[124:136] = b"%011o\0" % size
    return rechecksum(header) + padded(records)


def reference_members(path) -> list[tuple[str, bytes]]:
    with tarfile.open(path) as tar:
        return [(m.name, tar.extractfile(m).read()) for m in tar.getmembers() if m.isreg()]


def test_a_pax_path_holding_an_equals_sign_is_split_at_the_first_one(tmp_path):
    """A pax record is ``key=value``; the value (a path) may hold ``=`` itself."""
    path = tmp_path / "s.tar"
    name = "k=v" + "c" * 120 + ".cls"  # over 100 bytes: tarfile writes it as a pax path
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo(name)
        info.size = 1
        tar.addfile(info, io.BytesIO(b"5"))
    assert reference_members(path) == [(name, b"5")]
    assert list(iter_tar(path)) == [(name, b"5")]
    assert [n for n, _, _ in tar_index(path)] == [name]


def test_pax_records_padded_with_nuls_end_at_the_first_nul(tmp_path):
    """A pax header whose size counts NUL padding after its records (tarfile stops at the NUL too)."""
    path = tmp_path / "s.tar"
    name = "p" * 150 + ".cls"
    records = pax_record("path", name)
    path.write_bytes(
        pax_member(records + b"\0" * 40) + rechecksum(ustar_header("short.cls", 1)) + padded(b"5") + b"\0" * 1024
    )
    assert reference_members(path) == [(name, b"5")]
    assert list(iter_tar(path)) == [(name, b"5")]
    assert list(tar_index(path)) == [(name, 512 * 3, 1)]  # pax header, its data, the member's header


def test_a_pax_header_without_a_path_keeps_the_path_of_the_one_before(tmp_path):
    """Two pax headers before one member, the second without a path (a comment): the first one's path
    still names the member, as in tarfile."""
    path = tmp_path / "s.tar"
    name = "p" * 150 + ".cls"
    path.write_bytes(
        pax_member(pax_record("path", name))
        + pax_member(pax_record("comment", "hi"))
        + rechecksum(ustar_header("short.cls", 1))
        + padded(b"5")
        + b"\0" * 1024
    )
    assert reference_members(path) == [(name, b"5")]
    assert list(iter_tar(path)) == [(name, b"5")]


def test_a_pax_path_wins_over_the_ustar_prefix(tmp_path):
    """A member named by a pax path whose own header also holds a ustar prefix (as writers fill in a
    split of the name): the pax path alone is the name, as in tarfile."""
    path = tmp_path / "s.tar"
    name = "ÿ" * 60 + ".cls"  # non-ASCII: a pax path even though it is short
    header = ustar_header("x.cls", 1)
    header[345:354] = b"elsewhere"
    path.write_bytes(pax_member(pax_record("path", name)) + rechecksum(header) + padded(b"5") + b"\0" * 1024)
    assert reference_members(path) == [(name, b"5")]
    assert list(iter_tar(path)) == [(name, b"5")]


def test_the_ustar_prefix_ends_before_the_header_padding(tmp_path):
    """The prefix field is bytes 345..499; bytes 500..511 are padding, ignored whatever they hold."""
    path = tmp_path / "s.tar"
    name = "d" * 60 + "/" + "n" * 60 + ".cls"  # 125 bytes: split into prefix and name
    header = ustar_header(name, 1)
    assert header[345:405] == b"d" * 60
    header[500] = ord("X")
    path.write_bytes(rechecksum(header) + padded(b"5") + b"\0" * 1024)
    assert reference_members(path) == [(name, b"5")]
    assert list(iter_tar(path)) == [(name, b"5")]


def test_a_size_field_written_left_aligned_is_read_whole(tmp_path):
    """A size field of digits then NULs (``1750`` = 1000 bytes), which tarfile reads too: the first
    byte of the field is a digit that counts."""
    path = tmp_path / "s.tar"
    header = ustar_header("a.bin", 1000)
    header[124:136] = b"1750" + b"\0" * 8
    path.write_bytes(rechecksum(header) + padded(b"x" * 1000) + rechecksum(ustar_header("b.cls", 1)) + padded(b"7"))
    assert reference_members(path) == [("a.bin", b"x" * 1000), ("b.cls", b"7")]
    assert list(iter_tar(path)) == [("a.bin", b"x" * 1000), ("b.cls", b"7")]
    assert list(tar_index(path)) == [
        ("a.bin", 512, 1000),
        ("b.cls", 512 + 1024 + 512, 1),
    ]  # header, 1000 bytes padded, header


def names_read_before(path, error: type[Exception]) -> tuple[list[str], Exception]:
    """The member names that ``iter_tar`` yields from ``path`` before it raises ``error``, and the error."""
    read = []
    with pytest.raises(error) as raised:
        for name, _ in iter_tar(path):
            read.append(name)
    return read, raised.value


def test_a_partial_header_at_the_end_is_a_truncated_header_whatever_its_bytes(tmp_path):
    """A whole member, then 100 bytes of a header cut short (here the letter X) instead of the end blocks."""
    path = tmp_path / "s.tar"
    path.write_bytes(rechecksum(ustar_header("a.cls", 1)) + padded(b"5") + b"X" * 100)
    read, error = names_read_before(path, EOFError)
    assert read == ["a.cls"]
    assert str(error) == f"{path}: truncated tar header"


def test_the_header_index_names_the_shard_in_its_errors(tmp_path):
    path = tmp_path / "s.tar"
    write_shard(path)
    damage(path, "truncated")
    with pytest.raises(EOFError) as err:
        list(tar_index(path))
    assert str(err.value) == f"{path}: truncated member (100 of {len(jpeg(2))} bytes)"


# a stray letter and an 8 (one past octal), where tarfile stops reading; GNU's base-256 size, which tarfile reads
@pytest.mark.parametrize(
    ("field", "tarfile_stops"),
    [(b"0000000001X\0", True), (b"00000000018\0", True), (b"\x80" + b"\0" * 10 + b"\x01", False)],
)
def test_a_size_field_that_is_not_octal_is_named_with_the_shard_and_byte(tmp_path, field, tarfile_stops):
    """A header with a valid checksum but a size that is not octal digits (a writer's bug, or GNU's base-256
    sizes, written for members over 8 GiB) stops the reader with the shard, the header's byte offset and the
    field, as the other header errors do; before, Python's bare ``int()`` error named neither."""
    path = tmp_path / "s.tar"
    second = ustar_header("b.cls", 1)
    second[124:136] = field
    path.write_bytes(
        rechecksum(ustar_header("a.cls", 1)) + padded(b"5") + rechecksum(second) + padded(b"6") + b"\0" * 1024
    )
    read, error = names_read_before(path, ValueError)
    assert read == ["a.cls"]
    assert str(error) == f"{path}: tar header at byte 1024 has a size field that is not octal: {field!r}"
    if tarfile_stops:  # tarfile ends the archive there, silently
        assert reference_members(path) == [("a.cls", b"5")]


def test_a_size_field_padded_with_spaces_or_nul_reads_as_tarfile_reads_it(tmp_path):
    """Old writers right-align the octal size behind spaces, or end it with a space instead of NUL:
    tarfile (the reference) reads both, and so must the reader."""
    path = tmp_path / "s.tar"
    members = b""
    for name, field in [("a.cls", b"         12\0"), ("b.cls", b"00000000012 "), ("c.cls", b"\0" * 12)]:
        header = ustar_header(name, 0)
        header[124:136] = field
        members += rechecksum(header) + padded(b"x" * int(field.strip(b"\0 ") or b"0", 8))
    path.write_bytes(members + b"\0" * 1024)
    assert (
        list(iter_tar(path)) == reference_members(path) == [("a.cls", b"x" * 10), ("b.cls", b"x" * 10), ("c.cls", b"")]
    )
