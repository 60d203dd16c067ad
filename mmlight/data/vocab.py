"""Special tokens and vocabulary files of the text data, shared by training, prediction and
``mmlight prepare``.

Every text data set numbers the specials as fairseq does: ``<s>`` 0, ``<pad>`` 1, ``</s>`` 2,
``<unk>`` 3, then its own tokens. Two file formats hold the rest:

``dict.txt`` (translation, fairseq's format)
    ``token count`` per line, by descending count, ties alphabetical; the specials are implicit, so
    line ``i`` is id ``i + 4``.
``vocab.txt`` (WikiText-103)
    one token per line, the specials written out, the line index being the id.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from mmlight.data.shards import write_text_atomic

log = logging.getLogger(__name__)

SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")
BOS_ID, PAD_ID, EOS_ID, UNK_ID = range(len(SPECIALS))
SPECIAL_IDS = {"bos": BOS_ID, "pad": PAD_ID, "eos": EOS_ID, "unk": UNK_ID}


def _write_or_verify(path: Path, text: str, entries: int) -> None:
    """Write a vocabulary file atomically, or keep an identical one untouched.

    A different one is refused with a ValueError: the shards beside it hold ids of that vocabulary,
    and a rerun keeps finished shards, so a changed vocabulary (new raw data, another tokeniser)
    needs a fresh folder.
    """
    if path.is_file():
        existing = _read_text(path)
        if existing == text:
            log.info("vocabulary %s verified (%d entries)", path, entries)
            return
        raise ValueError(f"{path} differs from the vocabulary built from the raw data "
                         f"({len(existing.splitlines())} vs {entries} entries): the raw data or its "
                         "tokenisation changed; prepare into an empty --out folder")
    write_text_atomic(path, text)
    log.info("vocabulary %s written (%d entries)", path, entries)


def _read_text(path: Path) -> str:
    with open(path, encoding="utf-8", newline="") as f:
        return f.read()


# ----------------------------------------------------------------------------- dict.txt

def build_dictionary(sides: Iterable[Iterable[str]]) -> list[tuple[str, int]]:
    """``(token, count)`` of the whitespace-separated tokens of every line of every side, specials
    left out, by descending count with ties alphabetical (the order of ``dict.txt``)."""
    counts: Counter = Counter()
    for side in sides:
        for line in side:
            counts.update(line.split())
    for special in SPECIALS:
        counts.pop(special, None)
    return sorted(counts.items(), key=lambda tc: (-tc[1], tc[0]))


def write_dictionary(entries: list[tuple[str, int]], path: Path) -> None:
    """Write ``dict.txt`` (see :func:`_write_or_verify`)."""
    _write_or_verify(path, "".join(f"{tok} {count}\n" for tok, count in entries), len(entries))


def load_dictionary(path: str | Path) -> list[str]:
    """Id -> token list: the four specials, then the tokens of ``dict.txt`` in order."""
    with open(path, encoding="utf-8") as f:
        return list(SPECIALS) + [line.rsplit(" ", 1)[0] for line in f if line.strip()]


# ----------------------------------------------------------------------------- vocab.txt

def save_vocab(path: Path, vocab: list[str]) -> Path:
    """Write ``vocab.txt`` (see :func:`_write_or_verify`); returns ``path``."""
    _write_or_verify(path, "".join(w + "\n" for w in vocab), len(vocab))
    return path


def load_vocab(path: str | Path) -> list[str]:
    """The vocabulary of a shard set: one entry per line, the line index being the id."""
    return _read_text(Path(path)).split("\n")[:-1]
