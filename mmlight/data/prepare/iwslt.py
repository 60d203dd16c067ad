"""IWSLT14 German-English for ``mmlight prepare iwslt14``, following fairseq's ``prepare-iwslt14.sh``.

Two raw layouts are accepted (see :func:`detect_layout`):

``fairseq``
    what fairseq's preparation script leaves: ``{train,valid,test}.{de,en}`` (Moses-tokenised,
    lowercased, joint BPE with ``@@ `` separators) plus its BPE ``code`` file. Used as is; the codes
    are copied beside the shards.
``raw``
    the IWSLT14 release: ``train.tags.de-en.{de,en}`` and the XML dev/test sets. The recipe's steps
    are re-implemented:

    1. training text: drop lines holding ``<url>``, ``<talkid>`` or ``<keywords>``, and strip the
       ``<title>``/``</title>``/``<description>``/``</description>`` tags but keep their text (this is
       exactly the recipe's ``grep -v``/``sed`` rule: other lines, even ones starting with ``<``, stay);
    2. Moses tokenisation per language (``sacremoses``, with tokenizer.perl's default escaping of
       ``& | < > ' " [ ]`` and its splitting of a line's final period, see
       :mod:`mmlight.data.tokenizers`), lowercasing;
    3. cleaning of training pairs as ``clean-corpus-n.perl -ratio 1.5 ... 1 175``: 1..175 tokens per
       side, length ratio at most 1.5 either way, no token over 1000 characters;
    4. valid = every 23rd cleaned training pair (lines 23, 46, ...), train = the rest;
       test = dev2010 + TEDX.dev2012 + tst2010 + tst2011 + tst2012, from the ``<seg id="N">`` lines
       (with ``’`` replaced by ``'``, as the recipe does; test pairs are not length-cleaned);
    5. joint BPE (``subword-nmt``) with 10,000 merge operations learnt on train de + en, applied to
       every split; the codes are saved as ``code`` beside the shards.

    The tokenised splits are kept in ``tokenised.json`` (keyed by the raw files' checksums) and the
    codes with ``code.json``, so a rerun neither tokenises nor learns BPE again.

Both layouts then go through :func:`mmlight.data.translation_shards.write_translation_shards`: a
joint dictionary ``dict.txt`` (fairseq's format ``token count``, one per line, by descending count,
ties alphabetical; the specials ``<s>`` 0, ``<pad>`` 1, ``</s>`` 2, ``<unk>`` 3 come first and are
implicit, so line ``i`` is id ``i + 4``), and shards of samples::

    {"__key__": "train-0000042", "src.npy": int32 ids (de), "tgt.npy": int32 ids (en),
     "src.txt": BPE'd German text, "tgt.txt": BPE'd English text}

with no BOS/EOS stored. The tokeniser, BPE and dictionary code lives in the runtime modules
:mod:`mmlight.data.tokenizers` and :mod:`mmlight.data.vocab`, which also encode and decode text at
predict time. A pair with an empty side or invalid UTF-8 is skipped, logged with
``path:line`` and listed in ``_info.json`` (with the split its file feeds; raw training-file skips
are listed under ``train``); line counts that differ between the German and English files are fatal.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import re
import shutil
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Literal

from mmlight.data.shard_writer import Skipped
from mmlight.data.shards import atomic_write, sha256, write_text_atomic
from mmlight.data.tokenizers import TOKENIZER, apply_bpe, count_bpe_merges, moses_tokenize
from mmlight.data.translation_shards import (
    BPE_FILE,
    SAMPLES_PER_SHARD,
    SRC_LANG,
    TGT_LANG,
    ParallelText,
    write_translation_shards,
)

log = logging.getLogger(__name__)

NEEDS_SRC = True
LANGS = (SRC_LANG, TGT_LANG)
BPE_MERGES = 10_000
MIN_LEN, MAX_LEN, MAX_RATIO, MAX_WORD_LEN = 1, 175, 1.5, 1000
VALID_EVERY = 23

FAIRSEQ_FILES = [f"{split}.{lang}" for split in ("train", "valid", "test") for lang in LANGS] + [BPE_FILE]
RAW_TRAIN = {lang: f"train.tags.de-en.{lang}" for lang in LANGS}
#: the dev/test sets the recipe concatenates into ``test``, in its order.
RAW_TEST_SETS = (
    "IWSLT14.TED.dev2010",
    "IWSLT14.TEDX.dev2012",
    "IWSLT14.TED.tst2010",
    "IWSLT14.TED.tst2011",
    "IWSLT14.TED.tst2012",
)
RAW_FILES = list(RAW_TRAIN.values()) + [f"{name}.de-en.{lang}.xml" for name in RAW_TEST_SETS for lang in LANGS]

_DROP_TAGS = ("<url>", "<talkid>", "<keywords>")
_STRIP_TAGS = re.compile(r"</?(title|description)>")
_SEG_OPEN = re.compile(r'<seg id="[0-9]*">\s*')
_SEG_CLOSE = re.compile(r"\s*</seg>\s*")

Layout = Literal["fairseq", "raw"]


# ----------------------------------------------------------------------------- text processing


def _tokenize_chunk(job: tuple[str, list[str]]) -> list[str]:
    lang, lines = job
    return [moses_tokenize(line, lang) for line in lines]


def _bpe_chunk(job: tuple[str, list[str]]) -> list[str]:
    codes, lines = job
    return [apply_bpe(line, codes) for line in lines]


def _parallel(fn, arg: str, lines: list[str], workers: int, chunk: int = 5000) -> list[str]:
    """``fn((arg, lines))`` over chunks of ``lines``, in ``workers`` processes when worth it."""
    jobs = [(arg, lines[i : i + chunk]) for i in range(0, len(lines), chunk)]
    if workers <= 1 or len(jobs) <= 1:
        return [out for job in jobs for out in fn(job)]
    with ProcessPoolExecutor(max_workers=workers) as pool:
        return [out for part in pool.map(fn, jobs) for out in part]


def clean_pair(de: str, en: str) -> tuple[str, str] | None:
    """``clean-corpus-n.perl -ratio 1.5 ... 1 175`` on one tokenised pair: the normalised pair, or None."""
    sides = []
    for text in (de, en):
        words = text.replace("|", "").split()
        if not MIN_LEN <= len(words) <= MAX_LEN or any(len(w) > MAX_WORD_LEN for w in words):
            return None
        sides.append(words)
    n_de, n_en = len(sides[0]), len(sides[1])
    if n_de / n_en > MAX_RATIO or n_en / n_de > MAX_RATIO:
        return None
    return " ".join(sides[0]), " ".join(sides[1])


# ----------------------------------------------------------------------------- reading raw files


def detect_layout(src: Path) -> Layout:
    """``fairseq`` or ``raw`` by which complete set of files ``src`` holds; else a FileNotFoundError."""
    missing = {
        name: [f for f in files if not (src / f).is_file()]
        for name, files in (("fairseq", FAIRSEQ_FILES), ("raw", RAW_FILES))
    }
    for name in ("fairseq", "raw"):
        if not missing[name]:
            return name  # type: ignore[return-value]
    raise FileNotFoundError(
        f"{src} holds neither IWSLT14 layout. fairseq's prepared output needs {', '.join(FAIRSEQ_FILES)} "
        f"(missing: {', '.join(missing['fairseq'])}); the raw release needs {', '.join(RAW_FILES)} "
        f"(missing: {', '.join(missing['raw'])})"
    )


def _read_lines(path: Path) -> list[bytes]:
    with open(path, "rb") as f:
        return [line.rstrip(b"\r\n") for line in f]


def _paired_lines(de_path: Path, en_path: Path, de: list[bytes], en: list[bytes], what: str, unit: str = ""):
    """Yield ``(loc_de, loc_en, de_text, en_text)`` or ``Skipped`` per pair; different counts are fatal.

    Locations read ``path:N`` (``path:segN`` for the N-th ``<seg>`` line of an XML file, ``unit="seg"``).
    """
    if len(de) != len(en):
        raise ValueError(
            f"{what}: {de_path} has {len(de)} lines but {en_path} has {len(en)}; "
            "the German and English sides must be line-aligned"
        )
    for i, (d, e) in enumerate(zip(de, en)):
        texts = []
        for path, raw in ((de_path, d), (en_path, e)):
            try:
                texts.append(raw.decode("utf-8"))
            except UnicodeDecodeError as err:
                texts.append(Skipped(f"{path}:{unit}{i + 1}", f"invalid UTF-8 ({err.reason} at byte {err.start})"))
        bad = [t for t in texts if isinstance(t, Skipped)]
        yield bad[0] if bad else (f"{de_path}:{unit}{i + 1}", f"{en_path}:{unit}{i + 1}", texts[0], texts[1])


def _xml_segments(path: Path) -> list[bytes]:
    """The ``<seg id>`` lines of an IWSLT XML file, cut to their text as the recipe's grep/sed does."""
    return [line for line in _read_lines(path) if b"<seg id" in line]


