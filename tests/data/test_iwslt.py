"""IWSLT14 de-en: preparation from both raw layouts, and token-budget streaming."""

import hashlib
import io
import json
import logging
import shutil
import tarfile
import warnings
from itertools import islice
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import webdataset as wds
import yaml

from mmlight.commands.prepare import main as prepare_main
from mmlight.data.prepare.iwslt import RAW_TEST_SETS, _read_raw, clean_pair, prepare_iwslt
from mmlight.data.shards import read_info, sha256
from mmlight.data.streaming import RankRandom
from mmlight.data.tokenizers import TOKENIZER
from mmlight.data.translation import TranslationDataModule
from mmlight.data.translation_shards import write_translation_shards
from mmlight.data.vocab import SPECIAL_IDS, load_dictionary
from tests.helpers.iwslt import moses_tok, write_raw

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def raw(tmp_path_factory):
    root = tmp_path_factory.mktemp("iwslt_raw")
    kept, test = write_raw(root)
    return root, kept, test


@pytest.fixture(scope="module")
def shards(raw, tmp_path_factory):
    out = tmp_path_factory.mktemp("iwslt_shards")
    prepare_iwslt(raw[0], out, workers=1, merges=50, samples_per_shard=4)
    return out


def _read_split(out, split):
    info = read_info(out)
    samples = {}
    for shard in info["splits"][split]["shards"]:
        for s in wds.WebDataset(str(out / shard["name"]), shardshuffle=False).decode():
            samples[s["__key__"]] = s
    return [samples[k] for k in sorted(samples)]


def _unbpe(text):
    return (text + " ").replace("@@ ", "").rstrip()


def test_raw_counts_cleaning_and_skips(raw, shards):
    root, kept, test = raw
    info = read_info(shards)
    assert info["dataset"] == "iwslt14" and info["layout"] == "raw" and info["version"] == 2
    vocab = info["vocab"]
    assert (vocab["file"], vocab["format"], vocab["special_ids"]) == ("dict.txt", "dict", SPECIAL_IDS)
    assert vocab["tokenizer"]["bpe_merges"] == 50 and vocab["tokenizer"]["bpe_file"] == "code"
    assert (vocab["tokenizer"]["src_lang"], vocab["tokenizer"]["tgt_lang"]) == ("de", "en")
    assert info["cleaning"] == {"tag_lines_dropped": 6, "cleaned_out": 2}
    assert len(kept) == 64
    splits = info["splits"]
    assert (splits["train"]["num_samples"], splits["valid"]["num_samples"], splits["test"]["num_samples"]) == (
        62,
        2,
        10,
    )
    assert splits["train"]["num_skipped"] == 2 and splits["valid"]["num_skipped"] == splits["test"]["num_skipped"] == 0
    where = {s["path"]: s["reason"] for s in splits["train"]["skipped"]}
    assert where == {
        f"{root}/train.tags.de-en.en:10": "empty English side",
        f"{root}/train.tags.de-en.de:20": where.get(f"{root}/train.tags.de-en.de:20"),
    }
    assert "invalid UTF-8" in where[f"{root}/train.tags.de-en.de:20"]
    # valid = every 23rd kept pair, lowercased and tokenised; train = the rest in order
    valid = _read_split(shards, "valid")
    expect_valid = [kept[22], kept[45]]
    assert [(_unbpe(s["src.txt"]), _unbpe(s["tgt.txt"])) for s in valid] == [
        (moses_tok(d, "de"), moses_tok(e, "en")) for d, e in expect_valid
    ]
    train = _read_split(shards, "train")
    expect_train = [p for i, p in enumerate(kept, 1) if i % 23]
    assert [_unbpe(s["src.txt"]) for s in train] == [moses_tok(d, "de") for d, _ in expect_train]
    assert train[0]["src.txt"] == train[0]["src.txt"].lower() and "<title>" not in train[0]["src.txt"]
    assert not any("url" in s["src.txt"] or "talkid" in s["src.txt"] for s in train)
    # test = the five sets in order, with ’ turned into '
    tst = _read_split(shards, "test")
    assert [_unbpe(s["tgt.txt"]) for s in tst] == [moses_tok(e, "en") for _, e in test]
    assert any("doesn &apos;t" in _unbpe(s["tgt.txt"]) for s in tst)
    # ids match the dictionary, no BOS/EOS stored
    vocab = load_dictionary(shards / "dict.txt")
    assert len(vocab) == info["vocab"]["size"] and vocab[:4] == ["<s>", "<pad>", "</s>", "<unk>"]
    for s in train[:5]:
        assert s["src.npy"].dtype == np.int32 and [vocab[i] for i in s["src.npy"]] == s["src.txt"].split()
    # dict order: descending count, ties alphabetical
    counts = [
        (line.rsplit(" ", 1)[0], int(line.rsplit(" ", 1)[1])) for line in (shards / "dict.txt").read_text().splitlines()
    ]
    assert counts == sorted(counts, key=lambda tc: (-tc[1], tc[0]))
    assert any("@@" in tok for tok, _ in counts)  # BPE did merge subwords


