"""Multi-query associative recall: structure, scoring mask, determinism, and oracle/baseline accuracy."""

from collections import Counter

import numpy as np
import pytest
import torch

from mmlight.data import RecallDataModule

SMALL = {
    "num_keys": 12,
    "num_values": 10,
    "num_pairs": 5,
    "num_queries": 3,
    "train_size": 64,
    "val_size": 40,
    "test_size": 30,
    "batch_size": 16,
    "seed": 0,
}


def _full_sequences(dm, split):
    """Whole sequences rebuilt from a pass over the split's loader (input + last target)."""
    loader = {"train": dm.train_dataloader, "val": dm.val_dataloader, "test": dm.test_dataloader}[split]()
    rows = []
    for batch in loader:
        rows.append(torch.cat([batch["input"], batch["target"][:, -1:]], dim=1))
    return torch.cat(rows).numpy()


def _answers(seq, num_keys, num_pairs):
    """(position in the target, expected value token) of every query, by reading the pairs, token by token."""
    out = []
    pairs = {}
    for i in range(0, 2 * num_pairs, 2):
        pairs[int(seq[i])] = int(seq[i + 1])
    for i in range(2 * num_pairs, len(seq), 2):
        out.append((i, pairs[int(seq[i])]))  # target position i (predicting seq[i + 1]) is the answer
    return out, pairs


def test_batches_have_the_wikitext_format_and_shapes():
    dm = RecallDataModule(**SMALL)
    batch = next(iter(dm.train_dataloader()))
    T = 2 * 5 + 2 * 3 - 1
    assert set(batch) == {"input", "target", "loss_mask"}
    assert batch["input"].shape == batch["target"].shape == batch["loss_mask"].shape == (16, T) == (16, dm.seq_len)
    assert batch["input"].dtype == batch["target"].dtype == torch.int64 and batch["loss_mask"].dtype == torch.bool
    torch.testing.assert_close(batch["input"][:, 1:], batch["target"][:, :-1])  # target = next token
    assert len(dm.train_dataloader()) == 64 // 16
    assert sum(len(b["input"]) for b in dm.val_dataloader()) == 40  # whole split, last partial batch kept
    assert dm.vocab_size == 4 + 12 + 10 == len(dm.vocab)
    assert (dm.pad_id, dm.eos_id) == (1, 2)
    tokens = dm.vocab.tokens
    assert tokens[:4] == ("<s>", "<pad>", "</s>", "<unk>") and tokens[4] == "k0" and tokens[16] == "v0"


@pytest.mark.parametrize("num_queries", [3, 8])  # without / with replacement of the queried pairs
def test_sequence_structure_and_answers(num_queries):
    args = {**SMALL, "num_queries": num_queries}
    dm = RecallDataModule(**args)
    seqs = _full_sequences(dm, "val")
    assert seqs.shape == (40, 2 * 5 + 2 * num_queries)
    key_ids = set(range(4, 16))
    value_ids = set(range(16, 26))
    for seq in seqs:
        keys, values = seq[0:10:2], seq[1:10:2]
        assert set(keys.tolist()) <= key_ids and len(set(keys.tolist())) == 5  # distinct keys
        assert set(values.tolist()) <= value_ids
        queries, answers = seq[10::2], seq[11::2]
        assert set(queries.tolist()) <= set(keys.tolist())
        if num_queries <= 5:
            assert len(set(queries.tolist())) == num_queries  # drawn without replacement
        expected, pairs = _answers(seq, 12, 5)
        for pos, value in expected:
            assert seq[pos + 1] == value
        assert all(int(a) == pairs[int(q)] for q, a in zip(queries, answers))


def test_loss_mask_marks_exactly_the_answers():
    dm = RecallDataModule(**SMALL)
    for batch in dm.val_dataloader():
        for inp, tgt, mask in zip(batch["input"], batch["target"], batch["loss_mask"]):
            seq = torch.cat([inp, tgt[-1:]]).numpy()
            expected, _ = _answers(seq, 12, 5)
            positions = {pos for pos, _ in expected}
            assert set(torch.nonzero(mask).flatten().tolist()) == positions
            assert all(int(tgt[p]) == v for p, v in expected)
            assert all(16 <= int(tgt[p]) < 26 for p in positions)  # every scored target is a value