def _seg_text(line: str) -> str:
    return _SEG_CLOSE.sub("", _SEG_OPEN.sub("", line)).replace("\u2019", "'")


def _empty_side(loc_de: str, loc_en: str, de: str, en: str) -> Skipped | None:
    if not de.strip():
        return Skipped(loc_de, "empty German side")
    if not en.strip():
        return Skipped(loc_en, "empty English side")
    return None


def _tokenize_pairs(pairs: list[tuple[str, str, str, str]], skipped: list[dict], workers: int) -> list[tuple[str, str]]:
    """Tokenise ``(loc_de, loc_en, de, en)`` pairs; a pair with an empty side after tokenisation is
    recorded in ``skipped`` (with the location of the empty side) and left out."""
    tok_de = _parallel(_tokenize_chunk, "de", [p[2] for p in pairs], workers)
    tok_en = _parallel(_tokenize_chunk, "en", [p[3] for p in pairs], workers)
    kept = []
    for (loc_de, loc_en, _, _), de, en in zip(pairs, tok_de, tok_en):
        bad = _empty_side(loc_de, loc_en, de, en)
        if bad is None:
            kept.append((de, en))
        else:
            skipped.append(vars(bad))
    return kept


def _read_raw(src: Path, workers: int) -> tuple[dict, dict, dict]:
    """Raw layout -> ({split: (de_lines, en_lines)} tokenised + lowercased, {split: skipped}, stats)."""
    stats = {"tag_lines_dropped": 0, "cleaned_out": 0}
    skipped: dict[str, list[dict]] = {"train": [], "valid": [], "test": []}

    def keep(item) -> tuple | None:
        if isinstance(item, Skipped):
            skipped["train"].append(vars(item))
            return None
        return item

    # training pairs: tags, then tokenise, then empty sides and cleaning
    paths = {lang: src / RAW_TRAIN[lang] for lang in LANGS}
    pairs = []
    for item in _paired_lines(
        paths["de"], paths["en"], _read_lines(paths["de"]), _read_lines(paths["en"]), "training text"
    ):
        if keep(item) is None:
            continue
        loc_de, loc_en, de, en = item
        if any(tag in de or tag in en for tag in _DROP_TAGS):
            stats["tag_lines_dropped"] += 1
            continue
        pairs.append((loc_de, loc_en, _STRIP_TAGS.sub("", de), _STRIP_TAGS.sub("", en)))
    cleaned = []
    for de, en in _tokenize_pairs(pairs, skipped["train"], workers):
        pair = clean_pair(de, en)
        if pair is None:
            stats["cleaned_out"] += 1
            continue
        cleaned.append(pair)
    valid = [p for i, p in enumerate(cleaned, 1) if i % VALID_EVERY == 0]
    train = [p for i, p in enumerate(cleaned, 1) if i % VALID_EVERY != 0]

    # test: the dev/test sets in the recipe's order
    test_pairs = []
    for name in RAW_TEST_SETS:
        xml = {lang: src / f"{name}.de-en.{lang}.xml" for lang in LANGS}
        for item in _paired_lines(
            xml["de"],
            xml["en"],
            _xml_segments(xml["de"]),
            _xml_segments(xml["en"]),
            f"<seg> lines of {name}",
            unit="seg",
        ):
            if isinstance(item, Skipped):
                skipped["test"].append(vars(item))
                continue
            loc_de, loc_en, de, en = item
            test_pairs.append((loc_de, loc_en, _seg_text(de), _seg_text(en)))
    test = [
        (" ".join(de.split()), " ".join(en.split())) for de, en in _tokenize_pairs(test_pairs, skipped["test"], workers)
    ]

    texts = {
        name: ([p[0] for p in split], [p[1] for p in split])
        for name, split in (("train", train), ("valid", valid), ("test", test))
    }
    return texts, skipped, stats


