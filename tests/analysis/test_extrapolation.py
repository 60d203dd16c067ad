"""Length extrapolation: the bucket boundaries against grouping by integer division on every small case,
the evaluation stream against the windows it was cut into, and the perplexities against per-token NLLs
recomputed in float64 and summed by hand."""

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from mmlight.analysis.extrapolation import (
    Stream,
    bucket_bounds,
    extrapolation_rows,
    length_extrapolation,
    position_limit,
    position_rule,
    stream_from_batches,
)
from mmlight.data import RecallDataModule
from mmlight.data.text import EvalWindows
from mmlight.models.transformer import LLAMA_STYLE, TokenPositionEmbedding, TransformerLM
from mmlight.tasks import LanguageModel
from tests.helpers.models import tiny_transformer

PAD, EOS = 1, 2


def test_bucket_bounds_are_the_groups_of_integer_division_on_every_small_case():
    for length in range(1, 13):
        for size in range(1, 15):
            groups: dict[int, list[int]] = {}
            for p in range(length):
                groups.setdefault(p // size, []).append(p)
            expected = [(ps[0], ps[-1] + 1) for _, ps in sorted(groups.items())]
            assert bucket_bounds(length, size) == expected, (length, size)
    with pytest.raises(ValueError, match="must be >= 1"):
        bucket_bounds(4, 0)


@pytest.mark.parametrize("context", [0, 2, 4])
def test_the_stream_of_overlapping_windows_is_the_split_once_in_order(context):
    tokens = np.arange(10, 33)  # 23 targets
    windows = EvalWindows(tokens, block_size=5, context=context, batch_size=3, pad_id=PAD, eos_id=EOS)
    stream = stream_from_batches(iter(windows), PAD, num_positions=10_000)
    assert stream.inputs.tolist() == [EOS, *tokens[:-1]]
    assert stream.targets.tolist() == tokens.tolist()
    assert bool(stream.scored.all())
    first = stream_from_batches(iter(windows), PAD, num_positions=7)  # stops early, cut to the length
    assert first.targets.tolist() == tokens[:7].tolist()


def test_rows_without_a_start_follow_one_another_without_their_padding():
    batch = {
        "input": torch.tensor([[5, 6, 7], [8, PAD, PAD]]),
        "target": torch.tensor([[6, 7, 9], [4, 0, 0]]),
        "loss_mask": torch.tensor([[False, True, True], [True, False, False]]),
    }
    stream = stream_from_batches([batch, batch], PAD, num_positions=100)
    assert stream.inputs.tolist() == [5, 6, 7, 8] * 2
    assert stream.targets.tolist() == [6, 7, 9, 4] * 2
    assert stream.scored.tolist() == [False, True, True, True] * 2


def reference_nll(model: TransformerLM, stream: Stream, length: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-position NLL and scored count summed by hand over the windows, from a float64 copy of ``model``
    (with sinusoidal positions, built with a table of ``length`` positions from the start)."""
    config = replace(model.config, max_positions=length) if model.config.positions == "sinusoidal" else model.config
    double = TransformerLM(config).double().eval()
    double.load_state_dict(model.state_dict())
    nll, count = np.zeros(length), np.zeros(length, dtype=int)
    with torch.no_grad():
        for w in range(len(stream) // length):
            part = slice(w * length, (w + 1) * length)
            log_probs = torch.log_softmax(double.logits(double(stream.inputs[part][None]))[0], dim=-1)  # (W, V)
            for p in range(length):
                if stream.scored[part][p]:
                    nll[p] += -float(log_probs[p, stream.targets[part][p]])
                    count[p] += 1
    return nll, count


def random_stream(n: int, vocab: int, seed: int = 0) -> Stream:
    g = torch.Generator().manual_seed(seed)
    inputs = torch.randint(4, vocab, (n,), generator=g)
    targets = torch.randint(4, vocab, (n,), generator=g)
    return Stream(inputs, targets, torch.rand(n, generator=g) < 0.7)


@pytest.mark.parametrize("sinusoidal", [True, False])
def test_perplexities_equal_float64_token_nlls_summed_by_hand(sinusoidal):
    torch.manual_seed(0)
    context = 6
    # a sinusoidal table of exactly the training context, extended for the evaluation; a learned one of 2x
    config = tiny_transformer(max_positions=context if sinusoidal else 2 * context, sinusoidal_positions=sinusoidal)
    task = LanguageModel(config)
    stream = random_stream(2 * 4 * context + 5, config.vocab_size)  # 2 windows at 4x, 5 positions left over
    result = length_extrapolation(task, stream, context, multiples=(1, 2, 4), bucket=4)
    assert result["positions"] == 48 and result["scored"] == int(stream.scored[:48].sum())
    assert result["limit"] == (None if sinusoidal else 2 * context)
    assert result["position_rule"] == (
        "sinusoidal positions: the table is extended to the window, every multiple evaluated"
        if sinusoidal
        else "learned position table of 12 positions: a longer window is not defined"
    )
    used = Stream(stream.inputs[:48], stream.targets[:48], stream.scored[:48])
    for m in (1, 2, 4):
        entry = result["multiples"][m]
        if not sinusoidal and m == 4:
            assert not entry["defined"] and "holds 12 positions, fewer than 24" in entry["reason"]
            assert "ppl" not in entry
            continue
        nll, count = reference_nll(task.model, used, m * context)
        assert entry["defined"] and entry["count"] == count.sum()
        assert entry["ppl"] == pytest.approx(math.exp(nll.sum() / count.sum()), rel=1e-5)
        for bucket, (start, stop) in zip(entry["buckets"], bucket_bounds(m * context, 4)):
            assert (bucket["start"], bucket["stop"], bucket["count"]) == (start, stop, count[start:stop].sum())
            assert bucket["nll"] == pytest.approx(nll[start:stop].sum(), rel=1e-5)
    # the sinusoidal table is back to its own size; the model still refuses what it always refused
    embed = task.model.decoder.embed
    table = embed.sinusoid if sinusoidal else embed.positions.weight
    assert embed.max_positions == config.max_positions == table.shape[0]
    with pytest.raises(ValueError, match="exceed max_positions"):
        task.model(stream.inputs[None, : 4 * context])
    assert task.training  # the mode is put back


@pytest.mark.parametrize("positions", ["rope", "none"])
def test_a_llama_style_lm_without_a_position_table_is_evaluated_at_every_multiple(positions):
    """Rotary (grouped-query, 4 heads over 2) and position-free Llama-style LMs with ``max_positions`` the
    training context: every multiple is defined, and equals float64 token NLLs summed by hand."""
    torch.manual_seed(0)
    context = 6
    config = tiny_transformer(**{**LLAMA_STYLE, "positions": positions}, n_heads=4, n_kv_heads=2, max_positions=context)
    task = LanguageModel(config)
    stream = random_stream(4 * context + 3, config.vocab_size, seed=1)
    result = length_extrapolation(task, stream, context, multiples=(1, 2, 4), bucket=5)
    assert result["limit"] is None and result["positions"] == 24
    rule = {"rope": "rotary positions (no table)", "none": "no position embedding (NoPE)"}[positions]
    assert result["position_rule"] == f"{rule}: every multiple evaluated"
    used = Stream(stream.inputs[:24], stream.targets[:24], stream.scored[:24])
    for m in (1, 2, 4):
        entry = result["multiples"][m]
        nll, count = reference_nll(task.model, used, m * context)
        assert entry["defined"] and entry["reason"] is None and entry["count"] == count.sum()
        assert entry["ppl"] == pytest.approx(math.exp(nll.sum() / count.sum()), rel=1e-5)
        for bucket, (start, stop) in zip(entry["buckets"], bucket_bounds(m * context, 5)):
            assert bucket["nll"] == pytest.approx(nll[start:stop].sum(), rel=1e-5)
    assert task.model.config.max_positions == context and task.training


def test_rows_list_each_window_and_bucket_and_the_undefined_multiples():
    result = {
        "multiples": {
            1: {"length": 4, "defined": True, "count": 3, "ppl": 2.0, "buckets": [
                {"start": 0, "stop": 2, "count": 1, "ppl": 3.0}, {"start": 2, "stop": 4, "count": 2, "ppl": 1.5}]},
            2: {"length": 8, "defined": False, "reason": "too long"},
        }
    }  # fmt: skip
    assert extrapolation_rows(result) == [
        (1, 4, "window", 0, 4, 3, 2.0),
        (1, 4, "bucket", 0, 2, 1, 3.0),
        (1, 4, "bucket", 2, 4, 2, 1.5),
        (2, 8, "window", 0, 8, None, None),
    ]


def test_at_1x_on_recall_sequences_the_perplexity_is_the_models_own_loss():
    """Windows of the training context on the recall task are its sequences, so 1x is the validation loss."""
    torch.manual_seed(0)
    data = RecallDataModule(num_keys=8, num_values=8, num_pairs=3, num_queries=3, val_size=10, batch_size=4)
    data.setup("validate")
    task = LanguageModel(tiny_transformer(vocab_size=20, sinusoidal_positions=False)).eval()
    batches = list(data.val_dataloader())
    stream = stream_from_batches(batches, PAD, num_positions=10 * data.seq_len)
    result = length_extrapolation(task, stream, data.seq_len, multiples=(1, 2))
    with torch.no_grad():
        sums = [task.model.loss(b["input"], b["target"], b["loss_mask"]) for b in batches]
    total, count = sum(float(s) for s, _ in sums), sum(int(n) for _, n in sums)
    assert result["multiples"][1]["count"] == count == 10 * 3
    assert result["multiples"][1]["ppl"] == pytest.approx(math.exp(total / count), rel=1e-5)
    assert result["multiples"][2]["count"] == count  # the same tokens, two sequences per window
    assert position_limit(task.model) == 32 and result["bucket"] == 3  # default: a quarter of 11, rounded up


def test_a_stream_shorter_than_one_window_is_refused_with_the_numbers():
    task = LanguageModel(tiny_transformer())
    with pytest.raises(ValueError, match="holds 20 positions, fewer than one window of 8 x 3 = 24"):
        length_extrapolation(task, random_stream(20, 20), 3)


def test_a_row_whose_positions_were_all_held_before_adds_nothing_and_no_batch_is_read_past_the_count():
    """Windows of a stream overlap: a row whose every position an earlier row held adds nothing; once the
    positions asked for are there, no further batch is read (the rest of the split is never evaluated)."""
    first = {
        "input": torch.tensor([[5, 6, 7, 8]]),
        "target": torch.tensor([[6, 7, 8, 9]]),
        "loss_mask": torch.ones(1, 4, dtype=torch.bool),
        "start": torch.tensor([0]),
    }
    held = {
        **first,
        "input": torch.tensor([[6, 7, 8]]),
        "target": torch.tensor([[7, 8, 9]]),
        "loss_mask": torch.ones(1, 3, dtype=torch.bool),
        "start": torch.tensor([1]),
    }
    stream = stream_from_batches([first, held], PAD, num_positions=100)
    assert stream.inputs.tolist() == [5, 6, 7, 8] and stream.targets.tolist() == [6, 7, 8, 9]

    def batches():
        yield first
        raise AssertionError("a batch was read after the stream was complete")

    assert stream_from_batches(batches(), PAD, num_positions=4).inputs.tolist() == [5, 6, 7, 8]


def test_no_batch_is_an_empty_stream():
    stream = stream_from_batches([], PAD, num_positions=10)
    assert len(stream) == 0
    assert [(tuple(t.shape), t.dtype) for t in (stream.inputs, stream.targets, stream.scored)] == [
        ((0,), torch.int64),
        ((0,), torch.int64),
        ((0,), torch.bool),
    ]


def test_each_kind_of_position_gets_its_sentence():
    config = tiny_transformer(max_positions=10, sinusoidal_positions=False)
    both = torch.nn.ModuleList(
        [
            TokenPositionEmbedding(torch.nn.Embedding(20, config.d_model), config),
            TokenPositionEmbedding(torch.nn.Embedding(20, config.d_model), replace(config, positions="rope")),
        ]
    )
    assert position_rule(both) == (
        "learned position table of 10 positions: a longer window is not defined; "
        "rotary positions (no table): every multiple evaluated"
    )


@pytest.mark.parametrize("context, multiples", [(0, (1,)), (4, ()), (4, (1, 0)), (-1, (2,))])
def test_a_context_or_multiple_below_1_is_refused_whole(context, multiples):
    task = LanguageModel(tiny_transformer())
    with pytest.raises(ValueError) as caught:
        length_extrapolation(task, random_stream(40, 20), context, multiples)
    assert str(caught.value) == f"context and every multiple must be >= 1, got {context} and {list(multiples)}"


def test_a_context_of_one_token_is_evaluated():
    task = LanguageModel(tiny_transformer())
    result = length_extrapolation(task, random_stream(8, 20), 1, multiples=(1, 2))
    assert result["context"] == 1 and result["bucket"] == 1 and result["multiples"][2]["count"] > 0


def test_every_field_of_the_result_and_the_progress_of_each_batch():
    """Context 9 (a default bucket of 3, a quarter rounded up), multiples given out of order; a learned table
    of 18 positions: 1x and 2x defined, 4x not. Each multiple runs ``widest // length`` windows per pass."""
    torch.manual_seed(0)
    task = LanguageModel(tiny_transformer(max_positions=18, sinusoidal_positions=False))
    stream = random_stream(2 * 36 + 1, 20)  # two windows of 4x
    done = []
    result = length_extrapolation(task, stream, 9, multiples=(4, 1, 2), progress=done.append)
    assert {k: result[k] for k in ("context", "bucket", "positions", "limit")} == {
        "context": 9,
        "bucket": 3,
        "positions": 72,
        "limit": 18,
    }
    assert done == [2, 2, 2, 2, 1, 1, 1, 1]  # 8 windows of 9, 2 per pass; 4 windows of 18, 1 per pass
    assert [result["multiples"][m]["length"] for m in (4, 1, 2)] == [36, 9, 18]
    used = Stream(stream.inputs[:72], stream.targets[:72], stream.scored[:72])
    for m in (1, 2):
        entry = result["multiples"][m]
        nll, count = reference_nll(task.model, used, 9 * m)
        assert entry["nll"] == pytest.approx(nll.sum(), rel=1e-5)
        for bucket in entry["buckets"]:
            part = slice(bucket["start"], bucket["stop"])
            assert bucket["ppl"] == pytest.approx(math.exp(nll[part].sum() / count[part].sum()), rel=1e-5)
    rows = extrapolation_rows(result)
    assert rows[0] == (4, 36, "window", 0, 36, None, None) and rows[1][:3] == (1, 9, "window")
    assert len(rows) == 1 + (1 + 3) + (1 + 6)  # the rows after an undefined multiple are kept


def test_a_model_that_can_embed_no_multiple_reports_each_as_not_defined():
    task = LanguageModel(tiny_transformer(max_positions=4, sinusoidal_positions=False))
    result = length_extrapolation(task, random_stream(20, 20), 5, multiples=(1, 2))
    assert [result["multiples"][m]["defined"] for m in (1, 2)] == [False, False]
    assert result["multiples"][1]["reason"] == "the model's learned position table holds 4 positions, fewer than 5"
