"""WikiText-103: raw text -> vocabulary + token-id shards -> training blocks and evaluation windows."""

import collections
import io
import json
import math
import shutil
import tarfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml

from mmlight.commands.prepare import main as prepare_main
from mmlight.data.prepare.wikitext import prepare
from mmlight.data.shards import sha256
from mmlight.data.skips import SkipCounter
from mmlight.data.streaming import RankRandom
from mmlight.data.text import BlockStream, EvalWindows, WikiTextDataModule, block_starts, eval_windows
from mmlight.data.vocab import load_vocab
from tests.helpers.wikitext import TEST, TRAIN, VALID, tokens, write_raw

VOCAB = [
    "<s>",
    "<pad>",
    "</s>",
    "<unk>",
    "=",  # 6
    ".",
    "The",
    "game",  # 3 each, by code point
    "is",
    "play",  # 2
    ",",
    "@-@",
    "Gameplay",
    "Valkyria",
    "fun",
    "the",
]  # 1
CHUNK, PER_SHARD = 8, 2  # small chunks so that the splits span several samples and shards


def ids(data: bytes) -> np.ndarray:
    index = {w: i for i, w in enumerate(VOCAB)}
    return np.array([index.get(w, 3) for w in tokens(data)], dtype=np.int64)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("wikitext")
    src = write_raw(root / "raw")
    out = root / "shards"
    prepare(src, out, workers=1, chunk_tokens=CHUNK, chunks_per_shard=PER_SHARD)
    return src, out


def snapshot(folder):
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(folder.iterdir())}


def test_vocabulary_and_counts(shards):
    src, out = shards
    info = json.loads((out / "_info.json").read_text())
    assert load_vocab(out / "vocab.txt") == VOCAB
    assert (out / "vocab.txt").read_text() == "".join(w + "\n" for w in VOCAB)
    assert info["dataset"] == "wikitext103" and info["version"] == 2
    assert info["vocab"] == {
        "file": "vocab.txt",
        "format": "lines",
        "size": 16,
        "special_ids": {"bos": 0, "pad": 1, "eos": 2, "unk": 3},
        "tokenizer": {"moses": False, "src_lang": None, "tgt_lang": None, "version": None},
    }
    train, valid, test = (info["splits"][s] for s in ("train", "valid", "test"))
    assert (train["num_tokens"], valid["num_tokens"], test["num_tokens"]) == (33, 10, 16)
    assert (train["num_lines"], valid["num_lines"], test["num_lines"]) == (6, 3, 4)
    assert train["num_skipped"] == 1 and valid["num_skipped"] == test["num_skipped"] == 0
    assert train["skipped"][0]["path"] == f"{src / 'wiki.train.tokens'}:5"
    assert "UTF-8" in train["skipped"][0]["reason"]
    # 33 tokens in chunks of 8 -> 5 samples, 2 per shard -> 3 shards; 10 -> 2 samples; 16 -> 2.
    assert train["num_samples"] == 5 and [s["num_samples"] for s in train["shards"]] == [2, 2, 1]
    assert valid["num_samples"] == 2 and test["num_samples"] == 2
    # the bad line sits after token 20, in chunk 2, i.e. shard 1
    record = json.loads((out / "train-000001.tar.done.json").read_text())
    assert [s["path"] for s in record["skipped"]] == [f"{src / 'wiki.train.tokens'}:5"]
    # each split's samples, read from the tars: chunks of 8 ids keyed 000000, 000001, ... that join into its
    # stream, the reference tokenisation of the raw text
    for split, data in (("train", TRAIN), ("valid", VALID), ("test", TEST)):
        chunks = []
        for shard in info["splits"][split]["shards"]:
            chunks += [(name, np.load(io.BytesIO(data_))) for name, data_ in members(out / shard["name"])]
        assert [name for name, _ in chunks] == [f"{i:06d}.ids.npy" for i in range(len(chunks))]
        assert all(len(c) == CHUNK for _, c in chunks[:-1]) and all(c.dtype == np.uint32 for _, c in chunks)
        np.testing.assert_array_equal(np.concatenate([c for _, c in chunks]), ids(data))


def test_streams_reassemble_in_order(shards):
    _, out = shards
    dm = WikiTextDataModule(str(out), block_size=3, batch_size=2, num_workers=0)
    assert list(dm.vocab.tokens) == VOCAB and dm.vocab_size == 16 and dm.pad_id == 1
    for split, data in (("train", TRAIN), ("valid", VALID), ("test", TEST)):
        np.testing.assert_array_equal(dm.stream(split), ids(data))
    # "<unk>" in the text and the unseen "zebra" are the special; the literal is no entry of its own
    assert dm.stream("valid")[-4] == 3 and dm.stream("train")[11] == 3