TOKENISED_CACHE = "tokenised.json"


def _read_raw_cached(src: Path, out: Path, workers: int) -> tuple[dict, dict, dict]:
    """:func:`_read_raw`, kept in ``out/tokenised.json`` (keyed by the raw files' checksums and the
    tokeniser's version) so that a rerun does not tokenise again."""
    key = {**{name: sha256(src / name) for name in RAW_FILES}, "tokenizer": TOKENIZER}
    cache = out / TOKENISED_CACHE
    if cache.is_file():
        try:
            data = json.loads(cache.read_text(encoding="utf-8"))
        except ValueError:
            data = {}
        if data.get("key") == key:
            log.info("reusing the tokenised text in %s", cache)
            return ({k: tuple(v) for k, v in data["texts"].items()}, data["skipped"], data["stats"])
    texts, skipped, stats = _read_raw(src, workers)
    write_text_atomic(cache, json.dumps({"key": key, "texts": texts, "skipped": skipped, "stats": stats}))
    return texts, skipped, stats


def _read_fairseq(src: Path) -> tuple[ParallelText, dict]:
    """fairseq layout -> ({split: (de_lines, en_lines)} BPE'd, {split: skipped})."""
    texts, skipped = {}, {}
    for split in ("train", "valid", "test"):
        de_path, en_path = src / f"{split}.de", src / f"{split}.en"
        de_lines, en_lines, bad = [], [], []
        for item in _paired_lines(de_path, en_path, _read_lines(de_path), _read_lines(en_path), split):
            if isinstance(item, Skipped):
                bad.append(vars(item))
                continue
            empty = _empty_side(*item)
            if empty is not None:
                bad.append(vars(empty))
                continue
            de_lines.append(" ".join(item[2].split()))
            en_lines.append(" ".join(item[3].split()))
        texts[split], skipped[split] = (de_lines, en_lines), bad
    return texts, skipped


