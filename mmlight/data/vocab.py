"""Vocabularies and label sets of the data, shared by ``mmlight prepare``, the DataModules and the
tasks (which keep them in their checkpoints, so that a checkpoint alone can encode and decode).

Every text data set numbers the specials as fairseq does: ``<s>`` 0, ``<pad>`` 1, ``</s>`` 2,
``<unk>`` 3, then its own tokens. Two file formats hold the rest:

``dict.txt`` (translation, fairseq's format)
    ``token count`` per line, by descending count, ties alphabetical; the specials are implicit, so
    line ``i`` is id ``i + 4``.
``vocab.txt`` (WikiText-103)
    one token per line, the specials written out, the line index being the id.
``tokenizer.json`` (``mmlight prepare text``)
    a Hugging Face ``tokenizers`` tokenizer (byte-level BPE); its ids are the vocabulary's, and its
    JSON travels in :class:`Tokenizer` (``hf_json``), so a checkpoint encodes and decodes without it.

:class:`Vocab` is the one typed vocabulary (tokens, special ids, and the :class:`Tokenizer` that
turns raw text into its tokens); :class:`ClassMap` the one label set. A shard set describes its
vocabulary in ``_info.json`` under ``vocab`` (:func:`vocab_entry` writes it, :meth:`Vocab.from_shards`
reads it) and its label set under ``classes``.
"""

from __future__ import annotations

import importlib
import logging
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Literal

import torch

from mmlight.data.shards import write_text_atomic
from mmlight.data.tokenizers import apply_bpe, moses_detokenize, moses_tokenize, remove_bpe

log = logging.getLogger(__name__)

SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")
BOS_ID, PAD_ID, EOS_ID, UNK_ID = range(len(SPECIALS))
SPECIAL_IDS = {"bos": BOS_ID, "pad": PAD_ID, "eos": EOS_ID, "unk": UNK_ID}

#: how a vocabulary file lists its tokens (see the module docstring)
VocabFormat = Literal["dict", "lines", "hf"]


@dataclass(frozen=True)
class Tokenizer:
    """How raw text becomes the tokens of a :class:`Vocab`, and back.

    Args:
        moses: Moses-tokenise (``tokenizer.perl`` with escaping, then lowercase) before encoding and
            detokenise after decoding; False: the text is split on whitespace as it is.
        src_lang: the language :meth:`Vocab.encode` tokenises by default.
        tgt_lang: the language :meth:`Vocab.decode` detokenises by default.
        bpe_codes: the subword-nmt codes (the text of the ``code`` file), or None for no BPE.
        version: what the tokenised text depends on besides the raw text (informative).
        hf_json: a Hugging Face ``tokenizers`` tokenizer (the text of its ``tokenizer.json``), or None;
            when set it alone turns text into tokens and back (the other fields are unused).
    """

    moses: bool = False
    src_lang: str | None = None
    tgt_lang: str | None = None
    bpe_codes: str | None = None
    version: str | None = None
    hf_json: str | None = None

    @cached_property
    def hf(self):
        """The ``tokenizers.Tokenizer`` of ``hf_json`` (built once)."""
        if self.hf_json is None:
            raise ValueError("this tokenizer is not a Hugging Face tokenizer (no hf_json)")
        return hf_tokenizers().Tokenizer.from_str(self.hf_json)

    def tokenize(self, text: str, lang: str | None = None) -> list[str]:
        """Raw text -> tokens (Moses, lowercasing and BPE where this tokenizer has them; the Hugging
        Face tokenizer's tokens, specials not added, when it has one)."""
        if self.hf_json is not None:
            return self.hf.encode(text, add_special_tokens=False).tokens
        if self.moses:
            text = moses_tokenize(text, lang or self.src_lang)
        if self.bpe_codes is not None:
            text = apply_bpe(text, self.bpe_codes)
        return text.split()

    def detokenize(self, tokens: list[str], moses: bool = True, lang: str | None = None) -> str:
        """Tokens -> text: BPE removed (``@@ ``), then Moses-detokenised when ``moses`` and this
        tokenizer has Moses; otherwise the tokenised text. A Hugging Face tokenizer's decoder gives the
        raw text back (byte-level BPE: byte for byte) unless ``moses`` is False."""
        if self.hf_json is not None and moses and self.hf.decoder is not None:
            return self.hf.decoder.decode(tokens)
        text = " ".join(tokens)
        if self.bpe_codes is not None:
            text = remove_bpe(text)
        return moses_detokenize(text, lang or self.tgt_lang) if moses and self.moses else text


