"""``mmlight prepare text`` (mmlight/data/prepare/text.py) on fixtures of every raw format, damaged ones
included: token ids against ``tokenizers`` encoding the same text directly, the split against the hash
rule computed here, the bad inputs counted and named, determinism (tokenizer bytes, 1 vs 2 workers),
resumption, streaming through the WikiText DataModule on two ranks, and decoding from a checkpoint
with the data folder deleted."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import logging
import os
import shutil
import sys
import tarfile
from pathlib import Path
from pydoc_data.topics import topics
from types import SimpleNamespace

import lightning as L
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import zstandard
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

from mmlight.commands.prepare import main
from mmlight.data import WikiTextDataModule
from mmlight.data.prepare import text
from mmlight.data.shard_writer import Skipped
from mmlight.data.shards import read_info
from mmlight.data.text import read_stream
from mmlight.data.vocab import Vocab
from mmlight.tasks import LanguageModel
from tests.helpers.models import tiny_transformer

VOCAB = 300
VALID = 0.25
#: documents: real English from pydoc_data, cut short to keep tokenising fast
DOCS = [topics[name][:600] for name in sorted(topics)[:44]]


def jsonl(texts) -> bytes:
    return b"".join(json.dumps({"text": t, "meta": 1}).encode() + b"\n" for t in texts)


def write_raw(root: Path) -> tuple[list[str], list[tuple[str, str]]]:
    """Every raw format with damage; returns the readable documents in source order and the bad
    inputs ``(place relative to root, start of the reason)`` in the order they are reported."""
    root.mkdir(parents=True)
    d = iter(DOCS)
    take = lambda n: [next(d) for _ in range(n)]  # noqa: E731
    docs, bad = [], []
    # sorted order: a.txt, b.jsonl, bad.txt, broken.parquet, c.jsonl.gz, d.jsonl.zst, e.parquet, empty.txt,
    # nocol.parquet, notes.md, sub/f.txt.gz, truncated.jsonl.gz
    (a,) = take(1)
    (root / "a.txt").write_text(a, encoding="utf-8")
    b = take(6)
    lines = [*jsonl(b[:2]).splitlines(keepends=True), b'{"text": "unterminated\n', b"\n"]
    lines += [*jsonl(b[2:4]).splitlines(keepends=True), b'{"text": "caf\xe9"}\n', b'{"other": "x"}\n']
    lines += [b'{"text": 7}\n', b'["text"]\n', jsonl(["   \n"]), *jsonl(b[4:]).splitlines(keepends=True)]
    (root / "b.jsonl").write_bytes(b"".join(lines))
    docs += [a, *b]
    bad += [("b.jsonl:3", "malformed JSON"), ("b.jsonl:4", "blank line"), ("b.jsonl:7", "not valid UTF-8")]
    bad += [("b.jsonl:8", "no 'text' field"), ("b.jsonl:9", "'text' is int"), ("b.jsonl:10", "not a JSON object")]
    bad += [("b.jsonl:11", "empty document")]
    (root / "bad.txt").write_bytes(b"valid start \xff\xfe then not")
    bad.append(("bad.txt", "not valid UTF-8"))
    (root / "broken.parquet").write_bytes(b"PAR1 this is no parquet file")
    bad.append(("broken.parquet", "unreadable parquet file"))
    c = take(5)
    (root / "c.jsonl.gz").write_bytes(gzip.compress(jsonl(c), mtime=0))
    d_ = take(5)
    (root / "d.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(jsonl(d_)))
    docs += [*c, *d_]
    e = take(8)
    table = pa.table({"id": list(range(10)), "text": [e[0], None, *e[1:4], "", *e[4:]]})
    pq.write_table(table, root / "e.parquet", row_group_size=4)  # row groups of rows 0-3, 4-7, 8-9
    docs += e
    bad += [("e.parquet:1", "null text"), ("e.parquet:5", "empty document")]
    (root / "empty.txt").write_text("\n \n", encoding="utf-8")
    bad.append(("empty.txt", "empty document"))
    pq.write_table(pa.table({"content": ["no text column"]}), root / "nocol.parquet")
    bad.append(("nocol.parquet", "no column 'text'"))
    (root / "notes.md").write_text("not a source", encoding="utf-8")
    bad.append(("notes.md", "not a text source"))
    (sub,) = take(1)
    (root / "sub").mkdir()
    (root / "sub" / "f.txt.gz").write_bytes(gzip.compress(sub.encode(), mtime=0))
    docs.append(sub)
    t = take(3)
    damaged = gzip.compress(jsonl(t), mtime=0) + gzip.compress(jsonl(["lost"]), mtime=0)[:14]
    (root / "truncated.jsonl.gz").write_bytes(damaged)
    docs += t
    bad.append(("truncated.jsonl.gz:4", "unreadable from here on"))
    # reported order: files that are not sources, then parquet files skipped at planning, then the rest
    order = ["notes.md", "broken.parquet", "nocol.parquet"]
    bad.sort(key=lambda x: order.index(x[0]) if x[0] in order else len(order))
    return docs, bad


def valid_by_hash(doc: str) -> bool:
    """The documented rule, computed here: BLAKE2b-64 of the UTF-8 text, big-endian, below fraction * 2**64."""
    value = int(hashlib.blake2b(doc.encode("utf-8"), digest_size=8).hexdigest(), 16)
    return value < VALID * 2**64


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("text")
    docs, bad = write_raw(root / "raw")
    options = {"workers": 1, "vocab_size": VOCAB, "valid_fraction": VALID, "chunk_tokens": 500}
    info = text.prepare([root / "raw"], root / "out", **options)
    return root, docs, bad, info


def expected_streams(tokenizer_file: Path, docs: list[str], eos: int) -> dict[str, list[int]]:
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    streams = {"train": [], "valid": []}
    for doc in docs:
        ids = tokenizer.encode(doc, add_special_tokens=False).ids
        streams["valid" if valid_by_hash(doc) else "train"] += ids + [eos]
    return streams


def test_ids_equal_tokenizers_on_the_same_text_split_by_hash(prepared):
    root, docs, _, info = prepared
    out = root / "out"
    streams = expected_streams(out / "tokenizer.json", docs, eos=2)
    assert 0 < len(streams["valid"]) < len(streams["train"])  # both splits hold documents
    for split, expected in streams.items():
        assert read_stream(out, info, split).tolist() == expected
        assert info["splits"][split]["num_tokens"] == len(expected)
        assert info["splits"][split]["num_documents"] == sum((split == "valid") == valid_by_hash(d) for d in docs)
    assert info["num_documents"] == len(docs)
    for split, expected in streams.items():  # chunks of chunk_tokens (500), the last one shorter
        lengths = []
        for shard in sorted(out.glob(f"{split}-*.tar")):
            with tarfile.open(shard) as tar:
                for member in (m for m in tar if m.name.endswith(".ids.npy")):
                    chunk = np.load(io.BytesIO(tar.extractfile(member).read()))
                    assert chunk.dtype == np.uint16  # 300 tokens fit
                    lengths.append(len(chunk))
        full, last = divmod(len(expected), 500)
        assert lengths == [500] * full + ([last] if last else [])


def test_bad_inputs_are_counted_and_named(prepared):
    root, _, bad, info = prepared
    raw = str(root / "raw") + "/"
    places = [s["path"].removeprefix(raw) for s in info["skipped"]]
    assert places == [where for where, _ in bad]
    for s, (_, reason) in zip(info["skipped"], bad):
        assert s["reason"].startswith(reason), (s, reason)
    assert info["num_skipped"] == len(bad) == 15


def test_the_trained_tokenizer_is_byte_level_with_the_specials_first(prepared):
    root, docs, _, info = prepared
    tokenizer = Tokenizer.from_file(str(root / "out" / "tokenizer.json"))
    assert [tokenizer.id_to_token(i) for i in range(4)] == ["<s>", "<pad>", "</s>", "<unk>"]
    assert tokenizer.get_vocab_size() == VOCAB == info["vocab"]["size"]
    assert info["vocab"]["special_ids"] == {"bos": 0, "pad": 1, "eos": 2, "unk": 3}
    odd = "naïve – ∑ 🙂 \x00 tab\tend"  # never seen in training: bytes still round-trip
    assert tokenizer.decode(tokenizer.encode(odd).ids) == odd


def test_same_input_same_tokenizer_and_shards_with_1_or_2_workers(prepared, tmp_path):
    root, _, _, info = prepared
    again = text.prepare([root / "raw"], tmp_path, workers=2, vocab_size=VOCAB, valid_fraction=VALID, chunk_tokens=500)
    assert (tmp_path / "tokenizer.json").read_bytes() == (root / "out" / "tokenizer.json").read_bytes()
    assert again == info  # shard names, sample counts and SHA-256 included
    for shard in info["splits"]["train"]["shards"]:
        assert (tmp_path / shard["name"]).read_bytes() == (root / "out" / shard["name"]).read_bytes()


def test_an_interrupted_run_resumes_to_the_same_result(prepared, tmp_path, monkeypatch):
    root, _, _, info = prepared
    done = []
    real = text.tokenize_unit

    def interrupted(job):
        if len(done) == 3:
            raise KeyboardInterrupt
        done.append(job.name)
        return real(job)

    monkeypatch.setattr(text, "tokenize_unit", interrupted)
    options = {"workers": 1, "vocab_size": VOCAB, "valid_fraction": VALID, "chunk_tokens": 500}
    with pytest.raises(KeyboardInterrupt):
        text.prepare([root / "raw"], tmp_path, **options)
    assert not (tmp_path / "_info.json").exists()
    finished = {p: p.stat().st_mtime_ns for p in (tmp_path / "_work").glob("*.npy")}
    assert len(finished) == 2 * 3
    monkeypatch.setattr(text, "tokenize_unit", real)
    monkeypatch.setattr(text, "train_tokenizer", lambda *args: pytest.fail("trained again, not reused"))
    assert text.prepare([root / "raw"], tmp_path, **options) == info
    assert (tmp_path / "_info.json").read_bytes() == (root / "out" / "_info.json").read_bytes()
    assert all(p.stat().st_mtime_ns == t for p, t in finished.items())  # the finished units were reused


def test_a_changed_source_is_refused_rather_than_mixed(prepared, tmp_path):
    root, _, _, _ = prepared
    raw = tmp_path / "raw"
    shutil.copytree(root / "raw", raw)
    text.prepare([raw / "a.txt"], tmp_path / "out", vocab_size=VOCAB, valid_fraction=VALID)
    (raw / "a.txt").write_text(DOCS[-1], encoding="utf-8")
    with pytest.raises(ValueError, match="another tokenizer than this one: prepare into an empty --out folder"):
        text.prepare([raw / "a.txt"], tmp_path / "out", vocab_size=VOCAB, valid_fraction=VALID)


def scored(batches) -> list[tuple[int, int]]:
    pairs = []
    for batch in batches:
        for start, target, mask in zip(batch["start"], batch["target"], batch["loss_mask"]):
            pairs += [(int(start) + int(t), int(target[t])) for t in torch.nonzero(mask).flatten()]
    return pairs


def test_streams_ddp_exact_through_the_wikitext_datamodule(prepared):
    root, _, _, info = prepared
    out = str(root / "out")
    steps, pairs = [], []
    for rank in (0, 1):
        dm = WikiTextDataModule(out, block_size=16, batch_size=2, num_workers=0, eval_context=4, val_split="valid")
        dm.trainer = SimpleNamespace(global_rank=rank, world_size=2)
        assert dm.vocab_size == VOCAB
        batches = list(dm.train_dataloader())
        steps.append(len(batches))
        assert all(b["input"].shape == (2, 16) and int(b["input"].max()) < VOCAB for b in batches)
        pairs += scored(dm.eval_dataset("valid"))
    assert steps[0] == steps[1] == info["splits"]["train"]["num_tokens"] // (16 * 2 * 2)
    stream = read_stream(out, info, "valid").tolist()
    assert sorted(pairs) == list(enumerate(stream))  # every validation token scored once over both ranks


def test_a_checkpoint_decodes_with_the_data_folder_deleted(prepared, tmp_path):
    root, docs, _, _ = prepared
    out = tmp_path / "data"
    shutil.copytree(root / "out", out)
    dm = WikiTextDataModule(str(out), block_size=8, batch_size=2, num_workers=0, val_split="valid")
    model = LanguageModel(tiny_transformer(vocab_size=VOCAB, pad_id=1, max_positions=16), warmup_steps=1)
    trainer = L.Trainer(max_steps=1, limit_val_batches=0, logger=False, enable_checkpointing=False, accelerator="cpu")
    trainer.fit(model, dm)
    trainer.save_checkpoint(tmp_path / "lm.ckpt")
    direct = Tokenizer.from_file(str(out / "tokenizer.json"))
    shutil.rmtree(out)
    loaded = LanguageModel.load_from_checkpoint(tmp_path / "lm.ckpt", map_location="cpu")
    vocab = Vocab.from_dict(torch.load(tmp_path / "lm.ckpt", weights_only=False)["mmlight_data"]["vocab"])
    for v in (loaded.vocab, vocab):
        ids = v.encode(docs[0])
        assert ids == direct.encode(docs[0], add_special_tokens=False).ids
        assert v.decode([v.bos_id, *ids, v.eos_id]) == docs[0]  # byte for byte, the specials dropped
    (score,) = loaded.score([docs[1][:40]], block_size=16)
    assert score.tokens == len(direct.encode(docs[1][:40]).ids) + 1 and score.log_prob < 0


def test_one_source_the_smallest_vocabulary_and_no_validation_split(tmp_path, caplog, monkeypatch):
    """``src`` as one path (not a list), the smallest vocabulary (the 256 bytes and the 4 specials, so no
    merge), one process by default, and ``valid_fraction`` 0 (warned of): each field of ``_info.json``
    that the readers take, against a value known here. One entry fewer is refused, naming the floor."""
    import tokenizers

    source = tmp_path / "a.txt"
    source.write_text(DOCS[0], encoding="utf-8")
    with pytest.raises(ValueError) as small:
        text.prepare(source, tmp_path / "refused", vocab_size=259)
    assert str(small.value) == "--vocab-size must be at least 260 (bytes and specials), got 259"
    tokenize_all, asked = text.tokenize_all, []

    def recording(jobs, workers):
        asked.append(workers)
        return tokenize_all(jobs, workers)

    monkeypatch.setattr(text, "tokenize_all", recording)
    options = {"vocab_size": 260, "valid_fraction": 0.0, "chunk_tokens": 64, "text_column": "body"}
    with caplog.at_level(logging.WARNING, logger=text.log.name):
        info = text.prepare(source, tmp_path / "out", **options)
    assert asked == [1]
    assert read_info(tmp_path / "out") == info
    fields = (info["dataset"], info["eos_per_line"], info["chunk_tokens"], info["text_column"])
    assert fields == ("text", True, 64, "body")
    assert info["vocab"]["size"] == 260 and info["vocab"]["file"] == "tokenizer.json"
    assert info["vocab"]["tokenizer"]["version"] == f"tokenizers {tokenizers.__version__}"
    assert json.loads((tmp_path / "out" / "tokenizer.json").read_text(encoding="utf-8"))["model"]["merges"] == []
    assert info["splits"]["valid"]["num_documents"] == 0 and info["splits"]["train"]["num_documents"] == 1
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == ["the validation split is empty: 1 documents at --valid-fraction 0"]


def test_units_are_tokenised_by_a_pool_of_at_most_workers_processes_only_where_two_can_share_them(monkeypatch):
    """A pool for two workers or more and two units or more, never of more processes than units; its
    results in unit order (the pool here maps in this process and records its size)."""
    pools = []

    class Pool:
        def __init__(self, max_workers):
            pools.append(max_workers)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def map(self, fn, items):
            return map(fn, items)

    monkeypatch.setattr(text, "ProcessPoolExecutor", Pool)
    monkeypatch.setattr(text, "tokenize_unit", lambda job: {"unit": job})
    for workers, units in [(1, 3), (2, 1), (2, 2), (3, 2), (4, 3)]:
        assert text.tokenize_all(list(range(units)), workers) == [{"unit": i} for i in range(units)]
    assert pools == [2, 2, 3]


@pytest.mark.parametrize(
    "size, want", [(300, "uint16"), (2**16 - 1, "uint16"), (2**16, "uint16"), (2**16 + 1, "uint32"), (2**20, "uint32")]
)
def test_ids_are_stored_in_the_narrowest_unsigned_type_that_holds_the_largest(size, want):
    """The boundary is the vocabulary of 2**16 entries, whose largest id 65,535 is uint16's largest value."""
    dtype = text.token_dtype(size)
    assert dtype == np.dtype(want)
    assert int(np.array([size - 1]).astype(dtype)[0]) == size - 1  # the largest id keeps its value


