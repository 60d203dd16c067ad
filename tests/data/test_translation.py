"""mmlight.data.translation.budget_batches: fairseq's token budget and position limits at their
boundaries, on samples whose lengths are written by hand (sizes count each side's ``</s>``)."""

import io
import logging
import random
import warnings
from functools import partial

import numpy as np
import pytest
import torch

from mmlight.data.skips import SkipCounter
from mmlight.data.translation import (
    BudgetStream,
    TranslationDataModule,
    _from_shard,
    budget_batches,
    collate,
    source_sample,
)


def sample(key: str, src: int, tgt: int) -> dict:
    return {"key": key, "src": np.zeros(src, np.int64), "tgt": np.zeros(tgt, np.int64)}


def batches(samples, max_tokens, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = list(budget_batches(samples, max_tokens, buffer=100, shuffle=False, **kwargs))
    return [[s["key"] for s in batch] for batch in out], [str(w.message) for w in caught]


def test_a_sample_fits_the_budget_with_its_end_of_sentence_token_on_either_side():
    """max_tokens 8: 7 tokens + </s> fit on either side; 8 + </s> do not, on either side."""
    got, warned = batches(
        [sample("fits_src", 7, 3), sample("over_src", 8, 3), sample("fits_tgt", 2, 7), sample("over_tgt", 2, 8)],
        max_tokens=8,
    )
    assert got == [["fits_src"], ["fits_tgt"]]  # 8 tokens each: one per batch
    assert len(warned) == 2 and "over_src" in warned[0] and "over_tgt" in warned[1]
    assert warned[1].endswith("; 2 skipped so far in this worker")


@pytest.mark.parametrize("side", ["source", "target"])
def test_position_limits_count_the_end_of_sentence_token(side):
    limits = {"max_source_positions": 5, "max_target_positions": 5}
    lengths = {"source": [(4, 1), (5, 1)], "target": [(1, 4), (1, 5)]}[side]
    got, warned = batches(
        [sample(f"n{n}", *n_lengths) for n, n_lengths in enumerate(lengths)], max_tokens=100, **limits
    )
    assert got == [["n0"]] and len(warned) == 1 and "n1" in warned[0]


def test_batches_are_cut_greedily_by_size_and_a_batch_may_fill_the_budget_exactly():
    """Sizes (longer side + 1) 2, 2, 3, 3, 4 under 8 tokens: [2, 2] (a third would cost 3 x 3 = 9),
    [3, 3] (6; a third costs 12), [4]. Two size-4 samples fill 8 exactly: one batch."""
    samples = [sample("c", 2, 1), sample("a", 1, 1), sample("e", 3, 0), sample("b", 1, 0), sample("d", 2, 2)]
    got, warned = batches(samples, max_tokens=8)
    assert got == [["a", "b"], ["c", "d"], ["e"]] and warned == []
    got, _ = batches([sample("x", 3, 3), sample("y", 2, 3)], max_tokens=8)
    assert got == [["x", "y"]]


def test_a_pool_of_buffer_samples_is_sorted_and_cut_on_its_own():
    """buffer 2: the pools are [e, b] and [d, a] (each sorted by size, each one batch under a large budget);
    the lone last sample makes the last pool."""
    samples = [sample("e", 4, 0), sample("b", 1, 0), sample("d", 3, 0), sample("a", 0, 0), sample("c", 2, 0)]
    out = list(budget_batches(samples, max_tokens=100, buffer=2, shuffle=False))
    assert [[s["key"] for s in batch] for batch in out] == [["b", "e"], ["a", "d"], ["c"]]
    out = list(budget_batches(samples, max_tokens=100, buffer=1, shuffle=False))
    assert [[s["key"] for s in batch] for batch in out] == [[k] for k in "ebdac"]


def test_without_sort_a_pool_is_cut_in_stream_order():
    """Sizes 4, 1, 4 under 8 tokens in stream order: [4, 1] costs 2 x 4 = 8, a third costs 12."""
    samples = [sample("x", 3, 0), sample("y", 0, 0), sample("z", 3, 0)]
    got, warned = batches(samples, max_tokens=8, sort=False)
    assert got == [["x", "y"], ["z"]] and warned == []


def _unshuffled(samples, max_tokens):
    return [[s["key"] for s in b] for b in budget_batches(samples, max_tokens, buffer=100, shuffle=False)]


def test_shuffle_permutes_the_batches_of_a_pool_with_the_given_generator():
    samples = [sample(f"s{i}", i % 5, 0) for i in range(20)]
    plain = _unshuffled(samples, max_tokens=6)
    assert len(plain) > 3
    expected = list(plain)
    random.Random(7).shuffle(expected)  # the order of the generator's own shuffle of the batch list
    out = budget_batches(samples, 6, buffer=100, shuffle=True, rng=random.Random(7))
    assert [[s["key"] for s in b] for b in out] == expected != plain
    # without a generator the batches are the same ones, in some order
    out = budget_batches(samples, 6, buffer=100, shuffle=True)
    assert sorted([s["key"] for s in b] for b in out) == sorted(plain)


def test_lengths_come_from_the_given_function():
    refs = [{"key": "long", "n": (9, 0)}, {"key": "short", "n": (1, 2)}]
    out = list(budget_batches(refs, 8, buffer=10, shuffle=False, lengths=lambda r: r["n"], warn=False))
    assert [[r["key"] for r in b] for b in out] == [["short"]]


def test_warn_false_skips_silently():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = list(budget_batches([sample("big", 9, 0), sample("ok", 1, 1)], 8, buffer=10, shuffle=False, warn=False))
    assert [[s["key"] for s in b] for b in out] == [["ok"]] and caught == []


def test_collate_pads_and_places_end_and_start_symbols():
    """Hand-written batch: pad 1, </s> 2, decoder start 9 (distinct from </s> to tell them apart)."""
    batch = [
        {"key": "a", "id": 4, "src": np.array([5, 6, 7]), "tgt": np.array([8])},
        {"key": "b", "id": 0, "src": np.array([5]), "tgt": np.array([6, 7, 8])},
    ]
    out = collate(batch, pad_id=1, eos_id=2, start_id=9)
    assert out["src"].tolist() == [[5, 6, 7, 2], [5, 2, 1, 1]]
    assert out["src_mask"].tolist() == [[True] * 4, [True, True, False, False]]
    assert out["tgt_in"].tolist() == [[9, 8, 1, 1], [9, 6, 7, 8]]
    assert out["tgt_out"].tolist() == [[8, 2, 1, 1], [6, 7, 8, 2]]
    assert out["tgt_mask"].tolist() == [[True, True, False, False], [True] * 4]
    assert out["ntokens"] == 6 and out["keys"] == ["a", "b"] and out["ids"].tolist() == [4, 0]
    assert all(out[k].dtype == torch.int64 for k in ("src", "tgt_in", "tgt_out", "ids"))


def test_a_source_sample_has_a_line_key_and_no_target():
    s = source_sample(12, [4, 5])
    assert s["key"] == "line-0000012" and s["id"] == 12
    assert s["src"].dtype == np.int64 and s["src"].tolist() == [4, 5] and s["tgt"].shape == (0,)
    empty = source_sample(0, [])  # an empty line: still int64 ids, like a shard's samples
    assert empty["src"].dtype == empty["tgt"].dtype == np.int64 and empty["src"].shape == (0,)
    out = collate([s], pad_id=1, eos_id=2, start_id=2)
    assert out["tgt_in"].tolist() == [[2]] and out["tgt_out"].tolist() == [[2]] and out["ntokens"] == 1


@pytest.mark.parametrize("max_tokens, bucket_buffer, error", [(1, 1, "max_tokens"), (2, 0, "bucket_buffer")])
def test_bad_budget_or_buffer_raise(tmp_path, max_tokens, bucket_buffer, error):
    with pytest.raises(ValueError, match=f"{error} must be >= "):
        TranslationDataModule(str(tmp_path), max_tokens=max_tokens, bucket_buffer=bucket_buffer)
    dm = TranslationDataModule(str(tmp_path), max_tokens=2, bucket_buffer=1)  # the smallest accepted
    assert (dm.max_tokens, dm.bucket_buffer) == (2, 1)


def _npy(array) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


def test_budget_stream_reads_lengths_from_headers_and_counts_unreadable_samples(tmp_path, caplog):
    """References into one file: a good sample, one whose source is not a ``.npy`` member, one missing its
    target; the last two are counted and logged when asked."""
    src, tgt = _npy(np.array([5, 6, 7, 8], np.int32)), _npy(np.array([9, 10, 11], np.int32))
    path = tmp_path / "members.bin"
    path.write_bytes(src + tgt + b"not an npy member at all")
    good = {"__key__": "train-0000003", "__url__": str(path), "src.npy": (0, len(src)), "tgt.npy": (len(src), len(tgt))}
    bad = {**good, "__key__": "train-0000004", "src.npy": (len(src) + len(tgt), 24)}
    missing = {k: v for k, v in good.items() if k != "tgt.npy"} | {"__key__": "train-0000005"}
    stream = BudgetStream(
        [str(path)], 4, {"max_tokens": 16, "buffer": 4}, partial(collate, pad_id=1, eos_id=2, start_id=2), SkipCounter()
    )
    with caplog.at_level(logging.WARNING, logger="mmlight.data.translation"):
        out = list(stream._with_lengths([good, bad, missing], count_skips=False))
    assert stream.counter.value == 0 and caplog.records == []
    with caplog.at_level(logging.WARNING, logger="mmlight.data.translation"):
        out = list(stream._with_lengths([good, bad, missing], count_skips=True))
    assert [(r["key"], r["src_len"], r["tgt_len"]) for r in out] == [("train-0000003", 4, 3)]
    assert out[0]["src.npy"] == good["src.npy"] and stream.counter.value == 2
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and f"skipped corrupt sample train-0000004 in {path}: ValueError" in messages[0]
    assert messages[1].startswith(f"skipped corrupt sample train-0000005 in {path}: KeyError")
    batch = stream.materialise(out)
    assert batch["src"].tolist() == [[5, 6, 7, 8, 2]] and batch["tgt_out"].tolist() == [[9, 10, 11, 2]]
    assert batch["ids"].tolist() == [3] and batch["keys"] == ["train-0000003"]


def test_default_position_limits_are_fairseqs_1024():
    """fairseq's ``DEFAULT_MAX_SOURCE_POSITIONS`` / ``..._TARGET_...`` = 1024, ``</s>`` included."""
    for side in ((1023, 0), (0, 1023), (1024, 0), (0, 1024)):
        got, _ = batches([sample("s", *side)], max_tokens=10**6)
        assert got == ([["s"]] if max(side) == 1023 else []), side


def test_a_shard_sample_s_index_is_the_number_after_the_last_dash():
    raw = {"src.npy": _npy(np.array([4, 5], np.int32)), "tgt.npy": _npy(np.array([6], np.int32))}
    out = _from_shard({"__key__": "tst-2014-0000042", **raw})
    assert (out["key"], out["id"]) == ("tst-2014-0000042", 42)
    assert out["src"].dtype == out["tgt"].dtype == np.int64 and out["src"].tolist() == [4, 5]
    pickled = {**raw, "tgt.npy": _npy(np.array([6, 7], dtype=object))}  # loading it would run pickle
    with pytest.raises(ValueError, match="allow_pickle"):
        _from_shard({"__key__": "train-0000001", **pickled})
