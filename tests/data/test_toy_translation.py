"""The toy translation corpus: its reordering rule, determinism, and streaming through the IWSLT pipeline."""

import inspect
import json
import os
import shutil
import threading
from pathlib import Path

import pytest
import yaml
from sacremoses import MosesDetokenizer

from mmlight.data import ToyTranslationDataModule, TranslationDataModule
from mmlight.data.shards import preparing
from mmlight.data.tokenizers import moses_tokenize
from mmlight.data.toy_translation import (
    ADJECTIVES,
    ADVERBS,
    CONJUNCTIONS,
    DETERMINERS,
    GENERATOR_VERSION,
    NOUNS,
    PRONOUNS,
    VERBS,
    lexicon,
    toy_pairs,
    write_toy_corpus,
)
from mmlight.data.vocab import load_dictionary

ROOT = Path(__file__).resolve().parents[2]
FILES = [f"{s}.{lang}" for s in ("train", "valid", "test") for lang in ("de", "en")] + ["code"]
SMALL = {"train_size": 200, "valid_size": 30, "test_size": 20, "seed": 0, "max_tokens": 256, "samples_per_shard": 64}

DETS = {w for forms, _ in DETERMINERS for w in forms}
ADJS = {stem + end for stem, _ in ADJECTIVES for end in ("e", "er", "en")}
NOUN_WORDS = {w for w, _ in NOUNS}
VERB_WORDS = {w for w, _ in VERBS}
PRONOUN_WORDS = {w for w, _ in PRONOUNS}
ADVERB_WORDS = {w for w, _ in ADVERBS}
CONJ_WORDS = {w for w, _ in CONJUNCTIONS}


def _noun_phrase(words, i):
    """The noun phrase starting at ``words[i]`` in target order, and the index after it."""
    if words[i] in PRONOUN_WORDS:
        return [words[i]], i + 1
    assert words[i] in DETS, words
    if words[i + 1] in ADJS:
        assert words[i + 2] in NOUN_WORDS
        return [words[i], words[i + 2], words[i + 1]], i + 3  # det adj noun -> det noun adj
    assert words[i + 1] in NOUN_WORDS
    return [words[i], words[i + 1]], i + 2


def _reference_translation(de: str) -> str:
    """The rule, re-derived from a German sentence by parsing it (not by the generator)."""
    words = de.split()
    assert words[-1] == "."
    words = words[:-1]
    main, sub = (words, None) if "," not in words else (words[: words.index(",")], words[words.index(",") + 1 :])
    out = []
    if main[0] in ADVERB_WORDS:  # adv verb subj obj -> adv subj verb obj
        assert main[1] in VERB_WORDS
        subj, i = _noun_phrase(main, 2)
        obj, j = _noun_phrase(main, i)
        out += [main[0], *subj, main[1], *obj]
    else:  # subj verb obj
        subj, i = _noun_phrase(main, 0)
        assert main[i] in VERB_WORDS
        obj, j = _noun_phrase(main, i + 1)
        out += [*subj, main[i], *obj]
    assert j == len(main)
    if sub is not None:  # conj subj obj verb -> conj subj verb obj
        assert sub[0] in CONJ_WORDS and sub[-1] in VERB_WORDS
        subj, i = _noun_phrase(sub, 1)
        obj, j = _noun_phrase(sub, i)
        assert j == len(sub) - 1
        out += [",", sub[0], *subj, sub[-1], *obj]
    words_en = {
        **{a: b for a, b in NOUNS + VERBS + PRONOUNS + ADVERBS + CONJUNCTIONS},
        **{f: en for forms, en in DETERMINERS for f in forms},
        **{stem + end: en for stem, en in ADJECTIVES for end in ("e", "er", "en")},
        ",": ",",
    }
    return " ".join(words_en[w] for w in out) + " ."


def _lines(path):
    return path.read_text(encoding="utf-8").splitlines()