@pytest.mark.parametrize("size, dtype", [(40_000, "uint16"), (70_000, "uint32")])
def test_a_given_tokenizer_gets_the_missing_specials_and_large_ids_keep_their_value(prepared, tmp_path, size, dtype):
    """The specials appended after ``size`` entries: ids above 2**15 (a signed 16-bit overflow) in uint16, and
    above 2**16 in uint32, are stored as they are."""
    root, docs, _, _ = prepared
    words = sorted({w for doc in docs for w in doc.split()})
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}
    vocab.update({f"filler{i}": len(vocab) + i for i in range(size - len(vocab))})
    given = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    given.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # as a Llama tokenizer.json has: a template that puts a token before every text, never in the streams
    given.post_processor = processors.TemplateProcessing(single="[UNK] $A", special_tokens=[("[UNK]", 0)])
    given.save(str(tmp_path / "given.json"))
    info = text.prepare(
        [root / "raw" / "c.jsonl.gz"], tmp_path / "out", tokenizer=tmp_path / "given.json", valid_fraction=VALID
    )
    assert info["vocab"]["special_ids"] == {"bos": size, "pad": size + 1, "eos": size + 2, "unk": size + 3}
    assert info["vocab"]["size"] == size + 4 and info["dtype"] == dtype
    lines = gzip.decompress((root / "raw" / "c.jsonl.gz").read_bytes()).decode().splitlines()
    for split in ("train", "valid"):
        texts = [t for t in (json.loads(line)["text"] for line in lines) if (split == "valid") == valid_by_hash(t)]
        expected = [i for t in texts for i in [vocab[w] for w in t.split()] + [size + 2]]
        assert read_stream(tmp_path / "out", info, split).tolist() == expected
    assert Vocab.from_shards(tmp_path / "out", read_info(tmp_path / "out")).decode([vocab[words[0]]]) == words[0]


