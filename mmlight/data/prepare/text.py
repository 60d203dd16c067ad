"""Any text to byte-level BPE token shards (``mmlight prepare text --src PATH... --out DIR``).

Sources (``--src``, files or folders, folders read recursively in sorted order):

* ``.txt`` (also ``.txt.gz``, ``.txt.zst``): the whole file is one document;
* ``.jsonl`` (also ``.jsonl.gz``, ``.jsonl.zst``): one JSON object per line, the document in its
  ``--text-column`` field;
* ``.parquet``: the ``--text-column`` column, one document per row (FineWeb-edu's layout: a ``text``
  column beside metadata columns); each row group is one unit of work.

``.zst`` needs ``zstandard`` and ``.parquet`` needs ``pyarrow``; a source that needs a missing one
stops the command before any work, naming the package. Any other file in a folder is skipped and named.

Documents are read in source order. A bad input is skipped, logged with its place (``path``,
``path:line`` for jsonl, ``path:row`` for parquet) and its reason, and listed in ``_info.json``
(``num_skipped``, ``skipped``), never fatal: an unreadable or truncated file (the part before the damage
is kept), a parquet file that does not open or lacks the column, text that is not valid UTF-8, a
malformed jsonl line, a field that is missing or not a string, and an empty (whitespace-only) document.

Split: a document goes to ``valid`` when the first 8 bytes of the BLAKE2b digest of its UTF-8 text, read
as a big-endian integer, are below ``valid_fraction * 2**64`` (:func:`in_valid`), else to ``train``;
identical documents land on the same side.

Tokenizer: a byte-level BPE trained with Hugging Face ``tokenizers`` on the training documents
(``--vocab-size``; the specials ``<s> <pad> </s> <unk>`` are ids 0-3; the same documents and settings
give the same ``tokenizer.json``, byte for byte), or a given ``tokenizer.json`` (``--tokenizer``), to
which those four specials are appended when it lacks them (its own ids are unchanged).
``tokenizer.json`` is written beside the shards and named in ``_info.json`` (``vocab``, format
``hf``); :class:`~mmlight.data.vocab.Vocab` carries it into checkpoints.

Tokens: each document's ids (specials not added) followed by ``</s>``, documents in source order,
form each split's stream, stored as ``uint16`` when every id fits (vocabulary of at most 65,536 tokens),
else ``uint32``. The streams are cut into chunks and shards exactly as WikiText-103's
(:mod:`mmlight.data.prepare.wikitext`), so :class:`~mmlight.data.text.WikiTextDataModule` streams them.

Work: the units (a file, or a parquet row group) are tokenised in ``workers`` processes, one core each,
into ``_work/`` beside the shards (kept: a rerun reuses every finished unit, so an interrupted run
resumes); the shards are then assembled from them in source order, so the result does not depend on
the number of workers.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib
import io
import json
import logging
import os
from array import array
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from mmlight.data.shard_writer import Skipped, plan_shards, write_shards
from mmlight.data.shards import atomic_write, sha256, write_info, write_text_atomic
from mmlight.data.vocab import SPECIAL_IDS, SPECIALS, Vocab, hf_tokenizers, vocab_entry
from mmlight.data.vocab import Tokenizer as VocabTokenizer

log = logging.getLogger(__name__)

NEEDS_SRC = True
SRC_NARGS = "+"
SRC_HELP = "text files and folders: .txt, .jsonl (also .gz/.zst), .parquet"
DATASET = "text"
SPLITS = ("train", "valid")
TOKENIZER_FILE = "tokenizer.json"
WORK_DIR = "_work"
#: tokens per sample and samples per shard (as WikiText-103's; 2 MiB of uint16 ids per shard)
CHUNK_TOKENS = 65_536
CHUNKS_PER_SHARD = 16
VOCAB_SIZE = 32_768
VALID_FRACTION = 0.01
TEXT_COLUMN = "text"
#: documents per encode_batch call in a worker
BATCH_DOCS = 256
KINDS = {
    ".txt": "txt",
    ".txt.gz": "txt",
    ".txt.zst": "txt",
    ".jsonl": "jsonl",
    ".jsonl.gz": "jsonl",
    ".jsonl.zst": "jsonl",
    ".parquet": "parquet",
}


def add_arguments(parser) -> None:
    """The options of ``mmlight prepare text`` (besides ``--src``, ``--out`` and ``--workers``)."""
    parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE, help="BPE vocabulary size, specials included")
    parser.add_argument("--tokenizer", help="an existing tokenizer.json to use instead of training one")
    parser.add_argument(
        "--valid-fraction", type=float, default=VALID_FRACTION, help="share of documents in valid (by hash)"
    )
    parser.add_argument("--text-column", default=TEXT_COLUMN, help="the text field of jsonl and column of parquet")


def optional_module(name: str, package: str, what: str):
    """Import ``name``, or an ImportError that names the package to install for ``what``."""
    try:
        return importlib.import_module(name)
    except ImportError as err:
        raise ImportError(f"{what} need the {package} package: pip install {package}") from err


# ----------------------------------------------------------------------------- sources


def kind_of(path: Path) -> str | None:
    """``txt``, ``jsonl`` or ``parquet`` by the file name's ending; None for any other file."""
    name = path.name.lower()
    return next((kind for suffix, kind in KINDS.items() if name.endswith(suffix)), None)