def test_documented_examples_follow_the_rule():
    assert _reference_translation("heute sieht mein alter koch den hund .") == "today my cook old sees the dog ."
    assert (
        _reference_translation("der vogel findet einen blauen fisch , weil er den arzt fragt .")
        == "the bird finds a fish blue , because he asks the doctor ."
    )


def test_every_generated_pair_follows_the_reordering_rule():
    pairs = toy_pairs(1500, seed=3, split="train")
    for de, en in pairs:
        assert _reference_translation(de) == en
        assert de.endswith(" .") and en.endswith(" .")
    lengths = [len(de.split()) for de, _ in pairs]
    assert min(lengths) == 5 and max(lengths) >= 16
    # the long-distance moves actually occur
    assert any(de.split()[0] in ADVERB_WORDS for de, _ in pairs)
    assert sum("," in de for de, _ in pairs) > 300
    assert set(lexicon()) >= {w for de, _ in pairs for w in de.split()}


def test_corpus_files_are_deterministic(tmp_path):
    a = write_toy_corpus(tmp_path / "a", seed=5, train_size=50, valid_size=10, test_size=10)
    b = write_toy_corpus(tmp_path / "b", seed=5, train_size=50, valid_size=10, test_size=10)
    c = write_toy_corpus(tmp_path / "c", seed=6, train_size=50, valid_size=10, test_size=10)
    for name in FILES:
        assert (a / name).read_bytes() == (b / name).read_bytes()
    assert (a / "train.de").read_bytes() != (c / "train.de").read_bytes()
    assert (a / "code").read_bytes() == (c / "code").read_bytes()  # the codes depend only on the lexicon
    assert len(_lines(a / "train.de")) == len(_lines(a / "train.en")) == 50
    assert _lines(a / "valid.de") != _lines(a / "train.de")[:10]
    for de, en in zip(_lines(a / "test.de"), _lines(a / "test.en")):
        assert _reference_translation(de) == en


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    cache = tmp_path_factory.mktemp("toy")
    dm = ToyTranslationDataModule(cache_dir=str(cache), **SMALL)
    dm.prepare_data()
    return dm, cache


def test_vocabulary_and_ids_are_iwslt_s(prepared):
    dm, cache = prepared
    assert (dm.bos_id, dm.pad_id, dm.eos_id, dm.unk_id) == (0, 1, 2, 3)
    assert list(dm.vocab.tokens) == load_dictionary(cache / "dict.txt")
    assert dm.vocab.tokens[:4] == ("<s>", "<pad>", "</s>", "<unk>")
    assert dm.vocab_size == len(dm.vocab) == dm._info()["vocab"]["size"]
    words = set(lexicon()) | set(lexicon().values())
    assert set(dm.vocab.tokens[4:]) <= words  # BPE left every word whole
    assert dm.encode("Heute sieht der Hund den Fisch.") == [
        dm.vocab.tokens.index(w) for w in ("heute", "sieht", "der", "hund", "den", "fisch", ".")
    ]


def test_batches_decode_to_the_raw_target_lines(prepared):
    dm, cache = prepared
    detok = MosesDetokenizer(lang="en")
    for split, loader, size in (("valid", dm.val_dataloader(), 30), ("test", dm.test_dataloader(), 20)):
        de_lines, en_lines = _lines(cache / "raw" / f"{split}.de"), _lines(cache / "raw" / f"{split}.en")
        seen = []
        for batch in loader:
            assert batch["src"].numel() <= 256 and batch["tgt_out"].numel() <= 256
            assert (batch["tgt_in"][:, 0] == dm.eos_id).all()
            for i, idx in enumerate(batch["ids"].tolist()):
                seen.append(idx)
                assert dm.decode(batch["tgt_out"][i]) == detok.detokenize(en_lines[idx].split())
                assert dm.decode(batch["tgt_out"][i], detokenize=False) == en_lines[idx]
                assert dm.decode(batch["src"][i], detokenize=False, lang="de") == de_lines[idx]
        assert sorted(seen) == list(range(size))  # every sample once
    batch = next(iter(dm.train_dataloader()))
    en_lines = _lines(cache / "raw" / "train.en")
    for i, idx in enumerate(batch["ids"].tolist()):
        assert dm.decode(batch["tgt_out"][i]) == detok.detokenize(en_lines[idx].split())
        assert batch["tgt_out"][i, batch["tgt_mask"][i].sum() - 1] == dm.eos_id
    assert dm.decode(batch["tgt_out"][0]).endswith(".") and " ." not in dm.decode(batch["tgt_out"][0])