def test_determinism_and_split_independence():
    a = RecallDataModule(**SMALL)
    b = RecallDataModule(**SMALL)
    c = RecallDataModule(**{**SMALL, "seed": 1})
    for split in ("train", "val", "test"):
        np.testing.assert_array_equal(a.sequences(split), b.sequences(split))
        assert not np.array_equal(a.sequences(split), c.sequences(split))
    np.testing.assert_array_equal(_full_sequences(a, "val"), a.sequences("val"))  # in order
    assert not np.array_equal(a.sequences("train")[:30], a.sequences("val")[:30])
    assert not np.array_equal(a.sequences("val")[:30], a.sequences("test"))
    # training order is shuffled, but holds the split's sequences
    torch.manual_seed(0)
    got = _full_sequences(a, "train")
    assert not np.array_equal(got, a.sequences("train"))
    assert sorted(map(tuple, got.tolist())) == sorted(map(tuple, a.sequences("train").tolist()))


def test_oracle_reaches_one_and_the_majority_baseline_is_chance():
    dm = RecallDataModule(
        num_keys=64,
        num_values=64,
        num_pairs=16,
        num_queries=8,
        train_size=64,
        val_size=2000,
        test_size=10,
        batch_size=64,
    )
    correct = oracle = total = 0
    counts: Counter = Counter()
    for batch in dm.train_dataloader():
        counts.update(batch["target"][batch["loss_mask"]].tolist())
    majority = counts.most_common(1)[0][0]
    for batch in dm.val_dataloader():
        inp, tgt, mask = batch["input"], batch["target"], batch["loss_mask"]
        # perfect lookup: the token that followed the latest earlier occurrence of the current input token
        T = inp.shape[1]
        same = (inp[:, :, None] == inp[:, None, :]) & torch.ones(T, T, dtype=torch.bool).tril(-1)  # [b, t, s<t]
        last = torch.where(same, torch.arange(T), -1).max(dim=2).values  # latest s, -1 when none
        follower = torch.cat([inp[:, 1:], tgt[:, -1:]], dim=1)  # token after position s
        pred = torch.where(last >= 0, follower.gather(1, last.clamp(min=0)), -1)
        oracle += int((pred[mask] == tgt[mask]).sum())
        correct += int((tgt[mask] == majority).sum())
        total += int(mask.sum())
    assert total == 2000 * 8
    assert oracle / total == 1.0
    assert abs(correct / total - 1 / 64) < 0.01


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"num_pairs": 13}, "num_keys >= num_pairs"),
        ({"num_keys": 0}, "num_keys must be a positive integer"),
        ({"num_values": -1}, "num_values must be a positive integer"),
        ({"num_queries": 0}, "num_queries must be a positive integer"),
        ({"val_size": 0}, "val_size"),
        ({"batch_size": 0}, "batch_size"),
        ({"train_size": 8}, "smaller than one batch"),
        ({"seed": -1}, "seed"),
        ({"num_workers": -2}, "num_workers"),
    ],
)
def test_bad_arguments_raise(bad, match):
    with pytest.raises(ValueError, match=match):
        RecallDataModule(**{**SMALL, **bad})


def test_the_vocabulary_attributes_and_text_round_trip():
    dm = RecallDataModule(**SMALL)
    assert (dm.bos_id, dm.pad_id, dm.eos_id, dm.unk_id) == (0, 1, 2, 3)
    assert dm.encode("k0 v9 k11 x") == [4, 4 + 12 + 9, 4 + 11, 3]
    assert dm.decode(torch.tensor([0, 4, 25, 15, 3, 2, 1])) == "k0 v9 k11 <unk>"
    assert str(dm) == "RecallDataModule(num_keys=12, num_values=10, num_pairs=5)"


def test_setup_builds_only_the_splits_of_its_stage():
    for stage, splits in [
        ("fit", {"train", "val"}),
        ("validate", {"val"}),
        ("test", {"test"}),
        ("predict", {"test"}),
        (None, {"train", "val", "test"}),
    ]:
        dm = RecallDataModule(**SMALL)
        dm.setup(stage)
        assert set(dm._data) == splits, stage
    with pytest.raises(KeyError, match="unknown split 'valid'"):
        dm.sequences("valid")