def find_files(srcs: list[Path]) -> tuple[list[Path], list[Skipped]]:
    """The source files in order (each ``--src`` in turn, a folder's files sorted), and the files of
    folders that are not text sources. A missing path, or a named file that is not a text source,
    is an error before any work; a file named twice is read once."""
    files: list[Path] = []
    others: list[Skipped] = []
    for src in srcs:
        if not src.exists():
            raise FileNotFoundError(f"--src {src} does not exist")
        if src.is_file():
            if kind_of(src) is None:
                raise ValueError(f"--src {src} is not a text source ({', '.join(KINDS)})")
            files.append(src)
            continue
        for path in sorted(p for p in src.rglob("*") if p.is_file()):
            if kind_of(path) is None:
                others.append(Skipped(str(path), f"not a text source ({', '.join(KINDS)})"))
            else:
                files.append(path)
    unique = list(dict.fromkeys(files))
    for path in unique:  # a missing optional package stops here, before any work
        if path.name.lower().endswith(".zst"):
            optional_module("zstandard", "zstandard", ".zst files")
        if kind_of(path) == "parquet":
            optional_module("pyarrow.parquet", "pyarrow", ".parquet files")
    return unique, others


@dataclass(frozen=True)
class Unit:
    """One unit of tokenising work: a file, or one row group of a parquet file.

    Args:
        path: the file.
        kind: ``txt``, ``jsonl`` or ``parquet``.
        part: the parquet row group (0 otherwise).
        first_row: the parquet row number of the group's first row (0 otherwise).
        size: the file's size in bytes, and
        mtime_ns: its modification time: a changed file is tokenised again on a rerun.
    """

    path: str
    kind: str
    part: int = 0
    first_row: int = 0
    size: int = 0
    mtime_ns: int = 0


def plan_units(files: list[Path], text_column: str) -> tuple[list[Unit], list[Skipped]]:
    """The units of the source files, in order; a parquet file that does not open, has no rows or has
    no text column ``text_column`` is skipped with its reason."""
    units: list[Unit] = []
    skipped: list[Skipped] = []
    for path in files:
        stat = path.stat()
        kind = kind_of(path)
        if kind != "parquet":
            units.append(Unit(str(path), kind, size=stat.st_size, mtime_ns=stat.st_mtime_ns))
            continue
        groups = parquet_groups(path, text_column)
        if isinstance(groups, Skipped):
            skipped.append(groups)
            continue
        for part, first_row in enumerate(groups):
            units.append(Unit(str(path), kind, part, first_row, stat.st_size, stat.st_mtime_ns))
    return units, skipped


def parquet_groups(path: Path, text_column: str) -> list[int] | Skipped:
    """The first row number of each row group of a parquet file, or why the file is skipped."""
    pa = importlib.import_module("pyarrow")
    pq = importlib.import_module("pyarrow.parquet")
    try:
        meta = pq.ParquetFile(path).metadata
        schema = meta.schema.to_arrow_schema()
    except Exception as err:  # pyarrow raises ArrowInvalid, OSError, ... for a damaged file
        return Skipped(str(path), f"unreadable parquet file: {type(err).__name__}: {err}")
    if text_column not in schema.names:
        return Skipped(str(path), f"no column {text_column!r} (columns: {', '.join(schema.names)})")
    kind = schema.field(text_column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        return Skipped(str(path), f"column {text_column!r} holds {kind}, not text")
    if meta.num_rows == 0:
        return Skipped(str(path), "no rows")
    starts = np.cumsum([0] + [meta.row_group(i).num_rows for i in range(meta.num_row_groups)])
    return [int(s) for s in starts[:-1]]


# ----------------------------------------------------------------------------- documents


def open_binary(path: str):
    """A binary reader of ``path``, decompressing ``.gz`` and ``.zst``."""
    name = path.lower()
    if name.endswith(".gz"):
        return gzip.open(path, "rb")
    if name.endswith(".zst"):
        zstandard = optional_module("zstandard", "zstandard", ".zst files")
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True))
    return open(path, "rb")


