"""The typed vocabulary and class map, and the ``_info.json`` schema: version 2 as the preparers write
it, version 1 (written before the vocabulary moved under ``vocab``) still read, others refused with
the command to run."""

import json

import pytest

from mmlight.data import ToyTranslationDataModule, WikiTextDataModule, read_info
from mmlight.data.shards import INFO_FILE, INFO_VERSION, write_info
from mmlight.data.vocab import (
    SPECIAL_IDS,
    SPECIALS,
    ClassMap,
    Tokenizer,
    Vocab,
    build_dictionary,
    load_dictionary,
    load_vocab,
    reprepare_hint,
    save_vocab,
    vocab_entry,
    write_dictionary,
)

WORDS = ("the", "dog", "sees", "a", "cat")


def test_encode_and_decode_by_whitespace():
    vocab = Vocab(SPECIALS + WORDS)
    assert vocab.encode("the dog  sees a zebra") == [4, 5, 6, 7, vocab.unk_id]
    assert vocab.decode([vocab.bos_id, 4, 5, vocab.unk_id, vocab.eos_id, vocab.pad_id]) == "the dog <unk>"
    assert (vocab.bos_id, vocab.pad_id, vocab.eos_id, vocab.unk_id) == (0, 1, 2, 3) and len(vocab) == 9


def test_a_vocabulary_travels_as_plain_types():
    vocab = Vocab(
        SPECIALS + WORDS,
        tokenizer=Tokenizer(moses=True, src_lang="de", tgt_lang="en", bpe_codes="#version: 0.2\nd o\n", version="v"),
    )
    data = vocab.to_dict()
    assert json.loads(json.dumps(data)) == data  # nothing but JSON types
    assert Vocab.from_dict(data) == vocab


def test_bad_vocabularies_are_named():
    with pytest.raises(ValueError, match=r"special ids .*\['unk'\] missing"):
        Vocab(SPECIALS + WORDS, {"bos": 0, "pad": 1, "eos": 2})
    with pytest.raises(ValueError, match=r"special ids \{'unk': 3\} are outside the 3 tokens"):
        Vocab(SPECIALS[:3])
    with pytest.raises(ValueError, match="at least one class"):
        ClassMap(())
    with pytest.raises(ValueError, match="not a class map"):
        ClassMap.from_dict({"names": ["a"]})
    assert ClassMap.from_dict(ClassMap(("cat", "dog")).to_dict()) == ClassMap(("cat", "dog"))


def test_write_info_adds_the_version_and_keeps_an_identical_file(tmp_path):
    written = write_info(tmp_path, {"dataset": "x", "splits": {}})
    assert written == {"version": INFO_VERSION, "dataset": "x", "splits": {}} == read_info(tmp_path)
    before = (tmp_path / INFO_FILE).stat().st_mtime_ns
    write_info(tmp_path, {"dataset": "x", "splits": {}})
    assert (tmp_path / INFO_FILE).stat().st_mtime_ns == before


@pytest.fixture(scope="module")
def wikitext(tmp_path_factory):
    from mmlight.data.prepare.wikitext import prepare
    from tests.helpers.wikitext import write_raw

    tmp = tmp_path_factory.mktemp("wikitext")
    prepare(write_raw(tmp / "raw"), tmp / "shards", workers=1)
    return tmp / "shards"


def rewrite_info(root, change) -> None:
    path = root / INFO_FILE
    path.write_text(json.dumps(change(json.loads(path.read_text()))))


def wikitext_version_1(info: dict) -> dict:
    """``_info.json`` as ``mmlight prepare wikitext103`` wrote it before the schema had a version."""
    vocab = info.pop("vocab")
    info.pop("version")
    return {**info, "vocab_file": vocab["file"], "vocab_size": vocab["size"], "special_ids": vocab["special_ids"]}


def test_a_version_1_wikitext_set_still_loads(wikitext, tmp_path):
    import shutil

    old = tmp_path / "old"
    shutil.copytree(wikitext, old)
    rewrite_info(old, wikitext_version_1)
    assert "vocab" not in json.loads((old / INFO_FILE).read_text())
    now, before = WikiTextDataModule(str(wikitext)), WikiTextDataModule(str(old))
    assert before.vocab == now.vocab and before.vocab.special_ids == SPECIAL_IDS
    assert (before.vocab_size, before.pad_id, before.eos_id) == (now.vocab_size, now.pad_id, now.eos_id)
    assert (before.stream("test") == now.stream("test")).all()


