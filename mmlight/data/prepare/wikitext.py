"""WikiText-103 (word level) to webdataset shards of token ids.

Raw layout (the ``wikitext-103`` folder of the official archive)::

    src/wiki.train.tokens  src/wiki.valid.tokens  src/wiki.test.tokens

Tokenisation follows fairseq's language-model preprocessing:

* The text is already tokenised; tokens are the whitespace-separated words of a line
  (``str.split()``), e.g. ``@-@`` and ``<unk>`` are tokens.
* **Every** line of the file, including empty ones (in WikiText they are lines holding a single space),
  contributes its tokens followed by the end-of-sentence symbol ``</s>``. An empty line therefore gives
  just ``</s>``. Lines are split on ``\\n`` only; a final newline does not start an extra empty line.
  On WikiText-103 test this gives 241,211 words + 4,358 line ends = 245,569 tokens, the count that
  ``fairseq-eval-lm`` scores.
* A line that is not valid UTF-8 is skipped entirely (no tokens, no ``</s>``), logged as
  ``path:line`` (1-based line number) and counted in the split's ``num_skipped``/``skipped`` of
  ``_info.json``.

Vocabulary (``vocab.txt`` beside the shards, one entry per line, the line number being the id), built
from the training split only:

* the specials first, as in fairseq: ``<s>`` = 0, ``<pad>`` = 1, ``</s>`` = 2, ``<unk>`` = 3;
* then every other training word by descending count, ties broken alphabetically (by code point), so
  the file is deterministic.

A literal special in the text (in practice only WikiText's own ``<unk>``) maps to the special's id and
gets no entry of its own. Words of valid/test that are not in the vocabulary map to ``<unk>``.
On WikiText-103 this scheme gives 4 specials + 267,734 distinct training words other than ``<unk>``
= 267,738 entries; fairseq reports 267,744 because it pads its dictionary to a multiple of 8 with
``madeupword`` fillers, which this scheme does not add.

Shards: each split's token ids form one stream (line after line). The stream is cut into consecutive
chunks of ``chunk_tokens`` tokens (the last shorter); each chunk is one sample
``{"__key__": "{index:06d}", "ids.npy": uint32 array}``, and ``chunks_per_shard`` consecutive chunks
form a shard ``{split}-{i:06d}.tar``, so the stream is the concatenation of the samples in key order.

``_info.json``::

    {"version": 2, "dataset": "wikitext103",
     "vocab": {"file": "vocab.txt", "format": "lines", "size": V,
               "special_ids": {"bos": 0, "pad": 1, "eos": 2, "unk": 3}, "tokenizer": {"moses": false, ...}},
     "eos_per_line": true, "chunk_tokens": 65536,
     "splits": {"train": {"num_tokens": ..., "num_lines": ..., "num_samples": ..., "num_skipped": ...,
                          "skipped": [{"path": "src/wiki.train.tokens:17", "reason": ...}],
                          "shards": [...]},
                "valid": {...}, "test": {...}}}

A rerun re-reads the raw text (only reads), checks that the vocabulary it builds equals ``vocab.txt``
(an error if not: the raw data changed, so prepare into a fresh folder), and verifies and keeps the
finished shards through :func:`~mmlight.data.shard_writer.write_shards`. The specials and the
``vocab.txt`` reader and writer live in the runtime module :mod:`mmlight.data.vocab`.
"""

from __future__ import annotations

import io
import logging
from array import array
from pathlib import Path

import numpy as np

from mmlight.data.prepare import require
from mmlight.data.shard_writer import ShardJob, Skipped, write_shards
from mmlight.data.shards import write_info
from mmlight.data.vocab import EOS_ID, SPECIALS, UNK_ID, save_vocab, vocab_entry

log = logging.getLogger(__name__)

NEEDS_SRC = True
DATASET = "wikitext103"
SPLITS = {"train": "wiki.train.tokens", "valid": "wiki.valid.tokens", "test": "wiki.test.tokens"}
VOCAB_FILE = "vocab.txt"
#: tokens per sample (the last sample of a split is shorter).
CHUNK_TOKENS = 65_536
#: samples per shard: 16 x 65,536 tokens = 4 MiB of uint32 ids per shard, ~100 training shards.
CHUNKS_PER_SHARD = 16


def read_lines(path: Path):
    """Yield ``(line_number, text_or_None, error)`` for every line of ``path`` (1-based numbers).

    ``text`` is None (and ``error`` the decoding error) when the line is not valid UTF-8.
    """
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                yield number, raw.rstrip(b"\n").decode("utf-8"), None
            except UnicodeDecodeError as err:
                yield number, None, err


def _bad_line(path: Path, number: int, err: Exception) -> Skipped:
    return Skipped(f"{path}:{number}", f"line is not valid UTF-8 ({err.reason} at byte {err.start})")


def _encode_lines(path: Path, word_id) -> tuple[np.ndarray, int, list[tuple[int, Skipped]]]:
    """Read ``path`` once: ``word_id(word)`` for every word and ``</s>`` after every line.

    Returns the uint32 token stream, the number of lines encoded and the bad (non-UTF-8) lines as
    ``(stream offset, Skipped)``.
    """
    ids = array("I")
    bad: list[tuple[int, Skipped]] = []
    num_lines = 0
    for number, text, err in read_lines(path):
        if text is None:
            bad.append((len(ids), _bad_line(path, number, err)))
            continue
        num_lines += 1
        ids.extend(word_id(word) for word in text.split())
        ids.append(EOS_ID)
    return np.frombuffer(ids, dtype=np.uint32).copy() if len(ids) else np.zeros(0, np.uint32), num_lines, bad