def test_as_many_queries_as_pairs_are_drawn_without_replacement():
    seqs = RecallDataModule(**{**SMALL, "num_queries": 5}).sequences("val")
    for seq in seqs:  # every pair queried once: the queries are a permutation of the keys
        assert sorted(seq[10::2].tolist()) == sorted(seq[0:10:2].tolist())


def test_ranks_share_one_permutation_and_take_alternate_batches():
    from types import SimpleNamespace

    dm = RecallDataModule(**SMALL)  # 64 rows, batches of 16: 2 steps per rank on 2 ranks
    rows = {}
    for rank in (0, 1):
        dm.trainer = SimpleNamespace(global_rank=rank, world_size=2)
        torch.manual_seed(0)
        rows[rank] = [b["input"] for b in dm.train_dataloader()]
        assert len(rows[rank]) == len(dm.train_dataloader()) == 2
        assert dm.train_dataloader().state_dict()["world_size"] == 2  # recorded, so a resume can compare
    seen = torch.cat(rows[0] + rows[1])
    expected = torch.from_numpy(dm.sequences("train")[:, :-1])
    # the two ranks together read every row exactly once
    assert sorted(map(tuple, seen.tolist())) == sorted(map(tuple, expected.tolist()))
    dm.trainer = SimpleNamespace(global_rank=0, world_size=8)
    with pytest.raises(ValueError, match=r"train_size=64 is smaller than one global batch \(16 x 8 devices\)"):
        dm.train_dataloader()


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"num_keys": True}, "num_keys must be a positive integer, got True"),
        ({"test_size": 2.0}, "test_size must be a positive integer, got 2.0"),
        ({"seed": True}, "seed must be a non-negative integer, got True"),
        ({"seed": 0.5}, "seed must be a non-negative integer"),
        ({"num_workers": 1.0}, "num_workers must be a non-negative integer, got 1.0"),
    ],
)
def test_arguments_of_other_types_raise(bad, match):
    with pytest.raises(ValueError, match=match):
        RecallDataModule(**{**SMALL, **bad})


def test_numpy_integers_and_edge_values_are_accepted():
    dm = RecallDataModule(**{**SMALL, "num_keys": np.int64(5), "seed": np.int64(0), "train_size": 16, "num_workers": 0})
    assert dm.num_keys == 5 and dm.sizes["train"] == 16
    assert RecallDataModule(**{**SMALL, "num_queries": 1, "val_size": 1}).sequences("val").shape == (1, 12)


def test_test_and_predict_read_the_test_split_in_order():
    dm = RecallDataModule(**SMALL)
    for loader in (dm.test_dataloader(), dm.predict_dataloader()):
        rows = torch.cat([torch.cat([b["input"], b["target"][:, -1:]], dim=1) for b in loader])
        np.testing.assert_array_equal(rows.numpy(), dm.sequences("test"))
        assert [len(b["input"]) for b in loader] == [16, 14]  # the last partial batch kept


def test_each_split_is_drawn_from_its_own_stream_of_the_seed():
    """``default_rng([seed, k])`` with k = 0, 1, 2 for train, val, test, as the class documents."""
    from mmlight.data.recall import mqar_sequences

    dm = RecallDataModule(**{**SMALL, "seed": 3})
    for k, split in enumerate(("train", "val", "test")):
        size = SMALL[f"{split}_size"]
        expected = mqar_sequences(size, 12, 10, 5, 3, np.random.default_rng([3, k]))
        np.testing.assert_array_equal(dm.sequences(split), expected)


def test_defaults_and_exact_messages():
    dm = RecallDataModule()
    assert (dm.num_keys, dm.num_values, dm.num_pairs, dm.num_queries) == (32, 32, 8, 8)
    assert dm.sizes == {"train": 20000, "val": 1000, "test": 1000} and (dm.batch_size, dm.seed, dm.num_workers) == (
        64,
        0,
        0,
    )
    assert RecallDataModule(**{**SMALL, "num_workers": 1}).val_dataloader().num_workers == 1
    for name in ("num_pairs", "train_size", "val_size", "batch_size"):
        with pytest.raises(ValueError, match=rf"^{name} must be a positive integer, got 0$"):
            RecallDataModule(**{**SMALL, name: 0})
    with pytest.raises(ValueError, match=r"; partial training batches are dropped, so no step would run$"):
        RecallDataModule(**{**SMALL, "train_size": 8})