def test_a_set_without_a_vocabulary_or_of_a_newer_schema_names_the_fix(wikitext, tmp_path):
    import shutil

    for name, change, message in [
        (
            "novocab",
            lambda info: {k: v for k, v in info.items() if k != "vocab"},
            rf"no vocabulary in its _info.json: prepare it again with `mmlight prepare wikitext103 --src <raw data> "
            rf"--out {tmp_path / 'novocab'}`",
        ),
        (
            "newer",
            lambda info: {**info, "version": INFO_VERSION + 1},
            f"schema version {INFO_VERSION + 1}; this mmlight reads up to {INFO_VERSION}: update mmlight",
        ),
    ]:
        shutil.copytree(wikitext, tmp_path / name)
        rewrite_info(tmp_path / name, change)
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            _ = WikiTextDataModule(str(tmp_path / name)).vocab


def iwslt_version_1(info: dict) -> dict:
    """``_info.json`` as ``mmlight prepare iwslt14`` (and the toy corpus) wrote it before the schema
    had a version."""
    vocab = info.pop("vocab")
    info.pop("version")
    tokenizer = vocab["tokenizer"]
    return {
        **info,
        "src_lang": tokenizer["src_lang"],
        "tgt_lang": tokenizer["tgt_lang"],
        "bpe_file": tokenizer["bpe_file"],
        "bpe_merges": tokenizer["bpe_merges"],
        "dict_file": vocab["file"],
        "vocab_size": vocab["size"],
        "specials": list(SPECIALS),
        **{f"{name}_id": i for name, i in vocab["special_ids"].items()},
    }


def test_a_version_1_translation_set_still_loads(tmp_path):
    sizes = {"train_size": 60, "valid_size": 4, "test_size": 4}
    now = ToyTranslationDataModule(cache_dir=str(tmp_path / "toy"), **sizes)
    now.prepare_data()
    rewrite_info(tmp_path / "toy", iwslt_version_1)
    before = ToyTranslationDataModule(cache_dir=str(tmp_path / "toy"), **sizes)
    assert before.vocab == now.vocab and before.vocab.tokenizer.bpe_codes == (tmp_path / "toy" / "code").read_text()
    line = "Heute sieht der Hund den Fisch."
    assert before.encode(line) == now.encode(line)
    assert before.decode(now.encode(line)) == "heute sieht der hund den fisch."
    assert before.decoder_start_id == now.eos_id


def test_a_repeated_token_keeps_its_first_id_and_tensors_decode_like_lists():
    import torch

    vocab = Vocab([*SPECIALS, "a", "b", "a"])
    assert vocab.tokens == (*SPECIALS, "a", "b", "a") and hash(vocab.tokens)  # a list is kept as a tuple
    assert vocab.index == {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3, "a": 4, "b": 5}
    assert vocab.encode("a b a") == [4, 5, 4] and vocab.decode([6, 5]) == "a b"
    ids = [0, 4, 5, 3, 1, 2]
    assert vocab.decode(torch.tensor(ids)) == vocab.decode(ids) == "a b <unk>"
    assert Vocab.from_dict({"tokens": list(vocab.tokens), "special_ids": dict(SPECIAL_IDS)}) == vocab


def test_the_tokenizer_language_defaults_and_overrides():
    """The language decides Moses' apostrophes (French keeps ``l'`` on the article, English moves it to the
    noun); ``encode`` uses ``src_lang`` and ``decode`` ``tgt_lang`` unless given one."""
    fr_en = Tokenizer(moses=True, src_lang="fr", tgt_lang="en")
    assert fr_en.tokenize("l'homme") == ["l&apos;", "homme"]
    assert fr_en.tokenize("l'homme", "en") == ["l", "&apos;homme"]
    assert fr_en.detokenize(["l&apos;", "homme", ","]) == "l' homme,"
    assert fr_en.detokenize(["l&apos;", "homme", ","], lang="fr") == "l'homme,"
    assert fr_en.detokenize(["l&apos;", "homme", ","], moses=False) == "l&apos; homme ,"
    # without Moses, decoding never detokenises
    assert Tokenizer(src_lang="fr", tgt_lang="fr").detokenize(["l&apos;", "homme", ","]) == "l&apos; homme ,"


def test_bpe_is_applied_and_removed():
    codes = "#version: 0.2\nd o\ndo g</w>\n"
    tokenizer = Tokenizer(bpe_codes=codes)
    assert tokenizer.tokenize("dog dot") == ["dog", "do@@", "t"]
    assert tokenizer.detokenize(["dog", "do@@", "t"]) == "dog dot"


def test_vocab_entry_names_the_bpe_codes_by_file():
    entry = vocab_entry("dict.txt", "dict", 9, Tokenizer(moses=True, src_lang="de", bpe_codes="x"), "code", 100)
    assert entry == {
        "file": "dict.txt",
        "format": "dict",
        "size": 9,
        "special_ids": SPECIAL_IDS,
        "tokenizer": {
            "moses": True,
            "src_lang": "de",
            "tgt_lang": None,
            "version": None,
            "bpe_file": "code",
            "bpe_merges": 100,
        },
    }


