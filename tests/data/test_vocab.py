"""The typed vocabulary and class map, and the ``_info.json`` schema: version 2 as the preparers write
it, version 1 (written before the vocabulary moved under ``vocab``) still read, others refused with
the command to run."""

import json

import pytest

from mmlight.data import ToyTranslationDataModule, WikiTextDataModule, read_info
from mmlight.data.shards import INFO_FILE, INFO_VERSION, write_info
from mmlight.data.vocab import SPECIAL_IDS, SPECIALS, ClassMap, Tokenizer, Vocab

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
    from tests.data.test_wikitext import write_raw

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
