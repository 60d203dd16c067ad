"""Writing and reading webdataset shard sets.

A shard set is a folder of ``{split}-{index:06d}.tar`` files plus ``_info.json``::

    {"splits": {"train": {"num_samples": N, "shards": [{"name": ..., "num_samples": n, "sha256": ...}]}},
     "classes": [...], ...}

Every dataset (the digits quick start, ImageNet, ...) goes through the same writer
(:mod:`mmlight.data.shard_writer`) and reader. Every file of a shard set is written through
:func:`atomic_write`, so a killed run never leaves a half-written file under its final name, and
the data modules that write their set on first use do it through :func:`prepare_once`, so that two runs
sharing a cache folder (a sweep with ``--parallel 2``, two jobs) write it once.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import logging
import os
import zlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

INFO_FILE = "_info.json"


def sha256(path: Path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@contextmanager
def atomic_write(path: Path) -> Iterator[Path]:
    """Yield ``<path>.tmp`` to write; when the block ends without error, rename it over ``path``.

    The rename is atomic, so readers see the old file or the complete new one, never a partial
    one; on an error the temporary file is removed and ``path`` is left as it was.
    """
    tmp = path.with_name(path.name + ".tmp")
    try:
        yield tmp
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)


@contextmanager
def preparing(folder: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``folder`` for the block, waiting while another process (or thread)
    holds it. The lock is ``flock`` on the file ``.<name>.lock`` beside the folder, so the folder's own
    contents stay those of the shard set, and a killed holder releases it with its file descriptor."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def prepare_once(folder: Path, prepare) -> None:
    """Call ``prepare()`` (which writes the shard set into ``folder`` or checks the one there) under
    :func:`preparing`, unless the set is complete (its ``_info.json``, written last, is there): then
    without the lock, so a prepared set in a folder the user cannot write beside still loads."""
    if (Path(folder) / INFO_FILE).is_file():
        prepare()
        return
    with preparing(folder):
        prepare()


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` (UTF-8, newlines untranslated) to ``path`` through :func:`atomic_write`."""
    with atomic_write(path) as tmp, open(tmp, "w", encoding="utf-8", newline="") as f:
        f.write(text)


#: the ``_info.json`` schema that :func:`write_info` writes (its ``version`` field). Version 1 (no
#: field) kept the vocabulary as flat keys (``vocab_file``/``special_ids`` for WikiText,
#: ``dict_file``/``bpe_file``/``pad_id``... for IWSLT14); version 2 keeps it under ``vocab``
#: (:func:`mmlight.data.vocab.vocab_entry`). :func:`read_info` upgrades version 1 on reading.
INFO_VERSION = 2


def write_info(out_dir: Path, info: dict) -> dict:
    """Write ``_info.json`` (with the schema ``version``) atomically, so a reader never sees a
    half-written file; an identical existing file is left untouched (a verified rerun). Returns the
    content written."""
    info = {"version": INFO_VERSION, **info}
    text = json.dumps(info, indent=2)
    path = out_dir / INFO_FILE
    if not (path.is_file() and path.read_text() == text):
        write_text_atomic(path, text)
    return info


def read_info(root: str | Path) -> dict:
    """Read a shard set's ``_info.json`` in the current schema, with a message that names what is
    missing; a version-1 file is upgraded in memory (:func:`upgrade_info`)."""
    path = Path(root) / INFO_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no shard set at {Path(root)}: expected {path} (write one with `mmlight prepare`)")
    return upgrade_info(json.loads(path.read_text()), root)


def upgrade_info(info: dict, root: str | Path) -> dict:
    """``_info.json`` content of any schema version -> the current one (see :data:`INFO_VERSION`)."""
    version = info.get("version", 1)
    if not isinstance(version, int) or version > INFO_VERSION:
        raise ValueError(
            f"{Path(root) / INFO_FILE} has schema version {version!r}; this mmlight reads up to "
            f"{INFO_VERSION}: update mmlight"
        )
    if version == INFO_VERSION:
        return info
    info = {**info, "version": INFO_VERSION}  # also over an explicit "version": 1
    specials = ("bos", "pad", "eos", "unk")
    if "vocab_file" in info:  # WikiText-103: vocab.txt, special ids as a mapping
        info["vocab"] = {
            "file": info.pop("vocab_file"),
            "format": "lines",
            "size": info.pop("vocab_size"),
            "special_ids": info.pop("special_ids"),
            "tokenizer": {"moses": False},
        }
    elif "dict_file" in info:  # IWSLT14: dict.txt, special ids as flat keys, Moses + BPE
        info["vocab"] = {
            "file": info.pop("dict_file"),
            "format": "dict",
            "size": info.pop("vocab_size"),
            "special_ids": {name: info.pop(f"{name}_id") for name in specials},
            "tokenizer": {
                "moses": True,
                "src_lang": info.pop("src_lang"),
                "tgt_lang": info.pop("tgt_lang"),
                "bpe_file": info.pop("bpe_file"),
                "bpe_merges": info.pop("bpe_merges"),
            },
        }
        info.pop("specials", None)
    return info