def test_a_dict_txt_set_loads_with_its_bpe_codes_and_a_wrong_size_is_refused(tmp_path):
    write_dictionary(build_dictionary([["b a a", "c </s> a"], ["b <unk> <pad>"]]), tmp_path / "dict.txt")
    assert (tmp_path / "dict.txt").read_text() == "a 3\nb 2\nc 1\n"  # by count, ties by name, no specials
    (tmp_path / "code").write_text("#version: 0.2\na b\n")
    info = {"dataset": "toy-translation", "vocab": vocab_entry("dict.txt", "dict", 7, Tokenizer(), "code", 1)}
    vocab = Vocab.from_shards(tmp_path, info)
    assert vocab == Vocab(SPECIALS + ("a", "b", "c"), tokenizer=Tokenizer(bpe_codes="#version: 0.2\na b\n"))
    info["vocab"]["size"] = 8
    with pytest.raises(
        ValueError,
        match=rf"dict.txt has 7 entries, _info.json says 8: prepare it again with `mmlight prepare "
        rf"toy-translation --src <raw data> --out {tmp_path}`",
    ):
        Vocab.from_shards(tmp_path, info)


def test_build_dictionary_orders_by_count_then_by_code_point():
    sides = [["z y x", "y Z"], ["x y"]]
    assert build_dictionary(sides) == [("y", 3), ("x", 2), ("Z", 1), ("z", 1)]
    assert build_dictionary([["<s> <pad> </s> <unk>"]]) == []


def test_load_dictionary_skips_blank_lines_and_keeps_the_token_before_the_count(tmp_path):
    (tmp_path / "dict.txt").write_text("a 5\n\n  \nb 1\n")
    assert load_dictionary(tmp_path / "dict.txt") == [*SPECIALS, "a", "b"]


def test_a_vocabulary_file_is_written_once_then_verified_byte_for_byte(tmp_path, caplog):
    path = tmp_path / "vocab.txt"
    assert save_vocab(path, ["<s>", "x"]) == path and path.read_bytes() == b"<s>\nx\n"
    before = path.stat().st_mtime_ns
    save_vocab(path, ["<s>", "x"])
    assert path.stat().st_mtime_ns == before
    assert load_vocab(path) == ["<s>", "x"]
    path.write_bytes(b"<s>\r\nx\r\n")  # the same lines with Windows line ends: another file
    with pytest.raises(
        ValueError,
        match=r"vocab.txt differs .* \(2 vs 2 entries\): the raw data or its "
        r"tokenisation changed; prepare into an empty --out folder$",
    ):
        save_vocab(path, ["<s>", "x"])
    with pytest.raises(ValueError, match=r"dict.txt differs .* \(0 vs 1 entries\)"):
        (tmp_path / "dict.txt").write_text("")
        write_dictionary([("a", 1)], tmp_path / "dict.txt")


def test_reprepare_hint_names_the_command_of_the_data_set():
    assert "`mmlight prepare digits --src <raw data> --out r`" in reprepare_hint("r", {"dataset": "sklearn-digits"})
    assert "`mmlight prepare wikitext103 --src" in reprepare_hint("r", {"dataset": "wikitext103"})
    assert "`mmlight prepare <dataset> --src" in reprepare_hint("r", {})


def test_a_class_map_keeps_a_tuple_and_names_its_errors_exactly():
    classes = ClassMap(["cat", "dog"])
    assert classes.names == ("cat", "dog") and len(classes) == 2 and hash(classes) == hash(ClassMap(("cat", "dog")))
    assert classes.to_dict() == {"classes": ["cat", "dog"]}
    with pytest.raises(ValueError, match=r"^a class map needs at least one class$"):
        ClassMap([])
    with pytest.raises(ValueError, match=r"^no 'classes' entry: not a class map$"):
        ClassMap.from_dict({})


def test_encode_and_decode_pass_the_language_on():
    from mmlight.data.vocab import VocabAttributes

    vocab = Vocab(SPECIALS + ("l&apos;", "homme", "l", "&apos;homme", ","), tokenizer=Tokenizer(True, "fr", "en"))

    class Data(VocabAttributes):
        def load_vocab(self) -> Vocab:
            return vocab

    for side in (vocab, Data()):
        assert side.encode("l'homme,") == [4, 5, 8] and side.encode("l'homme,", "en") == [6, 7, 8]
        assert side.decode([4, 5, 8]) == "l' homme," and side.decode([4, 5, 8], lang="fr") == "l'homme,"
        assert side.decode([4, 5, 8], False) == "l&apos; homme ,"