def test_rerun_writes_nothing_and_resume_is_identical(raw, shards, tmp_path):
    before = {p.name: p.stat().st_mtime_ns for p in shards.iterdir() if p.name != "_info.json"}
    info = read_info(shards)
    again = prepare_iwslt(raw[0], shards, workers=1, merges=50, samples_per_shard=4)
    assert {p.name: p.stat().st_mtime_ns for p in shards.iterdir() if p.name != "_info.json"} == before
    assert again == info
    # an interrupted run: copy, lose the last train shards and the dictionary, leave a half-written tmp
    out = tmp_path / "resumed"
    shutil.copytree(shards, out)
    for name in (
        "train-000015.tar",
        "train-000015.tar.done.json",
        "train-000014.tar.done.json",
        "dict.txt",
        "_info.json",
    ):
        (out / name).unlink()
    (out / "train-000015.tar.tmp").write_bytes(b"partial")
    resumed = prepare_iwslt(raw[0], out, workers=2, merges=50, samples_per_shard=4)
    assert (out / "code").stat().st_mtime_ns == (shards / "code").stat().st_mtime_ns  # BPE not relearnt
    assert resumed["splits"]["train"]["num_samples"] == 62
    for split in ("train", "valid", "test"):
        a, b = _read_split(shards, split), _read_split(out, split)
        assert [(s["__key__"], s["src.txt"], s["tgt.txt"], s["src.npy"].tolist()) for s in a] == [
            (s["__key__"], s["src.txt"], s["tgt.txt"], s["src.npy"].tolist()) for s in b
        ]
    assert (out / "dict.txt").read_text() == (shards / "dict.txt").read_text()


def test_missing_and_misaligned_files(tmp_path, raw):
    with pytest.raises(FileNotFoundError, match=r"train\.tags\.de-en\.de.*") as err:
        prepare_iwslt(tmp_path, tmp_path / "out")
    assert "code" in str(err.value) and "IWSLT14.TED.tst2012.de-en.en.xml" in str(err.value)
    bad = tmp_path / "bad"
    shutil.copytree(raw[0], bad)
    with open(bad / "train.tags.de-en.en", "a") as f:
        f.write("one more line\n")
    with pytest.raises(ValueError, match="line-aligned"):
        prepare_iwslt(bad, tmp_path / "out2", merges=50)


def test_fairseq_layout_via_cli(shards, tmp_path, capsys):
    src = tmp_path / "fairseq"
    src.mkdir()
    for split in ("train", "valid", "test"):
        samples = _read_split(shards, split)
        de = [s["src.txt"] for s in samples]
        en = [s["tgt.txt"] for s in samples]
        if split == "valid":
            de.append("ein satz")
            en.append("")
        (src / f"{split}.de").write_text("".join(x + "\n" for x in de))
        (src / f"{split}.en").write_text("".join(x + "\n" for x in en))
    shutil.copyfile(shards / "code", src / "code")
    out = tmp_path / "out"
    prepare_main(["iwslt14", "--src", str(src), "--out", str(out), "--workers", "1"])
    assert "train 62 samples (0 skipped), valid 2 samples (1 skipped), test 10 samples" in capsys.readouterr().out
    info = read_info(out)
    assert info["layout"] == "fairseq" and info["splits"]["valid"]["skipped"] == [
        {"path": f"{src}/valid.en:3", "reason": "empty English side"}
    ]
    assert (out / "code").read_bytes() == (shards / "code").read_bytes()
    assert (out / "dict.txt").read_text() == (shards / "dict.txt").read_text()
    assert [s["src.npy"].tolist() for s in _read_split(out, "test")] == [
        s["src.npy"].tolist() for s in _read_split(shards, "test")
    ]


def _check_batch(batch, dm, max_tokens):
    src, tgt_in, tgt_out = batch["src"], batch["tgt_in"], batch["tgt_out"]
    assert src.dtype == tgt_in.dtype == torch.int64
    assert src.numel() <= max_tokens and tgt_out.numel() <= max_tokens
    assert torch.equal(batch["src_mask"], src != dm.pad_id) and torch.equal(batch["tgt_mask"], tgt_out != dm.pad_id)
    assert (tgt_in[:, 0] == dm.eos_id).all()  # fairseq's decoder start symbol
    for i in range(len(src)):
        t = int(batch["tgt_mask"][i].sum())
        assert torch.equal(tgt_in[i, 1:t], tgt_out[i, : t - 1]) and tgt_out[i, t - 1] == dm.eos_id
        assert (tgt_in[i, t:] == dm.pad_id).all()
        assert src[i, int(batch["src_mask"][i].sum()) - 1] == dm.eos_id
    assert batch["ntokens"] == int(batch["tgt_mask"].sum())


def test_eval_batches_budget_and_exactly_once(shards, monkeypatch):
    dm = TranslationDataModule(str(shards), max_tokens=48, num_workers=2, bucket_buffer=8, val_split="test")
    assert dm.vocab_size == read_info(shards)["vocab"]["size"] and (dm.bos_id, dm.pad_id, dm.eos_id) == (0, 1, 2)
    batches = list(dm.val_dataloader())
    for b in batches:
        _check_batch(b, dm, 48)
    assert sorted(i for b in batches for i in b["ids"].tolist()) == list(range(10))
    assert len(batches) > 1
    # two simulated ranks: webdataset's split_by_node reads RANK/WORLD_SIZE
    dm = TranslationDataModule(str(shards), max_tokens=48, num_workers=0, bucket_buffer=8)
    seen = []
    for rank in range(2):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        ids = [k for b in dm.test_dataloader() for k in b["keys"]]
        assert ids
        seen += ids
    assert sorted(seen) == [f"test-{i:07d}" for i in range(10)]


def test_train_epoch_length_and_budget(shards):
    dm = TranslationDataModule(str(shards), max_tokens=64, num_workers=0, bucket_buffer=16)
    steps = read_info(shards)["splits"]["train"]["num_tokens"] // 64
    loader = dm.train_dataloader()
    assert len(loader) == steps > 2
    batches = list(loader)
    assert len(batches) == steps
    for b in batches:
        _check_batch(b, dm, 64)
    dm.trainer = SimpleNamespace(world_size=2)
    assert dm.train_steps() == steps // 2
    # a sample bigger than the budget is skipped with a warning
    with pytest.warns(UserWarning, match="skipping sample"):
        assert (
            next(iter(TranslationDataModule(str(shards), max_tokens=4, num_workers=0).val_dataloader()), None) is None
        )