def split_urls(root: str | Path, info: dict, split: str) -> list[str]:
    """Paths of the shards of ``split``, checked to exist."""
    if split not in info["splits"]:
        raise KeyError(f"shard set {root} has no split {split!r}; it has {sorted(info['splits'])}")
    urls = [str(Path(root) / s["name"]) for s in info["splits"][split]["shards"]]
    missing = [u for u in urls if not Path(u).is_file()]
    if missing:
        raise FileNotFoundError(f"shard set {root} lists shards that are missing: {missing[:3]}")
    return urls


def _pax_records(data: bytes) -> dict[str, str]:
    records, pos = {}, 0
    while pos < len(data) and data[pos : pos + 1] != b"\0":
        length = int(data[pos : data.index(b" ", pos)])
        key, _, value = data[data.index(b" ", pos) + 1 : pos + length - 1].partition(b"=")
        records[key.decode()] = value.decode()
        pos += length
    return records


def byte_sum(data: bytes) -> int:
    """The sum of ``data``'s bytes, in C: the low half of ``zlib.adler32`` is 1 + that sum modulo 65521,
    exact for up to 256 bytes (256 * 255 < 65521). Python's ``sum`` over a header's 512 bytes doubled the
    cost of reading a shard's headers."""
    return sum((zlib.adler32(data[i : i + 256]) & 0xFFFF) - 1 for i in range(0, len(data), 256))


def _check_header(header: bytes, path, at: int) -> None:
    """Raise ``ValueError`` unless ``header`` is a tar header: its checksum field (octal) must equal
    the sum of its bytes with that field read as spaces (unsigned, or signed as some old tars wrote
    it). Garbage in place of a header, or a flipped bit, is caught here rather than read as a wrong
    name or size."""
    field = header[148:156].strip(b"\0 ")
    unsigned = 256 + byte_sum(header[:148]) + byte_sum(header[156:])  # 256: the field's 8 bytes as spaces
    if field and all(48 <= byte <= 55 for byte in field):  # octal digits
        stored = int(field, 8)
        if stored == unsigned or stored == unsigned - 256 * sum(byte > 127 for byte in header[:148] + header[156:]):
            return
    raise ValueError(
        f"{path}: not a tar header at byte {at} (checksum field {header[148:156]!r}, header bytes sum to {unsigned})"
    )


def _member_size(header: bytes, path, at: int) -> int:
    """The member size of a tar header (octal). A non-octal field under a valid checksum is a writer's bug
    rather than a flipped bit; it gets the same kind of error as a bad header, naming the shard and byte."""
    field = header[124:136].strip(b"\0 ") or b"0"
    if not all(48 <= byte <= 55 for byte in field):  # octal digits
        raise ValueError(f"{path}: tar header at byte {at} has a size field that is not octal: {header[124:136]!r}")
    return int(field, 8)


def _walk_tar(f, path, read_data: bool) -> Iterator[tuple[str, int, int, bytes | None]]:
    """``(member name, data offset, size, bytes or None)`` of the regular files of the open tar ``f``.

    With ``read_data`` False the member data is seeked over, not read: only the 512-byte headers (and
    the small GNU long-name and pax records) are. A truncated shard raises ``EOFError`` either way; a
    header whose checksum does not match (garbage, a flipped bit) raises ``ValueError``.
    """
    end = os.fstat(f.fileno()).st_size
    long_name = None
    while True:
        header = f.read(512)
        if len(header) < 512 or header == b"\0" * 512:
            if header.strip(b"\0"):
                raise EOFError(f"{path}: truncated tar header")
            if not end:
                raise EOFError(f"{path}: empty file, not a tar")
            return
        offset = f.tell()
        _check_header(header, path, offset - 512)
        size = _member_size(header, path, offset - 512)
        kind = header[156:157]
        if offset + size > end:
            raise EOFError(f"{path}: truncated member ({end - offset} of {size} bytes)")
        data = None
        if read_data or kind in (b"L", b"x"):
            data = f.read(size)
            f.seek(-size % 512, os.SEEK_CUR)
        else:
            f.seek(size + (-size % 512), os.SEEK_CUR)
        if kind == b"L":  # GNU long name: the next member's name
            long_name = data.rstrip(b"\0").decode()
            continue
        if kind == b"x":  # pax extended header ("<len> key=value\n" records): may carry the path
            long_name = _pax_records(data).get("path", long_name)
            continue
        if kind not in (b"0", b"\0"):  # directories, pax headers, links: not samples
            continue
        name = long_name or header[:100].rstrip(b"\0").decode()
        if long_name is None and header[257:262] == b"ustar":
            prefix = header[345:500].rstrip(b"\0").decode()
            name = f"{prefix}/{name}" if prefix else name
        long_name = None
        yield name, offset, size, data