def test_bad_options_and_missing_sources_stop_before_work(tmp_path):
    (tmp_path / "a.txt").write_text("some text", encoding="utf-8")
    (tmp_path / "x.csv").write_text("a,b", encoding="utf-8")
    cases = [
        ({"src": [tmp_path / "nope"]}, FileNotFoundError, "does not exist"),
        ({"src": [tmp_path / "x.csv"]}, ValueError, "is not a text source"),
        ({"src": [tmp_path], "valid_fraction": 1.0}, ValueError, r"--valid-fraction must be in \[0, 1\)"),
        ({"src": [tmp_path], "vocab_size": 100}, ValueError, "--vocab-size must be at least 260"),
        ({"src": [tmp_path], "tokenizer": tmp_path / "none.json"}, FileNotFoundError, "--tokenizer .* is not a file"),
        ({"src": [tmp_path / "x.csv", tmp_path / "a.txt"]}, ValueError, "x.csv is not a text source"),
    ]
    for options, error, message in cases:
        with pytest.raises(error, match=message):
            text.prepare(out=tmp_path / "out", **options)
    (tmp_path / "only").mkdir()
    (tmp_path / "only" / "empty.txt").write_text(" ", encoding="utf-8")
    with pytest.raises(ValueError) as nothing:
        text.prepare([tmp_path / "only"], tmp_path / "out2", vocab_size=VOCAB)
    assert str(nothing.value) == f"no readable document in {[str(tmp_path / 'only')]} (1 inputs skipped, above)"