def test_encode_decode_and_predict_in_order(raw, shards, tmp_path):
    dm = TranslationDataModule(str(shards), max_tokens=24, num_workers=0)
    for de, en in raw[1][:8]:
        assert dm.decode(dm.encode(de, "de"), detokenize=False) == moses_tok(de, "de")
        assert dm.decode(dm.encode(en, "en"), detokenize=False) == moses_tok(en, "en")
    ids = dm.encode("The dog sees the sun, doesn't it?", "en")
    assert dm.unk_id not in ids and any(dm.vocab.tokens[i].endswith("@@") for i in ids)
    assert dm.decode(ids + [dm.eos_id, dm.pad_id]) == "the dog sees the sun, doesn't it?"
    lines = [d for d, _ in raw[1][:7]]
    (tmp_path / "input.de").write_text("\n".join(lines) + "\n", encoding="utf-8")
    dm = TranslationDataModule(str(shards), max_tokens=64, num_workers=0, src_file=str(tmp_path / "input.de"))
    batches = list(dm.predict_dataloader())
    assert len(batches) > 1 and [i for b in batches for i in b["ids"].tolist()] == list(range(7))
    rows = [row[mask].tolist() for b in batches for row, mask in zip(b["src"], b["src_mask"])]
    assert rows == [dm.encode(line) + [dm.eos_id] for line in lines]
    for b in batches:
        assert b["src"].numel() <= 64


# ---------------------------------------------------------------------------- each cleaning rule


def _words(n: int, word: str = "w") -> str:
    return " ".join([word] * n)


@pytest.mark.parametrize(
    "de, en, kept",
    [
        ("eins", "one", ("eins", "one")),  # 1 token per side: the lower bound
        ("", "one", None),
        ("eins", "", None),
        ("| |", "one", None),  # 0 tokens (a side of factor bars only)
        (_words(175), _words(175), (_words(175), _words(175))),  # 175: the upper bound
        (_words(176), _words(175), None),
        (_words(175), _words(176), None),
        ("a b c", "x y", ("a b c", "x y")),
        ("a b", "x y z", ("a b", "x y z")),  # ratio exactly 1.5 either way
        ("a b c d e", "x y z", None),  # de / en = 5 / 3 > 1.5
        ("a b c", "v w x y z", None),  # en / de = 5 / 3 > 1.5
        (_words(3), _words(2), (_words(3), _words(2))),
        ("a" * 1000 + " b", "x y", ("a" * 1000 + " b", "x y")),  # a 1000-character token is kept
        ("a" * 1001 + " b", "x y", None),
        ("a b", "x" * 1001 + " y", None),  # 1001 characters, either side
        ("a  |b |  c", "x\ty  z", ("a b c", "x y z")),  # bars removed, whitespace normalised
    ],
)
def test_clean_pair_applies_each_rule_of_clean_corpus_n(de, en, kept):
    """``clean-corpus-n.perl -ratio 1.5 ... 1 175``, rule by rule at its boundaries."""
    assert clean_pair(de, en) == kept


def test_raw_pairs_removed_by_each_rule_are_counted_and_the_rest_kept_in_order(raw, tmp_path):
    """A training file with one pair per rule: tag lines, an empty German side, invalid UTF-8 in
    English, both directions of the length ratio, over 175 tokens on either side, a token over 1000
    characters on either side; and the pairs on each rule's boundary, which stay."""
    src = tmp_path / "raw"
    shutil.copytree(raw[0], src)
    lines = [  # (de, en, what happens)
        (b"eins zwei drei", b"one two", "kept"),  # ratio 1.5
        (b"<url>http://x</url>", b"<url>http://x</url>", "tag"),
        (b"eins zwei", b"one two three", "kept"),  # ratio 1.5 the other way
        (b"a b c d e", b"x y z", "cleaned"),  # de / en > 1.5
        (b"   ", b"hello there", "empty de"),
        (b"a b c", b"v w x y z", "cleaned"),  # en / de > 1.5
        (_words(176).encode(), _words(176).encode(), "cleaned"),
        (_words(175).encode(), _words(175).encode(), "kept"),
        (b"gut", b"good \xff", "bad utf-8 en"),
        (_words(170).encode(), _words(176).encode(), "cleaned"),  # only English over 175
        (b"a" * 1001 + b" b", b"x y", "cleaned"),
        (b"a b", b"x" * 1001 + b" y", "cleaned"),
        (b"a" * 1000 + b" b", b"x y", "kept"),
        (b"ja", b"yes", "kept"),
    ]
    (src / "train.tags.de-en.de").write_bytes(b"".join(de + b"\n" for de, _, _ in lines))
    (src / "train.tags.de-en.en").write_bytes(b"".join(en + b"\n" for _, en, _ in lines))
    texts, skipped, stats = _read_raw(src, workers=1)
    assert stats == {"tag_lines_dropped": 1, "cleaned_out": 6}
    reasons = {s["path"]: s["reason"] for s in skipped["train"]}
    assert len(skipped["train"]) == 2 and reasons[f"{src}/train.tags.de-en.de:5"] == "empty German side"
    assert reasons[f"{src}/train.tags.de-en.en:9"] == "invalid UTF-8 (invalid start byte at byte 5)"
    kept = [(de.decode(), en.decode()) for de, en, what in lines if what == "kept"]
    assert texts["train"] == ([de for de, _ in kept], [en for _, en in kept]) and texts["valid"] == ([], [])