def checked(where: str, text: str) -> tuple[str, str] | Skipped:
    """``(where, text)``, or a Skipped for an empty document or text that UTF-8 cannot hold (a lone
    surrogate from a JSON escape)."""
    if not text.strip():
        return Skipped(where, "empty document")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        return Skipped(where, f"not encodable as UTF-8 ({err.reason} at character {err.start})")
    return where, text


def decoded(where: str, raw: bytes) -> str | Skipped:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        return Skipped(where, f"not valid UTF-8 ({err.reason} at byte {err.start})")


def jsonl_document(where: str, raw: bytes, text_column: str) -> tuple[str, str] | Skipped:
    """One jsonl line -> ``(where, text)`` or why it is skipped."""
    line = raw.rstrip(b"\r\n")
    if not line.strip():
        return Skipped(where, "blank line")
    text = decoded(where, line)
    if isinstance(text, Skipped):
        return text
    try:
        record = json.loads(text)
    except ValueError as err:
        return Skipped(where, f"malformed JSON: {err}")
    if not isinstance(record, dict):
        return Skipped(where, f"not a JSON object but {type(record).__name__}")
    if text_column not in record:
        return Skipped(where, f"no {text_column!r} field")
    if not isinstance(record[text_column], str):
        return Skipped(where, f"{text_column!r} is {type(record[text_column]).__name__}, not a string")
    return checked(where, record[text_column])


def documents(unit: Unit, text_column: str) -> Iterator[tuple[str, str] | Skipped]:
    """The documents of a unit in order, as ``(where, text)``, and a Skipped for each bad one; the
    damage of an unreadable or truncated file ends it with a Skipped naming where reading stopped."""
    if unit.kind == "parquet":
        yield from parquet_documents(unit, text_column)
        return
    number = 0
    try:
        with open_binary(unit.path) as f:
            if unit.kind == "txt":
                text = decoded(unit.path, f.read())
                yield text if isinstance(text, Skipped) else checked(unit.path, text)
                return
            for number, raw in enumerate(f, start=1):
                yield jsonl_document(f"{unit.path}:{number}", raw, text_column)
    except Exception as err:  # gzip/zstd/OS errors of a damaged file, whatever their type
        where = unit.path if unit.kind == "txt" else f"{unit.path}:{number + 1}"
        yield Skipped(where, f"unreadable from here on: {type(err).__name__}: {err}")


def parquet_documents(unit: Unit, text_column: str) -> Iterator[tuple[str, str] | Skipped]:
    """The rows of one parquet row group (row numbers count from the file's first row)."""
    pq = importlib.import_module("pyarrow.parquet")
    try:
        values = pq.ParquetFile(unit.path).read_row_group(unit.part, columns=[text_column]).column(0).to_pylist()
    except Exception as err:
        yield Skipped(f"{unit.path}#group{unit.part}", f"unreadable row group: {type(err).__name__}: {err}")
        return
    for i, value in enumerate(values):
        where = f"{unit.path}:{unit.first_row + i}"
        yield Skipped(where, "null text") if value is None else checked(where, value)