def test_a_missing_optional_package_is_named(tmp_path, monkeypatch):
    pq.write_table(pa.table({"text": ["a"]}), tmp_path / "a.parquet")
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # import fails as if not installed
    with pytest.raises(ImportError, match=r"\.parquet files need the pyarrow package: pip install pyarrow"):
        text.prepare([tmp_path], tmp_path / "out")


def test_command_line(prepared, tmp_path, capsys):
    root, _, bad, _ = prepared
    with pytest.raises(SystemExit) as exit_info:
        main(["text", "--help"])
    assert exit_info.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())  # argparse wraps at the terminal's width
    assert " --src SRC [SRC ...] text files and folders: .txt, .jsonl (also .gz/.zst), .parquet " in help_text
    assert " --workers WORKERS " in help_text
    assert " text options: --vocab-size " in help_text  # the preparer's own options, in a group of its name
    for option, said in (
        ("--vocab-size VOCAB_SIZE", "BPE vocabulary size, specials included"),
        ("--tokenizer TOKENIZER", "an existing tokenizer.json to use instead of training one"),
        ("--valid-fraction VALID_FRACTION", "share of documents in valid (by hash)"),
        ("--text-column TEXT_COLUMN", "the text field of jsonl and column of parquet"),
    ):
        assert f" {option} {said} " in help_text + " "
    main(["text", "--src", str(root / "raw" / "a.txt"), str(root / "raw"), "--out", str(tmp_path), "--vocab-size",
          str(VOCAB), "--valid-fraction", str(VALID), "--workers", "1"])  # fmt: skip
    printed = capsys.readouterr().out
    assert f"{len(bad)} bad inputs skipped, named in _info.json" in printed
    written = read_info(tmp_path)
    assert written["vocab"]["size"] == VOCAB and written["valid_fraction"] == VALID  # the options reached it
    with pytest.raises(SystemExit) as exit_info:
        main(["text", "--src", str(tmp_path / "nope"), "--out", str(tmp_path / "o")])
    assert exit_info.value.code == 2 and "does not exist" in capsys.readouterr().err