def _xml(segs: list[bytes]) -> bytes:
    """An IWSLT XML file around ``<seg>`` lines (given whole, as bytes)."""
    head = b'<?xml version="1.0" encoding="UTF-8"?>\n<mteval>\n<doc docid="1">\n<talkid>7</talkid>\n'
    return head + b"".join(s + b"\n" for s in segs) + b"</doc>\n</mteval>\n"


def test_test_sets_skip_bad_segments_with_their_seg_number_and_keep_the_rest(raw, tmp_path):
    """In a dev/test XML file: a ``<seg>`` that is not UTF-8 and one whose side is empty are skipped, located as
    ``file:segN`` (N counts ``<seg>`` lines only) under ``test``; the others are cut to their text (any id,
    spaces around it, ``’`` made ``'``), tokenised, and kept in the recipe's order of the five sets."""
    src = tmp_path / "raw"
    shutil.copytree(raw[0], src)
    name = RAW_TEST_SETS[2]
    de_xml, en_xml = src / f"{name}.de-en.de.xml", src / f"{name}.de-en.en.xml"
    de_xml.write_bytes(
        _xml(
            [
                b'<seg id="1"> Hallo Welt . </seg>',
                b'<seg id="2">Kaputt \xff .</seg>',
                b'<seg id="30">   Das ist gut .   </seg>   ',
                b'<seg id="4"> Leer ? </seg>',
                b'<seg id="5">Er sagt \xe2\x80\x99 ja \xe2\x80\x99 .</seg>',
            ]
        )
    )
    en_xml.write_bytes(
        _xml(
            [
                b'<seg id="1"> Hello world . </seg>',
                b'<seg id="2">Broken .</seg>',
                b'<seg id="30">That is good .</seg>',
                b'<seg id="4">   </seg>',
                b'<seg id="5">He says \xe2\x80\x99 yes \xe2\x80\x99 .</seg>',
            ]
        )
    )
    texts, skipped, _ = _read_raw(src, workers=1)
    assert skipped["test"] == [
        {"path": f"{de_xml}:seg2", "reason": "invalid UTF-8 (invalid start byte at byte 19)"},  # in the whole line
        {"path": f"{en_xml}:seg4", "reason": "empty English side"},
    ]
    assert skipped["valid"] == [] and len(skipped["train"]) == 2  # the fixture's own two training skips
    test = raw[2]
    before, after = [p for p in test[:4]], [p for p in test[6:]]  # sets 0, 1 and 3, 4 are the fixture's
    want = [(moses_tok(d, "de"), moses_tok(e, "en")) for d, e in before]
    want += [
        (moses_tok("Hallo Welt .", "de"), moses_tok("Hello world .", "en")),
        (moses_tok("Das ist gut .", "de"), moses_tok("That is good .", "en")),
        (moses_tok("Er sagt ' ja ' .", "de"), moses_tok("He says ' yes ' .", "en")),
    ]
    want += [(moses_tok(d, "de"), moses_tok(e, "en")) for d, e in after]
    assert list(zip(*texts["test"])) == want


def test_test_set_segment_counts_must_agree(raw, tmp_path):
    src = tmp_path / "raw"
    shutil.copytree(raw[0], src)
    name = RAW_TEST_SETS[4]
    (src / f"{name}.de-en.en.xml").write_bytes(_xml([b'<seg id="1">Only one .</seg>']))
    with pytest.raises(ValueError) as err:
        _read_raw(src, workers=1)
    assert str(err.value) == (
        f"<seg> lines of {name}: {src}/{name}.de-en.de.xml has 2 lines but {src}/{name}.de-en.en.xml has 1; "
        "the German and English sides must be line-aligned"
    )


def test_crlf_line_ends_and_windows_files_give_the_same_text(raw, tmp_path):
    """``\\r\\n`` line ends (a file saved on Windows) are cut like ``\\n``: the same tokenised text."""
    src = tmp_path / "raw"
    shutil.copytree(raw[0], src)
    for path in [src / f"train.tags.de-en.{lang}" for lang in ("de", "en")] + list(src.glob("*.xml")):
        path.write_bytes(path.read_bytes().replace(b"\n", b"\r\n"))
    texts, skipped, stats = _read_raw(src, workers=1)
    assert (texts, stats) == _read_raw(raw[0], workers=1)[::2]
    assert [(s["path"].replace(str(src), "SRC"), s["reason"]) for s in skipped["train"]] == [
        ("SRC/train.tags.de-en.de:20", "invalid UTF-8 (invalid start byte at byte 7)"),
        ("SRC/train.tags.de-en.en:10", "empty English side"),
    ]


def test_tokenised_text_is_cached_by_the_raw_files_checksums(raw, tmp_path, monkeypatch):
    """``tokenised.json``: a rerun on the same raw files reads it (no tokenising); a changed raw file or an
    unreadable cache tokenises again."""
    from mmlight.data.prepare import iwslt

    src, out = tmp_path / "raw", tmp_path / "out"
    shutil.copytree(raw[0], src)
    out.mkdir()
    first = iwslt._read_raw_cached(src, out, workers=1)
    assert first == _read_raw(src, workers=1)
    key = json.loads((out / "tokenised.json").read_text(encoding="utf-8"))["key"]
    assert key == {**{name: sha256(src / name) for name in iwslt.RAW_FILES}, "tokenizer": TOKENIZER}
    calls = []

    def counted(*args):
        calls.append(args)
        return _read_raw(*args)

    monkeypatch.setattr(iwslt, "_read_raw", counted)
    assert iwslt._read_raw_cached(src, out, workers=1) == first and calls == []  # reused, same types
    (out / "tokenised.json").write_text("{not json")
    assert iwslt._read_raw_cached(src, out, workers=1) == first and len(calls) == 1
    assert iwslt._read_raw_cached(src, out, workers=1) == first and len(calls) == 1  # the rewritten cache
    with open(src / "train.tags.de-en.en", "ab") as f, open(src / "train.tags.de-en.de", "ab") as g:
        f.write(b"One more line .\n")
        g.write(b"Noch eine Zeile .\n")
    texts, _, _ = iwslt._read_raw_cached(src, out, workers=1)
    assert len(calls) == 2 and texts["train"][1][-1] == "one more line ."