def test_rerun_verifies_and_rewrites_nothing(shards, tmp_path, caplog):
    src, out = shards
    copy = tmp_path / "shards"
    shutil.copytree(out, copy)
    before = snapshot(copy)
    with caplog.at_level("WARNING"):
        info = prepare(src, copy, workers=1, chunk_tokens=CHUNK, chunks_per_shard=PER_SHARD)
    assert snapshot(copy) == before
    assert info == json.loads((copy / "_info.json").read_text())
    assert "wiki.train.tokens:5" in caplog.text  # the bad line is logged with path:line


def test_interrupted_run_resumes_identically(shards, tmp_path):
    src, out = shards
    copy = tmp_path / "shards"
    shutil.copytree(out, copy)
    (copy / "train-000001.tar.done.json").unlink()  # killed before its record
    (copy / "train-000002.tar").unlink()  # killed while writing shard 2
    (copy / "train-000002.tar.done.json").unlink()
    (copy / "train-000002.tar.tmp").write_bytes(b"partial")
    (copy / "_info.json").unlink()
    prepare(src, copy, workers=1, chunk_tokens=CHUNK, chunks_per_shard=PER_SHARD)
    # The same files with the same samples. (Rewritten tars differ in bytes only by the member mtimes
    # that webdataset's TarWriter stamps, hence in their checksums.)
    assert sorted(p.name for p in copy.iterdir()) == sorted(p.name for p in out.iterdir())
    for tar in out.glob("*.tar"):
        assert members(copy / tar.name) == members(tar)
    assert (copy / "vocab.txt").read_bytes() == (out / "vocab.txt").read_bytes()
    info, resumed = (json.loads((d / "_info.json").read_text()) for d in (out, copy))
    for split in resumed["splits"].values():
        for shard in split["shards"]:
            assert sha256(copy / shard["name"]) == shard.pop("sha256")
    for split in info["splits"].values():
        for shard in split["shards"]:
            del shard["sha256"]
    assert resumed == info


def members(tar_path):
    with tarfile.open(tar_path) as tar:
        return [(m.name, tar.extractfile(m).read()) for m in tar]


def test_changed_vocabulary_is_refused(shards, tmp_path):
    src, out = shards
    copy = tmp_path / "shards"
    shutil.copytree(out, copy)
    (copy / "vocab.txt").write_text("<s>\n")
    with pytest.raises(ValueError, match="vocab.txt differs"):
        prepare(src, copy, workers=1, chunk_tokens=CHUNK, chunks_per_shard=PER_SHARD)