def test_trainer_settings_are_deterministic_across_fresh_tokenizers():
    """The trainer alone, twice on the same batches: the same JSON (what the preparation relies on)."""
    texts = [[d] for d in DOCS]
    first = text.train_tokenizer(iter(texts), 280)
    assert text.train_tokenizer(iter(texts), 280) == first
    reference = Tokenizer(models.BPE())
    reference.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=280,
        special_tokens=["<s>", "<pad>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    reference.train_from_iterator(DOCS, trainer)
    assert Tokenizer.from_str(first).get_vocab() == reference.get_vocab()


def test_parquet_files_are_planned_by_their_row_groups_and_skipped_with_the_reason(tmp_path):
    """A file of one row is one unit at row 0; row groups start at their first row; no rows, or a column
    that is not text, is skipped naming it (a large_string column, as Polars writes, is text)."""
    one, groups, empty, ints, large = (tmp_path / f"{n}.parquet" for n in ("one", "groups", "empty", "ints", "large"))
    pq.write_table(pa.table({"text": ["only row"]}), one)
    pq.write_table(pa.table({"text": [f"row {i}" for i in range(10)]}), groups, row_group_size=4)
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), empty)
    pq.write_table(pa.table({"text": [1, 2]}), ints)
    pq.write_table(pa.table({"text": pa.array(["a", "b"], pa.large_string())}), large)
    assert text.parquet_groups(one, "text") == [0]
    assert text.parquet_groups(groups, "text") == [0, 4, 8]
    assert text.parquet_groups(large, "text") == [0]
    assert text.parquet_groups(empty, "text") == Skipped(str(empty), "no rows")
    assert text.parquet_groups(ints, "text") == Skipped(str(ints), "column 'text' holds int64, not text")
    pq.write_table(pa.table({"id": [1], "content": ["x"]}), tmp_path / "other.parquet")
    missing = Skipped(str(tmp_path / "other.parquet"), "no column 'text' (columns: id, content)")
    assert text.parquet_groups(tmp_path / "other.parquet", "text") == missing
    units = [text.Unit(str(groups), "parquet", part, first) for part, first in enumerate([0, 4, 8])]
    rows = [where for unit in units for where, _ in text.parquet_documents(unit, "text")]
    assert rows == [f"{groups}:{i}" for i in range(10)]


