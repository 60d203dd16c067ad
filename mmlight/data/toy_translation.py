"""The translation quick start: a generated German->English-like language pair with word reordering,
written once into a cache folder (the corpus in IWSLT14's ``fairseq`` layout under ``raw/``, and the
shard set by the IWSLT14 writer :func:`~mmlight.data.translation_shards.write_translation_shards`)
and then streamed exactly like IWSLT14 (:class:`TranslationDataModule`).

The grammar (lowercase, already "Moses-tokenised": punctuation is a separate word)::

    sentence := main [ "," conj sub ] "."
    main     := subj verb obj            (no fronted adverb: both languages S V O)
              | adv verb subj obj        German verb-second -> target  adv subj verb obj
    sub      := subj obj verb            German verb-final  -> target  subj verb obj
    subj     := pronoun | det_nom [adj_nom] noun
    obj      := det_acc [adj_acc] noun

Every source word has one target word (``der``/``den`` -> ``the``, ``rote``/``roter``/``roten`` -> ``red``;
the German forms follow real masculine declension: ``der rote hund``, ``ein roter hund``,
``den roten hund``), and noun phrases reorder as ``det adj noun`` -> ``det noun adj``. So the target is
the source with (1) every ``adj noun`` swapped, (2) the verb of a fronted-adverb main clause moved
after the subject, (3) the clause-final verb of a subordinate clause moved after its subject, then
(4) every word translated. Sentences have 5 to 18 words (punctuation included). Examples::

    heute sieht mein alter koch den hund .
    today my cook old sees the dog .

    der vogel findet einen blauen fisch , weil er den arzt fragt .
    the bird finds a fish blue , because he asks the doctor .

The BPE ``code`` file holds real subword-nmt merges learnt on the lexicon (every word of both
languages, ``learn_bpe`` with ``min_frequency=2`` on counts of 2) until each word is one symbol, so BPE
leaves every word whole (a code file with no merges would split words into characters; one with zero
lines is rejected by subword-nmt).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path

import numpy as np

from mmlight.data.shards import INFO_FILE, prepare_once, write_text_atomic
from mmlight.data.tokenizers import count_bpe_merges
from mmlight.data.translation import TranslationDataModule
from mmlight.data.translation_shards import BPE_FILE, ParallelText, write_translation_shards

#: bump when the grammar or lexicon changes, so an old cache is refused.
GENERATOR_VERSION = 1
ARGS_FILE = "toy_translation.json"
SPLITS = ("train", "valid", "test")

# (German, English); German determiners as (nominative, accusative), adjectives as stems.
DETERMINERS = [
    (("der", "den"), "the"),
    (("ein", "einen"), "a"),
    (("mein", "meinen"), "my"),
    (("dein", "deinen"), "your"),
]
ADJECTIVES = [
    ("rot", "red"),
    ("gross", "big"),
    ("klein", "small"),
    ("alt", "old"),
    ("jung", "young"),
    ("schnell", "fast"),
    ("gruen", "green"),
    ("blau", "blue"),
]
NOUNS = [
    ("hund", "dog"),
    ("vogel", "bird"),
    ("lehrer", "teacher"),
    ("fisch", "fish"),
    ("koch", "cook"),
    ("koenig", "king"),
    ("freund", "friend"),
    ("baecker", "baker"),
    ("arzt", "doctor"),
    ("fuchs", "fox"),
    ("maler", "painter"),
    ("onkel", "uncle"),
]
VERBS = [
    ("sieht", "sees"),
    ("findet", "finds"),
    ("liebt", "loves"),
    ("hoert", "hears"),
    ("fragt", "asks"),
    ("kennt", "knows"),
    ("ruft", "calls"),
    ("malt", "paints"),
    ("fuettert", "feeds"),
    ("besucht", "visits"),
]
PRONOUNS = [("er", "he"), ("sie", "she"), ("es", "it")]
ADVERBS = [("heute", "today"), ("morgen", "tomorrow"), ("oft", "often"), ("jetzt", "now")]
CONJUNCTIONS = [("weil", "because"), ("obwohl", "although"), ("wenn", "when")]
PUNCTUATION = [(",", ","), (".", ".")]

P_ADVERB, P_ADJECTIVE, P_PRONOUN, P_SUBCLAUSE = 0.3, 0.5, 0.2, 0.4


def adjective_form(stem: str, det: str, accusative: bool) -> str:
    """Masculine declension: ``den roten``, ``der rote``, ``ein/mein/dein roter``."""
    if accusative:
        return stem + "en"
    return stem + ("e" if det == "der" else "er")


def lexicon() -> dict[str, str]:
    """Every German word form -> its English word."""
    out = {}
    for (nom, acc), en in DETERMINERS:
        out[nom] = out[acc] = en
    for stem, en in ADJECTIVES:
        for form in (stem + "e", stem + "er", stem + "en"):
            out[form] = en
    for table in (NOUNS, VERBS, PRONOUNS, ADVERBS, CONJUNCTIONS, PUNCTUATION):
        out.update(table)
    return out


def _pick(rng: np.random.Generator, table: list):
    return table[int(rng.integers(len(table)))]


def _noun_phrase(rng: np.random.Generator, accusative: bool, allow_pronoun: bool) -> tuple[list[str], list[str]]:
    """(German words, English words) of one noun phrase."""
    if allow_pronoun and rng.random() < P_PRONOUN:
        de, en = _pick(rng, PRONOUNS)
        return [de], [en]
    (nom, acc), det_en = _pick(rng, DETERMINERS)
    det = acc if accusative else nom
    noun_de, noun_en = _pick(rng, NOUNS)
    if rng.random() < P_ADJECTIVE:
        stem, adj_en = _pick(rng, ADJECTIVES)
        return [det, adjective_form(stem, nom, accusative), noun_de], [det_en, noun_en, adj_en]
    return [det, noun_de], [det_en, noun_en]


def toy_pair(rng: np.random.Generator) -> tuple[str, str]:
    """One (German, English) sentence pair drawn from the grammar of the module docstring."""
    subj_de, subj_en = _noun_phrase(rng, accusative=False, allow_pronoun=True)
    verb_de, verb_en = _pick(rng, VERBS)
    obj_de, obj_en = _noun_phrase(rng, accusative=True, allow_pronoun=False)
    if rng.random() < P_ADVERB:
        adv_de, adv_en = _pick(rng, ADVERBS)
        de = [adv_de, verb_de, *subj_de, *obj_de]
        en = [adv_en, *subj_en, verb_en, *obj_en]
    else:
        de = [*subj_de, verb_de, *obj_de]
        en = [*subj_en, verb_en, *obj_en]
    if rng.random() < P_SUBCLAUSE:
        conj_de, conj_en = _pick(rng, CONJUNCTIONS)
        s_de, s_en = _noun_phrase(rng, accusative=False, allow_pronoun=True)
        v_de, v_en = _pick(rng, VERBS)
        o_de, o_en = _noun_phrase(rng, accusative=True, allow_pronoun=False)
        de += [",", conj_de, *s_de, *o_de, v_de]
        en += [",", conj_en, *s_en, v_en, *o_en]
    return " ".join(de + ["."]), " ".join(en + ["."])


def toy_pairs(n: int, seed: int, split: str) -> list[tuple[str, str]]:
    """``n`` pairs of ``split``, from the random stream ``numpy.random.default_rng([seed, k])``
    (``k`` = 0, 1, 2 for train, valid, test)."""
    rng = np.random.default_rng([seed, SPLITS.index(split)])
    return [toy_pair(rng) for _ in range(n)]


def toy_bpe_codes() -> str:
    """subword-nmt codes (``#version: 0.2``) that merge every lexicon word of both languages into one
    symbol, learnt with subword-nmt's ``learn_bpe`` on the word list (so BPE leaves the words whole)."""
    from subword_nmt.learn_bpe import learn_bpe

    words = sorted(set(lexicon()) | set(lexicon().values()))
    out = io.StringIO()
    with contextlib.redirect_stderr(io.StringIO()):  # its progress bar and "Stopping" message
        learn_bpe(
            io.StringIO("".join(f"{w} 2\n" for w in words)), out, num_symbols=10_000, min_frequency=2, is_dict=True
        )
    return out.getvalue()


def toy_corpus(seed: int, train_size: int, valid_size: int, test_size: int) -> ParallelText:
    """``{split: (German lines, English lines)}`` of :func:`toy_pairs` (every size >= 1)."""
    sizes = dict(zip(SPLITS, (train_size, valid_size, test_size)))
    return {split: tuple(list(side) for side in zip(*toy_pairs(n, seed, split))) for split, n in sizes.items()}


def _write_fairseq_layout(src_dir: Path, texts: ParallelText, codes: str) -> Path:
    src_dir.mkdir(parents=True, exist_ok=True)
    for split, sides in texts.items():
        for lang, lines in zip(("de", "en"), sides):
            write_text_atomic(src_dir / f"{split}.{lang}", "".join(line + "\n" for line in lines))
    write_text_atomic(src_dir / BPE_FILE, codes)
    return src_dir


def write_toy_corpus(
    src_dir: Path, seed: int = 0, train_size: int = 20000, valid_size: int = 500, test_size: int = 500
) -> Path:
    """Write ``{train,valid,test}.{de,en}`` and the BPE ``code`` (IWSLT14's fairseq layout) into
    ``src_dir``; the same arguments give byte-identical files. Returns ``src_dir``."""
    return _write_fairseq_layout(Path(src_dir), toy_corpus(seed, train_size, valid_size, test_size), toy_bpe_codes())


class ToyTranslationDataModule(TranslationDataModule):
    """The toy translation task (see the module docstring), written to ``cache_dir`` by
    :meth:`prepare_data` on first use and then streamed exactly like IWSLT14 (same batch dicts, ids,
    ``encode``/``decode``). Lightning calls ``prepare_data`` before any loader; used by hand, call it
    first (loaders and the other vocabulary properties raise a FileNotFoundError saying so otherwise;
    :attr:`vocab_size` prepares the corpus itself, since the CLI reads it before Lightning runs).

    The cache keeps the generation arguments in ``toy_translation.json``; a cache written with other
    arguments is refused with a ValueError.

    Args:
        cache_dir: where the raw corpus (``raw/``), shards, ``dict.txt`` and ``code`` are written once.
        train_size: training sentence pairs.
        valid_size: validation sentence pairs.
        test_size: test sentence pairs (also predicted when ``src_file`` is None).
        seed: seed of the corpus (each split has its own random stream).
        max_tokens: token budget per batch: batch size x largest sample size (longer side + ``</s>``).
        num_workers: DataLoader worker processes per device.
        samples_per_shard: sentence pairs per shard file.
        max_source_positions: longest source (with ``</s>``) kept; longer samples are skipped.
        max_target_positions: longest target (with ``</s>``) kept; longer samples are skipped.
        bucket_buffer: samples gathered, sorted by length and cut into batches at a time.
        src_file: raw German text file for ``predict`` (tokenised, lowercased and BPE'd like the data).
    """

    def __init__(
        self,
        cache_dir: str = "~/.cache/mmlight/toy_translation",
        train_size: int = 20000,
        valid_size: int = 500,
        test_size: int = 500,
        seed: int = 0,
        max_tokens: int = 2048,
        num_workers: int = 0,
        samples_per_shard: int = 5000,
        max_source_positions: int = 1024,
        max_target_positions: int = 1024,
        bucket_buffer: int = 2000,
        src_file: str | None = None,
    ):
        super().__init__(
            os.path.expanduser(cache_dir),
            max_tokens,
            num_workers,
            max_source_positions,
            max_target_positions,
            bucket_buffer,
            src_file,
        )
        for name, value in (
            ("train_size", train_size),
            ("valid_size", valid_size),
            ("test_size", test_size),
            ("samples_per_shard", samples_per_shard),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.train_size, self.valid_size, self.test_size = train_size, valid_size, test_size
        self.seed = seed
        self.samples_per_shard = samples_per_shard

    def generation_args(self) -> dict:
        """What the cache's content depends on (kept in ``toy_translation.json``)."""
        return {
            "version": GENERATOR_VERSION,
            "seed": self.seed,
            "train_size": self.train_size,
            "valid_size": self.valid_size,
            "test_size": self.test_size,
            "samples_per_shard": self.samples_per_shard,
        }

    def prepare_data(self) -> None:
        """Write the corpus and its shard set into ``cache_dir`` unless a complete one with the same
        generation arguments is there; refuse one written with other arguments. Another process
        preparing the same folder is waited for (:func:`~mmlight.data.shards.prepare_once`)."""
        prepare_once(self.root, self._prepare)

    def _prepare(self) -> None:
        root = Path(self.root)
        args, args_path = self.generation_args(), root / ARGS_FILE
        if (root / INFO_FILE).is_file():
            if not args_path.is_file():
                raise ValueError(
                    f"{root} holds a shard set that is not the toy translation corpus "
                    f"(no {ARGS_FILE}): choose another cache_dir or delete that folder"
                )
            old = json.loads(args_path.read_text(encoding="utf-8"))
            diff = [f"{k}={old.get(k)!r} (asked {v!r})" for k, v in args.items() if old.get(k) != v]
            if diff:
                raise ValueError(
                    f"{root} holds a toy translation corpus written with other arguments: "
                    f"{', '.join(diff)}; choose another cache_dir or delete that folder"
                )
            return
        # no complete shard set (none, or an interrupted write): write everything; _info.json comes last
        root.mkdir(parents=True, exist_ok=True)
        write_text_atomic(args_path, json.dumps(args, indent=2))
        texts = toy_corpus(self.seed, self.train_size, self.valid_size, self.test_size)
        codes = toy_bpe_codes()
        _write_fairseq_layout(root / "raw", texts, codes)  # the corpus as text, for reading and reference
        write_text_atomic(root / BPE_FILE, codes)  # BPE leaves every word whole: the text is already BPE'd
        write_translation_shards(
            texts,
            root,
            layout="fairseq",
            bpe_merges=count_bpe_merges(root / BPE_FILE),
            samples_per_shard=self.samples_per_shard,
        )
        self.info, self._vocab = None, None

    @property
    def vocab_size(self) -> int:
        """The joint dictionary's size. The corpus is generated and prepared first when it is not yet:
        the CLI links this size into the model when it builds the DataModule, before Lightning calls
        :meth:`prepare_data`, and the size is a property of the generated corpus."""
        if self.info is None and not (Path(self.root) / INFO_FILE).is_file():
            self.prepare_data()
        return super().vocab_size

    def _info(self) -> dict:
        if self.info is None and not (Path(self.root) / INFO_FILE).is_file():
            raise FileNotFoundError(
                f"no toy translation data in {self.root} yet: call prepare_data() first "
                "(Lightning's fit/validate/test/predict call it before any loader)"
            )
        return super()._info()