def in_valid(text: str, valid_fraction: float) -> bool:
    """Whether a document belongs to the validation split: the 8-byte BLAKE2b digest (``digest_size=8``,
    not the 64-byte default cut short) of its UTF-8 text, as a big-endian integer, is below
    ``valid_fraction * 2**64``."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") < valid_fraction * 2**64


# ----------------------------------------------------------------------------- the tokenizer


def train_tokenizer(texts: Iterator[str], vocab_size: int) -> str:
    """A byte-level BPE trained on ``texts`` (the specials ids 0-3), as the text of its ``tokenizer.json``."""
    tk = hf_tokenizers()
    tokenizer = tk.Tokenizer(tk.models.BPE())
    tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIALS),
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer.to_str()


def with_specials(hf_json: str) -> tuple[str, dict[str, int]]:
    """A given tokenizer with ``<s> <pad> </s> <unk>`` appended where it lacks them, and their ids."""
    tokenizer = hf_tokenizers().Tokenizer.from_str(hf_json)
    missing = [tok for tok in SPECIALS if tokenizer.token_to_id(tok) is None]
    if missing:
        tokenizer.add_special_tokens(missing)
        log.info("appended the specials %s to the given tokenizer", missing)
        hf_json = tokenizer.to_str()
    return hf_json, {role: tokenizer.token_to_id(SPECIALS[i]) for role, i in SPECIAL_IDS.items()}


def prepared_tokenizer(
    units: list[Unit], out: Path, vocab_size: int, tokenizer: Path | None, valid_fraction: float, text_column: str
) -> tuple[str, dict[str, int]]:
    """The text of ``out/tokenizer.json`` and its special ids: the given one, or one trained on the
    training documents (reused on a rerun over the same sources and settings). A different
    ``tokenizer.json`` already in ``out`` is refused: the shards beside it hold its ids."""
    path = out / TOKENIZER_FILE
    record = out / WORK_DIR / "tokenizer.source.json"
    source = {
        "units": [asdict(u) for u in units],
        "vocab_size": vocab_size,
        "valid_fraction": valid_fraction,
        "text_column": text_column,
        "tokenizers": hf_tokenizers().__version__,
    }
    if tokenizer is not None:
        hf_json, special_ids = with_specials(tokenizer.read_text(encoding="utf-8"))
    elif path.is_file() and record.is_file() and json.loads(record.read_text()) == source:
        log.info("tokenizer %s reused (trained on the same sources and settings)", path)
        return path.read_text(encoding="utf-8"), dict(SPECIAL_IDS)
    else:
        log.info("training a byte-level BPE of %d tokens on the training documents", vocab_size)
        hf_json = train_tokenizer(training_texts(units, text_column, valid_fraction), vocab_size)
        special_ids = dict(SPECIAL_IDS)
    if path.is_file() and path.read_text(encoding="utf-8") != hf_json:
        raise ValueError(f"{path} is another tokenizer than this one: prepare into an empty --out folder")
    if not path.is_file():
        write_text_atomic(path, hf_json)
    if tokenizer is None:
        record.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(record, json.dumps(source))
    return hf_json, special_ids


def training_texts(units: list[Unit], text_column: str, valid_fraction: float) -> Iterator[list[str]]:
    """The training documents' texts in batches (bad ones left out: they are counted when tokenising)."""
    batch: list[str] = []
    for unit in units:
        for doc in documents(unit, text_column):
            if not isinstance(doc, Skipped) and not in_valid(doc[1], valid_fraction):
                batch.append(doc[1])
                if len(batch) == BATCH_DOCS:
                    yield batch
                    batch = []
    if batch:
        yield batch


# ----------------------------------------------------------------------------- tokenising