def test_documents_batched_three_at_a_time_give_the_same_tokenizer_and_streams(prepared, tmp_path, monkeypatch):
    """Training and tokenising read documents in batches of ``BATCH_DOCS``: batches of 3 (many full ones,
    and a last partial one in most files) change nothing."""
    root, _, _, info = prepared
    monkeypatch.setattr(text, "BATCH_DOCS", 3)
    options = {"workers": 1, "vocab_size": VOCAB, "valid_fraction": VALID, "chunk_tokens": 500}
    again = text.prepare([root / "raw"], tmp_path / "out", **options)
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (root / "out" / "tokenizer.json").read_bytes()
    for split in ("train", "valid"):
        assert read_stream(tmp_path / "out", again, split).tolist() == read_stream(root / "out", info, split).tolist()


def test_a_jsonl_line_loses_only_its_line_ending():
    """``\\n`` and ``\\r\\n`` end a line; other trailing bytes are the record's, and JSON refuses a form feed."""
    assert text.jsonl_document("f:1", b'{"text": "a b"}\r\n', "text") == ("f:1", "a b")
    assert text.jsonl_document("f:2", b'{"text": "a b"}\n', "text") == ("f:2", "a b")
    for line in (b'{"text": "a b"}\x0c\n', b'{"text": "a b"}X\n'):
        skipped = text.jsonl_document("f:3", line, "text")
        assert skipped.path == "f:3" and skipped.reason.startswith("malformed JSON: Extra data")