def test_bpe_codes_are_learnt_once_and_again_when_their_inputs_change(tmp_path, monkeypatch):
    """``learn_joint_bpe``: the codes subword-nmt learns on train de + en, one line each; kept while the merge
    count, the training text and the codes file itself are unchanged, learnt again when one changes."""
    from subword_nmt.learn_bpe import learn_bpe

    from mmlight.data.prepare import iwslt
    from mmlight.data.tokenizers import count_bpe_merges

    de = ["der hund sieht die sonne", "die katze sieht den hund"]
    en = ["the dog sees the sun", "the cat sees the dog"]
    codes = iwslt.learn_joint_bpe((de, en), tmp_path, merges=12)
    reference = io.StringIO()
    learn_bpe(io.StringIO("".join(line + "\n" for line in de + en)), reference, 12)
    assert codes == tmp_path / "code" and codes.read_text() == reference.getvalue()
    assert count_bpe_merges(codes) == 12
    corpus_sha = hashlib.sha256("".join(line + "\n" for line in de + en).encode()).hexdigest()
    assert json.loads((tmp_path / "code.json").read_text()) == {
        "merges": 12,
        "train_sha256": corpus_sha,
        "sha256": hashlib.sha256(codes.read_bytes()).hexdigest(),
    }
    learnt = []
    monkeypatch.setattr("subword_nmt.learn_bpe.learn_bpe", lambda *a: learnt.append(a) or learn_bpe(*a))
    assert iwslt.learn_joint_bpe((de, en), tmp_path, merges=12) == codes and learnt == []  # reused
    iwslt.learn_joint_bpe((de, en), tmp_path, merges=5)  # another merge count
    assert len(learnt) == 1 and count_bpe_merges(codes) == 5
    iwslt.learn_joint_bpe((de, en[::-1]), tmp_path, merges=5)  # another training text
    assert len(learnt) == 2
    codes.write_text(codes.read_text() + "x y\n")  # the codes edited by hand
    iwslt.learn_joint_bpe((de, en[::-1]), tmp_path, merges=5)
    assert len(learnt) == 3 and count_bpe_merges(codes) == 5
    iwslt.learn_joint_bpe((de, en[::-1]), tmp_path, merges=5)
    assert len(learnt) == 3
    (tmp_path / "code.json").unlink()  # codes without their record: learnt again
    iwslt.learn_joint_bpe((de, en[::-1]), tmp_path, merges=5)
    assert len(learnt) == 4 and (tmp_path / "code.json").is_file()


def test_fairseq_layout_normalises_spaces_skips_bad_pairs_and_replaces_stale_codes(tmp_path):
    """fairseq's files: runs of spaces and tabs become one space; a pair with invalid UTF-8 or an empty side
    is skipped under its split with ``path:line``; a ``code`` in the output that differs from the source's is
    replaced, an identical one kept."""
    from mmlight.data.prepare.iwslt import _read_fairseq

    src = tmp_path / "fairseq"
    src.mkdir()
    lines = {
        "train": ([b"ein  hund", b"  ", b"eine\tkatze "], [b"a dog", b"nothing", b" a  cat"]),
        "valid": ([b"kaputt \xc3", b"gut"], [b"broken", b"good"]),
        "test": ([b"ja"], [b"yes \xff"]),
    }
    for split, (de, en) in lines.items():
        (src / f"{split}.de").write_bytes(b"".join(x + b"\n" for x in de))
        (src / f"{split}.en").write_bytes(b"".join(x + b"\n" for x in en))
    (src / "code").write_text("#version: 0.2\ne i\nh u\n")
    texts, skipped = _read_fairseq(src)
    assert texts == {
        "train": (["ein hund", "eine katze"], ["a dog", "a cat"]),
        "valid": (["gut"], ["good"]),
        "test": ([], []),
    }
    assert skipped == {
        "train": [{"path": f"{src}/train.de:2", "reason": "empty German side"}],
        "valid": [{"path": f"{src}/valid.de:1", "reason": "invalid UTF-8 (unexpected end of data at byte 7)"}],
        "test": [{"path": f"{src}/test.en:1", "reason": "invalid UTF-8 (invalid start byte at byte 4)"}],
    }
    info = prepare_iwslt(src, tmp_path / "new" / "out", workers=1, samples_per_shard=4)  # parents made
    assert info["cleaning"] == {} and (tmp_path / "new" / "out" / "code").read_bytes() == (src / "code").read_bytes()
    out = tmp_path / "out"
    out.mkdir()
    (out / "code").write_text("#version: 0.2\nstale codes\n")
    info = prepare_iwslt(src, out, workers=1, samples_per_shard=4)
    assert (out / "code").read_bytes() == (src / "code").read_bytes() and info["vocab"]["tokenizer"]["bpe_merges"] == 2
    before = (out / "code").stat().st_mtime_ns
    prepare_iwslt(src, out, workers=1, samples_per_shard=4)
    assert (out / "code").stat().st_mtime_ns == before
    (src / "test.en").write_bytes(b"yes\nno\n")
    with pytest.raises(ValueError) as err:
        _read_fairseq(src)
    assert str(err.value) == (
        f"test: {src}/test.de has 1 lines but {src}/test.en has 2; the German and English sides must be line-aligned"
    )