def token_dtype(vocab_size: int) -> np.dtype:
    """``uint16`` when every id of a ``vocab_size`` vocabulary fits, else ``uint32``."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


@dataclass(frozen=True)
class TokenizeJob:
    """Tokenise one unit into ``{work}/{name}.{split}.npy`` and its record ``{name}.done.json``.

    Args:
        unit: what to read.
        name: the files' stem (the unit's index).
        work: the work folder.
        tokenizer: path of ``tokenizer.json``, and
        tokenizer_sha: its SHA-256 (a record of another tokenizer is not reused).
        eos_id: the id that ends every document.
        dtype: the token arrays' dtype.
        valid_fraction: see :func:`in_valid`.
        text_column: see :func:`documents`.
    """

    unit: Unit
    name: str
    work: str
    tokenizer: str
    tokenizer_sha: str
    eos_id: int
    dtype: str
    valid_fraction: float
    text_column: str

    def path(self, split: str) -> Path:
        return Path(self.work) / f"{self.name}.{split}.npy"


_TOKENIZERS: dict[str, object] = {}  # per process: tokenizer SHA-256 -> tokenizers.Tokenizer


@contextmanager
def single_threaded():
    """Hugging Face tokenizers on one thread inside the block: one worker process, one core."""
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


def reusable(job: TokenizeJob) -> dict | None:
    """The record of a finished job whose files are in place, else None."""
    path = Path(job.work) / f"{job.name}.done.json"
    if not path.is_file():
        return None
    record = json.loads(path.read_text())
    if record.get("job") != json.loads(json.dumps(asdict(job))):
        return None
    if any(not job.path(s).is_file() or job.path(s).stat().st_size != record["bytes"][s] for s in SPLITS):
        return None
    return record


def tokenize_unit(job: TokenizeJob) -> dict:
    """Run one job (or reuse its finished record); return the record: documents, tokens, bytes and
    SHA-256 per split, and the skipped inputs."""
    record = reusable(job)
    if record is not None:
        return record
    if job.tokenizer_sha not in _TOKENIZERS:
        _TOKENIZERS[job.tokenizer_sha] = hf_tokenizers().Tokenizer.from_file(job.tokenizer)
    tokenizer = _TOKENIZERS[job.tokenizer_sha]
    code = "H" if job.dtype == "uint16" else "I"
    streams = {split: array(code) for split in SPLITS}
    counts = dict.fromkeys(SPLITS, 0)
    skipped: list[dict] = []
    batch: list[str] = []

    def flush():
        for text, encoding in zip(batch, tokenizer.encode_batch_fast(batch, add_special_tokens=False)):
            split = "valid" if in_valid(text, job.valid_fraction) else "train"
            streams[split].extend(encoding.ids)
            streams[split].append(job.eos_id)
            counts[split] += 1
        batch.clear()

    for doc in documents(job.unit, job.text_column):
        if isinstance(doc, Skipped):
            skipped.append(asdict(doc))
            continue
        batch.append(doc[1])
        if len(batch) == BATCH_DOCS:
            flush()
    flush()
    record = {"job": asdict(job), "documents": counts, "tokens": {}, "bytes": {}, "sha256": {}, "skipped": skipped}
    for split, stream in streams.items():
        path = job.path(split)
        with atomic_write(path) as tmp, open(tmp, "wb") as f:
            np.save(f, np.frombuffer(stream, dtype=job.dtype) if len(stream) else np.zeros(0, job.dtype))
        record["tokens"][split] = len(stream)
        record["bytes"][split] = path.stat().st_size
        record["sha256"][split] = sha256(path)
    write_text_atomic(Path(job.work) / f"{job.name}.done.json", json.dumps(record))
    return record


def tokenize_all(jobs: list[TokenizeJob], workers: int) -> list[dict]:
    """Every job's record, in job order; ``workers`` processes, one thread each."""
    bar = tqdm(total=len(jobs), desc=f"{DATASET} tokenising", unit="unit")
    records = []
    # Forked workers: tokenizers turns its thread pool off in a child forked after the parent used it
    # (training does), and the variable set here says so, without its warning.
    with single_threaded():
        if workers > 1 and len(jobs) > 1:
            with ProcessPoolExecutor(min(workers, len(jobs))) as pool:
                for record in pool.map(tokenize_unit, jobs):
                    records.append(record)
                    bar.update()
        else:
            for job in jobs:
                records.append(tokenize_unit(job))
                bar.update()
    bar.close()
    return records


# ----------------------------------------------------------------------------- shards


def chunk_items(jobs: list[TokenizeJob], records: list[dict], split: str, chunk_tokens: int) -> list[tuple]:
    """The split's stream (the units' arrays in order) cut into chunks of ``chunk_tokens`` (the last
    shorter), each ``(key, pieces)`` with pieces ``(array path, its SHA-256, start, stop)``."""
    items: list[tuple] = []
    pieces: list[tuple] = []
    filled = 0
    for job, record in zip(jobs, records):
        n, start = record["tokens"][split], 0
        while start < n:
            take = min(chunk_tokens - filled, n - start)
            pieces.append((str(job.path(split)), record["sha256"][split], start, start + take))
            filled, start = filled + take, start + take
            if filled == chunk_tokens:
                items.append((f"{len(items):06d}", tuple(pieces)))
                pieces, filled = [], 0
    if pieces:
        items.append((f"{len(items):06d}", tuple(pieces)))
    return items


def make_chunk(item: tuple) -> dict:
    """Shard item -> sample ``{"__key__", "ids.npy"}``: the pieces' tokens, concatenated."""
    key, pieces = item
    ids = np.concatenate([np.load(path, mmap_mode="r")[start:stop] for path, _, start, stop in pieces])
    buf = io.BytesIO()
    np.save(buf, ids, allow_pickle=False)
    return {"__key__": key, "ids.npy": buf.getvalue()}