def test_without_zstandard_a_zst_source_names_the_package_to_install(tmp_path, monkeypatch):
    path = tmp_path / "a.jsonl.zst"
    path.write_bytes(zstandard.ZstdCompressor().compress(jsonl(["one document"])))
    monkeypatch.setitem(sys.modules, "zstandard", None)  # import fails as if not installed
    with pytest.raises(ImportError) as err:
        text.open_binary(str(path))
    assert str(err.value) == ".zst files need the zstandard package: pip install zstandard"


def test_without_zstandard_a_zst_source_stops_the_run_before_any_work(tmp_path, monkeypatch):
    """The check runs while the sources are listed, for any case of the ending, before a folder is made."""
    folder = tmp_path / "src"
    folder.mkdir()
    (folder / "a.txt").write_text("plain text", encoding="utf-8")
    (folder / "B.JSONL.ZST").write_bytes(zstandard.ZstdCompressor().compress(jsonl(["one document"])))
    monkeypatch.setitem(sys.modules, "zstandard", None)
    message = ".zst files need the zstandard package: pip install zstandard"
    with pytest.raises(ImportError) as listed:
        text.find_files([folder])
    with pytest.raises(ImportError) as prepared:
        text.prepare(folder, tmp_path / "out")
    assert str(listed.value) == str(prepared.value) == message
    assert not (tmp_path / "out").exists()


def test_a_file_that_is_not_a_text_source_is_named_with_the_endings_read(tmp_path):
    """Named as ``--src`` it is an error; found in a folder it is skipped, with the same list of endings."""
    endings = ".txt, .txt.gz, .txt.zst, .jsonl, .jsonl.gz, .jsonl.zst, .parquet"
    (tmp_path / "notes.md").write_text("not a source", encoding="utf-8")
    (tmp_path / "a.txt").write_text("plain text", encoding="utf-8")
    with pytest.raises(ValueError) as named:
        text.find_files([tmp_path / "notes.md"])
    assert str(named.value) == f"--src {tmp_path / 'notes.md'} is not a text source ({endings})"
    files, others = text.find_files([tmp_path])
    assert files == [tmp_path / "a.txt"]
    assert others == [Skipped(str(tmp_path / "notes.md"), f"not a text source ({endings})")]


def test_a_lone_surrogate_or_blank_text_in_a_jsonl_record_is_skipped_naming_the_line():
    """JSON's ``\\ud800`` escape decodes to a lone surrogate, which UTF-8 (and so the tokenizer) cannot hold."""
    surrogate = text.jsonl_document("f:4", b'{"text": "ab\\ud800c"}\n', "text")
    assert surrogate == Skipped("f:4", "not encodable as UTF-8 (surrogates not allowed at character 2)")
    assert text.jsonl_document("f:5", b'{"text": "  "}\n', "text") == Skipped("f:5", "empty document")