def iter_tar(path: str | Path) -> Iterator[tuple[str, bytes]]:
    """``(member name, bytes)`` of the regular files in an uncompressed tar, in order.

    A minimal ustar reader (plus GNU long names and pax paths, as Python's tarfile writes for long
    keys; other pax records are ignored): reading a shard
    with it costs a few tens of microseconds per sample against ~0.3 ms for Python's streaming
    ``tarfile`` as webdataset uses it, which made the shard path slower than an ImageFolder on a
    local disk. A truncated shard raises ``EOFError``, a corrupt header (bad checksum) ``ValueError``.
    """
    with open(path, "rb", buffering=1 << 20) as f:
        for name, _, _, data in _walk_tar(f, path, read_data=True):
            yield name, data


def tar_index(path: str | Path) -> Iterator[tuple[str, int, int]]:
    """``(member name, data offset, size)`` of the regular files of a tar, from its headers alone
    (the data is seeked over): what a resumed stream reads to skip samples without decoding them."""
    with open(path, "rb", buffering=4096) as f:
        for name, offset, size, _ in _walk_tar(f, path, read_data=False):
            yield name, offset, size


def group_samples(members: Iterable[tuple[str, object]], url: str) -> Iterator[dict]:
    """``(member name, value)`` pairs -> webdataset samples ``{"__key__", "__url__", "<ext>": value}``:
    consecutive files ``key.ext`` with the same key form one sample."""
    sample: dict = {}
    for name, value in members:
        base = name.rsplit("/", 1)[-1]
        key, _, ext = base.partition(".")
        key = name[: len(name) - len(base)] + key
        if sample and key != sample["__key__"]:
            yield sample
            sample = {}
        sample.setdefault("__key__", key)
        sample["__url__"] = url
        sample[ext] = value
    if sample:
        yield sample


def npy_header(reader: MemberReader, url: str, offset: int, size: int) -> tuple[np.dtype, tuple, int]:
    """``(dtype, shape, data offset in the shard)`` of a ``.npy`` member, from its header alone."""
    head = io.BytesIO(reader.read(url, offset, min(size, 4096)))
    version = np.lib.format.read_magic(head)
    read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, fortran_order, dtype = read_header(head)
    if fortran_order or dtype.hasobject:
        raise ValueError(f"{url}: .npy member at {offset} is not a plain C-ordered array")
    data_offset = offset + head.tell()
    if data_offset + dtype.itemsize * int(np.prod(shape)) > offset + size:
        raise ValueError(f"{url}: .npy member at {offset} is shorter than its header says")
    return dtype, shape, data_offset


class MemberReader:
    """Reads byte ranges of shard members by position, keeping the last few shards open (a stream
    reads from the handful of shards that its shuffle buffer spans).

    Args:
        max_open: files kept open at once.
    """

    def __init__(self, max_open: int = 8):
        self.max_open = max_open
        self._files: dict[str, object] = {}

    def read(self, url: str, offset: int, size: int) -> bytes:
        f = self._files.pop(url, None) or open(url, "rb")
        self._files[url] = f  # most recently used last
        if len(self._files) > self.max_open:
            self._files.pop(next(iter(self._files))).close()
        f.seek(offset)
        data = f.read(size)
        if len(data) < size:
            raise EOFError(f"{url}: {len(data)} of {size} bytes at offset {offset}")
        return data

    def __getstate__(self) -> dict:  # open files stay in the process that opened them
        return {"max_open": self.max_open, "_files": {}}


class TarSamples:
    """Pipeline stage: shard URLs (``{"url": ...}`` dicts or strings) -> webdataset samples
    (``{"__key__", "__url__", "<ext>": bytes}``; files ``key.ext`` in a row form one sample).

    A shard that cannot be read (truncated, missing) is logged and counted in ``counter``, and the
    stream goes on with the next shard.

    Args:
        counter: a :class:`mmlight.data.skips.SkipCounter` (or None).
    """

    def __init__(self, counter=None):
        self.counter = counter

    def __call__(self, urls: Iterable) -> Iterator[dict]:
        for url in urls:
            url = url["url"] if isinstance(url, dict) else url
            try:
                yield from self._samples(url)
            except (OSError, EOFError, ValueError) as err:
                if self.counter is not None:
                    self.counter.add()
                log.warning("skipped the rest of shard %s: %s: %s", url, type(err).__name__, err)

    @staticmethod
    def _samples(url: str) -> Iterator[dict]:
        yield from group_samples(iter_tar(url), url)