def prepare(
    src: Path | list[Path],
    out: Path,
    workers: int = 1,
    vocab_size: int = VOCAB_SIZE,
    tokenizer: str | Path | None = None,
    valid_fraction: float = VALID_FRACTION,
    text_column: str = TEXT_COLUMN,
    chunk_tokens: int = CHUNK_TOKENS,
    chunks_per_shard: int = CHUNKS_PER_SHARD,
) -> dict:
    """Prepare the text of ``src`` into the shard set ``out``; return ``_info.json``'s content.

    Args:
        src: text files and folders (see the module docstring).
        out: shard set folder (created; a finished one is verified and kept, an interrupted one resumed).
        workers: tokenising and shard-writing processes.
        vocab_size: tokens of the trained BPE, the four specials included (at least 260: the 256 bytes
            and the specials).
        tokenizer: a ``tokenizer.json`` to use instead of training one.
        valid_fraction: share of the documents in the validation split, in [0, 1).
        text_column: the text field of jsonl records and column of parquet files.
        chunk_tokens: tokens per sample.
        chunks_per_shard: samples per shard.
    """
    srcs = [Path(s) for s in (src if isinstance(src, (list, tuple)) else [src])]
    if not 0.0 <= valid_fraction < 1.0:
        raise ValueError(f"--valid-fraction must be in [0, 1), got {valid_fraction}")
    if tokenizer is None and vocab_size < 256 + len(SPECIALS):
        raise ValueError(f"--vocab-size must be at least {256 + len(SPECIALS)} (bytes and specials), got {vocab_size}")
    if tokenizer is not None and not Path(tokenizer).is_file():
        raise FileNotFoundError(f"--tokenizer {tokenizer} is not a file")
    files, others = find_files(srcs)
    units, bad_files = plan_units(files, text_column)
    out = Path(out)
    work = out / WORK_DIR
    work.mkdir(parents=True, exist_ok=True)
    given = None if tokenizer is None else Path(tokenizer)
    hf_json, special_ids = prepared_tokenizer(units, out, vocab_size, given, valid_fraction, text_column)
    vocab = Vocab.from_hf_json(hf_json, special_ids)
    dtype = token_dtype(len(vocab))
    tokenizer_sha = sha256(out / TOKENIZER_FILE)
    jobs = [
        TokenizeJob(
            unit, f"{i:06d}", str(work), str(out / TOKENIZER_FILE), tokenizer_sha, vocab.eos_id, dtype.name,
            valid_fraction, text_column,
        )
        for i, unit in enumerate(units)
    ]  # fmt: skip
    records = tokenize_all(jobs, workers)
    skipped = [asdict(s) for s in others + bad_files] + [s for record in records for s in record["skipped"]]
    for s in skipped:
        log.warning("skipped %s: %s", s["path"], s["reason"])
    num_documents = sum(sum(record["documents"].values()) for record in records)
    if num_documents == 0:
        raise ValueError(f"no readable document in {[str(s) for s in srcs]} ({len(skipped)} inputs skipped, above)")
    splits = {}
    for split in SPLITS:
        items = chunk_items(jobs, records, split, chunk_tokens)
        jobs_of_split = plan_shards(split, items, chunks_per_shard)
        entry = write_shards(jobs_of_split, out, make_chunk, workers, f"{DATASET} {split}")
        splits[split] = {
            "num_tokens": sum(record["tokens"][split] for record in records),
            "num_documents": sum(record["documents"][split] for record in records),
            **entry,
        }
    if splits["valid"]["num_documents"] == 0:
        log.warning("the validation split is empty: %d documents at --valid-fraction %g", num_documents, valid_fraction)
    log.info(
        "%s: %d documents (%d train, %d valid), %d inputs skipped",
        DATASET, num_documents, splits["train"]["num_documents"], splits["valid"]["num_documents"], len(skipped),
    )  # fmt: skip
    info = {
        "dataset": DATASET,
        "vocab": vocab_entry(
            TOKENIZER_FILE, "hf", len(vocab), VocabTokenizer(version=f"tokenizers {hf_tokenizers().__version__}"),
            special_ids=special_ids,
        ),
        "eos_per_line": True,
        "chunk_tokens": chunk_tokens,
        "dtype": dtype.name,
        "valid_fraction": valid_fraction,
        "text_column": text_column,
        "num_documents": num_documents,
        "num_skipped": len(skipped),
        "skipped": skipped,
        "splits": splits,
    }  # fmt: skip
    return write_info(out, info)