def word_level(vocab: dict[str, int]) -> str:
    """A Hugging Face word-level tokenizer (whitespace split) over ``vocab``, as JSON text."""
    from tokenizers import Tokenizer as HF
    from tokenizers import models, pre_tokenizers

    tokenizer = HF(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tokenizer.to_str()


def test_a_hugging_face_vocabulary_encodes_decodes_and_travels_as_plain_types():
    hf_json = word_level({tok: i for i, tok in enumerate(SPECIALS + WORDS)})
    vocab = Vocab.from_hf_json(hf_json, dict(SPECIAL_IDS), expected_size=9)
    assert vocab.tokens == SPECIALS + WORDS
    assert vocab.encode("the dog  sees a zebra") == [4, 5, 6, 7, vocab.unk_id]
    # no decoder in this tokenizer: tokens joined by spaces, the specials but <unk> dropped, as for the others
    assert vocab.decode([vocab.bos_id, 4, 5, vocab.unk_id, vocab.eos_id]) == "the dog <unk>"
    data = vocab.to_dict()
    assert json.loads(json.dumps(data)) == data and data["tokenizer"]["hf_json"] == hf_json
    assert Vocab.from_dict(data) == vocab and Vocab.from_dict(data).encode("a cat") == [7, 8]
    entry = vocab_entry("tokenizer.json", "hf", 9, vocab.tokenizer, special_ids={**SPECIAL_IDS, "pad": 5})
    assert "hf_json" not in entry["tokenizer"] and entry["special_ids"]["pad"] == 5  # the file holds it


def test_a_hugging_face_vocabulary_with_a_gap_or_another_size_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"ids are not consecutive: no token has id \[4\]"):
        Vocab.from_hf_json(word_level({**{t: i for i, t in enumerate(SPECIALS)}, "x": 5}), dict(SPECIAL_IDS))
    with pytest.raises(ValueError, match="has 9 tokens, _info.json says 10"):
        Vocab.from_hf_json(word_level({t: i for i, t in enumerate(SPECIALS + WORDS)}), dict(SPECIAL_IDS), 10)


def test_a_hugging_face_tokenizer_with_a_template_adds_no_specials_when_it_tokenizes():
    from tokenizers import Tokenizer as HF
    from tokenizers import processors

    tokenizer = HF.from_str(word_level({tok: i for i, tok in enumerate(SPECIALS + WORDS)}))
    # as a Llama or RoBERTa tokenizer.json has: <s> put before every encoded text
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    assert tokenizer.encode("the dog").tokens == ["<s>", "the", "dog"]  # the template is live
    vocab = Vocab.from_hf_json(tokenizer.to_str(), dict(SPECIAL_IDS))
    assert vocab.tokenizer.tokenize("the dog") == ["the", "dog"]
    assert vocab.encode("the dog") == [4, 5]


def test_the_first_five_gaps_of_a_hugging_face_vocabulary_are_named():
    # 14 entries, so tokenizers' size is 14 (ids 0-13); the words sit at 14-23, leaving 4-13 without a token
    ids = {**{t: i for i, t in enumerate(SPECIALS)}, **{f"w{i}": 14 + i for i in range(10)}}
    with pytest.raises(ValueError) as err:
        Vocab.from_hf_json(word_level(ids), dict(SPECIAL_IDS))
    assert str(err.value) == "the tokenizer's ids are not consecutive: no token has id [4, 5, 6, 7, 8]"


def test_a_shard_sets_hugging_face_vocabulary_of_another_size_is_refused(tmp_path):
    (tmp_path / "tokenizer.json").write_text(word_level({t: i for i, t in enumerate(SPECIALS + WORDS)}))
    info = {"vocab": vocab_entry("tokenizer.json", "hf", 10, Tokenizer())}
    with pytest.raises(ValueError, match=r"^the tokenizer has 9 tokens, _info.json says 10$"):
        Vocab.from_shards(tmp_path, info)
    info["vocab"]["size"] = 9
    assert Vocab.from_shards(tmp_path, info).tokens == SPECIALS + WORDS


def test_without_tokenizers_a_byte_level_vocabulary_says_how_to_install_it(monkeypatch):
    import sys

    from mmlight.data.vocab import hf_tokenizers

    monkeypatch.setitem(sys.modules, "tokenizers", None)  # what an environment without the package gives
    with pytest.raises(ImportError) as err:
        hf_tokenizers()
    assert str(err.value) == "byte-level BPE vocabularies need Hugging Face tokenizers: pip install tokenizers"