def count_train(path: Path) -> tuple[list[str], np.ndarray, int, list[tuple[int, Skipped]]]:
    """Read the training file once: build the vocabulary and encode the file with it.

    Returns ``(vocab, ids, num_lines, bad)``: the vocabulary (specials first), the token stream as
    uint32 ids, the number of lines encoded and the bad lines as ``(stream offset, Skipped)``.
    """
    first_id: dict[str, int] = {s: i for i, s in enumerate(SPECIALS)}  # word -> provisional id

    def provisional_id(word: str) -> int:
        return first_id.setdefault(word, len(first_id))

    provisional, num_lines, bad = _encode_lines(path, provisional_id)
    counts = np.bincount(provisional, minlength=len(first_id))
    words = list(first_id)[len(SPECIALS) :]
    order = sorted(range(len(words)), key=lambda i: (-counts[i + len(SPECIALS)], words[i]))
    vocab = list(SPECIALS) + [words[i] for i in order]
    remap = np.arange(len(first_id), dtype=np.uint32)
    remap[np.asarray(order, dtype=np.int64) + len(SPECIALS)] = np.arange(len(SPECIALS), len(first_id), dtype=np.uint32)
    return vocab, remap[provisional], num_lines, bad


def encode_file(path: Path, index: dict[str, int]) -> tuple[np.ndarray, int, list[tuple[int, Skipped]]]:
    """Encode ``path`` with the vocabulary ``index`` (word -> id); unknown words become ``<unk>``."""
    return _encode_lines(path, lambda word: index.get(word, UNK_ID))


def make_sample(item) -> dict | Skipped:
    """Shard item -> sample: ``(key, ids)`` or an already-made :class:`Skipped` record."""
    if isinstance(item, Skipped):
        return item
    key, ids = item
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(ids, dtype=np.uint32), allow_pickle=False)
    return {"__key__": key, "ids.npy": buf.getvalue()}


def plan_split(
    split: str, ids: np.ndarray, bad: list[tuple[int, Skipped]], chunk_tokens: int, chunks_per_shard: int
) -> list[ShardJob]:
    """Shard jobs of one split: consecutive chunks, and each bad line in the shard where it occurred."""
    if chunk_tokens < 1 or chunks_per_shard < 1:
        raise ValueError(f"chunk_tokens and chunks_per_shard must be >= 1, got {chunk_tokens}, {chunks_per_shard}")
    starts = range(0, len(ids), chunk_tokens)
    chunks = [(f"{i:06d}", ids[s : s + chunk_tokens]) for i, s in enumerate(starts)]
    num_jobs = max(1 if bad else 0, -(-len(chunks) // chunks_per_shard))
    jobs = [
        ShardJob(f"{split}-{j:06d}.tar", chunks[j * chunks_per_shard : (j + 1) * chunks_per_shard])
        for j in range(num_jobs)
    ]
    for offset, skipped in bad:
        shard = min(offset // chunk_tokens // chunks_per_shard, num_jobs - 1)
        jobs[shard].items.append(skipped)
    return jobs


def prepare(
    src: Path, out: Path, workers: int = 1, chunk_tokens: int = CHUNK_TOKENS, chunks_per_shard: int = CHUNKS_PER_SHARD
) -> dict:
    """Prepare WikiText-103 from ``src`` into the shard set ``out``; return ``_info.json``'s content.

    Args:
        src: folder with ``wiki.{train,valid,test}.tokens``.
        out: shard set folder (created; a finished one is verified and kept).
        workers: shard-writing processes.
        chunk_tokens: tokens per sample.
        chunks_per_shard: samples per shard.
    """
    paths = {
        split: require(Path(src) / name, f"the WikiText-103 {split} file {name}") for split, name in SPLITS.items()
    }
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    vocab, train_ids, train_lines, train_bad = count_train(paths["train"])
    save_vocab(out / VOCAB_FILE, vocab)
    index = {w: i for i, w in enumerate(vocab)}  # the specials included: they open the vocabulary
    splits: dict[str, dict] = {}
    for split, path in paths.items():
        if split == "train":
            ids, num_lines, bad = train_ids, train_lines, train_bad
        else:
            ids, num_lines, bad = encode_file(path, index)
        jobs = plan_split(split, ids, bad, chunk_tokens, chunks_per_shard)
        entry = write_shards(jobs, out, make_sample, workers=workers, desc=f"{DATASET} {split}")
        splits[split] = {"num_tokens": len(ids), "num_lines": num_lines, **entry}
        log.info(
            "%s %s: %d lines, %d tokens, %d lines skipped", DATASET, split, num_lines, len(ids), entry["num_skipped"]
        )
    info = {
        "dataset": DATASET,
        "vocab": vocab_entry(VOCAB_FILE, "lines", len(vocab)),
        "eos_per_line": True,
        "chunk_tokens": chunk_tokens,
        "splits": splits,
    }
    return write_info(out, info)  # a verified rerun leaves the identical _info.json untouched