def given_word_tokenizer(path: Path) -> Path:
    """A word-level tokenizer of four words (ids 1-4, ``[UNK]`` 0) saved at ``path``."""
    words = ["alpha", "beta", "gamma", "delta"]
    given = Tokenizer(models.WordLevel({"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}, unk_token="[UNK]"))
    given.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    given.save(str(path))
    return path


@pytest.mark.parametrize(
    "second, mtime_step, want",
    [
        (["gamma beta alpha", "alpha delta"], 10**9, [3, 2, 1, "eos", 1, 4, "eos"]),  # same size, a later time
        (["gamma beta", "alpha delta delta delta"], 0, [3, 2, "eos", 1, 4, 4, 4, "eos"]),  # another size, same time
    ],
)
@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_a_rerun_after_a_source_changed_writes_its_new_ids(tmp_path, second, mtime_step, want, suffix):
    """A source file rewritten between runs is tokenised again, whether its size or its time shows the
    change, and the shard holding its tokens is written again (its items name the arrays' SHA-256, not
    only their paths and ranges: the same words in another order are as many tokens in the same place)."""
    options = {"tokenizer": given_word_tokenizer(tmp_path / "given.json"), "valid_fraction": 0.0}
    source = tmp_path / "raw" / f"a.{suffix}"
    source.parent.mkdir()

    def write(texts):
        if suffix == "parquet":
            pq.write_table(pa.table({"text": texts}), source)
        else:
            source.write_bytes(jsonl(texts))

    write(["alpha beta gamma", "delta alpha"])
    text.prepare([source], tmp_path / "out", **options)
    before, size = source.stat().st_mtime_ns, source.stat().st_size
    write(second)
    assert (source.stat().st_size == size) == (mtime_step > 0)  # what each case means to show
    os.utime(source, ns=(before + mtime_step, before + mtime_step))  # a coarse file-system clock's view
    info = text.prepare([source], tmp_path / "out", **options)
    eos = info["vocab"]["special_ids"]["eos"]
    assert read_stream(tmp_path / "out", info, "train").tolist() == [eos if i == "eos" else i for i in want]


def test_a_damaged_work_array_is_tokenised_again_on_a_rerun(tmp_path):
    """A finished unit's array whose size is not the recorded one (a disk that filled, a file cut short) is
    not reused: the rerun, after a run stopped before its shards, writes it again and the shards hold the
    right ids."""
    options = {"tokenizer": given_word_tokenizer(tmp_path / "given.json"), "valid_fraction": 0.0}
    source = tmp_path / "a.jsonl"
    source.write_bytes(jsonl(["alpha beta gamma", "delta alpha"]))
    first = text.prepare([source], tmp_path / "out", **options)
    (array,) = (tmp_path / "out" / text.WORK_DIR).glob("*.train.npy")
    np.save(array, np.zeros(2, np.uint16))
    for shard in (tmp_path / "out").glob("train-*.tar"):  # as if the run had stopped before writing them
        shard.unlink()
    info = text.prepare([source], tmp_path / "out", **options)
    eos = info["vocab"]["special_ids"]["eos"]
    assert read_stream(tmp_path / "out", info, "train").tolist() == [1, 2, 3, eos, 4, 1, eos]
    assert info == first


@pytest.mark.parametrize(
    "name, kind, where", [("x.jsonl.gz", "jsonl", "x.jsonl.gz:1"), ("x.txt.gz", "txt", "x.txt.gz")]
)
def test_a_file_unreadable_from_its_first_byte_is_named_at_its_first_line(tmp_path, name, kind, where):
    """A .gz that is no gzip fails before any line is read: a jsonl file at its line 1, a txt file whole."""
    (tmp_path / name).write_bytes(b"not gzip at all")
    (skipped,) = text.documents(text.Unit(str(tmp_path / name), kind), "text")
    reason = "unreadable from here on: BadGzipFile: Not a gzipped file (b'no')"
    assert skipped == Skipped(f"{tmp_path}/{where}", reason)


def test_a_jsonl_line_that_is_no_object_names_what_it_is():
    assert text.jsonl_document("f:9", b'["text"]\n', "text") == Skipped("f:9", "not a JSON object but list")


def test_the_tokenizer_is_trained_on_the_training_documents_only(prepared):
    """The trainer on the readable training documents in source order (one batch: fewer than ``BATCH_DOCS``)
    gives the prepared ``tokenizer.json``, byte for byte."""
    root, docs, _, _ = prepared
    training = [doc for doc in docs if not valid_by_hash(doc)]
    assert 0 < len(training) < len(docs) < text.BATCH_DOCS
    want = text.train_tokenizer(iter([training]), VOCAB)
    assert (root / "out" / "tokenizer.json").read_text(encoding="utf-8") == want


def test_a_damaged_parquet_file_or_row_group_is_skipped_naming_the_error(tmp_path):
    """A file that is no parquet is skipped at planning; a row group whose pages are damaged (the footer
    intact) is skipped when read, named by its group, and the file's other groups still read."""
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 this is no parquet file")
    broken = text.parquet_groups(tmp_path / "broken.parquet", "text")
    assert broken.path == str(tmp_path / "broken.parquet")
    assert broken.reason.startswith("unreadable parquet file: ArrowInvalid: Parquet magic bytes not found")
    path = tmp_path / "damaged.parquet"
    pq.write_table(pa.table({"text": [f"row {i} " * 20 for i in range(10)]}), path, row_group_size=5)
    data = bytearray(path.read_bytes())
    data[30:300] = b"\xab" * 270  # inside the first row group's pages
    path.write_bytes(bytes(data))
    assert text.parquet_groups(path, "text") == [0, 5]
    first, second = (text.Unit(str(path), "parquet", part, row) for part, row in enumerate([0, 5]))
    (damaged,) = text.parquet_documents(first, "text")  # pyarrow's words for the damage vary by version
    assert damaged.path == f"{path}#group0" and damaged.reason.startswith("unreadable row group: OSError: ")
    assert [where for where, _ in text.parquet_documents(second, "text")] == [f"{path}:{i}" for i in range(5, 10)]