def test_missing_file_is_named(tmp_path, capsys):
    src = write_raw(tmp_path / "raw", {"wiki.train.tokens": TRAIN, "wiki.test.tokens": TEST})
    with pytest.raises(FileNotFoundError) as err:
        prepare(src, tmp_path / "out", workers=1)
    assert str(err.value) == f"expected the WikiText-103 valid file wiki.valid.tokens at {src / 'wiki.valid.tokens'}"
    with pytest.raises(SystemExit) as exit_info:
        prepare_main(["wikitext103", "--src", str(src), "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert "wiki.valid.tokens" in capsys.readouterr().err


def test_command_line(shards, tmp_path, capsys):
    src, _ = shards
    prepare_main(["wikitext103", "--src", str(src), "--out", str(tmp_path / "cli"), "--workers", "2"])
    assert "train 1 samples (1 skipped)" in capsys.readouterr().out  # default 65,536-token chunks
    info = json.loads((tmp_path / "cli" / "_info.json").read_text())
    assert info["chunk_tokens"] == 65536 and info["splits"]["train"]["num_tokens"] == 33
    assert load_vocab(tmp_path / "cli" / "vocab.txt") == VOCAB


def test_parallel_writers_give_the_same_samples(shards, tmp_path):
    src, out = shards
    info = prepare(src, tmp_path / "par", workers=2, chunk_tokens=CHUNK, chunks_per_shard=PER_SHARD)
    assert sorted(p.name for p in (tmp_path / "par").iterdir()) == sorted(p.name for p in out.iterdir())
    for tar in out.glob("*.tar"):
        assert members(tmp_path / "par" / tar.name) == members(tar)
    assert (
        info["splits"]["train"]["skipped"] == json.loads((out / "_info.json").read_text())["splits"]["train"]["skipped"]
    )


def test_training_with_loader_workers(shards):
    _, out = shards
    dm = WikiTextDataModule(str(out), block_size=3, batch_size=2, num_workers=2, shuffle_buffer=4)
    loader = dm.train_dataloader()
    for _ in range(2):  # persistent workers, two epochs of exactly 5 steps
        assert sum(1 for _ in loader) == 5


def find(stream: np.ndarray, row: np.ndarray) -> list[int]:
    windows = np.lib.stride_tricks.sliding_window_view(stream, len(row))
    return np.flatnonzero((windows == row).all(axis=1)).tolist()


@pytest.mark.parametrize("world_size", [1, 2])
def test_training_blocks_are_contiguous_slices(shards, world_size):
    _, out = shards
    dm = WikiTextDataModule(str(out), block_size=3, batch_size=2, num_workers=0, shuffle_buffer=4)
    if world_size > 1:
        dm.trainer = SimpleNamespace(global_rank=1, world_size=world_size)
    stream = ids(TRAIN)
    steps = 33 // (3 * 2 * world_size)
    assert dm.train_steps() == steps
    loader = dm.train_dataloader()
    assert len(loader) == steps
    batches = list(loader)
    assert len(batches) == steps
    for batch in batches:
        assert batch["input"].shape == batch["target"].shape == (2, 3)
        assert batch["input"].dtype == batch["target"].dtype == torch.int64
        assert batch["loss_mask"].dtype == torch.bool and batch["loss_mask"].all()
        for inp, tgt in zip(batch["input"].numpy(), batch["target"].numpy()):
            block = np.concatenate([inp, tgt[-1:]])
            assert np.array_equal(inp[1:], tgt[:-1])  # target = input shifted by one
            starts = find(stream, block)
            assert starts and any(s // CHUNK == (s + 3) // CHUNK for s in starts)  # within one chunk


def scored_pairs(batches):
    pairs = []
    for batch in batches:
        for start, tgt, mask in zip(batch["start"], batch["target"], batch["loss_mask"]):
            pairs += [(int(start) + int(t), int(tgt[t])) for t in torch.nonzero(mask).flatten()]
    return pairs


def test_eval_window_geometry():
    # 16 targets, windows of 5 with 2 tokens of context -> stride 3, 5 windows, the last short
    assert eval_windows(16, 5, 2) == [(0, 0, 5), (3, 5, 8), (6, 8, 11), (9, 11, 14), (12, 14, 16)]
    assert eval_windows(10, 5, 0) == [(0, 0, 5), (5, 5, 10)]
    assert eval_windows(3, 5, 4) == [(0, 0, 3)]
    with pytest.raises(ValueError):
        eval_windows(10, 5, 5)


@pytest.mark.parametrize("block,context,world_size", [(5, 2, 1), (5, 2, 2), (4, 0, 2), (20, 3, 1)])
def test_eval_scores_every_token_once(shards, block, context, world_size):
    _, out = shards
    stream = ids(TEST)
    dm = WikiTextDataModule(
        str(out), block_size=3, batch_size=2, num_workers=0, eval_block_size=block, eval_context=context
    )
    pairs, counts = [], []
    for rank in range(world_size):
        dm.trainer = SimpleNamespace(global_rank=rank, world_size=world_size)
        batches = list(dm.test_dataloader())
        counts.append(sum(len(b["start"]) for b in batches))
        for batch in batches:
            assert batch["input"].shape == batch["target"].shape == batch["loss_mask"].shape
            assert batch["input"].shape[1] == block and batch["loss_mask"].dtype == torch.bool
            for start, inp, tgt, mask in zip(batch["start"], batch["input"], batch["target"], batch["loss_mask"]):
                s = int(start)
                n = min(block, len(stream) - s)
                # target t is stream[s + t]; input t is its predecessor ("</s>" before the first token)
                np.testing.assert_array_equal(tgt[:n].numpy(), stream[s : s + n])
                np.testing.assert_array_equal(inp[:n].numpy(), np.concatenate([[2], stream])[s : s + n])
                assert (inp[n:] == 1).all() and (tgt[n:] == 1).all() and not mask[n:].any()
                scored = torch.nonzero(mask).flatten()
                if s > 0:  # every scored target sees >= context + 1 tokens of the window
                    assert int(scored.min()) + 1 >= context + 1 and int(scored.min()) == context
        pairs += scored_pairs(batches)
    assert collections.Counter(pairs) == collections.Counter(enumerate(stream.tolist()))
    if world_size == 2 and (block, context) == (5, 2):
        assert counts == [3, 2]  # uneven windows across ranks


def test_perplexity_matches_independent_computation(shards):
    """A bigram "model" (add-one smoothed, trained on the train stream): perplexity from the batches
    equals exp(mean NLL) over the raw test text, the first token conditioned on "</s>"."""
    _, out = shards
    train = ids(TRAIN)
    counts = np.ones((16, 16))
    np.add.at(counts, (np.concatenate([[2], train[:-1]]), train), 1)
    logp = torch.from_numpy(np.log(counts / counts.sum(1, keepdims=True)))

    dm = WikiTextDataModule(str(out), batch_size=3, eval_block_size=6, eval_context=2)
    nll, n = 0.0, 0
    for batch in dm.test_dataloader():
        token_logp = logp[batch["input"], batch["target"]]
        nll -= float(token_logp[batch["loss_mask"]].sum())
        n += int(batch["loss_mask"].sum())

    words = tokens(TEST)
    index = {w: i for i, w in enumerate(VOCAB)}
    prev, ref = "</s>", []
    for w in words:
        ref.append(-math.log(counts[index[prev], index.get(w, 3)] / counts[index[prev]].sum()))
        prev = w
    assert n == len(words) == 16
    assert math.exp(nll / n) == pytest.approx(math.exp(sum(ref) / len(ref)), rel=1e-12)


def test_eval_windows_dataset_length():
    ds = EvalWindows(np.arange(4, 20), 5, 2, batch_size=2, pad_id=1, eos_id=2, rank=1, world_size=2)
    assert len(ds) == len(list(ds)) == 1


def test_datamodule_from_config(shards):
    import jsonargparse

    _, out = shards
    parser = jsonargparse.ArgumentParser()
    parser.add_class_arguments(WikiTextDataModule, "data")
    cfg = parser.parse_args(["--data.root", str(out), "--data.eval_context", "400", "--data.eval_block_size", "512"])
    dm = getattr(parser, "instantiate", None) or parser.instantiate_classes
    dm = dm(cfg).data
    assert isinstance(dm, WikiTextDataModule) and dm.eval_context == 400 and dm.block_size == 512
    with pytest.raises(ValueError, match="eval_context"):
        WikiTextDataModule(str(out), eval_block_size=8, eval_context=8)
    # the data section of the paper's LM config builds the same class
    config = yaml.safe_load((Path(__file__).parents[2] / "configs/lm_wikitext103_softmax.yaml").read_text())
    assert config["data"]["class_path"] == "mmlight.data.WikiTextDataModule"
    init_args = {**config["data"]["init_args"], "root": str(out)}
    cfg = parser.parse_object({"data": init_args})
    dm = getattr(parser, "instantiate", None) or parser.instantiate_classes
    assert dm(cfg).data.eval_context == 400


def test_corrupt_training_chunk_is_skipped_and_counted(shards, tmp_path, caplog, monkeypatch):
    """A chunk whose ids.npy does not load is skipped while streaming, counted and logged: once per
    draw of its shard (every shard holds one, first), and the good chunks still give every batch."""
    import webdataset as wds

    from mmlight.data import streaming

    _, out = shards
    copy = tmp_path / "shards"
    shutil.copytree(out, copy)
    info = json.loads((copy / "_info.json").read_text())
    for shard in info["splits"]["train"]["shards"]:  # a corrupt chunk ahead of every shard's own
        good = list(wds.WebDataset(str(out / shard["name"]), shardshuffle=False))
        with wds.TarWriter(str(copy / shard["name"])) as writer:
            writer.write({"__key__": "corrupt", "ids.npy": b"not an npy file"})
            for sample in good:
                writer.write({"__key__": sample["__key__"], "ids.npy": sample["ids.npy"]})
    draws = []  # every shard the stream draws, seen where its header index is read
    index = streaming.tar_index
    monkeypatch.setattr(streaming, "tar_index", lambda url: draws.append(url) or index(url))
    dm = WikiTextDataModule(str(copy), block_size=4, batch_size=2, num_workers=0, shuffle_buffer=0)
    with caplog.at_level("WARNING"):
        batches = list(dm.train_dataloader())
    assert len(batches) == len(dm.train_dataloader()) and all(b["input"].shape == (2, 4) for b in batches)
    skips = [r.getMessage() for r in caplog.records if "skipped corrupt chunk" in r.getMessage()]
    assert len(draws) >= 2 and dm.skipped.value == len(draws) == len(skips)
    assert all(m.startswith("skipped corrupt chunk corrupt in ") for m in skips)


def record_draws(monkeypatch, limit=100):
    """The names of the shards the stream draws, in order (seen where a shard's header index is read); more
    than ``limit`` draws fail the test, so that a stream that would draw forever fails at once."""
    from mmlight.data import streaming

    draws, index = [], streaming.tar_index

    def recorded(url):
        draws.append(Path(url).name)
        assert len(draws) <= limit, f"the stream drew {limit} shards and goes on"
        return index(url)

    monkeypatch.setattr(streaming, "tar_index", recorded)
    return draws


def corrupt_headers(out, copy, shards=None):
    """A copy of the shard set ``out`` in ``copy`` whose training chunks in ``shards`` (names; all if None)
    hold bytes that are no ``.npy`` file; returns the training shard names."""
    import webdataset as wds

    shutil.copytree(out, copy)
    names = [s["name"] for s in json.loads((copy / "_info.json").read_text())["splits"]["train"]["shards"]]
    for name in names if shards is None else shards:
        keys = [sample["__key__"] for sample in wds.WebDataset(str(out / name), shardshuffle=False)]
        with wds.TarWriter(str(copy / name)) as writer:
            for key in keys:
                writer.write({"__key__": key, "ids.npy": b"not an npy file"})
    return names


@pytest.mark.parametrize("shards_kept", [None, 1, 4])
def test_training_shards_without_a_readable_chunk_stop_the_stream(shards, tmp_path, monkeypatch, shards_kept):
    """Every chunk header corrupt (in every shard, or in the one shard kept): the stream stops with an error
    naming the shards, after counting each chunk it skipped, instead of drawing shards forever."""
    _, out = shards
    copy = tmp_path / "shards"
    names = corrupt_headers(out, copy)
    if shards_kept == 4:  # more shards than the message names: a fourth, a copy of the first
        shutil.copy(copy / names[0], copy / "train-000003.tar")
        names.append("train-000003.tar")
    urls = [str(copy / name) for name in names[:shards_kept]]
    chunks = {
        s["name"]: s["num_samples"] for s in json.loads((out / "_info.json").read_text())["splits"]["train"]["shards"]
    }
    chunks["train-000003.tar"] = chunks[names[0]]
    draws = record_draws(monkeypatch)
    counter = SkipCounter()
    stream = BlockStream(urls, block_size=4, batch_size=2, shuffle_buffer=0, counter=counter)
    shown = sorted(urls)[:3]
    message = (
        f"no chunk of more than block_size=4 tokens with a readable header in any of the {len(urls)} training "
        f"shards, e.g. {shown}: prepare the data again (mmlight prepare wikitext103)"
    )
    with pytest.raises(RuntimeError) as stopped:
        next(iter(stream.units(RankRandom(0, 0, 0), count_skips=True)))
    assert str(stopped.value) == message
    # every shard drawn twice at least (a chunk seen again is what shows its shard has none); every chunk of
    # every draw counted, the last draw stopped at its first chunk
    assert all(draws.count(Path(url).name) >= 2 for url in urls)
    assert counter.value == sum(chunks[name] for name in draws[:-1]) + 1


def test_a_shard_without_a_readable_chunk_leaves_the_others_training(shards, tmp_path, monkeypatch):
    """One shard's chunks all corrupt: the stream skips them at every draw and trains on the other shards."""
    _, out = shards
    copy = tmp_path / "shards"
    names = json.loads((out / "_info.json").read_text())["splits"]["train"]["shards"]
    corrupt_headers(out, copy, [names[0]["name"]])
    record_draws(monkeypatch, limit=1000)
    dm = WikiTextDataModule(str(copy), block_size=4, batch_size=2, num_workers=0, shuffle_buffer=0)
    batches = list(dm.train_dataloader())
    assert len(batches) == dm.train_steps() and all(b["input"].shape == (2, 4) for b in batches)
    assert dm.skipped.value % PER_SHARD == 0 and dm.skipped.value > 0  # whole draws of the corrupt shard


def test_chunks_shorter_than_a_block_in_every_shard_stop_the_stream(shards, monkeypatch):
    """The stream itself (not only train_steps) stops when no chunk can hold a block: 8-token chunks, a block
    of 8 needs 9."""
    record_draws(monkeypatch)
    _, out = shards
    info = json.loads((out / "_info.json").read_text())
    urls = [str(out / s["name"]) for s in info["splits"]["train"]["shards"]]
    stream = BlockStream(urls, block_size=CHUNK, batch_size=1, shuffle_buffer=0, counter=SkipCounter())
    with pytest.raises(RuntimeError, match=rf"no chunk of more than block_size={CHUNK} tokens"):
        next(iter(stream.units(RankRandom(0, 0, 0), count_skips=True)))


def test_chunks_too_short_for_one_block_stop_before_training(shards):
    """The fixture's chunks hold 8 tokens: a block of 7 (+1 target) fits, one of 8 never would, and
    the resampled stream would wait forever for it."""
    _, out = shards
    fits = WikiTextDataModule(str(out), block_size=CHUNK - 1, batch_size=1, num_workers=0)
    assert fits.train_steps() == 33 // 7  # the 33 training tokens in blocks of 7
    with pytest.raises(ValueError) as refused:
        WikiTextDataModule(str(out), block_size=CHUNK, batch_size=1, num_workers=0).train_steps()
    assert str(refused.value) == (
        f"the training chunks of {out} hold at most 8 tokens, and a block of block_size=8 needs 9: lower "
        "block_size, or prepare the data again with longer chunks (mmlight.data.prepare.wikitext.prepare's "
        "chunk_tokens)"
    )
    with pytest.raises(ValueError) as refused:  # 33 training tokens, a batch of 5 x 7 = 35
        WikiTextDataModule(str(out), block_size=7, batch_size=5, num_workers=0).train_steps()
    assert str(refused.value) == "the training split (33) is smaller than one global batch (5 x 7 tokens x 1 devices)"


def test_block_starts_against_an_exhaustive_reference():
    """Every start from the offset on, a block apart, whose block of ``block_size + 1`` tokens fits the
    chunk; the offsets drawn cover exactly ``[0, block_size)``."""
    import random

    class Fixed(random.Random):
        """Draws ``offset``, after checking that it was asked for one in ``[0, block)``."""

        def __init__(self, offset: int, block: int):
            super().__init__(0)
            self.offset, self.block = offset, block

        def randrange(self, n):
            assert n == self.block
            return self.offset

    for length in range(0, 12):
        for block in range(1, 6):
            for offset in range(block):
                expected = [s for s in range(offset, length) if (s - offset) % block == 0 and s + block + 1 <= length]
                assert list(block_starts(length, block, Fixed(offset, block))) == expected
            assert list(block_starts(length, block, random.Random(0), random_offset=False)) == [
                s for s in range(0, length, block) if s + block + 1 <= length
            ]
    rng = random.Random(0)
    assert {block_starts(100, 4, rng)[0] for _ in range(200)} == {0, 1, 2, 3}


def test_eval_windows_dataset_length_is_the_number_of_batches():
    for n, block, context, batch, world in [(16, 5, 2, 2, 2), (16, 5, 2, 3, 1), (16, 4, 0, 4, 1), (1, 4, 0, 2, 1)]:
        for rank in range(world):
            ds = EvalWindows(
                np.arange(4, 4 + n), block, context, batch, pad_id=1, eos_id=2, rank=rank, world_size=world
            )
            windows = len(eval_windows(n, block, context)[rank::world])
            assert len(ds) == len(list(ds)) == math.ceil(windows / batch)
            assert sum(len(b["start"]) for b in ds) == windows


def test_eval_window_defaults_and_bad_sizes(shards):
    _, out = shards
    dm = WikiTextDataModule(str(out), block_size=3, batch_size=2, num_workers=0)
    assert (dm.eval_block_size, dm.eval_context) == (3, 0)
    batches = list(dm.test_dataloader())  # 16 targets in windows of 3 without context
    assert [b["input"].shape for b in batches] == [(2, 3)] * 3
    assert torch.cat([b["start"] for b in batches]).tolist() == list(range(0, 16, 3))
    assert int(sum(b["loss_mask"].sum() for b in batches)) == 16
    assert dm.val_dataloader() is not None and int(sum(b["loss_mask"].sum() for b in dm.val_dataloader())) == 10
    for bad in ({"block_size": 0}, {"batch_size": 0}, {"eval_block_size": 2, "eval_context": -1}):
        with pytest.raises(ValueError, match="must be"):
            WikiTextDataModule(str(out), **{"block_size": 3, "batch_size": 2, **bad})
    assert WikiTextDataModule(str(out), block_size=1, batch_size=1, eval_block_size=1).eval_context == 0


def test_a_stream_that_disagrees_with_its_info_is_refused(shards, tmp_path):
    _, out = shards
    copy = tmp_path / "shards"
    shutil.copytree(out, copy)
    info = json.loads((copy / "_info.json").read_text())
    info["splits"]["valid"]["num_tokens"] = 11
    (copy / "_info.json").write_text(json.dumps(info))
    with pytest.raises(ValueError, match=r"split 'valid' of .* has 10 tokens, _info.json says 11"):
        WikiTextDataModule(str(copy)).stream("valid")
    with tarfile.open(out / info["splits"]["test"]["shards"][0]["name"]) as tar:  # its first chunk renamed
        members = [(m, tar.extractfile(m).read()) for m in tar]
    with tarfile.open(copy / info["splits"]["test"]["shards"][0]["name"], "w") as tar:
        for member, data in members:
            member.name = member.name.replace("000000.", "000007.")
            tar.addfile(member, io.BytesIO(data))
    with pytest.raises(ValueError, match=r"split 'test' of .* does not hold consecutive chunks 000000"):
        WikiTextDataModule(str(copy)).stream("test")


def test_an_empty_split_is_an_empty_stream(shards, tmp_path):
    _, out = shards
    copy = tmp_path / "shards"
    shutil.copytree(out, copy)
    info = json.loads((copy / "_info.json").read_text())
    info["splits"]["valid"].update(num_tokens=0, shards=[])
    (copy / "_info.json").write_text(json.dumps(info))
    dm = WikiTextDataModule(str(copy), block_size=3)
    assert dm.stream("valid").dtype == np.int64 and dm.stream("valid").shape == (0,)
    assert list(dm.val_dataloader()) == []


def test_training_needs_one_block_in_the_split_when_chunks_are_longer(shards, tmp_path):
    """Without a chunk size in _info.json, or with chunks longer than the split, the split's own length
    bounds the block."""
    _, out = shards
    copy = tmp_path / "shards"
    shutil.copytree(out, copy)
    info = json.loads((copy / "_info.json").read_text())
    for chunk_tokens in (None, 1000):
        if chunk_tokens is None:
            info.pop("chunk_tokens")
        else:
            info["chunk_tokens"] = chunk_tokens
        (copy / "_info.json").write_text(json.dumps(info))
        assert WikiTextDataModule(str(copy), block_size=32, batch_size=1).train_steps() == 1
        with pytest.raises(ValueError, match="hold at most 33 tokens, and a block of block_size=33 needs 34"):
            WikiTextDataModule(str(copy), block_size=33, batch_size=1).train_steps()


def test_eval_windows_default_to_one_rank_and_run_in_the_main_process(shards):
    stream = np.arange(4, 20)
    one_rank = EvalWindows(stream, 5, 2, batch_size=2, pad_id=1, eos_id=2)
    assert one_rank.windows == eval_windows(16, 5, 2)
    with pytest.raises(ValueError, match=r"^eval_context must be in \[0, eval_block_size\), got 5 with block 5$"):
        eval_windows(10, 5, 5)
    _, out = shards
    assert WikiTextDataModule(str(out), block_size=3).test_dataloader().num_workers == 0  # a small split in memory


def test_unreadable_training_shards_are_counted_at_each_draw(shards, tmp_path, monkeypatch):
    from mmlight.data import streaming

    _, out = shards
    copy = tmp_path / "shards"
    shutil.copytree(out, copy)
    broken = [str(copy / f"train-00000{i}.tar") for i in (1, 2)]
    for url in broken:
        Path(url).write_bytes(b"\xff" * 700)  # no tar header
    draws = []
    index = streaming.tar_index
    monkeypatch.setattr(streaming, "tar_index", lambda url: draws.append(url) or index(url))
    dm = WikiTextDataModule(str(copy), block_size=3, batch_size=2, num_workers=0, shuffle_buffer=0)
    batches = list(dm.train_dataloader())
    assert len(batches) == 5 and all(b["input"].shape == (2, 3) for b in batches)
    drawn = sum(url in broken for url in draws)
    assert drawn >= 1 and dm.skipped.value == drawn


def test_bad_lines_at_the_edges_of_a_split_and_empty_splits(tmp_path):
    """A bad line right after the last full shard's tokens goes to the last shard (there is no next one); a split
    of nothing but a bad line is one shard with no sample and that skip; an empty file is a split of no shard."""
    from mmlight.data.prepare.wikitext import plan_split
    from mmlight.data.shard_writer import Skipped

    train = b" a b c \n" * 4 + b"\xff\xfe bad \n"  # 16 tokens = one shard of 2 chunks of 8, then the bad line
    valid = b" a b c \n" * 4 + b"\xff\n" + b" a b \n"  # the bad line opens shard 1, the last
    test = b"caf\xe9\ncaf\xe9 \n X\n"  # a character cut at the line's end, then before a space; then "X"
    files = {"wiki.train.tokens": train, "wiki.valid.tokens": valid, "wiki.test.tokens": test}
    src = write_raw(tmp_path / "raw", files)
    info = prepare(src, tmp_path / "out", workers=1, chunk_tokens=CHUNK, chunks_per_shard=PER_SHARD)
    assert info["eos_per_line"] is True and info["chunk_tokens"] == CHUNK
    assert load_vocab(tmp_path / "out" / "vocab.txt") == ["<s>", "<pad>", "</s>", "<unk>", "a", "b", "c"]
    train_info, valid, test = (info["splits"][s] for s in ("train", "valid", "test"))
    assert (train_info["num_tokens"], train_info["num_lines"], train_info["num_samples"]) == (16, 4, 2)
    assert [s["name"] for s in train_info["shards"]] == ["train-000000.tar"]
    assert train_info["skipped"] == [
        {"path": f"{src / 'wiki.train.tokens'}:5", "reason": "line is not valid UTF-8 (invalid start byte at byte 0)"}
    ]
    record = json.loads((tmp_path / "out" / "train-000000.tar.done.json").read_text())
    assert record["skipped"] == train_info["skipped"]
    assert (valid["num_tokens"], valid["num_lines"], valid["num_samples"]) == (19, 5, 3)
    assert [s["num_samples"] for s in valid["shards"]] == [2, 1]
    record = json.loads((tmp_path / "out" / "valid-000001.tar.done.json").read_text())
    assert [s["path"] for s in record["skipped"]] == [f"{src / 'wiki.valid.tokens'}:5"]
    assert (test["num_tokens"], test["num_lines"], test["num_samples"], test["num_skipped"]) == (2, 1, 1, 2)
    assert [s["name"] for s in test["shards"]] == ["test-000000.tar"]
    # a line is decoded without its "\n" and nothing else: a cut character at its end is "unexpected end of
    # data", one before a space an "invalid continuation byte"; the final "X" is a word (<unk>, then </s>)
    assert test["skipped"] == [
        {
            "path": f"{src / 'wiki.test.tokens'}:1",
            "reason": "line is not valid UTF-8 (unexpected end of data at byte 3)",
        },
        {
            "path": f"{src / 'wiki.test.tokens'}:2",
            "reason": "line is not valid UTF-8 (invalid continuation byte at byte 3)",
        },
    ]
    # a training file without words (the vocabulary is the specials), an empty file, into a new folder's child
    files = {"wiki.train.tokens": b" \n \n", "wiki.valid.tokens": b"", "wiki.test.tokens": b" a \n"}
    empty = prepare(write_raw(tmp_path / "raw2", files), tmp_path / "new" / "out", chunk_tokens=CHUNK)
    assert load_vocab(tmp_path / "new" / "out" / "vocab.txt") == ["<s>", "<pad>", "</s>", "<unk>"]
    assert [empty["splits"]["valid"][k] for k in ("num_tokens", "num_lines", "num_samples", "shards")] == [0, 0, 0, []]
    streams = {split: [] for split in ("train", "test")}
    for split, stream in streams.items():
        for shard in empty["splits"][split]["shards"]:
            stream += [
                np.load(io.BytesIO(data)).tolist() for _, data in members(tmp_path / "new" / "out" / shard["name"])
            ]
    assert streams == {"train": [[2, 2]], "test": [[3, 2]]}
    skip = Skipped("wiki.test.tokens:1", "line is not valid UTF-8")  # a split of nothing but a bad line
    [job] = plan_split("test", np.zeros(0, np.uint32), [(0, skip)], CHUNK, PER_SHARD)
    assert (job.name, job.items) == ("test-000000.tar", [skip])
    jobs = plan_split("train", np.arange(3, dtype=np.uint32), [], 1, 1)  # the smallest sizes
    assert [(job.name, [key for key, _ in job.items]) for job in jobs] == [
        (f"train-00000{i}.tar", [f"00000{i}"]) for i in range(3)
    ]
    for chunk_tokens, per_shard in ((0, 2), (8, 0)):
        with pytest.raises(ValueError) as err:
            plan_split("train", np.zeros(3, np.uint32), [], chunk_tokens, per_shard)
        assert str(err.value) == f"chunk_tokens and chunks_per_shard must be >= 1, got {chunk_tokens}, {per_shard}"


def test_defaults_are_the_documented_recipe(shards):
    """tokens_per_sample 512 of fairseq's transformer_lm WikiText-103 recipe, and the documented loader sizes."""
    _, out = shards
    dm = WikiTextDataModule(str(out))
    assert (dm.block_size, dm.batch_size, dm.num_workers, dm.shuffle_buffer) == (512, 8, 2, 4096)
    assert (dm.eval_block_size, dm.eval_context, dm.train_split) == (512, 0, "train")


def rewrite_shard(src, dst, extra=(), replace=None):
    """``dst``: the tar ``src`` with the members ``extra`` ((name, bytes)) written first and the bytes of the
    members named in ``replace`` ({name: bytes}) replaced."""
    with tarfile.open(src) as tar:
        members = [(m.name, tar.extractfile(m).read()) for m in tar if m.isfile()]
    with tarfile.open(dst, "w") as tar:
        for name, data in [*extra, *members]:
            data = (replace or {}).get(name, data)
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_evaluation_streams_read_only_token_arrays_and_never_pickles(shards, tmp_path):
    """A member other than ``*.ids.npy`` in an evaluation shard is ignored; a chunk holding a pickled object
    array is refused (loading it would run the pickle's code)."""
    _, out = shards
    copy = tmp_path / "shards"
    shutil.copytree(out, copy)
    info = json.loads((copy / "_info.json").read_text())
    first = info["splits"]["valid"]["shards"][0]["name"]
    want = WikiTextDataModule(str(out)).stream("valid")
    rewrite_shard(out / first, copy / first, extra=[("000000.txt", b"not a token array")])
    assert np.array_equal(WikiTextDataModule(str(copy)).stream("valid"), want)
    pickled = io.BytesIO()
    np.save(pickled, np.array([object()] * 3, dtype=object), allow_pickle=True)
    rewrite_shard(out / first, copy / first, replace={"000000.ids.npy": pickled.getvalue()})
    with pytest.raises(ValueError, match="Object arrays cannot be loaded when allow_pickle=False"):
        WikiTextDataModule(str(copy)).stream("valid")


def test_a_training_sample_without_token_ids_is_passed_over(shards, tmp_path):
    """A sample with no ``ids.npy`` (a stray member) ahead of a shard's chunks: the chunks after it still give
    the blocks."""
    _, out = shards
    copy = tmp_path / "shards"
    shutil.copytree(out, copy)
    name = json.loads((out / "_info.json").read_text())["splits"]["train"]["shards"][0]["name"]
    rewrite_shard(out / name, copy / name, extra=[("000000-readme.txt", b"notes")])
    stream = BlockStream([str(copy / name)], block_size=3, batch_size=1, shuffle_buffer=0, counter=SkipCounter())
    first = next(iter(stream.units(RankRandom(0, 0, 0), count_skips=True)))
    assert len(first) == 1 and first[0][0] == str(copy / name)


def test_only_the_reporting_worker_counts_unreadable_shards(shards, tmp_path, monkeypatch):
    """``count_skips=False`` (a loader worker that replays what another reports) counts nothing; True counts one
    skip per draw of the unreadable shard, on the same draws."""
    _, out = shards
    copy = tmp_path / "shards"
    shutil.copytree(out, copy)
    names = [s["name"] for s in json.loads((out / "_info.json").read_text())["splits"]["train"]["shards"]]
    (copy / names[1]).write_bytes(b"\xff" * 700)  # no tar header
    urls = [str(copy / n) for n in names]
    for count_skips in (False, True):
        draws = record_draws(monkeypatch)
        counter = SkipCounter()
        stream = BlockStream(urls, block_size=3, batch_size=2, shuffle_buffer=0, counter=counter)
        units = stream.units(RankRandom(0, 0, 0), count_skips=count_skips)
        for _ in range(6):
            next(units)
        assert draws.count(names[1]) >= 1
        assert counter.value == (draws.count(names[1]) if count_skips else 0)