def hf_tokenizers():
    """The ``tokenizers`` package (Hugging Face), or an ImportError that says how to install it."""
    try:
        return importlib.import_module("tokenizers")
    except ImportError as err:
        raise ImportError("byte-level BPE vocabularies need Hugging Face tokenizers: pip install tokenizers") from err


@dataclass(frozen=True)
class Vocab:
    """A text vocabulary: id -> token, the special ids, and how raw text is tokenised.

    Args:
        tokens: the token of each id, specials first.
        special_ids: ``{"bos", "pad", "eos", "unk"}`` -> id.
        tokenizer: raw text <-> tokens.
    """

    tokens: tuple[str, ...]
    special_ids: dict[str, int] = field(default_factory=lambda: dict(SPECIAL_IDS))
    tokenizer: Tokenizer = Tokenizer()

    def __post_init__(self):
        object.__setattr__(self, "tokens", tuple(self.tokens))
        missing = sorted(set(SPECIAL_IDS) - set(self.special_ids))
        if missing:
            raise ValueError(f"a vocabulary needs the special ids {sorted(SPECIAL_IDS)}; {missing} missing")
        out_of_range = {k: i for k, i in self.special_ids.items() if not 0 <= i < len(self.tokens)}
        if out_of_range:
            raise ValueError(f"special ids {out_of_range} are outside the {len(self.tokens)} tokens")

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def bos_id(self) -> int:
        return self.special_ids["bos"]

    @property
    def pad_id(self) -> int:
        return self.special_ids["pad"]

    @property
    def eos_id(self) -> int:
        return self.special_ids["eos"]

    @property
    def unk_id(self) -> int:
        return self.special_ids["unk"]

    @cached_property
    def index(self) -> dict[str, int]:
        """Token -> id (a token listed twice keeps its first id)."""
        index: dict[str, int] = {}
        for i, tok in enumerate(self.tokens):
            index.setdefault(tok, i)
        return index

    def encode(self, text: str, lang: str | None = None) -> list[int]:
        """Raw text -> ids (the tokenizer's steps; a token not in the vocabulary is ``<unk>``; no ``</s>``)."""
        index, unk = self.index, self.unk_id
        return [index.get(tok, unk) for tok in self.tokenizer.tokenize(text, lang)]

    def decode(self, ids: Iterable[int] | torch.Tensor, detokenize: bool = True, lang: str | None = None) -> str:
        """Ids -> text: ``<s>``, ``<pad>`` and ``</s>`` dropped, BPE removed, then Moses-detokenised
        (and unescaped) unless ``detokenize`` is False, which gives the tokenised text."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        dropped = {self.bos_id, self.pad_id, self.eos_id}
        return self.tokenizer.detokenize([self.tokens[i] for i in ids if i not in dropped], detokenize, lang)

    def to_dict(self) -> dict:
        """Plain types only (a checkpoint entry; :meth:`from_dict` reads it back)."""
        return {"tokens": list(self.tokens), "special_ids": dict(self.special_ids), "tokenizer": asdict(self.tokenizer)}

    @classmethod
    def from_dict(cls, data: dict) -> Vocab:
        return cls(tuple(data["tokens"]), dict(data["special_ids"]), Tokenizer(**data.get("tokenizer", {})))

    @classmethod
    def from_shards(cls, root: str | Path, info: dict) -> Vocab:
        """The vocabulary of a shard set, from its ``_info.json`` content ``info`` (``vocab`` entry,
        see :func:`vocab_entry`) and the files it names."""
        entry = info.get("vocab")
        if entry is None:
            raise ValueError(f"the shard set {root} has no vocabulary in its _info.json: {reprepare_hint(root, info)}")
        path = Path(root) / entry["file"]
        if entry["format"] == "hf":
            return cls.from_hf_json(_read_text(path), dict(entry["special_ids"]), expected_size=entry["size"])
        tokens = load_dictionary(path) if entry["format"] == "dict" else load_vocab(path)
        if len(tokens) != entry["size"]:
            raise ValueError(
                f"{path} has {len(tokens)} entries, _info.json says {entry['size']}: {reprepare_hint(root, info)}"
            )
        settings = dict(entry.get("tokenizer") or {})
        bpe_file = settings.pop("bpe_file", None)
        settings.pop("bpe_merges", None)
        codes = (Path(root) / bpe_file).read_text(encoding="utf-8") if bpe_file else None
        return cls(tuple(tokens), dict(entry["special_ids"]), Tokenizer(bpe_codes=codes, **settings))

    @classmethod
    def from_hf_json(cls, hf_json: str, special_ids: dict[str, int], expected_size: int | None = None) -> Vocab:
        """The vocabulary of a Hugging Face tokenizer (the text of its ``tokenizer.json``): its tokens by
        id, added tokens included; an error if its ids have a gap or (``expected_size``) its size differs."""
        tokenizer = Tokenizer(hf_json=hf_json)
        size = tokenizer.hf.get_vocab_size(with_added_tokens=True)
        tokens = [tokenizer.hf.id_to_token(i) for i in range(size)]
        gaps = [i for i, tok in enumerate(tokens) if tok is None]
        if gaps:
            raise ValueError(f"the tokenizer's ids are not consecutive: no token has id {gaps[:5]}")
        if expected_size is not None and size != expected_size:
            raise ValueError(f"the tokenizer has {size} tokens, _info.json says {expected_size}")
        return cls(tuple(tokens), special_ids, tokenizer)


def vocab_entry(
    file: str,
    fmt: VocabFormat,
    size: int,
    tokenizer: Tokenizer = Tokenizer(),
    bpe_file: str | None = None,
    bpe_merges: int | None = None,
    special_ids: dict[str, int] | None = None,
) -> dict:
    """The ``vocab`` entry of ``_info.json``: the vocabulary file and its format, its size, the special
    ids (fairseq's by default) and the tokenizer settings (the BPE codes by file name and merge count;
    a Hugging Face tokenizer is the file itself)."""
    settings = {k: v for k, v in asdict(tokenizer).items() if k not in ("bpe_codes", "hf_json")}
    if bpe_file is not None:
        settings.update(bpe_file=bpe_file, bpe_merges=bpe_merges)
    ids = dict(SPECIAL_IDS if special_ids is None else special_ids)
    return {"file": file, "format": fmt, "size": size, "special_ids": ids, "tokenizer": settings}


def reprepare_hint(root: str | Path, info: dict) -> str:
    """What to run to write a shard set again in the current ``_info.json`` schema."""
    dataset = {"sklearn-digits": "digits"}.get(info.get("dataset"), info.get("dataset") or "<dataset>")
    return f"prepare it again with `mmlight prepare {dataset} --src <raw data> --out {root}` into an empty folder"


@dataclass(frozen=True)
class ClassMap:
    """The label set of a classification data set: label ``i`` is class ``names[i]``.

    Args:
        names: the class names in label order (ImageNet's WordNet ids, the digits ``"0"`` .. ``"9"``).
    """

    names: tuple[str, ...]

    def __post_init__(self):
        object.__setattr__(self, "names", tuple(self.names))
        if not self.names:
            raise ValueError("a class map needs at least one class")

    def __len__(self) -> int:
        return len(self.names)

    def to_dict(self) -> dict:
        """``{"classes": [...]}``: the ``_info.json`` entry and the checkpoint entry."""
        return {"classes": list(self.names)}

    @classmethod
    def from_dict(cls, data: dict) -> ClassMap:
        if "classes" not in data:
            raise ValueError("no 'classes' entry: not a class map")
        return cls(tuple(data["classes"]))


# ----------------------------------------------------------------------------- vocabulary files


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
        raise ValueError(
            f"{path} differs from the vocabulary built from the raw data "
            f"({len(existing.splitlines())} vs {entries} entries): the raw data or its "
            "tokenisation changed; prepare into an empty --out folder"
        )
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


# ----------------------------------------------------------------------------- DataModules


class VocabAttributes:
    """The vocabulary attributes of a text DataModule, all read from one :class:`Vocab`
    (:attr:`vocab`, loaded once by :meth:`load_vocab`): ``vocab_size``, the special ids,
    ``encode`` and ``decode``."""

    _vocab: Vocab | None = None

    @property
    def vocab(self) -> Vocab:
        """The data's vocabulary (id -> token, special ids, tokenizer)."""
        if self._vocab is None:
            self._vocab = self.load_vocab()
        return self._vocab

    def load_vocab(self) -> Vocab:
        """The shard set's vocabulary, as its ``_info.json`` describes it; generated data overrides this."""
        return Vocab.from_shards(self.root, self._info())

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    @property
    def bos_id(self) -> int:
        return self.vocab.bos_id

    @property
    def pad_id(self) -> int:
        return self.vocab.pad_id

    @property
    def eos_id(self) -> int:
        return self.vocab.eos_id

    @property
    def unk_id(self) -> int:
        return self.vocab.unk_id

    def encode(self, text: str, lang: str | None = None) -> list[int]:
        """Raw text -> ids (:meth:`Vocab.encode`)."""
        return self.vocab.encode(text, lang)

    def decode(self, ids: Iterable[int] | torch.Tensor, detokenize: bool = True, lang: str | None = None) -> str:
        """Ids -> text (:meth:`Vocab.decode`)."""
        return self.vocab.decode(ids, detokenize, lang)