def test_prepare_writes_once_and_refuses_other_arguments(prepared, tmp_path):
    _, cache = prepared
    stamp = (cache / "_info.json").stat().st_mtime_ns
    ToyTranslationDataModule(cache_dir=str(cache), **SMALL).prepare_data()
    assert (cache / "_info.json").stat().st_mtime_ns == stamp
    assert json.loads((cache / "toy_translation.json").read_text())["train_size"] == 200
    with pytest.raises(ValueError, match=r"seed=0 \(asked 1\)"):
        ToyTranslationDataModule(cache_dir=str(cache), **{**SMALL, "seed": 1}).prepare_data()
    with pytest.raises(ValueError, match=r"train_size=200 \(asked 100\)"):
        ToyTranslationDataModule(cache_dir=str(cache), **{**SMALL, "train_size": 100}).prepare_data()
    (tmp_path / "_info.json").write_text("{}")  # some other shard set
    with pytest.raises(ValueError, match="not the toy translation corpus"):
        ToyTranslationDataModule(cache_dir=str(tmp_path), **SMALL).prepare_data()


def test_a_run_waits_while_another_prepares_the_same_folder_then_keeps_its_set(prepared, tmp_path):
    """Two runs sharing a cache folder (``mmlight sweep --parallel 2`` on a fresh machine): while one holds
    the folder's lock, the other writes nothing; once it is released, the other finds a complete set."""
    _, cache = prepared
    folder = tmp_path / "shared"
    dm = ToyTranslationDataModule(cache_dir=str(folder), **SMALL)
    with preparing(folder):
        waiting = threading.Thread(target=dm.prepare_data)
        waiting.start()
        waiting.join(timeout=1.0)
        assert waiting.is_alive() and not folder.exists()  # nothing written while the other holds it
    waiting.join(timeout=120)
    assert not waiting.is_alive()
    assert (folder / "dict.txt").read_bytes() == (cache / "dict.txt").read_bytes()
    shards = [s["sha256"] for s in json.loads((folder / "_info.json").read_text())["splits"]["train"]["shards"]]
    assert shards == [s["sha256"] for s in json.loads((cache / "_info.json").read_text())["splits"]["train"]["shards"]]


def test_a_complete_set_is_read_without_the_lock(prepared, monkeypatch):
    """A prepared set in a folder the user cannot write beside (a shared, read-only dataset) still loads:
    the lock file is only made when there is something to write."""
    import mmlight.data.shards as shards

    dm, cache = prepared

    def no_lock(folder):
        raise AssertionError(f"took the lock of a complete set: {folder}")

    monkeypatch.setattr(shards, "preparing", no_lock)
    ToyTranslationDataModule(cache_dir=str(cache), **SMALL).prepare_data()
    with pytest.raises(ValueError, match=r"seed=0 \(asked 1\)"):  # and still checks what it holds
        ToyTranslationDataModule(cache_dir=str(cache), **{**SMALL, "seed": 1}).prepare_data()


def test_loaders_before_prepare_data_say_so(tmp_path):
    dm = ToyTranslationDataModule(cache_dir=str(tmp_path / "empty"), **SMALL)
    with pytest.raises(
        FileNotFoundError, match=r"call prepare_data\(\) first \(Lightning's fit/validate/test/predict call"
    ):
        dm.train_dataloader()
    with pytest.raises(FileNotFoundError, match=r"prepare_data"):
        _ = dm.vocab