# ----------------------------------------------------------------------------- BPE


def learn_joint_bpe(train: tuple[list[str], list[str]], out: Path, merges: int = BPE_MERGES) -> Path:
    """Learn ``merges`` joint BPE operations on train de + en into ``out/code``; reuse a consistent one.

    The codes are kept with ``code.json`` (merge count and checksum of the training text); when both
    match, the existing codes are reused instead of learnt again.
    """
    from subword_nmt.learn_bpe import learn_bpe

    corpus = "".join(line + "\n" for side in train for line in side)
    meta = {"merges": merges, "train_sha256": hashlib.sha256(corpus.encode("utf-8")).hexdigest()}
    codes, meta_path = out / BPE_FILE, out / (BPE_FILE + ".json")
    if codes.is_file() and meta_path.is_file():
        old = json.loads(meta_path.read_text())
        if {k: old.get(k) for k in meta} == meta and sha256(codes) == old.get("sha256"):
            log.info("reusing BPE codes %s", codes)
            return codes
    log.info("learning %d joint BPE merges on %d training lines", merges, corpus.count("\n"))
    buffer = io.StringIO()
    learn_bpe(io.StringIO(corpus), buffer, merges)
    write_text_atomic(codes, buffer.getvalue())
    write_text_atomic(meta_path, json.dumps({**meta, "sha256": sha256(codes)}))
    return codes


def prepare_iwslt(
    src: Path, out: Path, workers: int = 1, merges: int = BPE_MERGES, samples_per_shard: int = SAMPLES_PER_SHARD
) -> dict:
    """:func:`prepare` with the BPE merge count and shard size as knobs (tests use small ones)."""
    layout = detect_layout(src)
    out.mkdir(parents=True, exist_ok=True)
    stats: dict = {}
    if layout == "fairseq":
        texts, skipped = _read_fairseq(src)
        codes = out / BPE_FILE
        if not (codes.is_file() and sha256(codes) == sha256(src / BPE_FILE)):
            with atomic_write(codes) as tmp:
                shutil.copyfile(src / BPE_FILE, tmp)
        merges_used = count_bpe_merges(codes)
    else:
        tokenised, skipped, stats = _read_raw_cached(src, out, workers)
        codes = learn_joint_bpe(tokenised["train"], out, merges)
        merges_used = merges
        codes_text = codes.read_text(encoding="utf-8")
        texts = {
            split: tuple(_parallel(_bpe_chunk, codes_text, side, workers) for side in sides)
            for split, sides in tokenised.items()
        }
    return write_translation_shards(
        texts,
        out,
        layout=layout,
        bpe_merges=merges_used,
        skipped=skipped,
        cleaning=stats,
        samples_per_shard=samples_per_shard,
        workers=workers,
    )


def prepare(src: Path, out: Path, workers: int) -> dict:
    """``mmlight prepare iwslt14``: shards, ``code``, ``dict.txt`` and ``_info.json`` in ``out``."""
    return prepare_iwslt(src, out, workers)