def test_detect_layout_names_what_each_layout_misses(raw, tmp_path):
    from mmlight.data.prepare.iwslt import FAIRSEQ_FILES, RAW_FILES, detect_layout

    assert detect_layout(raw[0]) == "raw"
    src = tmp_path / "both"
    shutil.copytree(raw[0], src)
    for name in FAIRSEQ_FILES:
        (src / name).write_text("x\n")
    assert detect_layout(src) == "fairseq"  # both complete: fairseq's is read as is
    (src / "code").unlink()
    (src / "IWSLT14.TED.tst2011.de-en.en.xml").unlink()
    (src / "IWSLT14.TED.tst2012.de-en.de.xml").unlink()
    (src / "valid.en").unlink()
    (src / "valid.en").mkdir()  # a folder is not the file
    (src / "valid.en.tmp").write_text("x\n")
    with pytest.raises(FileNotFoundError) as err:
        detect_layout(src)
    assert str(err.value) == (
        f"{src} holds neither IWSLT14 layout. fairseq's prepared output needs {', '.join(FAIRSEQ_FILES)} "
        f"(missing: valid.en, code); the raw release needs {', '.join(RAW_FILES)} "
        "(missing: IWSLT14.TED.tst2011.de-en.en.xml, IWSLT14.TED.tst2012.de-en.de.xml)"
    )


def test_each_side_is_tokenised_by_its_own_language_rules(raw, tmp_path):
    """German keeps an ordinal's period before a capital (``3.``: on ``nonbreaking_prefix.de``'s list, not on
    English's) and splits ``no.`` before a number (a numeric-only prefix of other languages, not of German)."""
    src = tmp_path / "raw"
    shutil.copytree(raw[0], src)
    (src / "train.tags.de-en.de").write_text("Am 3. Mai kam das Kapitel no. 5 .\n")
    (src / "train.tags.de-en.en").write_text("Chapter 5 came on May 3. It was late.\n")
    texts, _, _ = _read_raw(src, workers=1)
    assert texts["train"] == (["am 3. mai kam das kapitel no . 5 ."], ["chapter 5 came on may 3 . it was late ."])


def test_a_tag_on_either_side_drops_the_pair_and_title_tags_are_stripped_from_both(raw, tmp_path):
    """The recipe's ``grep -v`` runs on each language's file alone; dropping a line from one side only would
    misalign the two, so a pair goes when either side holds ``<url>``, ``<talkid>`` or ``<keywords>``.
    ``<title>``/``<description>`` tags are cut from both sides, their text kept."""
    src = tmp_path / "raw"
    shutil.copytree(raw[0], src)
    lines = [
        (b"<url>http://x</url>", b"A stray line ."),
        (b"Eine Zeile .", b"<talkid>5</talkid>"),
        (b"<keywords>a, b</keywords>", b"<keywords>a, b</keywords>"),
        (b"<title>Der Titel</title>", b"<title>The title</title>"),
        (b"<description>Eine Rede .</description>", b"<description>A talk .</description>"),
        (b"<b> Ein Zeichen .", b"<b> A sign ."),  # other tags stay, even opening a line (escaped by Moses)
    ]
    (src / "train.tags.de-en.de").write_bytes(b"".join(de + b"\n" for de, _ in lines))
    (src / "train.tags.de-en.en").write_bytes(b"".join(en + b"\n" for _, en in lines))
    texts, _, stats = _read_raw(src, workers=1)
    assert stats == {"tag_lines_dropped": 3, "cleaned_out": 0}
    assert texts["train"] == (
        ["der titel", "eine rede .", "&lt; b &gt; ein zeichen ."],
        ["the title", "a talk .", "&lt; b &gt; a sign ."],
    )
    with open(src / "train.tags.de-en.de", "ab") as f:
        f.write(b"Noch eine .\n")
    with pytest.raises(ValueError) as err:
        _read_raw(src, workers=1)
    assert str(err.value) == (
        f"training text: {src}/train.tags.de-en.de has 7 lines but {src}/train.tags.de-en.en has 6; "
        "the German and English sides must be line-aligned"
    )


@pytest.mark.parametrize("workers", [1, 2])
def test_parallel_keeps_the_order_of_the_lines_across_chunks(workers):
    """Chunks of 2 lines, tokenised in the main process or in 2 worker processes: the lines in their order."""
    from mmlight.data.prepare.iwslt import _parallel, _tokenize_chunk
    from mmlight.data.tokenizers import moses_tokenize

    lines = [f"Line {i}, isn't it?" for i in range(7)]
    got = _parallel(_tokenize_chunk, "en", lines, workers, chunk=2)
    assert got == [moses_tokenize(line, "en") for line in lines] and got[6] == "line 6 , isn &apos;t it ?"


def test_only_the_line_end_is_cut_before_decoding(raw, tmp_path):
    """``\\n`` or ``\\r\\n`` is cut from each raw line, nothing else: a line ending in ``X`` keeps it, and a cut
    character followed by a space is reported as the invalid byte it is (not as a line cut short)."""
    src = tmp_path / "raw"
    shutil.copytree(raw[0], src)
    (src / "train.tags.de-en.de").write_bytes(b"Ein X\r\nkaputt \xc3 \nXX\n")
    (src / "train.tags.de-en.en").write_bytes(b"An X\r\nbroken\nXX\n")
    texts, skipped, _ = _read_raw(src, workers=1)
    assert texts["train"] == (["ein x", "xx"], ["an x", "xx"])
    assert skipped["train"] == [
        {"path": f"{src}/train.tags.de-en.de:2", "reason": "invalid UTF-8 (invalid continuation byte at byte 7)"}
    ]