def test_vocab_size_prepares_the_corpus_it_describes(prepared, tmp_path):
    """The CLI links ``vocab_size`` into the model before Lightning calls ``prepare_data``."""
    _, cache = prepared
    dm = ToyTranslationDataModule(cache_dir=str(tmp_path / "fresh"), **SMALL)
    assert dm.vocab_size == len(load_dictionary(cache / "dict.txt")) == len(dm.vocab)
    assert (tmp_path / "fresh" / "dict.txt").read_bytes() == (cache / "dict.txt").read_bytes()


def test_same_seed_gives_the_same_shard_set(prepared, tmp_path):
    dm, cache = prepared
    other = ToyTranslationDataModule(cache_dir=str(tmp_path), **SMALL)
    other.prepare_data()
    for name in FILES:
        assert (tmp_path / "raw" / name).read_bytes() == (cache / "raw" / name).read_bytes()
    assert (tmp_path / "dict.txt").read_bytes() == (cache / "dict.txt").read_bytes()
    info_a, info_b = other._info()["splits"], dm._info()["splits"]
    assert [s["sha256"] for s in info_a["train"]["shards"]] == [s["sha256"] for s in info_b["train"]["shards"]]
    assert len(info_a["train"]["shards"]) == 4  # 200 samples, 64 per shard


def test_bad_arguments_raise(tmp_path):
    with pytest.raises(ValueError, match="train_size"):
        ToyTranslationDataModule(cache_dir=str(tmp_path), train_size=0)
    with pytest.raises(ValueError, match="seed"):
        ToyTranslationDataModule(cache_dir=str(tmp_path), seed=-1)


@pytest.mark.parametrize("name", ["train_size", "valid_size", "test_size", "samples_per_shard"])
def test_each_size_must_be_at_least_one(tmp_path, name):
    with pytest.raises(ValueError, match=rf"^{name} must be >= 1, got 0$"):
        ToyTranslationDataModule(cache_dir=str(tmp_path), **{name: 0})
    assert getattr(ToyTranslationDataModule(cache_dir=str(tmp_path), **{name: 1}), name) == 1


def test_the_arguments_reach_the_streaming_data_module(tmp_path):
    dm = ToyTranslationDataModule(
        cache_dir=str(tmp_path / "c"),
        max_tokens=300,
        num_workers=3,
        max_source_positions=40,
        max_target_positions=50,
        bucket_buffer=60,
        src_file="input.de",
    )
    assert (dm.root, dm.num_workers, dm.src_file) == (str(tmp_path / "c"), 3, "input.de")
    assert dm._batching() == {"max_tokens": 300, "buffer": 60, "max_source_positions": 40, "max_target_positions": 50}


@pytest.mark.parametrize(
    "name, value",
    [("version", 0), ("seed", 1), ("train_size", 7), ("valid_size", 7), ("test_size", 7), ("samples_per_shard", 7)],
)
def test_a_cache_written_with_any_other_generation_argument_is_refused(prepared, tmp_path, name, value):
    """Each argument the corpus depends on is kept in ``toy_translation.json`` under its own name and
    compared; an older generator's cache (another ``version``) is refused too."""
    _, cache = prepared
    copy = tmp_path / "cache"
    shutil.copytree(cache, copy)
    args = json.loads((copy / "toy_translation.json").read_text())
    assert args == {"version": GENERATOR_VERSION, **{k: v for k, v in SMALL.items() if k != "max_tokens"}}
    args[name] = value
    (copy / "toy_translation.json").write_text(json.dumps(args))
    asked = GENERATOR_VERSION if name == "version" else SMALL[name]
    with pytest.raises(ValueError, match=rf"other arguments: {name}={value} \(asked {asked}\); choose"):
        ToyTranslationDataModule(cache_dir=str(copy), **SMALL).prepare_data()


