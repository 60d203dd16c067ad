"""mmlight.data.translation.budget_batches: fairseq's token budget and position limits at their
boundaries, on samples whose lengths are written by hand (sizes count each side's ``</s>``)."""

import warnings

import numpy as np
import pytest

from mmlight.data.translation import budget_batches


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
    assert "2 skipped so far" in warned[1]


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