def test_num_tokens_sums_the_sample_sizes_of_each_split(shards):
    """``num_tokens`` of ``_info.json`` (the training epoch's length) = sum of max(source, target) + 1."""
    info = read_info(shards)
    for split in ("train", "valid", "test"):
        sizes = [max(len(s["src.npy"]), len(s["tgt.npy"])) + 1 for s in _read_split(shards, split)]
        assert info["splits"][split]["num_tokens"] == sum(sizes)


def _greedy_in_order(sizes, max_tokens):
    """Batches of consecutive indices, each closed when one more sample would exceed the budget."""
    out, batch = [], []
    for i in range(len(sizes)):
        if batch and (len(batch) + 1) * max(sizes[j] for j in batch + [i]) > max_tokens:
            out.append(batch)
            batch = []
        batch.append(i)
    return out + [batch]


def test_predict_cuts_the_file_in_order_and_refuses_a_line_over_the_limits(raw, shards, tmp_path):
    lines = [d for d, _ in raw[1][:7]]
    src_file = tmp_path / "input.de"
    src_file.write_text("\n".join(lines) + "\n", encoding="utf-8")
    dm = TranslationDataModule(str(shards), max_tokens=40, num_workers=0, src_file=str(src_file))
    sizes = [len(dm.encode(line)) + 1 for line in lines]
    got = [b["ids"].tolist() for b in dm.predict_dataloader()]
    assert got == _greedy_in_order(sizes, 40) and len(got) > 2
    longest = max(sizes)
    line_no = sizes.index(longest) + 1
    for limits in ({"max_tokens": longest - 1}, {"max_source_positions": longest - 1}):
        dm = TranslationDataModule(str(shards), **{"max_tokens": 64, **limits}, src_file=str(src_file))
        with pytest.raises(ValueError, match=rf"input\.de:{line_no} has {longest} tokens with </s>"):
            dm.predict_dataloader()
    dm = TranslationDataModule(str(shards), max_tokens=longest, max_source_positions=longest, src_file=str(src_file))
    assert sorted(i for b in dm.predict_dataloader() for i in b["ids"].tolist()) == list(range(7))
    src_file.write_text("", encoding="utf-8")
    assert list(TranslationDataModule(str(shards), src_file=str(src_file)).predict_dataloader()) == []


def test_predict_keeps_each_line_whole_and_reads_the_test_split_without_a_file(shards, tmp_path):
    """A line ending in a capital X keeps it (only the newline is cut); a line over 1024 tokens is
    translated when the position limit allows it; with no ``src_file``, predict reads the test split."""
    long_line = " ".join(["Der Hund sieht die Sonne"] * 100)
    src_file = tmp_path / "input.de"
    src_file.write_text("Er sieht Teil X\n" + long_line + "\n", encoding="utf-8")
    dm = TranslationDataModule(str(shards), max_tokens=4096, max_source_positions=2000, src_file=str(src_file))
    assert len(dm.encode(long_line)) > 1024
    rows = [row[mask].tolist() for b in dm.predict_dataloader() for row, mask in zip(b["src"], b["src_mask"])]
    assert rows == [dm.encode(line) + [dm.eos_id] for line in ("Er sieht Teil X", long_line)]
    assert dm.encode("Er sieht Teil X") != dm.encode("Er sieht Teil")
    dm = TranslationDataModule(str(shards), max_tokens=64, num_workers=0, val_split="valid")
    assert sorted(k for b in dm.predict_dataloader() for k in b["keys"]) == [f"test-{i:07d}" for i in range(10)]


def test_shard_members_are_named_and_typed_as_documented(shards):
    """Read with ``tarfile`` (no webdataset decoding, no lowercasing): each sample is ``<key>.src.npy``,
    ``.src.txt``, ``.tgt.npy`` and ``.tgt.txt``, the ids int32 and the texts the BPE'd lines they encode."""
    vocab = load_dictionary(shards / "dict.txt")
    shard = read_info(shards)["splits"]["valid"]["shards"][0]["name"]
    with tarfile.open(shards / shard) as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
    keys = sorted({name.split(".", 1)[0] for name in members})
    assert keys and sorted(members) == sorted(
        f"{k}.{ext}" for k in keys for ext in ("src.npy", "src.txt", "tgt.npy", "tgt.txt")
    )
    for key in keys:
        for side in ("src", "tgt"):
            ids = np.load(io.BytesIO(members[f"{key}.{side}.npy"]))
            assert ids.dtype == np.int32 and ids.ndim == 1
            assert [vocab[i] for i in ids] == members[f"{key}.{side}.txt"].decode("utf-8").split()


def test_defaults_are_the_iwslt14_recipe_s(tmp_path):
    """``TranslationDataModule(root)`` batches as the recipe configs ask (fairseq's ``--max-tokens 4096``
    and 1024 positions, a 2000-sample bucketing buffer); only the worker count (speed) is the config's own."""
    for path in sorted((ROOT / "configs").glob("nmt_iwslt14_*.yaml")):
        asked = yaml.safe_load(path.read_text(encoding="utf-8"))["data"]["init_args"]
        default = TranslationDataModule(str(tmp_path))
        for name in ("max_tokens", "max_source_positions", "max_target_positions", "bucket_buffer"):
            assert getattr(default, name) == asked[name], (path.name, name)