def test_every_differing_argument_is_named(prepared):
    _, cache = prepared
    with pytest.raises(ValueError, match=r"seed=0 \(asked 1\), train_size=200 \(asked 100\); choose"):
        ToyTranslationDataModule(cache_dir=str(cache), **{**SMALL, "seed": 1, "train_size": 100}).prepare_data()


def test_an_interrupted_write_is_written_again_into_a_new_nested_folder(prepared, tmp_path):
    """A cache folder whose parents do not exist yet; then a write interrupted before ``_info.json``
    (the last file) is done again over what it left, giving the same files."""
    _, cache = prepared
    root = tmp_path / "a" / "b" / "toy"
    dm = ToyTranslationDataModule(cache_dir=str(root), **SMALL)
    dm.prepare_data()
    (root / "_info.json").unlink()
    ToyTranslationDataModule(cache_dir=str(root), **SMALL).prepare_data()
    for name in FILES:
        assert (root / "raw" / name).read_bytes() == (cache / "raw" / name).read_bytes()
    info = json.loads((root / "_info.json").read_text())
    assert info == json.loads((cache / "_info.json").read_text())
    merges = [line for line in (root / "code").read_text().splitlines() if not line.startswith("#version")]
    assert info["layout"] == "fairseq" and info["vocab"]["tokenizer"]["bpe_merges"] == len(merges) > 100
    assert write_toy_corpus(tmp_path / "x" / "y", train_size=3, valid_size=1, test_size=1).is_dir()


# German masculine declension written out by hand: the determiners of each case, and the adjective ending
# each determiner takes (weak after der/den, mixed after ein/mein/dein, -en in every accusative)
NOMINATIVE = {"der": "e", "ein": "er", "mein": "er", "dein": "er"}
ACCUSATIVE = {"den": "en", "einen": "en", "meinen": "en", "deinen": "en"}


def _noun_phrases(de: str) -> list[tuple[str, list[str]]]:
    """``(case, words)`` of each noun phrase of a German sentence, in order: each clause has its subject
    (nominative) first and its object (accusative) second."""
    words, out, i, case = de.split(), [], 0, "nom"
    while i < len(words):
        w = words[i]
        if w in PRONOUN_WORDS or w in DETS:
            n = 1 if w in PRONOUN_WORDS else 3 if words[i + 1] in ADJS else 2
            out.append((case, words[i : i + n]))
            case = "acc" if case == "nom" else "nom"
            i += n
        else:
            i += 1
    return out


def test_noun_phrases_follow_the_case_and_the_declension():
    pairs = toy_pairs(1500, seed=4, split="valid")
    seen_endings = set()
    for de, _ in pairs:
        phrases = _noun_phrases(de)
        assert len(phrases) == (4 if "," in de else 2)
        for case, words in phrases:
            table = NOMINATIVE if case == "nom" else ACCUSATIVE
            assert words[0] in table or (case == "nom" and words[0] in PRONOUN_WORDS), de
            if len(words) == 3:
                stem = words[1][: -len(table[words[0]])]
                assert words[1] == stem + table[words[0]] and stem in {s for s, _ in ADJECTIVES}, de
                seen_endings.add((words[0], words[1][len(stem) :]))
    assert seen_endings == {*NOMINATIVE.items(), *ACCUSATIVE.items()}


def _within(count: int, n: int, p: float) -> bool:
    """``count`` of ``n`` draws is within 5 standard deviations of a probability ``p``."""
    return abs(count - n * p) <= 5 * (n * p * (1 - p)) ** 0.5