def _damage_member(shard, member: str) -> None:
    """Overwrite the ``.npy`` magic of ``member`` in place: the tar stays whole, the member is unreadable."""
    with tarfile.open(shard) as tar:
        offset = tar.getmember(member).offset_data
    with open(shard, "r+b") as f:
        f.seek(offset)
        f.write(b"XXXXXX")


def _damaged_copy(shards, tmp_path):
    """The shard set with one unreadable member in ``train-000002.tar`` and in ``test-000001.tar``, and
    ``train-000005.tar`` cut in the middle of its second sample."""
    out = tmp_path / "damaged"
    shutil.copytree(shards, out)
    _damage_member(out / "train-000002.tar", "train-0000008.src.npy")
    _damage_member(out / "test-000001.tar", "test-0000005.tgt.npy")
    with tarfile.open(out / "train-000005.tar") as tar:
        cut = tar.getmember("train-0000021.src.npy").offset_data + 40
    (out / "train-000005.tar").write_bytes((out / "train-000005.tar").read_bytes()[:cut])
    return out


def test_training_units_count_and_warn_only_when_asked_and_are_shuffled_and_deterministic(shards, tmp_path, caplog):
    """The worker that reports (``count_skips``) counts the unreadable member and the cut shard, logs them
    and warns about the samples over the budget; a replaying worker draws the same batches silently. The
    batches of a pool come in shuffled order, not by size."""
    root = _damaged_copy(shards, tmp_path)
    sizes = sorted(max(len(s["src.npy"]), len(s["tgt.npy"])) + 1 for s in _read_split(shards, "train"))
    max_tokens = sizes[len(sizes) * 3 // 4]  # the longest quarter is over the budget
    dm = TranslationDataModule(str(root), max_tokens=max_tokens, num_workers=0, bucket_buffer=1000)
    stream = dm.train_dataloader().dataset.source

    def units(count_skips):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = [[r["key"] for r in unit] for unit in islice(stream.units(RankRandom(0, 0, 0), count_skips), 12)]
        return got, [str(w.message) for w in caught]

    with caplog.at_level(logging.WARNING):
        quiet, quiet_warnings = units(False)
        assert dm.skipped.value == 0 and quiet_warnings == [] and caplog.records == []
        loud, loud_warnings = units(True)
    assert loud == quiet and all(loud)
    assert dm.skipped.value >= 2 and any("skipping sample" in w for w in loud_warnings)
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "skipped corrupt sample train-0000008" in logged and "skipped the rest of shard" in logged
    keys = {k for unit in loud for k in unit}
    assert "train-0000008" not in keys
    longest = [max(max(len(s["src.npy"]), len(s["tgt.npy"])) for s in _read_keys(shards, unit)) for unit in loud]
    assert longest != sorted(longest)  # one pool of 1000: unshuffled, its batches would come by size


def _read_keys(root, keys):
    samples = {s["__key__"]: s for s in _read_split(root, "train") if s["__key__"] in keys}
    return [samples[k] for k in keys]


def test_evaluation_skips_and_counts_an_unreadable_sample_and_is_repeatable(shards, tmp_path):
    root = _damaged_copy(shards, tmp_path)
    dm = TranslationDataModule(str(root), max_tokens=48, num_workers=0, bucket_buffer=8)
    first = [b["keys"] for b in dm.test_dataloader()]
    assert sorted(k for keys in first for k in keys) == [f"test-{i:07d}" for i in range(10) if i != 5]
    assert dm.skipped.value == 1
    assert [b["keys"] for b in dm.test_dataloader()] == first  # the same batches in the same order
    assert TranslationDataModule(str(root), num_workers=1).val_dataloader().pipeline[0].num_workers == 1


def test_an_epoch_shorter_than_one_batch_is_refused_with_the_budget(shards):
    dm = TranslationDataModule(str(shards), max_tokens=10**6, num_workers=0)
    with pytest.raises(ValueError, match=r"smaller than one global batch \(1000000 tokens x 1 devices\)"):
        dm.train_dataloader()


def test_words_missing_from_the_training_dictionary_are_unk_and_the_info_keeps_the_tokeniser(tmp_path):
    """The dictionary comes from the training text alone: a validation word it lacks is ``<unk>`` (id 3);
    ``_info.json`` records the tokeniser version that cached tokenisations are checked against."""
    texts = {"train": (["a b", "b"], ["x y", "y"]), "valid": (["a zz"], ["qq y"])}
    info = write_translation_shards(texts, tmp_path, layout="fairseq", bpe_merges=0)
    vocab = load_dictionary(tmp_path / "dict.txt")
    valid = _read_split(tmp_path, "valid")[0]
    assert valid["src.npy"].tolist() == [vocab.index("a"), 3] and valid["tgt.npy"].tolist() == [3, vocab.index("y")]
    assert info["vocab"]["tokenizer"]["version"] == TOKENIZER and info["cleaning"] == {}
    assert info["splits"]["valid"]["num_tokens"] == 3 and info["splits"]["train"]["num_tokens"] == 3 + 2
    with tarfile.open(tmp_path / info["splits"]["valid"]["shards"][0]["name"]) as tar:  # no webdataset decoding
        members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
    key = "valid-0000000"
    assert sorted(members) == [f"{key}.{ext}" for ext in ("src.npy", "src.txt", "tgt.npy", "tgt.txt")]
    assert [np.load(io.BytesIO(members[f"{key}.{side}.npy"])).dtype for side in ("src", "tgt")] == [np.int32] * 2
    assert (members[f"{key}.src.txt"], members[f"{key}.tgt.txt"]) == (b"a zz", b"qq y")