def test_the_grammar_s_choices_have_their_probabilities_and_every_word_occurs():
    """Adverb 0.3, subordinate clause 0.4, pronoun subject 0.2, adjective 0.5 (of the phrases that are
    not pronouns), each checked within 5 standard deviations on 3000 sentences; lengths 5 to 18."""
    pairs = toy_pairs(3000, seed=5, split="test")
    n = len(pairs)
    assert _within(sum(de.split()[0] in ADVERB_WORDS for de, _ in pairs), n, 0.3)
    assert _within(sum("," in de for de, _ in pairs), n, 0.4)
    phrases = [p for de, _ in pairs for p in _noun_phrases(de)]
    subjects = [words for case, words in phrases if case == "nom"]
    assert _within(sum(len(w) == 1 for w in subjects), len(subjects), 0.2)
    full = [words for _, words in phrases if len(words) > 1]
    assert _within(sum(len(w) == 3 for w in full), len(full), 0.5)
    lengths = [len(de.split()) for de, _ in pairs]
    assert (min(lengths), max(lengths)) == (5, 18)
    assert {w for de, _ in pairs for w in de.split()} == set(lexicon())
    assert {w for _, en in pairs for w in en.split()} == set(lexicon().values())


def test_the_lexicon_is_already_moses_tokenised_and_one_to_one_per_form():
    """Every word of both languages is left as it is by the data's tokeniser (so raw text and corpus agree),
    and the lexicon holds each German form once: 8 determiners, 8 x 3 adjective forms and the other words."""
    entries = lexicon()
    assert len(entries) == 8 + 24 + len(NOUNS) + len(VERBS) + len(PRONOUNS) + len(ADVERBS) + len(CONJUNCTIONS) + 2
    for de, en in entries.items():
        assert moses_tokenize(de, "de") == de and moses_tokenize(en, "en") == en
    assert len(set(entries.values())) == 4 + 8 + len(NOUNS) + len(VERBS) + len(PRONOUNS) + 4 + 3 + 2


def test_the_defaults_are_the_quick_start_s_data():
    """docs/python-api.md attaches ``ToyTranslationDataModule()`` as the quick start's data: its defaults
    must be what the quick-start configs ask for, and the corpus docs/experiments.md describes (20,000 /
    500 / 500 pairs under ``~/.cache/mmlight/toy_translation``); the arguments it shares with IWSLT14's
    DataModule default alike, except the budget and the workers (a CPU quick start reads in-process)."""
    for name in ("nmt_softmax", "nmt_multimax"):
        config = yaml.safe_load((ROOT / "configs" / "quickstart" / f"{name}.yaml").read_text(encoding="utf-8"))
        asked = ToyTranslationDataModule(**config["data"]["init_args"])
        default = ToyTranslationDataModule()
        assert default.generation_args() == asked.generation_args() and default._batching() == asked._batching()
        assert default.root == asked.root == os.path.expanduser("~/.cache/mmlight/toy_translation")
    assert (default.train_size, default.valid_size, default.test_size) == (20000, 500, 500)
    assert (default.num_workers, default.src_file, default.max_tokens) == (0, None, 2048)
    # the training stream draws shards uniformly: equal shards draw every sample equally often
    assert default.train_size % default.samples_per_shard == 0 and default.samples_per_shard < default.train_size
    iwslt = inspect.signature(TranslationDataModule).parameters
    for name in ("max_source_positions", "max_target_positions", "bucket_buffer"):
        assert getattr(default, name) == iwslt[name].default


def test_write_toy_corpus_writes_the_quick_start_corpus_by_default(tmp_path):
    """The defaults of :func:`write_toy_corpus` give the corpus of ``ToyTranslationDataModule()``."""
    dm = ToyTranslationDataModule(cache_dir=str(tmp_path / "unused"))
    out = write_toy_corpus(tmp_path / "corpus")
    for split, size in (("train", dm.train_size), ("valid", dm.valid_size), ("test", dm.test_size)):
        de, en = _lines(out / f"{split}.de"), _lines(out / f"{split}.en")
        assert len(de) == len(en) == size
        assert (de[0], en[0]) == toy_pairs(1, dm.seed, split)[0]
